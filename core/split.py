"""The producer side: split a processor batch's media per microbatch, as the schedule splits rows.

``torch.distributed.pipelining`` gives microbatch ``k`` the rows ``torch.tensor_split(range(B), n)[k]``
of every tensor it is handed. :func:`split_media` pops the media out of the batch (media do not have
samples on dim 0) and cuts each media tensor so that microbatch ``k`` gets exactly the media of its
samples, as views of the batch's tensors.
"""

from __future__ import annotations

import functools
import itertools
import numbers
import operator
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterator, MutableMapping, Sequence

import numpy as np
import torch
from torch import Tensor

from .chunk import VlmMediaChunk
from .planners import (
    IMAGE_GRID_KEYS,
    Context,
    CountsArgument,
    FieldSplit,
    Part,
    plan_images,
    plan_step3,
    plan_videos,
    require_tensor,
    shape_of,
)
# planners of their own modules, each registered below in split_media (one line each)
from .planners_audio import AUDIO_KEYS, plan_audio
from .planners_frames import FRAME_KEYS, plan_video_frames, uses_frames

__all__ = [
    "IMAGE_GRID_KEYS",
    "MEDIA_KEYS",
    "StagedMedia",
    "microbatch_bounds",
    "split_media",
]

#: every key :func:`split_media` pops from the batch.
MEDIA_KEYS: tuple[str, ...] = (
    "pixel_values",
    *IMAGE_GRID_KEYS,
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
    "video_second_per_grid",
    *FRAME_KEYS,
    "patch_pixel_values",
    "num_patches",
    "patch_newline_mask",
    "n_images_per_sample",
    "n_videos_per_sample",
    *AUDIO_KEYS,
)
_MEDIA_KEY_SET = frozenset(MEDIA_KEYS)
# may also be sequences: seconds per video, counts per sample (checked where they are read)
_NOT_TENSORS = frozenset({"second_per_grid_ts", "video_second_per_grid", "n_images_per_sample", "n_videos_per_sample",
                          "n_audios_per_sample"})
_FIELDS = tuple(f.name for f in fields(VlmMediaChunk))
_ORDER = {name: i for i, name in enumerate(_FIELDS)}
Range = tuple[int, int]


def microbatch_bounds(batch_size: int, n_microbatches: int) -> list[int]:
    """Sample offsets ``[0, ..., batch_size]`` (length ``n + 1``) of ``torch.tensor_split(range(B), n)``.

    Microbatch ``k`` holds samples ``bounds[k]:bounds[k + 1]``: the first ``B % n`` microbatches get
    ``B // n + 1`` samples, the rest ``B // n`` (B=10, n=4 gives 3, 3, 2, 2).
    """
    q, r = divmod(batch_size, n_microbatches)
    sizes = [q + 1] * r + [q] * (n_microbatches - r)
    return [0, *itertools.accumulate(sizes)]


@functools.lru_cache(maxsize=256)
def _cached_bounds(batch_size: int, n_microbatches: int) -> tuple[tuple[int, ...], Any, tuple[Range, ...]]:
    """:func:`microbatch_bounds` as a tuple, as a read-only int64 array, and as ``(first, stop)`` pairs,
    cached: a training loop splits batches of the same ``(B, n)`` every step."""
    bounds = tuple(microbatch_bounds(batch_size, n_microbatches))
    at = np.asarray(bounds, dtype=np.int64)
    at.flags.writeable = False
    return bounds, at, tuple(zip(bounds, bounds[1:]))


