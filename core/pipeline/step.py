"""One training step of a ``pp x dp`` pipeline, as pieces a training loop calls.

:class:`ReplicaShare` is what one rank needs of a step's global batch: its replica's rows, their
shifted labels, the staged media (on the rank that encodes them), and the global counts the loss and
the log need. :func:`share_of_global_batch` cuts it from a global batch every rank holds (the tiny
stand-in batches); :func:`share_of_replica_batch` wraps a batch a per-replica loader already cut
(``ppmedia.data``'s, labels included). :class:`PipelineParts` is the pipeline around a schedule (its
stages' modules, optimizers, process groups); :func:`train_step` runs one optimizer step on a share,
:func:`eval_loss` a forward-only pass. Every collective is on every rank of the world, in the same
order.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

__all__ = ["PipelineParts", "ReplicaShare", "StepResult", "batch_to", "eval_loss", "loader_shares",
           "share_of_global_batch", "share_of_replica_batch", "train_step"]


@dataclass
class ReplicaShare:
    """One rank's part of a step's global batch.

    Attributes:
        input_ids, attention_mask: ``[b, S]``, the replica's rows (every pipeline rank of it).
        labels: ``[b, S]`` shifted labels (:func:`~ppmedia.pipeline.make_labels`'s form).
        staged: the replica's media split per microbatch (:func:`~ppmedia.split_media`), on the rank
            that stages them (stage 0's); elsewhere ``None`` or (a loader's share) the split of the
            token rows alone, without media.
        num_valid_tokens: label tokens of the GLOBAL batch (all replicas): the loss's divisor.
        samples: samples of the global batch.
        pad_positions, positions: padded and all token positions of the replica's rows.
        skipped: samples skipped so far over all replicas (a loader's count; 0 for fixed batches).
    """

    input_ids: Tensor
    attention_mask: Tensor
    labels: Tensor
    staged: Any
    num_valid_tokens: int
    samples: int
    pad_positions: int = 0
    positions: int = 0
    skipped: int = 0


@dataclass
class StepResult:
    """What :func:`train_step` measured (equal on every rank): the global batch's mean token loss,
    the gradient norm before clipping, pad positions / all positions of the global batch's rows, and
    whether the optimizer step was skipped (a non-finite loss or norm, :class:`~ppmedia.pipeline.NonFiniteGuard`)."""

    loss: float
    grad_norm: float
    padding_fraction: float
    nonfinite: bool = False


@dataclass
class PipelineParts:
    """A rank's pipeline: what :func:`train_step` and :func:`eval_loss` run.

    Attributes:
        schedule: from :func:`~ppmedia.pipeline.build_schedule`.
        first: this rank's first ``PipelineStage`` (stage 0), or ``None``.
        modules: this rank's stage modules (``stage.submod``).
        optimizers: one per module (:func:`~ppmedia.pipeline.stage_adamw`).
        tied: the model's tied parameter groups (:func:`~ppmedia.pipeline.tied_parameters`).
        pp_group, dp_group: this rank's pipeline and data-parallel process groups.
        sharded: FSDP2 stages (gradients already summed over the replicas); else replicated ones,
            whose gradients :func:`~ppmedia.pipeline.all_reduce_gradients` sums.
        max_grad_norm: the global L2 norm gradients are clipped to.
        spread: the :class:`~ppmedia.pipeline.EncoderSpread` when every rank encodes a share.
        tracer: a :class:`~ppmedia.pipeline.StepTracer` to start at each step, or ``None``.
        presplit: feed the schedule pre-split microbatches (:func:`ppmedia.microbatch_inputs`: each
            microbatch's media its own ``media`` keyword) instead of staging them on stage 0; every
            rank's share then needs its ``staged`` media.
        guard: a :class:`~ppmedia.pipeline.NonFiniteGuard` consulted before each optimizer step (a
            non-finite loss or norm stops the run, or skips the step within its limit); ``None``: none.
        tp_group: the tensor-parallel group of stages made with
            :func:`~ppmedia.pipeline.apply_tensor_parallel` (``pipeline_mesh(...)["tp"].get_group()``);
            :func:`train_step` then sums the replicated tower's gradients over it
            (:func:`~ppmedia.pipeline.reduce_tensor_parallel_gradients`), and the losses and counts
            are taken from its rank 0 only (every ``tp`` peer of a last stage holds the same loss).
            ``None``: no tensor parallelism.
        expert_parallel: the stages' routed experts are sharded over ``ep``
            (:func:`~ppmedia.pipeline.apply_expert_parallel`): :func:`train_step` sums the expert
            shards' gradients over ``edp_group`` (``pipeline_mesh(..., ep=)["edp"].get_group()``), the
            ranks holding the same experts (:func:`~ppmedia.pipeline.reduce_expert_parallel_gradients`).
        world_group: the group of every rank of this training job (the loss and counts are summed
            over it); ``None``: the default group (the world).
        cp_group: the context-parallel group (:func:`~ppmedia.pipeline.enable_context_parallel`):
            :func:`train_step` sums every gradient over it first (each cp rank's backward gave its share
            of the rows' part); ``None``: no context parallelism.
    """

    schedule: Any
    first: Any
    modules: Sequence[nn.Module]
    optimizers: Sequence[Any]
    tied: Sequence[Any] = ()
    pp_group: Any = None
    dp_group: Any = None
    sharded: bool = False
    max_grad_norm: float = 1.0
    spread: Any = None
    tracer: Any = None
    guard: Any = None
    presplit: bool = False
    tp_group: Any = None
    expert_parallel: bool = False
    edp_group: Any = None
    world_group: Any = None
    cp_group: Any = None


def batch_to(batch: Mapping[str, Any], device: torch.device | str, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """``batch`` with every tensor on ``device`` and every floating tensor (pixels, audio features) in
    ``dtype`` (the model's; ``None``: unchanged), as ``BatchFeature.to`` does; integer tensors (ids,
    masks, grids) keep their dtype. Other values are kept as they are."""
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, Tensor):
            value = value.to(device=device, dtype=dtype if dtype is not None and value.is_floating_point() else None)
        out[key] = value
    return out


def _padding(mask: Tensor) -> tuple[int, int]:
    return int((mask == 0).sum()), int(mask.numel())


def share_of_global_batch(batch: Mapping[str, Any], config: Any, adapter: Any, dp_rank: int, dp_size: int,
                          n_microbatches: int, *, stages_media: bool = True) -> ReplicaShare:
    """Replica ``dp_rank``'s share of a global ``batch`` that every rank holds (a processor's output:
    ``input_ids``, ``attention_mask``, media keys): its rows (:func:`~ppmedia.pipeline.shard_batch`),
    labels from :func:`~ppmedia.pipeline.make_labels` (pads and media tokens ignored), the media split
    per microbatch when ``stages_media``, and the global label-token count."""
    from ..producer.split import split_media
    from .loss import count_valid_tokens, make_labels
    from .parallel import shard_batch

    ids, mask = batch["input_ids"], batch["attention_mask"]
    num_valid = count_valid_tokens(make_labels(ids, config, adapter, attention_mask=mask))
    local = shard_batch(batch, dp_rank, dp_size, **adapter.media_counts(batch, config))
    ids, mask = local["input_ids"], local["attention_mask"]
    labels = make_labels(ids, config, adapter, attention_mask=mask)
    staged = split_media(local, n_microbatches, **adapter.media_counts(local, config)) if stages_media else None
    pads, positions = _padding(mask)
    return ReplicaShare(ids, mask, labels, staged, num_valid, int(batch["input_ids"].shape[0]), pads, positions)


def share_of_replica_batch(batch: Mapping[str, Any], config: Any, adapter: Any, n_microbatches: int, *,
                           num_valid_tokens: int, samples: int, stages_media: bool) -> ReplicaShare:
    """A share from a batch already cut for this replica (``labels`` in
    :func:`~ppmedia.pipeline.pipeline_loss`'s shifted form, media only where ``stages_media``).

    Args:
        batch: the replica's collated batch: ``input_ids``, ``attention_mask``, ``labels`` ``[b, S]``
            and, on the rank that stages them, the media keys (and ``media_counts``: the counts
            :func:`~ppmedia.split_media` takes; default ``adapter.media_counts``). Other keys that are
            not tensors (a loader's statistics) are left out of the split.
        num_valid_tokens: the global batch's label tokens (all replicas).
        samples: the global batch's samples.
        stages_media: whether this rank splits and stages the media (stage 0's rank). Elsewhere
            ``staged`` is the split of the token rows alone (no media, every chunk ``None``): the
            microbatch bounds :func:`ppmedia.microbatch_inputs` needs on every rank (``presplit``).
    """
    from ..producer.split import split_media

    ids, mask = batch["input_ids"], batch["attention_mask"]
    if stages_media:
        media = {k: v for k, v in batch.items() if isinstance(v, Tensor) and k != "labels"}
        counts = batch.get("media_counts") or adapter.media_counts(media, config)
        staged = split_media(media, n_microbatches, **counts)
    else:  # the rows' split alone (tensor_split's, as stage 0's): pre-split microbatches need its bounds
        staged = split_media({"input_ids": ids, "attention_mask": mask}, n_microbatches)
    pads, positions = _padding(mask)
    return ReplicaShare(ids, mask, batch["labels"], staged, int(num_valid_tokens), int(samples), pads, positions)


def loader_shares(loader: Any, config: Any, adapter: Any, n_microbatches: int, *, dp_group: Any = None,
                  stages_media: bool, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                  epochs: int | None = None) -> Iterator[ReplicaShare]:
    """The shares of a per-replica loader's batches (a :class:`ppmedia.data.ReplicaLoader`: one dict per
    global batch with ``n_label_tokens``, ``n_samples`` and ``skipped``), epoch after epoch
    (``epochs=None``: without end; else until that many passes, counted from the loader's position).

    Each batch goes to ``device`` (floating tensors in ``dtype``). A loader built with ``dp_group``
    summed the counts over the replicas already (``global_label_tokens``, ``global_samples``, its
    ``skipped``); for any other, one ``all_reduce`` over ``dp_group`` per batch sums the replicas'
    label tokens, samples and skipped samples (the records every replica's dataset left out when
    opened counted once, plus each replica's own skips; such a loader's saved ``skipped`` is its own,
    so resume it at ``dp > 1`` only when built with ``dp_group``).
    """
    opened = len(getattr(getattr(loader, "dataset", None), "skipped", ()) or ())  # the same on every replica
    done = 0
    while epochs is None or done < epochs:
        for batch in loader:
            batch = batch_to(batch, device, dtype)
            if "global_label_tokens" in batch:  # summed over the replicas by the loader (its dp_group)
                tokens, samples = int(batch["global_label_tokens"]), int(batch["global_samples"])
                skipped = int(batch["skipped"])
            else:
                tokens, samples, skipped = _replica_sums(batch, opened, dp_group, device)
            share = share_of_replica_batch(batch, config, adapter, n_microbatches, num_valid_tokens=tokens,
                                           samples=samples, stages_media=stages_media)
            share.skipped = skipped
            yield share
        done += 1


def _replica_sums(batch: Mapping[str, Any], opened: int, dp_group: Any, device: Any) -> tuple[int, int, int]:
    """(global label tokens, samples, skipped) of a batch whose loader did not sum them: one
    ``all_reduce`` over ``dp_group`` (the records left out when opened counted once)."""
    import torch.distributed as dist

    counts = torch.tensor([int(batch["n_label_tokens"]), int(batch["n_samples"]),
                           int(batch.get("skipped", opened)) - opened], dtype=torch.int64, device=device)
    if dp_group is not None:
        dist.all_reduce(counts, group=dp_group)
    tokens, samples, skipped = (int(c) for c in counts.tolist())
    return tokens, samples, opened + skipped


def _run_schedule(parts: PipelineParts, share: ReplicaShare, losses: list[Tensor]) -> None:
    from ..producer.staging import stage_media

    from ..producer.presplit import microbatch_inputs

    staging: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if parts.spread is not None:  # every pipeline rank encodes a share; stage 0 also stages the chunks
        staging = parts.spread.step(share.staged, share.input_ids, stage=not parts.presplit)
    elif parts.first is not None and not parts.presplit:
        staging = stage_media(parts.first, share.staged)
    loss_kwargs = {"num_valid_tokens": share.num_valid_tokens}
    with staging:
        if parts.presplit:  # every rank: microbatch k's rows as its arguments, its media as its `media` keyword
            if share.staged is None:
                raise ValueError("train_step(presplit): this rank's share has no staged media; pre-split "
                                 "microbatches need split_media(...) on every rank")
            inputs = microbatch_inputs(share.staged, share.input_ids, share.attention_mask, target=share.labels,
                                       loss_kwargs=loss_kwargs)
            parts.schedule.step(**inputs.step_kwargs(), losses=losses)
        else:
            parts.schedule.step(share.input_ids, share.attention_mask, target=share.labels, losses=losses,
                                loss_kwargs=loss_kwargs)


def train_step(parts: PipelineParts, share: ReplicaShare, step: int | None = None) -> StepResult:
    """One optimizer step (call it on every rank): zero the gradients, run the schedule with the
    share's media staged, sum tied gradients across the pipeline and (replicated) gradients across
    the replicas (with ``parts.tp_group``, first the tower's over ``tp``), clip to the global norm; one ``all_reduce`` over the world then gives every rank the
    global loss (the last stages' shares) and the padding counts (each replica's pipeline rank 0); with
    ``parts.guard``, a non-finite loss or norm raises or skips the optimizer step (``step`` names it);
    else every optimizer steps."""
    from .parallel import all_reduce_gradients, clip_grad_norm
    from .tensor_parallel import reduce_tensor_parallel_gradients
    from .tied import sync_tied_gradients

    for optimizer in parts.optimizers:
        optimizer.zero_grad(set_to_none=True)
    losses: list[Tensor] = []
    if parts.tracer is not None:
        parts.tracer.start(group=parts.pp_group)
    with _phase("schedule"):
        _run_schedule(parts, share, losses)
    with _phase("grad_sync"):
        if parts.cp_group is not None:  # before the tp and dp reductions and the clipping
            from .context_parallel import reduce_context_gradients

            reduce_context_gradients(parts.modules, parts.cp_group)
        if parts.tp_group is not None:  # the tower's (and per-head norms') gradients: each tp rank holds a share
            reduce_tensor_parallel_gradients(parts.modules)
        sync_tied_gradients(parts.modules, parts.tied, group=parts.pp_group)
        if not parts.sharded:  # FSDP2 reduce-scattered the sums over the replicas already
            all_reduce_gradients(parts.modules, group=parts.dp_group)
        if parts.expert_parallel:  # expert shards: over the edp ranks holding the same experts (FSDP2 ignores them)
            from .expert_parallel import reduce_expert_parallel_gradients

            reduce_expert_parallel_gradients(parts.modules, parts.edp_group)
    with _phase("clip"):
        norm = float(clip_grad_norm(parts.modules, parts.max_grad_norm, tied=parts.tied, group=parts.pp_group))
    with _phase("sums"):
        loss, fraction = _global_sums(parts, share, losses)
    skip = parts.guard is not None and parts.guard.should_skip(-1 if step is None else step, loss, norm)
    with _phase("optimizer"):
        for optimizer in parts.optimizers:
            if skip:
                optimizer.zero_grad(set_to_none=True)
            else:
                optimizer.step()
    return StepResult(loss, norm, fraction, skip)


def _phase(name: str) -> Any:
    """A labelled range of the step for torch's profiler (``ppmedia:NAME``; near free unprofiled)."""
    return torch.profiler.record_function(f"ppmedia:{name}")


def _global_sums(parts: PipelineParts, share: ReplicaShare, losses: list[Tensor]) -> tuple[float, float]:
    """(global loss, padding fraction): one float64 ``all_reduce`` over the world of [this rank's loss
    share, pads, positions] (the counts from each replica's pipeline rank 0 only; with tensor
    parallelism, from ``tp`` rank 0 only)."""
    import torch.distributed as dist

    device = share.input_ids.device
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    counts = parts.tp_group is None or dist.get_rank(parts.tp_group) == 0
    if losses and counts:
        sums[0] = torch.stack([loss.detach().double() for loss in losses]).sum().to(device)
    if counts and dist.get_rank(parts.pp_group) == 0:
        sums[1], sums[2] = share.pad_positions, share.positions
    dist.all_reduce(sums, group=parts.world_group)
    loss, pads, positions = sums.tolist()
    return loss, pads / positions if positions else 0.0


def eval_loss(parts: PipelineParts, shares: Sequence[ReplicaShare]) -> float:
    """The mean token loss over ``shares`` (forward only, modules in eval mode, then back in train
    mode): each batch's global mean (:func:`~ppmedia.pipeline.eval_step`) weighted by its label tokens."""
    from .evaluate import eval_step

    total, tokens = 0.0, 0
    for module in parts.modules:
        module.eval()
    try:
        for share in shares:
            staged = share.staged if parts.first is not None or parts.presplit else None
            loss = eval_step(parts.schedule, parts.first, staged, share.input_ids, share.attention_mask, share.labels,
                             share.num_valid_tokens, presplit=parts.presplit, tp_group=parts.tp_group,
                             group=parts.world_group)
            total += float(loss) * share.num_valid_tokens
            tokens += share.num_valid_tokens
    finally:
        for module in parts.modules:
            module.train()
    return total / tokens if tokens else 0.0
