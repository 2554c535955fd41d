"""Packed forms of the tiny families' batches, for the packing checks (in one process and in the parity runs)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..data.processor import TOKEN_KEYS

__all__ = ["in_order_rows", "pack_batch"]


def in_order_rows(n: int, per_row: int) -> list[list[int]]:
    """``[[0, .., per_row-1], [per_row, ..], ...]`` over ``n`` samples: consecutive samples per row (media keep their order)."""
    return [list(range(a, min(a + per_row, n))) for a in range(0, n, per_row)]


def pack_batch(batch: Mapping[str, Any], rows: Sequence[Sequence[int]], pad_id: int, max_length: int | None = None) -> dict[str, Any]:
    """A right-padded collated batch (``input_ids`` ``[B, S]``, a 0/1 ``attention_mask``, media in sample
    order) packed into ``rows`` with :func:`ppmedia.packing.pack_samples`.

    Each sample's token keys are its row cut at its length; the media tensors are kept as they are, so
    ``rows`` must list the samples in order (``[i for row in rows for i in row] == range(B)``): then
    the packed rows' media order is the batch's. Raises ``ValueError`` otherwise."""
    from ..packing import pack_samples

    order = [i for row in rows for i in row]
    B = int(batch["input_ids"].shape[0])
    if order != list(range(B)):
        raise ValueError(f"pack_batch: rows {list(map(list, rows))} do not list samples 0..{B - 1} in order")
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    samples = [{k: batch[k][i: i + 1, : int(n)] for k in TOKEN_KEYS if k in batch and k != "labels"} for i, n in enumerate(lengths)]
    packed: dict[str, Any] = pack_samples(samples, rows, pad_id, max_length=max_length)
    del packed["labels"]  # the tiny batches carry none: make_labels (boundary-aware) makes them
    for key, value in batch.items():
        if key not in TOKEN_KEYS:
            packed[key] = value
    return packed
