"""Planners made from a declaration, for plugin layouts (:func:`ppmedia.producer.layouts.item_layout`,
:func:`ppmedia.producer.layouts.sample_layout`).

Each checks shapes before the host read, reads only the integer metadata it needs (counts, rows per
item) in the split's one read, checks every value with exact arithmetic and stages views: what a
hand-written planner must do, done once for every author.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
from torch import Tensor

from .planners import (
    Context,
    Counts,
    FieldSplit,
    Ints,
    Part,
    _cut,
    check_counts,
    check_range,
    default_counts,
    exact_products,
    exact_sum,
    offsets,
    require_readable,
    require_shape,
    shape_of,
)

__all__ = ["GridRows", "item_planner", "sample_planner"]

Finish = Callable[[], Part]
_MAX_MERGE = 2**31  # its square fits in int64


@dataclass(frozen=True)
class GridRows:
    """Rows per item as the product of a grid key's columns, for :func:`ppmedia.producer.layouts.item_layout`.

    Item ``i`` has ``prod(grid[i]) // merge_i**2`` rows of the pixels: ``grid`` is the batch key
    ``key`` of shape ``[items, columns]`` (positive integers, e.g. ``image_grid_thw`` ``[images, 3]``,
    ``(t, h, w)`` patches), and ``merge_i`` is ``merge`` (an int) or ``merge[i]`` (the batch key
    ``merge`` of shape ``[items]``, positive integers): the side of the square of patches merged into
    one row. ``merge=1`` (the default): one row per patch, ``t * h * w`` rows.

    Each product must be a multiple of ``merge_i**2`` and the rows must add up to the pixels' dim 0;
    either error names the key, the item (with its sample and microbatch) and what was expected.

    Attributes:
        key: the grid's batch key (``"image_grid_thw"``).
        merge: an int >= 1, or the batch key of per-item merge sizes (``"image_merge_sizes"``).
    """

    key: str
    merge: int | str = 1

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key:
            raise ValueError(f"GridRows.key is {self.key!r}; expected the grid's batch key")
        merge = self.merge
        if isinstance(merge, bool) or not (isinstance(merge, str) and merge or isinstance(merge, int) and merge >= 1):
            raise ValueError(f"GridRows({self.key!r}).merge is {merge!r}; expected an int >= 1 or a per-item batch key")

    @property
    def keys(self) -> tuple[str, ...]:
        """The batch keys it reads: the grid, then the merge sizes' key if any."""
        return (self.key, *([self.merge] if isinstance(self.merge, str) else []))

    def describe(self) -> str:
        """``"the image_grid_thw products / 2**2"``, for messages."""
        merge = f" / {self.merge}**2" if self.merge != 1 else ""
        return f"the {self.key} products{merge}"


