"""The assembly step of the producer path: a finished plan -> :class:`~ppmedia.StagedMedia` of views.

What a plan hands down lives here too, so that every step above imports it downwards:
:class:`FieldSplit` and :class:`Part` (a planner's result, re-exported by :mod:`ppmedia.producer.planners`) and
:class:`Planned` (a batch planned for ``n`` microbatches, made by :func:`ppmedia.producer.plan.plan_split`).
:func:`reorder_plan` applies a row order decided above (``split_media(balance=...)``) to a per-sample
plan: every staged tensor gathered once. Nothing here reads the batch or calls a step above.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor

from ..chunk import STAGED_ATTRIBUTES
from .staged import Range, StagedMedia, cached_bounds, views

__all__ = ["FIELD_KINDS", "FieldSplit", "Part", "Planned", "assemble", "reorder_plan"]

#: what axis 0 of a staged field holds, as :class:`FieldSplit` ``kind`` says it:
#: ``"media"``: rows or items of the media (the ranges tile dim 0 in microbatch order);
#: ``"sample"``: one entry per sample, metadata of the media: staged EMPTY in a microbatch that holds
#: no media rows at all, so the consumer sees a text-only microbatch (Step3's ``num_patches``);
#: ``"input"``: one entry per sample, always staged (per-sample inputs, e.g. token types).
FIELD_KINDS: tuple[str, ...] = ("media", "sample", "input")
_ORDER = {name: i for i, name in enumerate(STAGED_ATTRIBUTES)}


class FieldSplit(NamedTuple):
    """One chunk field: its batch tensor, the key it came from, its ranges along dim 0 per microbatch.

    ``name`` is a :class:`~ppmedia.VlmMediaChunk` field, or any other name, which the chunk then
    carries in ``chunk.extras[name]``. ``sizes``: the ranges' lengths when they tile dim 0 (fast
    views), else ``None``. ``kind``: one of :data:`FIELD_KINDS`; a ``"sample"`` or ``"input"`` field's
    ranges are the microbatches' sample ranges.
    """

    name: str
    source: str
    tensor: Tensor
    ranges: tuple[Range, ...]
    sizes: tuple[int, ...] | None
    kind: str = "media"


class Part(NamedTuple):
    """A planner's result: its fields, and per microbatch its items (images, videos, ...) and media rows
    (the rows of its pixel tensor: the ones that make a microbatch hold media)."""

    fields: list[FieldSplit]
    items: tuple[int, ...]
    rows: tuple[int, ...]


@dataclass
class Planned:
    """A batch planned for ``n`` microbatches: every check passed, the host read done, no view made yet.

    ``parts`` pairs each finished :class:`Part` with its layout (a
    :class:`~ppmedia.producer.layouts.MediaLayout`; ``None``: the per-sample inputs); ``popped`` is every batch
    key a successful split removes. ``items`` and ``rows`` (computed) sum the layouts' items and
    media rows per modality and microbatch.
    """

    batch_size: int
    bounds: tuple[int, ...]
    samples: tuple[Range, ...]
    parts: list[tuple[Any, Part]]
    popped: frozenset[str]
    items: dict[str, tuple[int, ...]] = field(init=False)
    rows: dict[str, tuple[int, ...]] = field(init=False)

    def __post_init__(self) -> None:
        items: dict[str, tuple[int, ...]] = {}
        rows: dict[str, tuple[int, ...]] = {}
        for layout, part in self.parts:
            if layout is not None:
                m = layout.modality
                items[m] = part.items if m not in items else tuple(map(sum, zip(items[m], part.items)))
                rows[m] = part.rows if m not in rows else tuple(map(sum, zip(rows[m], part.rows)))
        self.items, self.rows = items, rows


def _checked_views(f: FieldSplit) -> list[Tensor]:
    try:
        return views(f.tensor, f.ranges, f.sizes)
    except RuntimeError as error:  # a guard: the planners checked the ranges already
        raise ValueError(f"{f.source}: shape {list(f.tensor.shape)}; cannot be cut at {list(f.ranges)} ({error})") from error


def _without_media(planned: Planned) -> list[int]:
    """The microbatches that hold no media rows in any layout."""
    n = len(planned.samples)
    held = [False] * n
    for rows in planned.rows.values():
        for k, count in enumerate(rows):
            if count:
                held[k] = True
    return [k for k in range(n) if not held[k]]


def _blanked(f: FieldSplit, empty: Sequence[int]) -> FieldSplit:
    ranges = list(f.ranges)
    for k in empty:
        ranges[k] = (ranges[k][0], ranges[k][0])
    return f._replace(ranges=tuple(ranges), sizes=None)


def assemble(planned: Planned, permutation: tuple[int, ...] | None = None) -> StagedMedia:
    """The :class:`StagedMedia` of a plan: every view made here (``"sample"`` fields staged empty in the
    microbatches without media), nothing popped. ``permutation`` is recorded as the result's."""
    n = len(planned.samples)
    zero = (0,) * n
    splits: list[FieldSplit] = []
    empty: list[int] | None = None
    names = [layout.name for layout, _ in planned.parts if layout is not None]
    for _, part in planned.parts:
        for f in part.fields:
            if f.kind == "sample":
                empty = _without_media(planned) if empty is None else empty
                if empty:
                    f = _blanked(f, empty)
            splits.append(f)
    if len(splits) > 1:
        splits.sort(key=_field_order)
    tensors: dict[str, Tensor] = {}
    sources: dict[str, str] = {}
    ranges: dict[str, tuple[Range, ...]] = {}
    kinds: dict[str, str] = {}
    chunks: dict[str, list[Tensor]] = {}
    for f in splits:
        if f.name in tensors:
            raise ValueError(f"{f.source}: staged as {f.name!r}, which {sources[f.name]} is staged as too; expected one key per field")
        tensors[f.name], sources[f.name], ranges[f.name], kinds[f.name] = f.tensor, f.source, f.ranges, f.kind
        chunks[f.name] = _checked_views(f)
    items, rows = dict(planned.items), dict(planned.rows)
    return StagedMedia(
        n_microbatches=n, batch_size=planned.batch_size, tensors=tensors, sources=sources, ranges=ranges,
        samples=planned.samples, images=items.get("image", zero), videos=items.get("video", zero),
        image_rows=rows.get("image", zero), video_rows=rows.get("video", zero), crop_rows=rows.get("crop", zero),
        permutation=permutation, chunks=chunks, items=items or {"image": zero, "video": zero}, rows=rows,
        kinds=kinds, layouts=tuple(names),
    )


