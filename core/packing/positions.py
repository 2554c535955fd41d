"""Per-sample positions of packed rows, from their sample numbers alone: a leaf (torch only), so the
adapters' ``packed_position_ids`` default uses it without importing the packing of batches."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["sample_positions"]


def sample_positions(segments: Tensor) -> Tensor:
    """``[b, S]`` int64 positions restarting at 0 at every sample (and at the padding run) of packed rows.

    ``segments``: ``[b, S]`` a packed batch's ``attention_mask`` (sample numbers, 0 on padding; a 0/1
    mask gives the usual ``0 .. S-1`` on a right-padded row's tokens). On the device, no host read.
    """
    b, S = segments.shape
    index = torch.arange(S, device=segments.device).expand(b, S)
    change = torch.ones_like(segments, dtype=torch.bool)
    change[:, 1:] = segments[:, 1:] != segments[:, :-1]
    starts = torch.where(change, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - starts
