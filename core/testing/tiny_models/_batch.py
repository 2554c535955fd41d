"""Batch-building pieces the built-in tiny families share (private to ``ppmedia.testing.tiny_models``)."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

__all__ = ["right_padded"]


def right_padded(rows: Sequence[Sequence[int]], pad_id: int, length: int | None = None) -> tuple[Tensor, Tensor]:
    """``input_ids`` and ``attention_mask`` ``[len(rows), S]`` int64 of token rows padded on the right
    with ``pad_id`` (mask 1 on each row's own tokens, 0 on the padding); ``S`` is ``length``, or the
    longest row when ``None``. Draws nothing: a family's seeded generator is untouched.
    """
    seq = max(len(r) for r in rows) if length is None else length
    input_ids = torch.full((len(rows), seq), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros_like(input_ids)
    for i, ids in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        attention_mask[i, : len(ids)] = 1
    return input_ids, attention_mask
