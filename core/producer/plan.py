"""The plan step of the producer path: select the batch's layouts, check, plan, read once, finish.

:func:`plan_split` is the first step :func:`ppmedia.split_media` calls (``n`` microbatches for the plain
split, ``B`` of one sample each for a row order such as ``balance=``); it returns a
:class:`~ppmedia.producer.assemble.Planned` and calls only downwards (layouts, planners, host reads, and the
types of :mod:`ppmedia.producer.assemble`). Nothing here modifies the batch.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Mapping, MutableMapping, Sequence

import torch
from torch import Tensor

from .assemble import FIELD_KINDS, FieldSplit, Part, Planned
from .layouts import LayoutSet, MediaLayout, Selection
from .planners import (
    Context,
    Counts,
    CountsArgument,
    is_empty,
    no_media,
    pending_counts,
    require_tensor,
    shape_of,
)
from .staged import cached_bounds

__all__ = ["Planned", "SampleInputsArgument", "default_layouts", "plan_split"]

#: ``split_media(sample_inputs=...)``: batch keys (taken from the batch), or ``{key: None or [B, ...] tensor}``.
SampleInputsArgument = Mapping[str, "Tensor | None"] | Sequence[str] | None


_registry: Any = None  # ppmedia.registry.default_registry, imported on first use (the registry imports this module's layouts)


def default_layouts() -> LayoutSet:
    """The process-wide registry's layouts: the built-ins, installed plugins' and ``PPMEDIA_PLUGINS``'."""
    global _registry
    if _registry is None:
        from ..registry import default_registry

        _registry = default_registry
    layouts: LayoutSet = _registry().media_layouts()
    return layouts


def _media_of(batch: MutableMapping[str, Any], layouts: LayoutSet) -> dict[str, Any]:
    """The batch's media values by key (``None`` values left out), each checked to be a dense tensor."""
    if type(batch) is not dict and not isinstance(batch, MutableMapping):  # dict first: the ABC check is slow
        raise TypeError(f"batch: got {type(batch).__name__}; expected a mutable mapping of str to tensors")
    media: dict[str, Any] = {}
    sequences = layouts.sequences
    for key in layouts.keys.intersection(batch):
        value = batch[key]
        if value is not None:
            media[key] = value if key in sequences else require_tensor(key, value)
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


def _batch_size(batch: MutableMapping[str, Any], skip: frozenset[str], batch_size: object) -> int:
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
        if key not in skip and isinstance(value, Tensor) and not value.is_nested and value.dim() >= 1:
            return value.shape[0]
    raise ValueError("batch: no input_ids (or other [B, ...] tensor) to take the batch size from; pass batch_size=")


def _check_left_over(batch: MutableMapping[str, Any], batch_size: int, popped: frozenset[str]) -> None:
    """Every tensor that stays in the batch has ``B`` on dim 0, so the schedule's split is right for it."""
    for key, value in batch.items():
        if key in popped or not isinstance(value, Tensor):
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
        f"{seen}. ppmedia does not know {key} as a media key (it splits the keys of its media layouts: "
        f"ppmedia.MEDIA_KEYS and those of plugins' layouts): take it out of the batch before split_media and "
        f"carry it yourself, give it samples on dim 0, or bring a media layout for it (a plugin's "
        f"ppmedia_media_layouts hook)"
    )


def _sample_inputs(batch: Mapping[str, Any], argument: SampleInputsArgument, layouts: LayoutSet) -> dict[str, Tensor]:
    """The per-sample inputs to stage: ``{key: tensor}``, each a dense tensor with a dim 0 (its length is
    checked against ``B`` later)."""
    if not argument:
        return {}
    if isinstance(argument, (str, bytes)) or not isinstance(argument, (Mapping, Sequence)):
        raise TypeError(f"sample_inputs: got {type(argument).__name__}; expected batch keys or a mapping of key to tensor")
    pairs = argument.items() if isinstance(argument, Mapping) else ((key, None) for key in argument)
    out: dict[str, Tensor] = {}
    for key, value in pairs:
        if not isinstance(key, str):
            raise TypeError(f"sample_inputs: key {key!r} ({type(key).__name__}); expected a batch key (str)")
        if key in layouts.keys:
            owner = next(layout.name for layout in layouts if key in layout.keys or key == layout.counts_key)
            raise ValueError(f"sample_inputs: {key} is a media key (media layout {owner!r} reads it); expected a key no layout reads")
        if value is None:
            value = batch.get(key)
            if value is None:
                raise ValueError(f"sample_inputs: {key} is not in the batch; expected a [B, ...] tensor under that key")
        tensor = require_tensor(key, value)
        if tensor.dim() == 0:
            raise ValueError(f"{key}: shape []; expected [B, ...] (a per-sample input: one row per sample)")
        out[key] = tensor
    return out


def _inputs_part(ctx: Context, inputs: Mapping[str, Tensor]) -> Part:
    B = ctx.batch_size
    ranges = tuple(zip(ctx.bounds, ctx.bounds[1:]))
    sizes = tuple(b - a for a, b in ranges)
    fields = []
    for key, tensor in inputs.items():
        if tensor.shape[0] != B:
            raise ValueError(f"{key}: shape {shape_of(tensor)}; expected [{B}, ...] (a per-sample input: one row per sample)")
        fields.append(FieldSplit(key, key, tensor, ranges, sizes, "input"))
    zero = (0,) * len(ranges)
    return Part(fields, zero, zero)


