"""Per-sample processor outputs + a row plan -> one packed batch (the keys of the unpacked collate)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from ..data.batching import _concat_media
from ..data.processor import TOKEN_KEYS
from ..pipeline.loss import IGNORE_INDEX, SHIFTED_MARK
from .positions import sample_positions

__all__ = ["pack_samples"]


def _pad_value(key: str, pad_id: int) -> int:
    return {"input_ids": pad_id, "labels": IGNORE_INDEX}.get(key, 0)


def _checked(samples: Sequence[Mapping[str, Any] | None], rows: Sequence[Sequence[int]], max_length: int | None) -> int:
    """The packed length ``S``; every sample once, in range, not ``None``, ``[1, L]`` token keys."""
    seen: dict[int, int] = {}
    longest = 1
    for r, row in enumerate(rows):
        total = 0
        for i in row:
            if not 0 <= i < len(samples):
                raise ValueError(f"rows[{r}]: sample {i} is out of range (there are {len(samples)} samples)")
            if i in seen:
                raise ValueError(f"rows[{r}]: sample {i} is also in row {seen[i]}; expected every sample exactly once")
            seen[i] = r
            s = samples[i]
            if s is None:
                raise ValueError(f"rows[{r}]: sample {i} is None (skipped); plan rows over the kept samples only")
            ids = s.get("input_ids")
            if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.shape[0] != 1:
                seen_shape = list(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__
                raise ValueError(f"sample {i}: input_ids is {seen_shape}; expected [1, L] (one processor output per sample)")
            total += int(ids.shape[1])
        longest = max(longest, total)
        if max_length is not None and total > max_length:
            raise ValueError(f"rows[{r}] holds {total} tokens (samples {list(row)}), over max_length={max_length}")
    missing = [i for i in range(len(samples)) if i not in seen and samples[i] is not None]
    if missing:
        raise ValueError(f"samples {missing} are in no row; expected every sample exactly once (plan_rows)")
    return longest if max_length is None else max_length


def _token_row(key: str, sample: Mapping[str, Any], segment: int) -> Tensor:
    length = int(sample["input_ids"].shape[1])
    if key == "attention_mask":
        return torch.full((length,), segment, dtype=torch.int64)
    if key not in sample:
        fill = IGNORE_INDEX if key == "labels" else 0
        return torch.full((length,), fill, dtype=torch.int64)
    value = sample[key][0].to(torch.int64)
    if value.shape[0] != length:
        raise ValueError(f"{key}: {value.shape[0]} tokens; expected {length} like the sample's input_ids")
    if key == "labels":  # the sample's last position predicts nothing: its next token is another sample's
        value = value.masked_fill(value == SHIFTED_MARK, IGNORE_INDEX)
        value[-1] = IGNORE_INDEX
    return value


def pack_samples(
    samples: Sequence[Mapping[str, Any] | None],
    rows: Sequence[Sequence[int]],
    pad_id: int,
    *,
    max_length: int | None = None,
) -> dict[str, Tensor]:
    """One packed batch of ``len(rows)`` rows from per-sample processor outputs.

    Args:
        samples: :class:`~ppmedia.data.SampleProcessor` outputs (``input_ids`` / ``attention_mask`` /
            ``labels`` ``[1, L]``, maybe ``mm_token_type_ids`` / ``token_type_ids`` ``[1, L]``, media
            keys in the processor's layout), the form :func:`ppmedia.data.collate_samples` takes.
        rows: :func:`plan_rows`' plan: per row, its sample indices in order.
        pad_id: the tokenizer's padding id.
        max_length: the row length ``S`` (default: the longest row); a longer row is an error.

    Returns:
        The keys :func:`~ppmedia.data.collate_samples` gives for the same samples, ``[R, S]`` token keys:

        * ``input_ids``: the row's samples one after the other, then ``pad_id`` up to ``S``;
        * ``attention_mask``: the sample's number within its row (1, 2, ...) on its tokens, 0 on
          padding: every reader of a 0/1 mask sees the same tokens as real, and the pipeline's stages
          (:func:`ppmedia.packing.enable_packing`) isolate the samples from it;
        * ``labels``: each sample's shifted labels, its last position :data:`IGNORE_INDEX` (no label
          crosses into the next sample), padding ignored, the row's last column :data:`SHIFTED_MARK`;
        * the other token keys per sample (0 where a sample lacks one), 0 on padding;
        * media keys: the samples' media concatenated along dim 0 in row order (row 0's samples in
          order, then row 1's, ...), other dims zero-padded to the largest as the unpacked collate does.

        Per-sample positions follow from the mask: :func:`sample_positions`.
    """
    S = _checked(samples, rows, max_length)
    order = [i for row in rows for i in row]
    real = [samples[i] for i in order]
    present = [k for k in TOKEN_KEYS if any(k in s for s in real if s is not None)]
    keys = list(dict.fromkeys(["input_ids", "attention_mask", "labels", *present]))
    batch: dict[str, Tensor] = {}
    for key in keys:
        out = torch.full((len(rows), S), _pad_value(key, pad_id), dtype=torch.int64)
        for r, row in enumerate(rows):
            at = 0
            for segment, i in enumerate(row, start=1):
                sample = samples[i]
                assert sample is not None
                value = _token_row(key, sample, segment)
                out[r, at: at + value.shape[0]] = value
                at += value.shape[0]
        batch[key] = out
    batch["labels"][:, -1] = SHIFTED_MARK
    for key in dict.fromkeys(k for s in real if s is not None for k in s if k not in TOKEN_KEYS):
        parts = [s[key] for s in real if s is not None and key in s]
        batch[key] = _concat_media(parts)
    return batch
