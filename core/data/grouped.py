"""Length-grouped sampling of the shuffled order (as Hugging Face's ``group_by_length`` does).

The epoch's order is cut into windows of several global batches; each window is sorted by the records'
length keys and cut into its batches again, which are then taken in an order drawn from the seed, the
epoch and the window. A step's rows are of similar length, so a step padded to its longest row carries
little padding. The keys come from the records alone (no media opened, no processor run), so the
grouped order is the same on every rank and at every ``pp x dp`` layout, and a run resumes in it to the
sample as in the plain order.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["MEDIA_CHARACTERS", "grouped_order", "record_length_key", "step_order"]


#: the characters of text one media item counts as in :func:`record_length_key`
MEDIA_CHARACTERS = 64


def record_length_key(record: Any) -> int:
    """A record's length key, from the record alone (no media opened, no processor run): the characters
    of its text plus :data:`MEDIA_CHARACTERS` per media item. An estimate of its token length (a media
    item's tokens depend on the model and the image size, unknown here); sorting by it puts records of
    similar length together.

    Args:
        record: a :class:`~ppmedia.data.Record`.
    """
    parts = [part for message in record.messages for part in message["content"]]
    return sum(len(p.get("text", "")) if p["type"] == "text" else MEDIA_CHARACTERS for p in parts)


def step_order(steps: int, seed: int, epoch: int, window_start: int) -> list[int]:
    """The order in which a window's ``steps`` grouped batches are taken: a permutation drawn from
    ``seed``, ``epoch`` and ``window_start`` (the window's first position in the epoch's order)."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + epoch) * 1_000_033 + window_start)
    return torch.randperm(steps, generator=gen).tolist()


def grouped_order(order: Sequence[int], keys: Sequence[Any], batch_size: int, window: int, *, seed: int,
                  epoch: int) -> list[int]:
    """``order`` grouped by length: each window of ``window`` whole batches of ``batch_size`` positions
    sorted by ``keys`` (ties: the earlier position first), cut into its batches, which are taken in
    :func:`step_order`'s order; a batch's positions stay sorted (shortest first). Positions after the
    last whole batch (dropped by the loader) stay where they are.

    Args:
        order: the epoch's order (:func:`~ppmedia.data.epoch_order`): sample indices.
        keys: per sample index its sortable length key (:func:`record_length_key`).
        batch_size: ``B``, the global batch.
        window: ``W``, global batches per window (1: ``order`` unchanged).

    Returns:
        A permutation of ``order``: the same samples in every window, each batch ``B`` of them.
    """
    if window < 1 or batch_size < 1:
        raise ValueError(f"grouped_order: window={window}, batch_size={batch_size}; expected both >= 1")
    whole = len(order) // batch_size * batch_size
    out: list[int] = []
    for start in range(0, whole, window * batch_size):
        chunk = list(order[start : min(start + window * batch_size, whole)])
        ranked = sorted(range(len(chunk)), key=lambda i: (keys[chunk[i]], i))
        batches = [[chunk[i] for i in ranked[k : k + batch_size]] for k in range(0, len(chunk), batch_size)]
        for k in step_order(len(batches), seed, epoch, start):
            out += batches[k]
    return out + list(order[whole:])