@dataclass
class StagedMedia:
    """One batch's media, split per microbatch: what :func:`ppmedia.stage_media` hangs on a stage.

    The batch's media tensors are kept whole in :attr:`tensors`; :attr:`ranges` gives each
    microbatch's ``(start, stop)`` along dim 0 of each. :attr:`chunks` holds the per-microbatch views
    (``tensors[f][start:stop]``), so no data is copied, and :meth:`to` moves a batch to a device with
    one copy per tensor and no host read.

    Attributes:
        n_microbatches: number of microbatches ``n``.
        batch_size: number of samples ``B``.
        tensors: chunk field name -> the batch's whole tensor (fields absent from the batch are left out).
        sources: chunk field name -> the batch key it was popped from.
        ranges: chunk field name -> ``n`` ``(start, stop)`` pairs along dim 0.
        samples: per microbatch, its ``(first, stop)`` samples.
        images, videos: per microbatch, its number of images and videos.
        audios: per microbatch, its number of audio clips (zeros without audio).
        image_rows, video_rows, crop_rows: per microbatch, its rows of ``pixel_values``,
            ``pixel_values_videos`` and ``patch_pixel_values``.
        permutation: with ``split_media(..., balance=...)``, the reordering applied to the batch:
            position ``i`` holds original sample ``permutation[i]`` (see :mod:`ppmedia.balance`);
            ``None`` when not balanced.
    """

    n_microbatches: int
    batch_size: int
    tensors: dict[str, Tensor]
    sources: dict[str, str]
    ranges: dict[str, tuple[Range, ...]]
    samples: tuple[Range, ...]
    images: tuple[int, ...]
    videos: tuple[int, ...]
    image_rows: tuple[int, ...]
    video_rows: tuple[int, ...]
    crop_rows: tuple[int, ...]
    audios: tuple[int, ...] = ()
    permutation: tuple[int, ...] | None = None
    chunks: dict[str, list[Tensor]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.audios:  # a split without audio (or pickled before audio existed)
            self.audios = (0,) * self.n_microbatches
        if not self.chunks:  # split_media passes the views it made; otherwise cut them from ranges
            self.chunks = {name: _views(tensor, self.ranges[name]) for name, tensor in self.tensors.items()}

    def __len__(self) -> int:
        return self.n_microbatches

    def __getstate__(self) -> dict[str, Any]:
        # The views are rebuilt on unpickling: only the whole tensors travel (DataLoader workers).
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "chunks"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        self.chunks = {}
        self.__post_init__()

    def chunk(self, k: int) -> VlmMediaChunk | None:
        """Microbatch ``k``'s media as :func:`ppmedia.next_vlm_media_chunk` would return it."""
        if not 0 <= k < self.n_microbatches:
            raise IndexError(f"microbatch {k} out of range for {self.n_microbatches} microbatches")
        values = [
            t if (t := self.chunks[name][k] if name in self.chunks else None) is not None and t.numel() else None
            for name in _FIELDS
        ]
        return None if all(v is None for v in values) else VlmMediaChunk(*values)

    def __iter__(self) -> Iterator[VlmMediaChunk | None]:
        return (self.chunk(k) for k in range(self.n_microbatches))

    def map_tensors(self, fn: Any) -> "StagedMedia":
        """A copy whose whole tensors are ``fn(tensor)`` (e.g. a device move); views are rebuilt."""
        state = self.__getstate__()
        state["tensors"] = {name: fn(t) for name, t in self.tensors.items()}
        new = StagedMedia.__new__(StagedMedia)
        new.__setstate__(state)
        return new

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "StagedMedia":
        """The same split with every tensor on ``device``: one copy per whole tensor, no host read."""
        return self.map_tensors(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "StagedMedia":
        """The same split with every whole tensor in pinned memory (for ``DataLoader(pin_memory=True)``)."""
        return self.map_tensors(lambda t: t.pin_memory())


def _views(tensor: Tensor, ranges: Sequence[Range], sizes: Sequence[int] | None = None) -> list[Tensor]:
    """``[tensor[a:b] for a, b in ranges]``, as views of ``tensor``.

    When the ranges tile dim 0 (the usual case; ``sizes``, their lengths, says so without a check),
    one ``split_with_sizes`` call makes every view at a fraction of the cost of one slice each. Its
    views are multi-output views, which autograd forbids to modify in place when they require grad,
    so a tensor that requires grad is sliced instead.
    """
    if sizes is not None and not tensor.requires_grad and tensor.dim() > 0:
        return list(tensor.split_with_sizes(list(sizes)))
    flat = list(itertools.chain.from_iterable(ranges))
    starts, stops = flat[0::2], flat[1::2]
    if (
        not tensor.requires_grad
        and tensor.dim() > 0
        and starts[0] == 0
        and stops[-1] == tensor.shape[0]
        and stops[:-1] == starts[1:]  # the ranges tile dim 0
    ):
        return list(tensor.split_with_sizes(list(map(operator.sub, stops, starts))))
    return [tensor[a:b] for a, b in ranges]


# --------------------------------------------------------------------------------------------------
# the producer


def split_media(
    batch: MutableMapping[str, Any],
    n_microbatches: int,
    *,
    images_per_sample: CountsArgument = None,
    videos_per_sample: CountsArgument = None,
    batch_size: int | None = None,
    balance: Any = False,
    audios_per_sample: CountsArgument = None,
) -> StagedMedia:
    """Pop the media out of ``batch`` and split them per microbatch exactly as the schedule splits rows.

    Keys popped (when present, see :data:`MEDIA_KEYS`): ``pixel_values``; at most one image metadata key
    of :data:`IMAGE_GRID_KEYS` (``image_grid_thw`` ``[images, 3]``, ``image_grid_hws`` ``[images, 2]``,
    ``image_sizes`` ``[images, 2]``, ``image_position_ids`` ``[images, max_patches, 2]``, Gemma 3's
    ``num_crops`` ``[images]``), staged as the chunk's ``image_grid``; ``pixel_values_videos``,
    ``video_grid_thw`` ``[videos, 3]`` and ``second_per_grid_ts`` ``[videos]`` (a tensor, or a list of
    seconds that becomes one new host tensor); Step3's ``patch_pixel_values`` ``[patches, C, h, w]``,
    ``num_patches`` ``[B]`` and ``patch_newline_mask`` ``[patches]``; the counts
    ``n_images_per_sample`` / ``n_videos_per_sample`` ``[B]``. Gemma 4's padded video frames
    ``pixel_values_videos`` ``[frames, max_patches, D]`` with ``video_position_ids`` and
    ``num_frames_per_video`` ``[videos]`` (:mod:`ppmedia.planners_frames`); the Qwen Omnis' video timing
    ``video_second_per_grid`` (staged as ``second_per_grid_ts``). Audio clips (:mod:`ppmedia.planners_audio`):
    ``input_features`` or ``audio_input_ids`` ``[audios, ...]`` with ``input_features_mask``,
    ``feature_attention_mask`` or ``audio_input_ids_mask`` ``[audios, T]``, and ``n_audios_per_sample`` ``[B]``.

    Rows of ``pixel_values`` per image: with ``image_grid_thw``/``image_grid_hws``, the grid's product
    (flat patch rows ``[patches, D]``, patch-major ``[patches, C, ph, pw]``) when the products add up to
    the rows, else one; with ``num_crops``, ``1 + num_crops[i]`` (the image, then its pan-and-scan crops);
    otherwise one (complete images ``[images, C, H, W]``, padded patches, LLaVA-NeXT crops
    ``[images, max_crops, C, H, W]``). Videos likewise with ``video_grid_thw``.

    Images per sample: the batch's ``n_images_per_sample``, else ``images_per_sample``, else one per
    sample when there are exactly ``B`` images (videos likewise). Counts are ``[B]`` integer tensors or
    sequences of ints (``bool``, ``float``, ``None`` refused). With ``num_crops`` they may count images
    or rows. Microbatch ``k`` gets samples ``torch.tensor_split(range(B), n)[k]`` and exactly their media.

    All or nothing: every check and every view is made before the first key is popped, so on any error
    ``batch`` is left exactly as it was. After a successful call every tensor left in ``batch`` has
    ``B`` on dim 0 (safe for the schedule's split); a tensor that does not is an error before anything
    is popped (e.g. Qwen's mrope ``position_ids`` ``[3, B, S]``, or a per-image key ppmedia does not know).

    Args:
        batch: the processor/collator output; modified in place (media keys popped).
        n_microbatches: the schedule's ``n_microbatches``, ``1 <= n <= B`` (the schedule's own split
            never gives more microbatches than samples).
        images_per_sample: ``[B]`` image counts, e.g. from an adapter's ``media_per_sample``.
        videos_per_sample: ``[B]`` video counts.
        audios_per_sample: ``[B]`` audio-clip counts (the batch's ``n_audios_per_sample``, else this,
            else one clip per sample when there are exactly ``B``).
        batch_size: ``B``; by default ``batch["input_ids"].shape[0]``.
        balance: reorder the samples so every microbatch gets a similar vision load
            (:func:`ppmedia.balance.balanced_split`): ``True`` (cost linear in patches), a cost function
            ``patches -> cost`` such as ``functools.partial(adapter.image_costs, config=config)``, or
            ``[B]`` per-sample costs. The ``[B, ...]`` tensors left in ``batch`` are reordered in place
            and the result's ``permutation`` says how; the media are copied once, in the new order.

    Returns:
        A :class:`StagedMedia` of views. The integer metadata needed (counts, grids, ``num_patches``,
        ``num_crops``) is read to the host in one read per batch (one per device when on several), and
        all arithmetic on it is exact (an absurd value is an error, never a wrapped number).

    Raises:
        TypeError: a value is not a dense tensor (or a sequence where one is allowed), metadata is not
            of an integer dtype, a count is not an int.
        ValueError: any inconsistency, overflow, or metadata on the ``meta`` device; the message names
            the key, the shape or value seen, what was expected and, where one is to blame, the row,
            sample and microbatch.
    """
    if balance is not False and balance is not None:
        from .balance import balanced_split

        return balanced_split(batch, n_microbatches, balance, images_per_sample=images_per_sample,
                              videos_per_sample=videos_per_sample, batch_size=batch_size,
                              audios_per_sample=audios_per_sample)
    media = _media_of(batch)
    B = _batch_size(batch, media, batch_size)
    bounds, at, samples = _cached_bounds(B, _microbatches(n_microbatches, B))
    ctx = Context(B, bounds, at)
    _check_left_over(batch, B)
    images = plan_images(ctx, media, images_per_sample)
    videos = (plan_video_frames if uses_frames(media) else plan_videos)(ctx, media, videos_per_sample)
    crops = plan_step3(ctx, media)
    audio = plan_audio(ctx, media, audios_per_sample)
    ctx.reader.read()  # the one host read
    image_part = images() if images is not None else None
    video_part = videos() if videos is not None else None
    crop_part = crops(image_part) if crops is not None else None
    audio_part = audio() if audio is not None else None
    staged = _staged(ctx, samples, image_part, video_part, crop_part, audio_part)  # every view made here, before anything is popped
    for key in [k for k in batch if k in _MEDIA_KEY_SET]:
        del batch[key]
    return staged


def _media_of(batch: MutableMapping[str, Any]) -> dict[str, Any]:
    """The batch's media values by key (``None`` values left out), each checked to be a dense tensor."""
    if type(batch) is not dict and not isinstance(batch, MutableMapping):  # dict first: the ABC check is slow
        raise TypeError(f"batch: got {type(batch).__name__}; expected a mutable mapping of str to tensors")
    media: dict[str, Any] = {}
    for key in _MEDIA_KEY_SET.intersection(batch):
        value = batch[key]
        if value is not None:
            media[key] = value if key in _NOT_TENSORS else require_tensor(key, value)
    return media


def _microbatches(n: object, batch_size: int) -> int:
    if type(n) is not int and (isinstance(n, (bool, torch.Tensor)) or not isinstance(n, numbers.Integral)):
        raise TypeError(f"n_microbatches: got {type(n).__name__}; expected an int >= 1")
    value = int(n)
    if not 1 <= value <= max(batch_size, 1):
        raise ValueError(
            f"n_microbatches: got {value} for a batch of {batch_size} samples; expected 1..{max(batch_size, 1)} "
            f"(the schedule's split gives at most one microbatch per sample)"
        )
    return value


def _batch_size(batch: MutableMapping[str, Any], media: dict[str, Any], batch_size: object) -> int:
    if batch_size is not None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral):
            raise TypeError(f"batch_size: got {type(batch_size).__name__}; expected an int >= 0")
        if int(batch_size) < 0:
            raise ValueError(f"batch_size: got {batch_size}; expected an int >= 0")
        return int(batch_size)
    ids = batch.get("input_ids")
    if isinstance(ids, Tensor) and not ids.is_nested and ids.dim() >= 1:
        return ids.shape[0]
    for key, value in batch.items():
        if key not in _MEDIA_KEY_SET and isinstance(value, Tensor) and not value.is_nested and value.dim() >= 1:
            return value.shape[0]
    raise ValueError("batch: no input_ids (or other [B, ...] tensor) to take the batch size from; pass batch_size=")


def _check_left_over(batch: MutableMapping[str, Any], batch_size: int) -> None:
    """Every tensor that stays in the batch has ``B`` on dim 0, so the schedule's split is right for it."""
    for key, value in batch.items():
        if key in _MEDIA_KEY_SET or not isinstance(value, Tensor):
            continue
        if value.is_nested:
            raise TypeError(f"{key}: a nested tensor; expected [{batch_size}, ...] (the schedule splits dim 0)")
        if value.dim() >= 1 and value.shape[0] == batch_size:
            continue
        raise ValueError(_left_over_message(key, value, batch_size))


def _left_over_message(key: str, value: Tensor, B: int) -> str:
    seen = f"{key}: shape {shape_of(value)}; expected [{B}, ...] (samples on dim 0: the schedule splits every tensor along dim 0)"
    if value.dim() == 0:
        return f"{seen}. A 0-dim tensor cannot be split: take it out of the batch before split_media"
    if key == "position_ids" and value.dim() == 3 and value.shape[1] == B:
        return (
            f"{seen}. These are mrope positions [3, B, S]; the schedule would cut the 3 position axes "
            f"instead of the samples. Pass them batch-first (position_ids.transpose(0, 1), [B, 3, S], "
            f"transposed back in the stage), or drop them and let the first stage compute each "
            f"microbatch's positions (adapter.position_ids)"
        )
    return (
        f"{seen}. ppmedia does not know {key} as a media key (it splits the keys of ppmedia.MEDIA_KEYS): "
        f"take it out of the batch before split_media and carry it yourself, or give it samples on dim 0"
    )


def _staged(ctx: Context, samples: tuple[Range, ...], images: Part | None, videos: Part | None,
            crops: Part | None, audio: Part | None = None) -> StagedMedia:
    """The :class:`StagedMedia` of the planners' parts; makes every view."""
    zero = (0,) * len(samples)
    chunks: dict[str, list[Tensor]] = {}
    sources: dict[str, str] = {}
    ranges: dict[str, tuple[Range, ...]] = {}
    splits: list[FieldSplit] = []
    for part in (images, videos, crops, audio):
        if part is not None:
            for f in part.fields:
                name = f.name
                chunks[name] = _checked_views(f)
                sources[name] = f.source
                ranges[name] = f.ranges
                splits.append(f)
    if len(splits) > 1:
        splits.sort(key=_field_order)
    return StagedMedia(
        n_microbatches=len(zero),
        batch_size=ctx.batch_size,
        chunks=chunks,
        tensors={f.name: f.tensor for f in splits},
        sources=sources,
        ranges=ranges,
        samples=samples,
        images=images.items if images is not None else zero,
        videos=videos.items if videos is not None else zero,
        image_rows=images.rows if images is not None else zero,
        video_rows=videos.rows if videos is not None else zero,
        crop_rows=crops.rows if crops is not None else zero,
        audios=audio.items if audio is not None else zero,
    )


def _field_order(f: FieldSplit) -> int:
    return _ORDER[f.name]


def _checked_views(f: FieldSplit) -> list[Tensor]:
    try:
        return _views(f.tensor, f.ranges, f.sizes)
    except RuntimeError as error:  # a guard: the planners checked the ranges already
        raise ValueError(f"{f.source}: shape {shape_of(f.tensor)}; cannot be cut at {list(f.ranges)} ({error})") from error
