"""Samples -> one batch: token rows padded on the right, media concatenated in sample order."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from ..pipeline.loss import IGNORE_INDEX, SHIFTED_MARK
from .errors import DataError
from .processor import TOKEN_KEYS

__all__ = ["collate_samples", "pad_to_length"]


def _pad_value(key: str, pad_id: int) -> int:
    return {"input_ids": pad_id, "labels": IGNORE_INDEX}.get(key, 0)


def _concat_media(parts: Sequence[Tensor | None], key: str = "media", names: Sequence[str | None] | None = None) -> Tensor:
    """Along dim 0 (a ``None`` part: one all-zero row, a sample without that key in a sample-axis
    layout); other dims zero-padded to the largest (as processors pad crops and images)."""
    names = list(names) if names is not None else [f"sample {i}" for i in range(len(parts))]
    real = [(p, n) for p, n in zip(parts, names) if p is not None]
    first = real[0][0]
    for p, name in real:
        if p.dim() != first.dim() or p.dtype != first.dtype:
            raise DataError(str(name), f"the processor gives {key} {list(p.shape)} {p.dtype} for this sample but "
                                       f"{list(first.shape)} {first.dtype} for {real[0][1]}: they cannot be batched")
    if all(p is not None and p.shape[1:] == first.shape[1:] for p in parts):
        return torch.cat([p for p in parts if p is not None])
    shape = [max(p.shape[d] for p, _ in real) for d in range(1, first.dim())]
    out = first.new_zeros((sum(1 if p is None else p.shape[0] for p in parts), *shape))
    row = 0
    for part in parts:
        if part is None:
            row += 1
            continue
        index = (slice(row, row + part.shape[0]),) + tuple(slice(0, n) for n in part.shape[1:])
        out[index] = part
        row += part.shape[0]
    return out


def collate_samples(samples: Sequence[dict[str, Any] | None], pad_id: int, *,
                    sample_axis_keys: Sequence[str] = (), names: Sequence[str | None] | None = None) -> dict[str, Tensor]:
    """One batch of ``len(samples)`` rows from :class:`~ppmedia.data.SampleProcessor` outputs.

    Token keys (``input_ids``, ``attention_mask``, ``labels``, ``mm_token_type_ids``,
    ``token_type_ids``) become ``[B, S]`` (``S`` the longest row), padded on the right with
    ``pad_id`` / 0 / :data:`IGNORE_INDEX`; ``labels``' last column is :data:`SHIFTED_MARK`. A ``None``
    sample (skipped) becomes a filler row: one ``pad_id`` token, attention 1, no label, no media, so
    the batch keeps its row count (the pipeline splits rows into equal microbatches). Media keys are
    concatenated along dim 0 in sample order, the other dims zero-padded to the largest, as the
    processors pad crops and images across a batch. A key of ``sample_axis_keys`` (the family
    adapter's :attr:`~ppmedia.adapters.VlmAdapter.sample_axis_keys`, e.g. Idefics3's
    ``pixel_values`` ``[B, max_crops, C, H, W]``) gets one entry per row: an all-zero one for a
    sample without it and for a filler row, as the processor's own batch call gives. ``names``
    (``FILE:LINE`` per sample) name the samples in a :class:`~ppmedia.data.DataError` when two
    samples' media cannot be batched.
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
    labels = list(names) if names is not None else [f"sample {i}" for i in range(len(samples))]
    for key in dict.fromkeys(k for s in real for k in s if k not in TOKEN_KEYS):
        rows: list[tuple[Tensor | None, str | None]]
        if key in sample_axis_keys:
            rows = [(s.get(key) if s is not None else None, n) for s, n in zip(samples, labels)]
        else:
            rows = [(s[key], n) for s, n in zip(samples, labels) if s is not None and key in s]
        batch[key] = _concat_media([p for p, _ in rows], key, [n for _, n in rows])
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
