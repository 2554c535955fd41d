"""A processor batch as one pipeline step's pre-split inputs: labels, media split, microbatches, loss kwargs."""

from __future__ import annotations

from typing import Any, MutableMapping

from ..adapters.base import VlmAdapter
from ..producer.presplit import MicrobatchInputs, microbatch_inputs
from .loss import count_valid_tokens, make_labels

__all__ = ["presplit_batch"]


def presplit_batch(
    batch: Any,
    n_microbatches: int,
    config: Any,
    adapter: VlmAdapter | None = None,
    *,
    num_valid_tokens: int | None = None,
    **split_kwargs: Any,
) -> MicrobatchInputs:
    """One call from a batch to ``schedule.step(**presplit_batch(batch, n, config).step_kwargs(), losses=...)``.

    Makes the labels (:func:`make_labels`: pads and media tokens masked, shifted), splits the media
    (:func:`ppmedia.split_media` with ``adapter.media_counts``: per-sample counts and per-sample
    inputs such as PaliGemma's ``token_type_ids``), and returns :func:`ppmedia.microbatch_inputs` with
    ``target_mbs`` the labels' rows and ``loss_kwargs={"num_valid_tokens": N}``
    (:func:`pipeline_loss`). Call it on every pipeline rank with the same batch.

    Args:
        batch: a processor's output (``input_ids`` ``[B, S]``, ``attention_mask`` ``[B, S]``, the media
            keys; modified in place: the media are popped), or a :class:`ppmedia.PipelineBatch` whose
            media are split already (``collate_for_pipeline(..., n_microbatches)``).
        n_microbatches: the schedule's ``n_microbatches``.
        config: the model's config.
        adapter: the family's adapter (default: the registry's for ``config``).
        num_valid_tokens: the valid labels the loss is normalised by: by default this batch's; with
            data parallelism pass the GLOBAL batch's (``batch`` is then this replica's
            :func:`shard_batch`), so the replicas' gradients add up to the global batch's.
        split_kwargs: more :func:`ppmedia.split_media` arguments (``balance=``, ``layouts=``, ...); the
            adapter's counts are used for any count not given.

    Returns:
        A :class:`ppmedia.MicrobatchInputs`: ``arg_mbs`` ``(input_ids, attention_mask)`` rows,
        ``kwarg_mbs`` ``{"media": MicrobatchMedia}``, ``target_mbs`` the labels' rows.

    Raises:
        ValueError: ``n_microbatches`` differs from a :class:`~ppmedia.PipelineBatch`'s split; and
            whatever :func:`~ppmedia.split_media` raises for the batch.
    """
    from ..producer.collate import PipelineBatch
    from ..producer.split import split_media

    if adapter is None:
        from ..registry import get_adapter

        adapter = get_adapter(config)
    if isinstance(batch, PipelineBatch):
        if batch.media.n_microbatches != n_microbatches:
            raise ValueError(
                f"presplit_batch: the PipelineBatch's media were split into {batch.media.n_microbatches} "
                f"microbatches; expected n_microbatches={n_microbatches}"
            )
        text: MutableMapping[str, Any] = batch.text
        staged = batch.media
    else:
        text = batch
        counts = adapter.media_counts(batch, config)
        staged = split_media(batch, n_microbatches, **{**counts, **split_kwargs})
    # after the split: a balanced split reorders the text rows in place, and the labels follow them
    ids, mask = text["input_ids"], text.get("attention_mask")
    labels = make_labels(ids, config, adapter, attention_mask=mask)
    valid = count_valid_tokens(labels) if num_valid_tokens is None else int(num_valid_tokens)
    return microbatch_inputs(staged, ids, mask, target=labels, loss_kwargs={"num_valid_tokens": valid})
