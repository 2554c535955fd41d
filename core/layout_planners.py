"""Planners made from a declaration, for plugin layouts (:func:`ppmedia.layouts.item_layout`,
:func:`ppmedia.layouts.sample_layout`).

Each checks shapes before the host read, reads only the integer metadata it needs (counts, rows per
item) in the split's one read, checks every value with exact arithmetic and stages views: what a
hand-written planner must do, done once for every author.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from torch import Tensor

from .planners import (
    Context,
    Counts,
    FieldSplit,
    Part,
    _cut,
    check_counts,
    check_range,
    default_counts,
    exact_sum,
    offsets,
    require_readable,
    require_shape,
    shape_of,
)

__all__ = ["item_planner", "sample_planner"]

Finish = Callable[[], Part]


def item_planner(
    name: str,
    modality: str,
    pixels: str,
    field: str,
    per_item: Mapping[str, str],
    per_row: Mapping[str, str],
    rows_per_item: str | None,
) -> Callable[[Context, Mapping[str, Any], Counts | None], Finish]:
    """The planner of ``pixels`` with items on axis 0 (one row each), or with ``rows_per_item`` (an
    ``[items]`` integer key) rows each; ``per_item`` keys have items on axis 0, ``per_row`` keys the
    rows of ``pixels``. Items map to samples by the modality's per-sample counts."""
    what = f"{modality}s"

    def plan(ctx: Context, media: Mapping[str, Any], counts: Counts | None) -> Finish:
        px: Tensor = media[pixels]
        if px.dim() < 1:
            raise ValueError(f"{pixels}: shape {shape_of(px)}; expected [{what}, ...] (media layout {name!r})")
        rows = px.shape[0]
        slot = None
        if rows_per_item is not None:
            per = require_readable(rows_per_item, media[rows_per_item])
            require_shape(rows_per_item, per, (None,), f"[{what}] (rows of {pixels} per item)")
            items = per.shape[0]
            slot = ctx.reader.add(per)
        else:
            items = rows
        for keys, length, axis in ((per_item, items, what), (per_row, rows, f"rows of {pixels} {shape_of(px)}")):
            for key in keys:
                t = media.get(key)
                if t is not None and (t.dim() < 1 or t.shape[0] != length):
                    raise ValueError(f"{key}: shape {shape_of(t)}; expected [{length}, ...] (one row per {axis}; media layout {name!r})")
        pending = counts if counts is not None else default_counts(
            ctx, pixels, items, what, f"n_{modality}s_per_sample", f"{modality}s_per_sample")

        def finish() -> Part:
            per_sample = pending.values(ctx.reader)
            item_at = check_counts(ctx, pending, per_sample, items, what)[ctx.at]
            row_at = item_at
            if slot is not None:
                assert rows_per_item is not None
                per_item_rows = ctx.reader.values[slot]
                check_range(rows_per_item, per_item_rows, rows, f"rows of {pixels}", lambda i: f"{modality} {i}")
                if exact_sum(per_item_rows, rows) != rows:
                    raise ValueError(
                        f"{rows_per_item}: sums to {exact_sum(per_item_rows)}; expected {rows}, the rows of {pixels} "
                        f"{shape_of(px)} (whole batch)"
                    )
                row_at = offsets(per_item_rows)[item_at]
            item_ranges, item_sizes = _cut(item_at)
            row_ranges, row_sizes = _cut(row_at)
            fields = [FieldSplit(field, pixels, px, row_ranges, row_sizes)]
            for keys, ranges, sizes in ((per_item, item_ranges, item_sizes), (per_row, row_ranges, row_sizes)):
                fields += [FieldSplit(f, key, media[key], ranges, sizes) for key, f in keys.items() if media.get(key) is not None]
            return Part(fields, item_sizes, row_sizes)

        return finish

    return plan


def sample_planner(name: str, keys: Mapping[str, str]) -> Callable[[Context, Mapping[str, Any], Counts | None], Finish]:
    """The planner of ``keys`` (batch key -> chunk field) whose axis 0 holds the samples."""

    def plan(ctx: Context, media: Mapping[str, Any], counts: Counts | None) -> Finish:
        B = ctx.batch_size
        present = [(key, f, media[key]) for key, f in keys.items() if media.get(key) is not None]
        for key, _, t in present:
            if t.dim() < 1 or t.shape[0] != B:
                raise ValueError(f"{key}: shape {shape_of(t)}; expected [{B}, ...] (samples on axis 0; media layout {name!r})")

        def finish() -> Part:
            ranges, sizes = _cut(ctx.at)
            return Part([FieldSplit(f, key, t, ranges, sizes) for key, f, t in present], sizes, sizes)

        return finish

    return plan