def _field_order(f: FieldSplit) -> int:
    return _ORDER.get(f.name, len(_ORDER))


def _gather(tensor: Tensor, ranges: Sequence[tuple[int, int]], order: Sequence[int]) -> tuple[Tensor, list[int]]:
    """``cat(tensor[ranges[s]] for s in order)`` as one ``index_select``, and the lengths in that order."""
    lengths = [ranges[s][1] - ranges[s][0] for s in order]
    if list(order) == sorted(order) and all(ranges[a][1] == ranges[b][0] for a, b in zip(order, order[1:])):
        return tensor, lengths
    index = np.concatenate([np.arange(*ranges[s], dtype=np.int64) for s in order] or [np.zeros(0, np.int64)])
    return tensor.index_select(0, torch.as_tensor(index, device=tensor.device)), lengths


def reorder_plan(per_sample: Planned, permutation: Sequence[int], n_microbatches: int) -> Planned:
    """The per-sample plan (``B`` microbatches of one sample) with its samples in ``permutation`` order,
    cut in ``n_microbatches``: every staged tensor gathered once (nothing copied for the identity)."""
    B = per_sample.batch_size
    bounds, _, samples = cached_bounds(B, n_microbatches)
    order = list(permutation)

    def per_mb(values: Sequence[int]) -> tuple[int, ...]:
        ordered = [values[s] for s in order]
        return tuple(sum(ordered[a:b]) for a, b in zip(bounds, bounds[1:]))

    parts: list[tuple[Any, Part]] = []
    for layout, part in per_sample.parts:
        fields = []
        for f in part.fields:
            tensor, lengths = _gather(f.tensor, f.ranges, order)
            at = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))[list(bounds)].tolist()
            fields.append(f._replace(tensor=tensor, ranges=tuple(zip(at, at[1:])), sizes=tuple(b - a for a, b in zip(at, at[1:]))))
        parts.append((layout, Part(fields, per_mb(part.items), per_mb(part.rows))))
    return Planned(B, bounds, samples, parts, per_sample.popped)
