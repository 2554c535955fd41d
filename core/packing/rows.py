"""Which samples share a row: first-fit decreasing into rows of at most ``max_length`` tokens."""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["plan_rows", "row_costs"]


def _checked_lengths(lengths: Sequence[int], max_length: int) -> list[int]:
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length: got {max_length!r}; expected an int >= 1 (tokens per packed row)")
    out = []
    for i, n in enumerate(lengths):
        value = int(n)
        if value < 1:
            raise ValueError(f"lengths: sample {i} has {value} tokens; expected >= 1")
        if value > max_length:
            raise ValueError(f"lengths: sample {i} has {value} tokens, over max_length={max_length}: it fits no "
                             f"packed row (raise max_length, or cut or drop the sample before packing)")
        out.append(value)
    return out


def _first_fit_decreasing(lengths: list[int], max_length: int) -> list[list[int]]:
    """Longest first, each into the first row with room (ties: the lower sample index first)."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, room in enumerate(free):
            if lengths[i] <= room:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(max_length - lengths[i])
    return rows


def _to_multiple(rows: list[list[int]], lengths: list[int], multiple: int) -> list[list[int]]:
    """Split rows until their count is a multiple of ``multiple``: the shortest sample of the row
    holding the most samples moves to a row of its own; empty rows when no row holds two samples."""
    while len(rows) % multiple:
        many = [r for r in range(len(rows)) if len(rows[r]) > 1]
        if not many:
            rows.append([])
            continue
        r = max(many, key=lambda r: (len(rows[r]), sum(lengths[i] for i in rows[r]), -r))
        short = min(rows[r], key=lambda i: (lengths[i], -i))
        rows[r].remove(short)
        rows.append([short])
    return rows


def _fewest_rows(lengths: list[int], max_length: int, multiple: int) -> list[list[int]]:
    """First-fit decreasing, its row count rounded up to a multiple; when the rounding adds rows, the
    samples are packed again into that many rows of the smallest capacity that first-fit decreasing
    fits them in (a bisection over ``[longest sample, max_length]``): the added rows take a share of
    the samples and the longest row, the packed batch's ``S``, gets shorter."""
    rows = _first_fit_decreasing(lengths, max_length)
    target = -(-len(rows) // multiple) * multiple
    if target == len(rows):
        return rows
    longest = lambda plan: max(sum(lengths[i] for i in row) for row in plan)  # noqa: E731
    best = _to_multiple([list(r) for r in rows], lengths, multiple)
    low, high = max(lengths), max_length
    while low < high:
        mid = (low + high) // 2
        plan = _first_fit_decreasing(lengths, mid)
        if len(plan) <= target:
            high = mid
            plan = _to_multiple(plan, lengths, multiple)
            if longest(plan) < longest(best):
                best = plan
        else:
            low = mid + 1
    return best


def row_costs(rows: Sequence[Sequence[int]], costs: Sequence[float] | np.ndarray) -> np.ndarray:
    """``[rows]`` float: each row's summed per-sample cost (``costs`` ``[samples]``)."""
    values = np.asarray(costs, dtype=np.float64)
    return np.asarray([float(values[list(row)].sum()) if row else 0.0 for row in rows], dtype=np.float64)


def plan_rows(
    lengths: Sequence[int],
    max_length: int,
    costs: Sequence[float] | np.ndarray | None = None,
    *,
    n_microbatches: int | None = None,
    multiple_of: int = 1,
) -> list[list[int]]:
    """Pack samples into rows: ``rows[r]`` lists the sample indices of row ``r``, in their order in the row.

    First-fit decreasing: samples longest first (ties: lower index first), each into the first row
    with room; within a row, samples then sit in ascending index order (a step's samples keep their
    relative order inside a row). Every sample is in exactly one row.

    Row order: by the rows' vision cost (each row's summed ``costs``) when ``costs`` is given, else
    their fill order (longest rows' first samples first):

    * with ``n_microbatches``: :func:`ppmedia.balance.balance_microbatches` over the rows' costs, the
      same cost model and assignment as ``split_media(..., balance=...)`` (each contiguous group of
      rows that ``torch.tensor_split`` makes one microbatch carries a similar vision load; the
      heaviest microbatch first);
    * without it: rows by descending cost, then alternated heavy / light (``[0, R-1, 1, R-2, ...]``
      of the sorted rows), so any run of consecutive rows carries a similar share.

    Args:
        lengths: ``[samples]`` tokens per sample (``input_ids.shape[1]`` of each processor output).
        max_length: tokens per row (the packed batch's ``S``).
        costs: ``[samples]`` per-sample vision cost (>= 0), e.g. :func:`ppmedia.packing.sample_costs`.
        n_microbatches: the schedule's microbatches (rows are ordered for that split).
        multiple_of: the row count is made a multiple of this (``n_microbatches`` times the data-parallel
            replicas, when the rows are split so): when first-fit decreasing gives fewer rows, the
            samples are packed again into that many rows as short as first-fit decreasing can make
            them (the smallest capacity it fits, by bisection), so the added rows take samples and the
            longest row shortens; rows still short of the multiple are split (a row with the most
            samples gives up its shortest sample to a new row); only when every row holds one sample
            are empty rows added.

    Raises:
        ValueError: a sample longer than ``max_length`` (named by index, with its length); a length
            < 1; bad ``max_length`` / ``multiple_of`` / ``costs``.
    """
    values = _checked_lengths(lengths, max_length)
    if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of < 1:
        raise ValueError(f"multiple_of: got {multiple_of!r}; expected an int >= 1")
    rows = _fewest_rows(values, max_length, multiple_of)
    rows = [sorted(row) for row in rows]
    if costs is None:
        return rows
    if len(costs) != len(values):
        raise ValueError(f"costs: {len(costs)} values; expected {len(values)} (one per sample)")
    load = row_costs(rows, costs)
    if n_microbatches is not None:
        from ..balance import balance_microbatches

        return [rows[i] for i in balance_microbatches(load, n_microbatches)]
    ranked = sorted(range(len(rows)), key=lambda r: (-load[r], r))
    order = [ranked[(k // 2) if k % 2 == 0 else len(ranked) - 1 - k // 2] for k in range(len(ranked))]
    return [rows[r] for r in order]
