"""Next-token labels and the pipeline loss (a share of the whole batch's mean token loss).

Shifted labels carry a mark: their last column is :data:`SHIFTED_MARK` (position ``S - 1`` has no
next token, so nothing is lost). :func:`pipeline_loss` refuses labels without it: transformers'
UNshifted labels (``labels=`` of a model's own forward, position ``t`` labelled with token ``t``) look
like shifted ones otherwise, and would train a different objective in silence.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..adapters.base import VlmAdapter, config_value

__all__ = ["IGNORE_INDEX", "SHIFTED_MARK", "count_valid_tokens", "make_labels", "mark_shifted", "pipeline_loss", "shift_labels"]

#: label value ignored by the loss (padding, media placeholders, the last position).
IGNORE_INDEX = -100

#: the last column of shifted labels (:func:`make_labels`, :func:`shift_labels`, ``ppmedia.data``):
#: ignored by the loss like :data:`IGNORE_INDEX`, and the mark that the labels are shifted.
SHIFTED_MARK = -101


def make_labels(
    input_ids: Tensor,
    config: Any,
    adapter: VlmAdapter | None = None,
    *,
    pad_id: int | None = None,
    attention_mask: Tensor | None = None,
    shift: bool = True,
) -> Tensor:
    """Next-token labels ``[B, S]`` int64: position ``t`` is labelled with token ``t + 1``; the last
    column is :data:`SHIFTED_MARK`.

    A label is :data:`IGNORE_INDEX` where the target token is padding (``pad_id``, default the
    config's ``pad_token_id``, or ``attention_mask == 0``) or a media placeholder (any mask of
    ``adapter.placeholder_masks``), and at the last position.

    Args:
        input_ids: ``[B, S]`` token ids.
        config: the model's config.
        adapter: the family adapter (default: looked up from ``config``).
        pad_id: the padding id; ``None`` reads ``pad_token_id`` from the config (text config too).
        attention_mask: ``[B, S]``, 0 marks padding; a packed batch's sample numbers
            (:func:`ppmedia.packing.pack_samples`) also ignore each sample's last position (its next
            token belongs to another sample).
        shift: ``False`` returns the UNshifted targets ``[B, S]`` (the ids with ignored tokens set to
            :data:`IGNORE_INDEX`), the form transformers' own ``labels=`` argument takes.
    """
    if adapter is None:
        from ..registry import get_adapter

        adapter = get_adapter(config)
    if pad_id is None:
        try:
            pad_id = int(config_value(config, "pad_token_id", "text_config.pad_token_id"))
        except AttributeError:
            pad_id = None
    ignore = torch.zeros_like(input_ids, dtype=torch.bool)
    if pad_id is not None:
        ignore |= input_ids == pad_id
    if attention_mask is not None:
        ignore |= attention_mask == 0
    for mask in adapter.placeholder_masks(input_ids, config).values():
        ignore |= mask
    targets = input_ids.masked_fill(ignore, IGNORE_INDEX).to(torch.int64)
    if not shift:
        return targets
    labels = shift_labels(targets)
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[1] > 1:
        # packed rows (ppmedia.packing: sample numbers in the mask): a sample's last token predicts nothing
        a, b = attention_mask[:, :-1], attention_mask[:, 1:]
        labels[:, :-1] = labels[:, :-1].masked_fill((a != b) & (a != 0) & (b != 0), IGNORE_INDEX)
    return labels


def shift_labels(targets: Tensor) -> Tensor:
    """Transformers' unshifted labels ``[B, S]`` (``labels=`` of the model's own forward) as the
    shifted, marked labels :func:`pipeline_loss` takes: ``out[:, t] = targets[:, t + 1]``, the last
    column :data:`SHIFTED_MARK`."""
    labels = torch.full_like(targets, IGNORE_INDEX)
    labels[:, :-1] = targets[:, 1:]
    return mark_shifted(labels)


def mark_shifted(labels: Tensor) -> Tensor:
    """Marks already shifted labels ``[B, S]`` in place (last column := :data:`SHIFTED_MARK`) and
    returns them. Raises ``ValueError`` if the last column holds a real label (then they are not
    shifted: nothing follows the last position)."""
    if labels.dim() != 2 or labels.shape[1] == 0:
        raise ValueError(f"labels must be [B, S] with S >= 1, got {tuple(labels.shape)}")
    last = labels[:, -1]
    if bool(((last != IGNORE_INDEX) & (last != SHIFTED_MARK)).any()):
        raise ValueError("labels hold a real label in their last column: these are not shifted labels "
                         "(use shift_labels for transformers' unshifted labels)")
    labels[:, -1] = SHIFTED_MARK
    return labels


def count_valid_tokens(labels: Tensor) -> int:
    """The number of labels that count in the loss (not :data:`IGNORE_INDEX` nor
    :data:`SHIFTED_MARK`); one host read."""
    return int(((labels != IGNORE_INDEX) & (labels != SHIFTED_MARK)).sum())


_UNMARKED = (
    "pipeline_loss takes SHIFTED labels [b, S] whose last column is SHIFTED_MARK "
    f"({SHIFTED_MARK}); these are not marked: transformers' unshifted labels (the model's own labels=) "
    "would train a different objective. Build them with make_labels(...), ppmedia.data.SampleProcessor, "
    "or shift_labels(unshifted)")


def _check_shifted(labels: Tensor) -> None:
    if labels.dim() != 2 or labels.shape[1] == 0:
        raise ValueError(f"{_UNMARKED} (shape {tuple(labels.shape)})")
    marked = (labels[:, -1] == SHIFTED_MARK).all()
    if labels.device.type == "cpu":  # a host read of CPU memory: no device sync
        if not bool(marked):
            raise ValueError(f"{_UNMARKED} (shape {tuple(labels.shape)})")
    else:  # on an accelerator the check runs on the device: no sync per microbatch
        torch._assert_async(marked, _UNMARKED)


def pipeline_loss(logits: Tensor, labels: Tensor, num_valid_tokens: int | Tensor | None = None) -> Tensor:
    """Summed token cross-entropy of a microbatch divided by the valid tokens of the WHOLE batch.

    Summing it over the microbatches gives the full batch's mean token loss, so a schedule with
    ``scale_grads=False`` accumulates exactly the full batch's gradients. Pass the whole batch's
    count with ``schedule.step(..., loss_kwargs={"num_valid_tokens": count_valid_tokens(labels)})``.

    Args:
        logits: ``[b, S, vocab]``.
        labels: ``[b, S]`` shifted and marked (:func:`make_labels`, :func:`shift_labels`): last column
            :data:`SHIFTED_MARK`, else ``ValueError``; :data:`IGNORE_INDEX` ignored.
        num_valid_tokens: the whole batch's valid labels; ``None`` uses this microbatch's (then the
            per-microbatch losses are means, not parts of one mean).

    A microbatch (or batch) without valid labels gives 0, never NaN.
    """
    _check_shifted(labels)
    labels = labels.masked_fill(labels == SHIFTED_MARK, IGNORE_INDEX)
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        labels.reshape(-1).to(logits.device),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    if num_valid_tokens is None:
        num_valid_tokens = (labels != IGNORE_INDEX).sum()
    if isinstance(num_valid_tokens, Tensor):
        return total / num_valid_tokens.clamp(min=1).to(total.dtype)
    return total / max(int(num_valid_tokens), 1)
