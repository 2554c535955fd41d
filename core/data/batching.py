"""Samples -> one batch: token rows padded on the right, media concatenated in sample order."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from ..pipeline.loss import IGNORE_INDEX, SHIFTED_MARK
from .processor import TOKEN_KEYS

__all__ = ["collate_samples", "pad_to_length"]


def _pad_value(key: str, pad_id: int) -> int:
    return {"input_ids": pad_id, "labels": IGNORE_INDEX}.get(key, 0)


def _concat_media(parts: list[Tensor]) -> Tensor:
    """Along dim 0; other dims zero-padded to the largest (as processors pad crops and images)."""
    if all(p.shape[1:] == parts[0].shape[1:] for p in parts):
        return torch.cat(parts)
    shape = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
    out = parts[0].new_zeros((sum(p.shape[0] for p in parts), *shape))
    row = 0
    for p in parts:
        index = (slice(row, row + p.shape[0]),) + tuple(slice(0, n) for n in p.shape[1:])
        out[index] = p
        row += p.shape[0]
    return out


def collate_samples(samples: Sequence[dict[str, Any] | None], pad_id: int) -> dict[str, Tensor]:
    """One batch of ``len(samples)`` rows from :class:`~ppmedia.data.SampleProcessor` outputs.

    Token keys (``input_ids``, ``attention_mask``, ``labels``, ``mm_token_type_ids``,
    ``token_type_ids``) become ``[B, S]`` (``S`` the longest row), padded on the right with
    ``pad_id`` / 0 / :data:`IGNORE_INDEX`; ``labels``' last column is :data:`SHIFTED_MARK`. A ``None``
    sample (skipped) becomes a filler row: one ``pad_id`` token, attention 1, no label, no media, so
    the batch keeps its row count (the pipeline splits rows into equal microbatches). Media keys are
    concatenated along dim 0 in sample order.
    """
    real = [s for s in samples if s is not None]
    keys = [k for k in TOKEN_KEYS if any(k in s for s in real)] or ["input_ids", "attention_mask", "labels"]
    for k in ("input_ids", "attention_mask", "labels"):
        if k not in keys:
            keys.append(k)
    seq = max([s["input_ids"].shape[1] for s in real] + [1])
    batch: dict[str, Tensor] = {}
    for key in keys:
        out = torch.full((len(samples), seq), _pad_value(key, pad_id), dtype=torch.int64)
        for row, s in enumerate(samples):
            if s is None:
                out[row, 0] = {"input_ids": pad_id, "attention_mask": 1}.get(key, _pad_value(key, pad_id))
            elif key in s:
                value = s[key][0]
                if key == "labels":
                    value = value.masked_fill(value == SHIFTED_MARK, IGNORE_INDEX)
                out[row, : value.shape[0]] = value
        batch[key] = out
    batch["labels"][:, -1] = SHIFTED_MARK
    for key in dict.fromkeys(k for s in real for k in s if k not in TOKEN_KEYS):
        parts = [s[key] for s in real if key in s]
        batch[key] = _concat_media(parts)
    return batch


def pad_to_length(batch: dict[str, Any], length: int, pad_id: int) -> None:
    """Pad ``batch``'s token rows ``[B, S]`` on the right to ``[B, length]`` in place (``length >= S``),
    as :func:`collate_samples` pads: ``pad_id`` / 0 / :data:`IGNORE_INDEX`, ``labels``' last column
    :data:`SHIFTED_MARK` (the old last column becomes an ignored position)."""
    seq = int(batch["input_ids"].shape[1])
    if length < seq:
        raise ValueError(f"pad_to_length: the rows are {seq} tokens; cannot pad them to {length}")
    if length == seq:
        return
    for key in TOKEN_KEYS:
        value = batch.get(key)
        if not isinstance(value, Tensor) or value.dim() != 2:
            continue
        extra = torch.full((value.shape[0], length - seq), _pad_value(key, pad_id), dtype=value.dtype,
                           device=value.device)
        if key == "labels":
            value = value.masked_fill(value == SHIFTED_MARK, IGNORE_INDEX)
            extra[:, -1] = SHIFTED_MARK
        batch[key] = torch.cat([value, extra], dim=1)
