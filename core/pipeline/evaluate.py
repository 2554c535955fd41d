"""Forward-only evaluation through the pipeline: the global loss of a batch, media staged and consumed once.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor

__all__ = ["eval_step"]


def eval_step(
    schedule: Any,
    first_stage: Any,
    staged: Any,
    input_ids: Tensor,
    attention_mask: Tensor,
    labels: Tensor,
    num_valid_tokens: int,
    *,
    group: Any = None,
    presplit: bool = False,
    tp_group: Any = None,
) -> Tensor:
    """One forward-only step of ``schedule`` (torch's ``schedule.eval``): the GLOBAL mean token loss.

    Call it on every rank of the world with this replica's share, as for a training step: the first
    stage's rank passes its ``PipelineStage`` as ``first_stage`` and the replica's
    :func:`~ppmedia.split_media` result as ``staged`` (``None`` on other ranks). Runs under
    ``torch.no_grad()``: no parameter gets a gradient (gradients already there stay as they are);
    every staged chunk is consumed exactly once (:func:`~ppmedia.stage_media` checks it, and gives
    back the chunk the schedule's shape-inference forward takes when it switches from training).

    Args:
        schedule: a schedule from :func:`~ppmedia.pipeline.build_schedule` (its ``loss_fn`` computes
            the loss on the last stage).
        first_stage: the first ``PipelineStage`` on this rank, or ``None``.
        staged: the replica's staged media (``split_media(local, n_microbatches, ...)``), or ``None``.
        input_ids, attention_mask: ``[b_replica, S]``, this replica's rows.
        labels: ``[b_replica, S]`` shifted labels (:func:`~ppmedia.pipeline.make_labels`).
        num_valid_tokens: the valid labels of the GLOBAL batch (all replicas), so the replicas'
            losses add up to the batch's mean.
        group: the group over which the last stages' losses are summed: the world (default), which
            holds one last stage per replica.
        presplit: feed the schedule pre-split microbatches (:func:`ppmedia.microbatch_inputs`: each
            microbatch's media as its own ``media`` keyword input) instead of staging the media on
            the first stage; ``staged`` is then required on every rank.
        tp_group: with tensor-parallel stages (:func:`~ppmedia.pipeline.apply_tensor_parallel`), their
            ``tp`` group: only its rank 0 adds its last stages' losses (every peer holds the same).

    Returns:
        A float32 scalar, equal on every rank: the global batch's mean token loss.
    """
    import torch.distributed as dist

    from ..producer.presplit import microbatch_inputs
    from ..producer.staging import stage_media

    losses: list[Tensor] = []
    loss_kwargs = {"num_valid_tokens": num_valid_tokens}
    if presplit:
        if staged is None:
            raise ValueError("eval_step(presplit=True): staged is None; expected the replica's split_media(...) on every rank")
        inputs = microbatch_inputs(staged, input_ids, attention_mask, target=labels, loss_kwargs=loss_kwargs)
        with torch.no_grad():
            schedule.eval(**inputs.step_kwargs(), losses=losses)
    else:
        staging: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if first_stage is not None:
            if staged is None:
                raise ValueError("eval_step: first_stage given without its staged media (split_media(...))")
            staging = stage_media(first_stage, staged)
        with torch.no_grad(), staging:
            schedule.eval(input_ids, attention_mask, target=labels, losses=losses, loss_kwargs=loss_kwargs)
    counted = losses if tp_group is None or dist.get_rank(tp_group) == 0 else []
    total = torch.stack([loss.detach().float() for loss in counted]).sum() if counted else torch.zeros(())
    dist.all_reduce(total, group=group)
    _reshard(schedule)
    return total


def _reshard(schedule: Any) -> None:
    """Free what FSDP2 gathered for the forward (a training step's backward reshards by itself)."""
    from torch.distributed.fsdp import FSDPModule

    stages = list(getattr(schedule, "_stages", None) or [schedule._stage])
    for stage in stages:
        for module in stage.submod.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
