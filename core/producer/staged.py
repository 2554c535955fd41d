"""What a split produces: :class:`StagedMedia`, one batch's media cut per microbatch as views.

Made by :func:`ppmedia.split_media` (plain or balanced, both through :mod:`ppmedia.producer.plan`) and hung
on the first stage by :func:`ppmedia.stage_media`.
"""

from __future__ import annotations

import functools
import itertools
import operator
from dataclasses import dataclass, field, fields
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from ..chunk import STAGED_ATTRIBUTES, VlmMediaChunk

__all__ = ["StagedMedia", "microbatch_bounds"]

#: the chunk's tensor fields, in order (``extras`` holds every other staged name)
_FIELDS = tuple(STAGED_ATTRIBUTES)
_FIELD_SET = frozenset(_FIELDS)
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
def cached_bounds(batch_size: int, n_microbatches: int) -> tuple[tuple[int, ...], Any, tuple[Range, ...]]:
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
        tensors: staged name -> the batch's whole tensor (fields absent from the batch are left out).
            A name is a :class:`~ppmedia.VlmMediaChunk` field, or another name a layout or a per-sample
            input stages, which the chunk carries in ``chunk.extras``.
        sources: staged name -> the batch key it was popped from.
        ranges: staged name -> ``n`` ``(start, stop)`` pairs along dim 0.
        samples: per microbatch, its ``(first, stop)`` samples.
        images, videos: per microbatch, its number of images and videos (``items["image"]``, ...);
            :attr:`audios` likewise for audio clips.
        image_rows, video_rows, crop_rows: per microbatch, its rows of the image, video and Step3
            crop pixels (``rows["image"]``, ``rows["video"]``, ``rows["crop"]``).
        permutation: with ``split_media(..., balance=...)``, the reordering applied to the batch:
            position ``i`` holds original sample ``permutation[i]`` (see :mod:`ppmedia.balance`);
            ``None`` when not balanced.
        items: modality -> per microbatch, its items (``"image"``, ``"video"``, a plugin's modality).
        rows: modality -> per microbatch, the rows of that modality's pixel tensor.
        kinds: staged name -> what its axis 0 holds (:data:`ppmedia.producer.planners.FIELD_KINDS`):
            ``"media"`` rows or items, ``"sample"`` one entry per sample (empty in a microbatch
            without media), ``"input"`` one entry per sample (a per-sample input, always staged).
        layouts: the names of the media layouts that staged this batch.
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
    chunks: dict[str, list[Tensor]] = field(default_factory=dict, repr=False, compare=False)
    items: dict[str, tuple[int, ...]] = field(default_factory=dict)
    rows: dict[str, tuple[int, ...]] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    layouts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.items:  # built by hand, or pickled before the per-modality tallies
            self.items = {"image": tuple(self.images), "video": tuple(self.videos)}
        if not self.rows:
            self.rows = {"image": tuple(self.image_rows), "video": tuple(self.video_rows), "crop": tuple(self.crop_rows)}
        if not self.chunks:  # split_media passes the views it made; otherwise cut them from ranges
            self.chunks = {name: views(tensor, self.ranges[name]) for name, tensor in self.tensors.items()}

    def __len__(self) -> int:
        return self.n_microbatches

    def __getstate__(self) -> dict[str, Any]:
        # The views are rebuilt on unpickling: only the whole tensors travel (DataLoader workers).
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "chunks"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for f in fields(self):  # a state pickled by an older ppmedia lacks the newer fields
            if f.name not in state and f.name != "chunks":
                setattr(self, f.name, f.default_factory() if callable(f.default_factory) else f.default)
        for name, value in state.items():
            setattr(self, name, value)
        self.chunks = {}
        self.__post_init__()

    @property
    def audios(self) -> tuple[int, ...]:
        """Per microbatch, its number of audio clips (``items["audio"]``; zeros without audio)."""
        found = self.items.get("audio")
        return tuple(found) if found is not None else (0,) * self.n_microbatches

    @property
    def extra_names(self) -> tuple[str, ...]:
        """The staged names that are not chunk fields: what ``chunk.extras`` holds."""
        return tuple(name for name in self.tensors if name not in _FIELD_SET)

    def chunk(self, k: int) -> VlmMediaChunk | None:
        """Microbatch ``k``'s media as :func:`ppmedia.next_vlm_media_chunk` would return it."""
        if not 0 <= k < self.n_microbatches:
            raise IndexError(f"microbatch {k} out of range for {self.n_microbatches} microbatches")
        chunks = self.chunks
        values: list[Any] = [
            t if (t := chunks[name][k] if name in chunks else None) is not None and t.numel() else None
            for name in _FIELDS
        ]
        extras = {name: t for name in self.extra_names if (t := chunks[name][k]).numel()}
        if not extras and all(v is None for v in values):
            return None
        chunk = VlmMediaChunk(*values)
        chunk.extras = extras or None
        return chunk

    def extras_per_microbatch(self) -> list[dict[str, Tensor] | None] | None:
        """Per microbatch, the non-empty views of the names that are not chunk fields (``None`` when
        a microbatch has none); ``None`` when the split staged no such name. What ``stage_media`` hangs
        on the stage as ``_vlm_extras_chunks``."""
        names = self.extra_names
        if not names:
            return None
        out: list[dict[str, Tensor] | None] = []
        for k in range(self.n_microbatches):
            entry = {name: t for name in names if (t := self.chunks[name][k]).numel()}
            out.append(entry or None)
        return out

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


def views(tensor: Tensor, ranges: Sequence[Range], sizes: Sequence[int] | None = None) -> list[Tensor]:
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
