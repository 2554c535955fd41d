"""The producer side: split a processor batch's media per microbatch, as the schedule splits rows.

``torch.distributed.pipelining`` gives microbatch ``k`` the rows ``torch.tensor_split(range(B), n)[k]``
of every tensor it is handed. :func:`split_media` pops the media out of the batch (media do not have
samples on dim 0) and cuts each media tensor so that microbatch ``k`` gets exactly the media of its
samples, as views of the batch's tensors.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from dataclasses import dataclass, field, fields
from typing import Any, Iterator, MutableMapping, Sequence

import numpy as np
import torch
from torch import Tensor

from .chunk import VlmMediaChunk
from .hostreads import HostReader

__all__ = [
    "IMAGE_GRID_KEYS",
    "MEDIA_KEYS",
    "StagedMedia",
    "microbatch_bounds",
    "split_media",
]

#: batch keys that hold per-image metadata; at most one may be present. Value: its trailing shape.
IMAGE_GRID_KEYS: tuple[str, ...] = ("image_grid_thw", "image_grid_hws", "image_sizes", "image_position_ids")
_PATCH_GRID_KEYS = ("image_grid_thw", "image_grid_hws")
_COUNT_KEYS = ("n_images_per_sample", "n_videos_per_sample")
#: every key :func:`split_media` pops from the batch.
MEDIA_KEYS: tuple[str, ...] = (
    "pixel_values",
    *IMAGE_GRID_KEYS,
    "pixel_values_videos",
    "video_grid_thw",
    "patch_pixel_values",
    "num_patches",
    "patch_newline_mask",
    *_COUNT_KEYS,
)
_MEDIA_KEY_SET = frozenset(MEDIA_KEYS)
_FIELDS = tuple(f.name for f in fields(VlmMediaChunk))
Range = tuple[int, int]
_EMPTY = np.zeros(0, dtype=np.int64)
_ZERO = np.zeros(1, dtype=np.int64)


def microbatch_bounds(batch_size: int, n_microbatches: int) -> list[int]:
    """Sample offsets ``[0, ..., batch_size]`` (length ``n + 1``) of ``torch.tensor_split(range(B), n)``.

    Microbatch ``k`` holds samples ``bounds[k]:bounds[k + 1]``: the first ``B % n`` microbatches get
    ``B // n + 1`` samples, the rest ``B // n`` (B=10, n=4 gives 3, 3, 2, 2).
    """
    q, r = divmod(batch_size, n_microbatches)
    sizes = [q + 1] * r + [q] * (n_microbatches - r)
    return [0, *itertools.accumulate(sizes)]


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
    permutation: tuple[int, ...] | None = None
    chunks: dict[str, list[Tensor]] = field(default=None, repr=False, compare=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.chunks is None:  # split_media passes the views it made; otherwise cut them from ranges
            self.chunks = {name: _views(tensor, self.ranges[name]) for name, tensor in self.tensors.items()}

    def __len__(self) -> int:
        return self.n_microbatches

    def __getstate__(self) -> dict[str, Any]:
        # The views are rebuilt on unpickling: only the whole tensors travel (DataLoader workers).
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "chunks"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        self.chunks = None  # type: ignore[assignment]
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
# validation helpers: every message names the key, what was seen, what was expected


def _shape(t: Tensor) -> str:
    return str(list(t.shape))


def _require_tensor(key: str, value: Any) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{key}: got {type(value).__name__}; expected a torch.Tensor")
    return value


def _require_integer(key: str, t: Tensor) -> None:
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{key}: dtype {t.dtype}; expected an integer dtype")


def _counts_argument(key: str, value: Any, batch_size: int) -> Tensor | list[int]:
    if isinstance(value, Tensor):
        _require_integer(key, value)
        if tuple(value.shape) != (batch_size,):
            raise ValueError(f"{key}: shape {_shape(value)}; expected [{batch_size}] (one count per sample)")
        return value
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) != batch_size:
            raise ValueError(f"{key}: {len(value)} counts; expected {batch_size} (one count per sample)")
        return [int(v) for v in value]
    raise TypeError(f"{key}: got {type(value).__name__}; expected a [B] integer tensor or a sequence of ints")


def _diffs(offsets: np.ndarray) -> tuple[int, ...]:
    """``offsets[k + 1] - offsets[k]`` for every ``k``."""
    return tuple((offsets[1:] - offsets[:-1]).tolist())


def _pairs(offsets: np.ndarray) -> tuple[Range, ...]:
    """``(offsets[k], offsets[k + 1])`` for every ``k``."""
    values = offsets.tolist()
    return tuple(zip(values, values[1:]))


def _microbatch_of(bounds: list[int], sample: int) -> int:
    """The microbatch holding ``sample``, given :func:`microbatch_bounds`."""
    return bisect.bisect_right(bounds, sample) - 1


def _locate(cum: list[int], item: int, bounds: list[int]) -> tuple[int, int]:
    """(sample, microbatch) holding ``item``, given cumulative per-sample item offsets."""
    sample = bisect.bisect_right(cum, item) - 1
    return sample, _microbatch_of(bounds, sample)


def _per_item_rows(
    key: str, grid_key: str, grid: list[int], columns: int, rows: int, items: int, counts: list[int], bounds: list[int]
) -> list[int]:
    """Rows of the pixel tensor per image/video: the grid products for patch rows, else 1.

    ``counts`` are the items per sample (they locate an offending row in the error message).
    """
    table = grid[: items * columns].reshape(items, columns)
    if items and table.min() <= 0:
        i = int(np.flatnonzero((table <= 0).any(axis=1))[0])
        sample, mb = _locate([0, *itertools.accumulate(counts.tolist())], i, bounds)
        raise ValueError(
            f"{grid_key}: row {i} (sample {sample}, microbatch {mb}) is {table[i].tolist()}; expected positive entries"
        )
    products = table.prod(axis=1)
    total = int(products.sum())
    if total == rows:
        return products
    if rows == items:
        return np.ones(items, dtype=np.int64)
    raise ValueError(
        f"{key}: dim 0 is {rows}; expected {total} (the sum of the {grid_key} products, patch rows) "
        f"or {items} (one row per item) for {grid_key} of shape [{items}, {columns}] (whole batch)"
    )


def _group(sizes: np.ndarray, groups: Any) -> np.ndarray:
    """Cumulative offsets of ``sizes``, read at the item offsets ``groups``."""
    return np.concatenate((_ZERO, sizes)).cumsum()[groups]


def split_media(
    batch: MutableMapping[str, Any],
    n_microbatches: int,
    *,
    images_per_sample: Tensor | Sequence[int] | None = None,
    videos_per_sample: Tensor | Sequence[int] | None = None,
    batch_size: int | None = None,
    balance: Any = False,
) -> StagedMedia:
    """Pop the media out of ``batch`` and split them per microbatch exactly as the schedule splits rows.

    Keys popped (when present): ``pixel_values``; one image metadata key of :data:`IMAGE_GRID_KEYS`
    (``image_grid_thw`` ``[images, 3]``, ``image_grid_hws`` ``[images, 2]``, ``image_sizes``
    ``[images, 2]`` or ``image_position_ids`` ``[images, max_patches, 2]``); ``pixel_values_videos`` and
    ``video_grid_thw`` ``[videos, 3]``; Step3's ``patch_pixel_values`` ``[patches, C, h, w]``,
    ``num_patches`` ``[B]`` and ``patch_newline_mask`` ``[patches]``; and the counts
    ``n_images_per_sample`` / ``n_videos_per_sample`` ``[B]``. What is left in ``batch`` is safe for the
    schedule's dim-0 split. Nothing is popped when an error is raised.

    Rows of ``pixel_values`` per image: with ``image_grid_thw``/``image_grid_hws``, the grid's product
    (flat patch rows ``[patches, D]`` or patch-major ``[patches, C, ph, pw]``) when the products add up
    to the rows, else one (image-major layouts); with the other keys, one (complete images
    ``[images, C, H, W]``, padded patches ``[images, max_patches, D]``, LLaVA-NeXT crops
    ``[images, max_crops, C, H, W]``). Videos likewise with ``video_grid_thw``.

    Images per sample: the batch's ``n_images_per_sample``, else ``images_per_sample``, else one per
    sample when there are exactly ``B`` images (videos likewise). Microbatch ``k`` gets samples
    ``torch.tensor_split(range(B), n)[k]`` and exactly their media.

    Args:
        batch: the processor/collator output; modified in place (media keys popped).
        n_microbatches: the schedule's ``n_microbatches``.
        images_per_sample: ``[B]`` image counts, e.g. from an adapter's ``media_per_sample``.
        videos_per_sample: ``[B]`` video counts.
        batch_size: ``B``; by default ``batch["input_ids"].shape[0]``.
        balance: reorder the samples so every microbatch gets a similar vision load
            (:func:`ppmedia.balance.balanced_split`): ``True`` (cost linear in patches), a cost function
            ``patches -> cost`` such as ``functools.partial(adapter.image_costs, config=config)``, or
            ``[B]`` per-sample costs. The ``[B, ...]`` tensors left in ``batch`` are reordered in place
            and the result's ``permutation`` says how; the media are copied once, in the new order.

    Returns:
        A :class:`StagedMedia` of views. All integer metadata needed (counts, grids, ``num_patches``) is
        read to the host in one read per batch (one per device when they sit on several).

    Raises:
        TypeError: a value is not a tensor, or metadata is not of an integer dtype.
        ValueError: any inconsistency; the message names the key, the shape seen, the shape expected
            and, where one is to blame, the sample and microbatch.
    """
    if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int):
        raise TypeError(f"n_microbatches: got {type(n_microbatches).__name__}; expected an int >= 1")
    if n_microbatches < 1:
        raise ValueError(f"n_microbatches: got {n_microbatches}; expected an int >= 1")
    if type(batch) is not dict and not isinstance(batch, MutableMapping):  # dict first: the ABC check is slow
        raise TypeError(f"batch: got {type(batch).__name__}; expected a mutable mapping of str to tensors")
    if balance is not False and balance is not None:
        from .balance import balanced_split

        return balanced_split(batch, n_microbatches, balance, images_per_sample=images_per_sample,
                              videos_per_sample=videos_per_sample, batch_size=batch_size)

    media: dict[str, Tensor] = {}
    for key in _MEDIA_KEY_SET.intersection(batch):
        value = batch[key]
        if value is not None:
            media[key] = _require_tensor(key, value)
    n = n_microbatches
    B = _batch_size(batch, media, batch_size)
    bounds = microbatch_bounds(B, n)
    reader = HostReader()

    grid_keys = [k for k in IMAGE_GRID_KEYS if k in media]
    if len(grid_keys) > 1:
        raise ValueError(f"image metadata: got {' and '.join(grid_keys)}; expected at most one of them")
    grid_key = grid_keys[0] if grid_keys else None
    pixels = media.get("pixel_values")
    grid = media.get(grid_key) if grid_key else None

    # ---- images: count, layout, metadata shapes (no data read yet)
    n_images = 0
    if grid is not None and pixels is None:
        raise ValueError(f"{grid_key}: shape {_shape(grid)} given without pixel_values")
    if pixels is not None:
        if pixels.dim() < 2:
            raise ValueError(f"pixel_values: shape {_shape(pixels)}; expected at least 2 dims (images or patches first)")
        n_images = grid.shape[0] if grid is not None and grid.dim() >= 1 else pixels.shape[0]
        if grid is not None:
            _check_image_grid(grid_key, grid, pixels)
    image_counts = _counts(
        "n_images_per_sample", "images_per_sample", media, images_per_sample, B, reader,
        "pixel_values", n_images if pixels is not None else None, "images",
    )
    grid_slot = reader.add(grid) if grid_key in _PATCH_GRID_KEYS else None

    # ---- videos
    vpixels = media.get("pixel_values_videos")
    vgrid = media.get("video_grid_thw")
    n_videos = 0
    if vpixels is not None and vgrid is None:
        raise ValueError(
            f"pixel_values_videos: shape {_shape(vpixels)} given without video_grid_thw; expected video_grid_thw [videos, 3]"
        )
    if vgrid is not None:
        if vpixels is None:
            raise ValueError(f"video_grid_thw: shape {_shape(vgrid)} given without pixel_values_videos")
        _require_integer("video_grid_thw", vgrid)
        if vgrid.dim() != 2 or vgrid.shape[1] != 3:
            raise ValueError(f"video_grid_thw: shape {_shape(vgrid)}; expected [videos, 3] (t, h, w)")
        n_videos = vgrid.shape[0]
    video_counts = _counts(
        "n_videos_per_sample", "videos_per_sample", media, videos_per_sample, B, reader,
        "pixel_values_videos", n_videos if vpixels is not None else None, "videos",
    )
    vgrid_slot = reader.add(vgrid) if vgrid is not None else None

    # ---- Step3 crop patches
    crops = media.get("patch_pixel_values")
    num_patches = media.get("num_patches")
    newline = media.get("patch_newline_mask")
    if crops is not None and num_patches is None:
        raise ValueError(
            f"patch_pixel_values: shape {_shape(crops)} given without num_patches; expected num_patches [{B}]"
        )
    if num_patches is not None:
        _require_integer("num_patches", num_patches)
        if tuple(num_patches.shape) != (B,):
            raise ValueError(f"num_patches: shape {_shape(num_patches)}; expected [{B}] (crop patches per sample)")
    if newline is not None:
        if crops is None:
            raise ValueError(f"patch_newline_mask: shape {_shape(newline)} given without patch_pixel_values")
        if newline.dim() != 1 or newline.shape[0] != crops.shape[0]:
            raise ValueError(
                f"patch_newline_mask: shape {_shape(newline)}; expected [{crops.shape[0]}] (one entry per crop patch)"
            )
    np_slot = reader.add(num_patches) if num_patches is not None else None

    # ---- the one host read
    reader.read()
    image_counts = _resolve_counts(image_counts, reader, "n_images_per_sample" if "n_images_per_sample" in media else "images_per_sample", n_images, "images", bounds)
    video_counts = _resolve_counts(video_counts, reader, "n_videos_per_sample" if "n_videos_per_sample" in media else "videos_per_sample", n_videos, "videos", bounds)

    ranges: dict[str, tuple[Range, ...]] = {}
    tensors: dict[str, Tensor] = {}
    sources: dict[str, str] = {}
    zero = (0,) * n
    images, image_rows = zero, zero
    videos, video_rows, crop_rows = zero, zero, zero

    if pixels is not None:
        item_at = _group(image_counts, bounds)
        if grid_slot is not None:
            per_image = _per_item_rows(
                "pixel_values", grid_key, reader.values[grid_slot], grid.shape[1], pixels.shape[0], n_images, image_counts, bounds
            )
        else:
            if pixels.shape[0] != n_images:
                raise ValueError(
                    f"pixel_values: dim 0 is {pixels.shape[0]}; expected {n_images} (one entry per image of "
                    f"{grid_key} {_shape(grid)})" if grid is not None else f"pixel_values: dim 0 is {pixels.shape[0]}; expected {n_images}"
                )
            per_image = np.ones(n_images, dtype=np.int64)
        row_at = _group(per_image, item_at)
        ranges["pixel_values"] = _pairs(row_at)
        tensors["pixel_values"], sources["pixel_values"] = pixels, "pixel_values"
        if grid is not None:
            ranges["image_grid"] = _pairs(item_at)
            tensors["image_grid"], sources["image_grid"] = grid, grid_key
        images = _diffs(item_at)
        image_rows = _diffs(row_at)

    if vpixels is not None:
        item_at = _group(video_counts, bounds)
        per_video = _per_item_rows(
            "pixel_values_videos", "video_grid_thw", reader.values[vgrid_slot], 3, vpixels.shape[0], n_videos, video_counts, bounds
        )
        row_at = _group(per_video, item_at)
        ranges["pixel_values_videos"] = _pairs(row_at)
        ranges["video_grid"] = _pairs(item_at)
        tensors["pixel_values_videos"], sources["pixel_values_videos"] = vpixels, "pixel_values_videos"
        tensors["video_grid"], sources["video_grid"] = vgrid, "video_grid_thw"
        videos = _diffs(item_at)
        video_rows = _diffs(row_at)

    if num_patches is not None:
        per_sample = reader.values[np_slot]
        # min() first: the sample-by-sample scan (for the message) runs only when a count is negative.
        for s, v in enumerate(per_sample.tolist() if per_sample.size and per_sample.min() < 0 else ()):
            if v < 0:
                raise ValueError(
                    f"num_patches: sample {s} (microbatch {_microbatch_of(bounds, s)}) has {v}; expected >= 0"
                )
        total = int(per_sample.sum())
        crop_total = crops.shape[0] if crops is not None else 0
        if total != crop_total:
            raise ValueError(
                f"num_patches: sums to {total}; expected {crop_total}, the rows of patch_pixel_values "
                f"{_shape(crops) if crops is not None else '(absent)'} (whole batch)"
            )
        crop_at = _group(per_sample, bounds)
        crop_rows = _diffs(crop_at)
        # A microbatch with neither images nor crops stages an empty num_patches, so it stays text-only.
        ranges["num_patches"] = tuple(
            (a, b) if images[k] or crop_rows[k] else (a, a) for k, (a, b) in enumerate(zip(bounds, bounds[1:]))
        )
        tensors["num_patches"], sources["num_patches"] = num_patches, "num_patches"
        if crops is not None:
            ranges["patch_pixel_values"] = _pairs(crop_at)
            tensors["patch_pixel_values"], sources["patch_pixel_values"] = crops, "patch_pixel_values"
            if newline is not None:
                ranges["patch_newline_mask"] = ranges["patch_pixel_values"]
                tensors["patch_newline_mask"], sources["patch_newline_mask"] = newline, "patch_newline_mask"

    for key in _MEDIA_KEY_SET.intersection(batch):
        del batch[key]
    # each tiling field's per-microbatch lengths along dim 0 (num_patches' ranges do not tile)
    sizes = {"pixel_values": image_rows, "image_grid": images, "pixel_values_videos": video_rows,
             "video_grid": videos, "patch_pixel_values": crop_rows, "patch_newline_mask": crop_rows}
    return StagedMedia(
        n_microbatches=n,
        batch_size=B,
        chunks={name: _views(t, ranges[name], sizes.get(name)) for name, t in tensors.items()},
        tensors={name: tensors[name] for name in _FIELDS if name in tensors},
        sources=sources,
        ranges=ranges,
        samples=tuple(zip(bounds, bounds[1:])),
        images=images,
        videos=videos,
        image_rows=image_rows,
        video_rows=video_rows,
        crop_rows=crop_rows,
    )


def _batch_size(batch: MutableMapping[str, Any], media: dict[str, Tensor], batch_size: int | None) -> int:
    if batch_size is not None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
            raise ValueError(f"batch_size: got {batch_size!r}; expected an int >= 0")
        return batch_size
    ids = batch.get("input_ids")
    if isinstance(ids, Tensor) and ids.dim() >= 1:
        return ids.shape[0]
    for key, value in batch.items():
        if key not in media and isinstance(value, Tensor) and value.dim() >= 1:
            return value.shape[0]
    raise ValueError("batch: no input_ids (or other [B, ...] tensor) to take the batch size from; pass batch_size=")


def _check_image_grid(key: str, grid: Tensor, pixels: Tensor) -> None:
    _require_integer(key, grid)
    if key in _PATCH_GRID_KEYS:
        if grid.dim() != 2 or grid.shape[1] not in (2, 3):
            raise ValueError(f"{key}: shape {_shape(grid)}; expected [images, 3] (t, h, w) or [images, 2] (h, w)")
    elif key == "image_sizes":
        if grid.dim() != 2 or grid.shape[1] != 2:
            raise ValueError(f"image_sizes: shape {_shape(grid)}; expected [images, 2] (height, width)")
    else:  # image_position_ids: per-patch positions of padded patches
        if grid.dim() != 3 or grid.shape[2] != 2:
            raise ValueError(f"image_position_ids: shape {_shape(grid)}; expected [images, max_patches, 2]")
        if pixels.dim() != 3 or pixels.shape[:2] != grid.shape[:2]:
            raise ValueError(
                f"pixel_values: shape {_shape(pixels)}; expected [{grid.shape[0]}, {grid.shape[1]}, D] "
                f"(padded patches matching image_position_ids {_shape(grid)})"
            )


def _counts(
    batch_key: str,
    arg_name: str,
    media: dict[str, Tensor],
    argument: Any,
    batch_size: int,
    reader: HostReader,
    pixels_key: str,
    items: int | None,
    what: str,
) -> list[int] | int | None:
    """Items per sample: a list of ints, a reader slot (int) for a tensor, or None (no items).

    From ``batch_key`` in the batch or ``argument``; else one per sample when ``items`` (the number
    of images or videos, ``None`` when the batch has none) equals the batch size.
    """
    in_batch = media.get(batch_key)
    if in_batch is not None and argument is not None:
        raise ValueError(f"{batch_key}: given both in the batch and as {arg_name}=; expected one")
    value = in_batch if in_batch is not None else argument
    if value is None:
        if items is None:
            return None
        if items != batch_size:
            raise ValueError(
                f"{pixels_key}: {items} {what} for a batch of {batch_size} samples and nothing maps them "
                f"to samples; expected {batch_key} [{batch_size}] in the batch or {arg_name}= "
                f"(e.g. an adapter's media_per_sample(input_ids, config))"
            )
        return [1] * batch_size
    counts = _counts_argument(batch_key if in_batch is not None else arg_name, value, batch_size)
    if isinstance(counts, Tensor):
        return _Slot(reader.add(counts))
    return counts


class _Slot(int):
    """A reader slot index (distinguishes a pending tensor read from a plain list of counts)."""


def _resolve_counts(
    counts: list[int] | _Slot | None, reader: HostReader, key: str, total: int, what: str, bounds: list[int]
) -> list[int]:
    if counts is None:
        return np.zeros(bounds[-1], dtype=np.int64)
    values = reader.values[counts] if isinstance(counts, _Slot) else np.asarray(counts, dtype=np.int64)
    # min() first: the sample-by-sample scan (for the message) runs only when a count is negative.
    for s, v in enumerate(values.tolist() if values.size and values.min() < 0 else ()):
        if v < 0:
            raise ValueError(
                f"{key}: sample {s} (microbatch {_microbatch_of(bounds, s)}) has {v} {what}; expected >= 0"
            )
    if int(values.sum()) != total:
        raise ValueError(f"{key}: counts sum to {int(values.sum())}; expected {total}, the number of {what} (whole batch)")
    return values