class _Grid:
    """One split's use of a :class:`GridRows`: the checks before the host read, then the rows per item."""

    def __init__(self, spec: GridRows, ctx: Context, media: Mapping[str, Any], pixels: str, what: str) -> None:
        self.spec, self.ctx, self.pixels = spec, ctx, f"{pixels} {shape_of(media[pixels])}"
        grid = require_readable(spec.key, media[spec.key])
        require_shape(spec.key, grid, (None, None), f"[{what}, columns] (the grid of each item, e.g. (t, h, w))")
        self.items, self.columns = grid.shape[0], grid.shape[1]
        self.slot = ctx.reader.add(grid)
        self.merge_slot: int | None = None
        if isinstance(spec.merge, str):
            sizes = require_readable(spec.merge, media[spec.merge])
            require_shape(spec.merge, sizes, (self.items,), f"[{self.items}] (one merge size per row of {spec.key} {shape_of(grid)})")
            self.merge_slot = ctx.reader.add(sizes)

    def rows(self, rows: int, locate: Callable[[int], str]) -> Ints:
        """Rows per item ``[items]`` after the read; ``ValueError`` for a non-positive grid entry or merge
        size, an item with more rows than the pixels hold, or a product that is not a multiple of its
        merge size squared."""
        spec, values = self.spec, self.ctx.reader.values
        table = values[self.slot].reshape(self.items, self.columns)
        if self.merge_slot is None:
            sizes = np.full(self.items, int(spec.merge), dtype=np.int64)
        else:
            sizes = values[self.merge_slot]
            bad = np.flatnonzero((sizes <= 0) | (sizes > _MAX_MERGE))
            if bad.size:
                i = int(bad[0])
                raise ValueError(f"{spec.merge}: {locate(i)} has merge size {int(sizes[i])}; expected 1..{_MAX_MERGE}")
        squares = sizes * sizes
        exact = exact_products(spec.key, table, rows * int(squares.max(initial=1)), locate)  # refuses entries <= 0
        if exact is not None and exact[0].size == self.items + 1:
            fast = np.diff(exact[0])
            if not (fast % squares).any():
                per_item: Ints = fast // squares
                if not per_item.size or int(per_item.max()) <= rows:
                    return per_item
        # a bad item, a product beyond the rows or a sum beyond int64: find it with exact Python ints
        products = [math.prod(r) for r in table.tolist()]
        for i, (product, square) in enumerate(zip(products, squares.tolist())):
            merge = f" from {spec.merge}" if isinstance(spec.merge, str) else ""
            if product % square:
                raise ValueError(
                    f"{spec.key}: {locate(i)} is {table[i].tolist()}, product {product}; expected a multiple of "
                    f"{int(sizes[i])}**2 = {square} (merge size {int(sizes[i])}{merge}), whole rows of {self.pixels}"
                )
            if product // square > rows:
                raise ValueError(
                    f"{spec.key}: {locate(i)} is {table[i].tolist()}, {product // square} rows ({spec.describe()}); "
                    f"expected at most {rows}, the rows of {self.pixels} (whole batch)"
                )
        return np.asarray([p // q for p, q in zip(products, squares.tolist())], dtype=np.int64)


def item_planner(
    name: str,
    modality: str,
    pixels: str,
    field: str,
    per_item: Mapping[str, str],
    per_row: Mapping[str, str],
    rows_per_item: str | GridRows | None,
) -> Callable[[Context, Mapping[str, Any], Counts | None], Finish]:
    """The planner of ``pixels`` with items on axis 0 (one row each), with ``rows_per_item`` (an
    ``[items]`` integer key) rows each, or with a :class:`GridRows` grid product each; ``per_item``
    keys have items on axis 0, ``per_row`` keys the rows of ``pixels``. Items map to samples by the
    modality's per-sample counts."""
    what = f"{modality}s"

    def plan(ctx: Context, media: Mapping[str, Any], counts: Counts | None) -> Finish:
        px: Tensor = media[pixels]
        if px.dim() < 1:
            raise ValueError(f"{pixels}: shape {shape_of(px)}; expected [{what}, ...] (media layout {name!r})")
        rows = px.shape[0]
        slot, grid = None, None
        if isinstance(rows_per_item, GridRows):
            grid = _Grid(rows_per_item, ctx, media, pixels, what)
            items = grid.items
        elif rows_per_item is not None:
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
            if rows_per_item is not None:
                def locate(i: int) -> str:
                    return f"{modality} {i} ({ctx.where_item(per_sample, i)})"

                if grid is not None:
                    per_item_rows, source = grid.rows(rows, locate), grid.spec.describe()
                else:
                    assert slot is not None and isinstance(rows_per_item, str)
                    per_item_rows, source = ctx.reader.values[slot], rows_per_item
                    check_range(rows_per_item, per_item_rows, rows, f"rows of {pixels}", locate)
                if exact_sum(per_item_rows, rows) != rows:
                    raise ValueError(
                        f"{source}: {'sum' if grid is not None else 'sums'} to {exact_sum(per_item_rows)}; expected {rows}, the rows of {pixels} "
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