def _checked_selection(layouts: LayoutSet, media: Mapping[str, Any]) -> Selection:
    selection = layouts.select(frozenset(media))
    if selection.error is not None:
        raise ValueError(selection.error)
    for orphan in selection.orphans:
        value = media[orphan.key]
        if orphan.optional and is_empty(value):  # e.g. an empty second_per_grid_ts in a batch without videos
            continue
        seen = f"shape {shape_of(value)}" if isinstance(value, Tensor) else f"a {type(value).__name__}"
        if orphan.missing:
            raise ValueError(f"{orphan.key}: {seen} given without {' and '.join(orphan.missing)}")
        present = frozenset(media)
        winners = [layout.name for layout in selection.layouts if set(layout.keys) & set(orphan.owner.keys) & present]
        raise ValueError(
            f"{orphan.key}: {seen}; only media layout {orphan.owner.name!r} reads it, and the batch's keys select "
            f"{' and '.join(map(repr, winners)) or 'another layout'} instead; expected the keys of one layout"
        )
    return selection


def _count_arguments(layouts: LayoutSet, images: CountsArgument, videos: CountsArgument,
                     counts: Mapping[str, CountsArgument] | None, audios: CountsArgument = None) -> dict[str, CountsArgument]:
    """``{modality: counts argument}`` of the arguments given (``None`` ones left out), each for a counted modality."""
    given: dict[str, CountsArgument] = {}
    for modality, value in (("image", images), ("video", videos), ("audio", audios)):
        if value is not None:
            given[modality] = value
    for modality, value in (counts or {}).items():
        if value is None:
            continue
        if modality in given:
            raise ValueError(f"counts[{modality!r}]: given both as counts= and as {modality}s_per_sample=; expected one")
        given[modality] = value
    for modality in given:
        if modality not in layouts.counted:
            raise ValueError(
                f"{modality}s_per_sample: counts for {modality!r} items, but no registered media layout counts "
                f"{modality} items (modalities with counts: {', '.join(layouts.counted) or 'none'})"
            )
    return given


def plan_split(
    batch: MutableMapping[str, Any],
    n_microbatches: int,
    *,
    images_per_sample: CountsArgument = None,
    videos_per_sample: CountsArgument = None,
    audios_per_sample: CountsArgument = None,
    counts: Mapping[str, CountsArgument] | None = None,
    batch_size: int | None = None,
    sample_inputs: SampleInputsArgument = None,
    layouts: LayoutSet | None = None,
) -> Planned:
    """Check and plan ``batch`` for ``n_microbatches`` (see :func:`ppmedia.split_media`); the one host read.

    Raises the ``ValueError``/``TypeError`` of any check, with ``batch`` untouched.
    """
    layouts = default_layouts() if layouts is None else layouts
    media = _media_of(batch, layouts)
    inputs = _sample_inputs(batch, sample_inputs, layouts)
    popped = layouts.keys.union(inputs) if inputs else layouts.keys
    B = _batch_size(batch, popped, batch_size)
    bounds, at, samples = cached_bounds(B, _microbatches(n_microbatches, B))
    ctx = Context(B, bounds, at)
    _check_left_over(batch, B, popped)
    arguments = _count_arguments(layouts, images_per_sample, videos_per_sample, counts, audios_per_sample)
    selection = _checked_selection(layouts, media)
    finishers: list[tuple[MediaLayout | None, Callable[[], Part]]] = []
    for layout, key, argument in selection.plans:
        pending: Counts | None = None
        if key is not None and argument is not None:
            pending = pending_counts(ctx, media, key, argument, arguments.get(layout.modality))
        finishers.append((layout, layout.plan(ctx, media, pending)))
    for modality, key, argument in selection.unplanned:
        pending = pending_counts(ctx, media, key, argument, arguments.get(modality))
        if pending is not None:  # counts for media the batch does not hold: all zero
            finishers.append((None, no_media(ctx, pending, f"{modality}s")))
    parts: list[tuple[MediaLayout | None, Part]] = [(None, _inputs_part(ctx, inputs))] if inputs else []
    ctx.reader.read()  # the one host read
    for owner, finish in finishers:
        part = finish()
        if owner is not None:
            _check_part(owner, part, len(samples))
            parts.append((owner, part))
    return Planned(B, bounds, samples, parts, popped)


def _check_part(layout: MediaLayout, part: Part, n: int) -> None:
    """A planner's result is what its layout declares (a guard against a broken plugin planner)."""
    if not isinstance(part, Part) or len(part.items) != n or len(part.rows) != n:
        raise TypeError(
            f"media layout {layout.name!r}: its planner's finish() returned {type(part).__name__}; expected a "
            f"ppmedia.producer.planners.Part with {n} items and rows (one per microbatch)"
        )
    for f in part.fields:
        if f.name not in layout.fields or f.kind not in FIELD_KINDS or len(f.ranges) != n:
            raise TypeError(
                f"media layout {layout.name!r}: its planner staged {f.name!r} (kind {f.kind!r}, {len(f.ranges)} "
                f"ranges); expected one of its fields {list(layout.fields)}, a kind of {list(FIELD_KINDS)} and {n} ranges"
            )
