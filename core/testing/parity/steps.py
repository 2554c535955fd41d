"""One step of a parity scenario on both sides: the pipeline's schedule step (staged, pre-split or with
the encoder spread; then the tied, tensor-parallel and data-parallel reductions), forward-only
evaluation, the ``varlen`` accumulation, the reference's own forward and backward, clipping, and the
comparison of every gradient."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from .batches import _balanced_split, _padded, _split
from .build import _Built
from .groups import _Groups
from .probes import _Probe
from .scenarios import VARLEN_PAD, Scenario


def _pipeline_step(built: _Built, scenario: Scenario, g: _Groups, local: dict[str, Any], media_local: dict[str, Any],
                   num_valid: int, probe: _Probe, adapter: Any, config: Any, n: int,
                   accumulate: bool = False) -> tuple[list[torch.Tensor], float, Any]:
    """One schedule step on this replica's share, then the tied and data-parallel reductions
    (``accumulate``: keep the gradients already there, and leave the reductions to the next step)."""
    from ...pipeline import all_reduce_gradients, make_labels, sync_tied_gradients
    from ...producer.presplit import microbatch_inputs
    from ...producer.staging import stage_media

    import torch.distributed as dist

    staged = _balanced_split(adapter, config, local, n) if scenario.balance else _split(adapter, config, dict(media_local), n)
    ids, mask = local["input_ids"], local["attention_mask"]  # reordered in place by a balanced split
    labels = make_labels(ids, config, adapter, attention_mask=mask)
    probe.reset(ids, staged.samples)
    if not (accumulate or scenario.variant == "varlen"):
        built.optimizer.zero_grad(set_to_none=True)
    losses: list[torch.Tensor] = []
    dist.barrier()
    t0 = time.perf_counter()
    staging: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if scenario.encoder == "spread":  # every rank: its share of the encoding; stage 0 also stages
        from ...pipeline import encoder_spread_of

        spread = encoder_spread_of(built.stages)
        if not scenario.lane:  # every encode before the schedule, every backward after it
            spread.set_background(False)
        if scenario.fault == "stale_copies":  # the copies keep the weights of the first step
            spread.refresh = lambda everything=True: None  # type: ignore[method-assign]
        staging = spread.step(staged, ids, stage=not scenario.presplit)
    elif built.first is not None and not scenario.presplit:
        staging = stage_media(built.first.submod if scenario.fault == "bare_module" else built.first, staged)
    loss_kwargs = {"num_valid_tokens": num_valid}
    with staging:
        if scenario.presplit:  # every rank the same microbatches; each one's media its own `media` input
            inputs = microbatch_inputs(staged, ids, mask, target=labels, loss_kwargs=loss_kwargs)
            built.schedule.step(**inputs.step_kwargs(), losses=losses)
        else:
            built.schedule.step(ids, mask, target=labels, losses=losses, loss_kwargs=loss_kwargs)
    if accumulate:
        return losses, time.perf_counter() - t0, staged
    if scenario.tp > 1 and scenario.fault != "unreduced_tower":
        from ...pipeline import reduce_tensor_parallel_gradients

        reduce_tensor_parallel_gradients(built.modules)
    sync_tied_gradients(built.modules, built.tied, group=g.pp_group)
    if g.dp > 1 and not scenario.fsdp:  # FSDP2 has reduce-scattered them over the dp mesh
        all_reduce_gradients(built.modules, group=g.dp_group)
    if scenario.ep > 1:  # expert shards: summed over the edp ranks holding them (the planted bug: averaged over ep)
        from ...pipeline import reduce_expert_parallel_gradients

        averaged = g.mesh["ep"].get_group() if scenario.fault == "ep_averaged" else None
        reduce_expert_parallel_gradients(built.modules, g.mesh["edp"].get_group(), average_over=averaged)
    return losses, time.perf_counter() - t0, staged


def _eval_loss(built: _Built, scenario: Scenario, local: dict[str, Any], media_local: dict[str, Any], num_valid: int,
               probe: _Probe, adapter: Any, config: Any, n: int) -> float | None:
    """``eval``: the global loss of ``eval_step`` on this replica's share (staged or pre-split as the
    scenario says), before the step's training step; ``None`` for other variants."""
    if scenario.variant != "eval":
        return None
    from ...pipeline import eval_step, make_labels

    staged = _split(adapter, config, dict(media_local), n)
    ids, mask = local["input_ids"], local["attention_mask"]
    labels = make_labels(ids, config, adapter, attention_mask=mask)
    probe.reset(ids, staged.samples)  # its calls are not counted: the training step resets again
    first = built.first
    loss = eval_step(built.schedule, first, staged if (first is not None or scenario.presplit) else None,
                     ids, mask, labels, num_valid, presplit=scenario.presplit)
    return float(loss)


def _accumulate_padded(built: _Built, scenario: Scenario, g: _Groups, seed: int, probe: _Probe, tiny_module: Any,
                       n: int) -> None:
    """``varlen``: zero the gradients, then one schedule step (and one reference forward and backward)
    on another batch, right-padded by :data:`VARLEN_PAD` columns; the step's own batch follows."""
    from ...pipeline import count_valid_tokens, make_labels, shard_batch
    from ...registry import get_adapter

    config = built.reference.config
    adapter = get_adapter(config)
    batch = _padded(dict(tiny_module.build_batch(seed)), config, VARLEN_PAD)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    num_valid = count_valid_tokens(make_labels(ids, config, adapter, attention_mask=mask))
    local = shard_batch(batch, g.dp_rank, g.dp, **adapter.media_counts(batch, config)) if g.dp > 1 else dict(batch)
    built.optimizer.zero_grad(set_to_none=True)
    _pipeline_step(built, scenario, g, local, dict(local), num_valid, probe, adapter, config, n, accumulate=True)
    _reference_step(built, tiny_module, batch, make_labels(ids, config, adapter, attention_mask=mask, shift=False))


def _reference_step(built: _Built, tiny_module: Any, batch: dict[str, Any], targets: torch.Tensor,
                    accumulate: bool = False) -> tuple[Any, float]:
    t0 = time.perf_counter()
    if not accumulate:
        built.ref_optimizer.zero_grad(set_to_none=True)
    inputs = dict(tiny_module.reference_inputs(batch))
    inputs.setdefault("use_cache", False)
    out = built.reference(**inputs, labels=targets)
    out.loss.backward()
    return out, time.perf_counter() - t0


def _clip_both(built: _Built, g: _Groups) -> tuple[float, float]:
    """Clip the reference to half its global norm with torch, the pipeline to the same with ppmedia."""
    from ...pipeline import clip_grad_norm

    ref_norm = float(torch.nn.utils.clip_grad_norm_(built.reference.parameters(), float("inf")))
    max_norm = 0.5 * ref_norm
    torch.nn.utils.clip_grad_norm_(built.reference.parameters(), max_norm)
    norm = clip_grad_norm(built.modules, max_norm, tied=built.tied, group=g.pp_group)
    return float(norm), ref_norm


def _compare(built: _Built) -> tuple[dict[bool, float], dict[bool, float], dict[bool, int], dict[bool, str | None]]:
    """Max |grad diff|, max |reference grad|, parameter counts and the parameter with the largest
    difference, per side (True: language model)."""
    ref_params = dict(built.reference.named_parameters(remove_duplicate=False))
    diffs = {True: 0.0, False: 0.0}
    scale = {True: 0.0, False: 0.0}
    counts = {True: 0, False: 0}
    worst: dict[bool, str | None] = {True: None, False: None}
    for name, (param, is_lm) in built.owned.items():  # the same order on every replica (collectives)
        ref_grad = ref_params[name].grad
        grad = None if param.grad is None else _full(param.grad).float()
        diff = _max_abs_diff(grad, ref_grad)
        if worst[is_lm] is None or diff > diffs[is_lm]:
            diffs[is_lm], worst[is_lm] = diff, name
        scale[is_lm] = max(scale[is_lm], _max_abs_diff(ref_grad, None))
        counts[is_lm] += 1
    return diffs, scale, counts, worst


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: an FSDP2 shard (``DTensor``) gathered over its data-parallel mesh."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _max_abs_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None and b is None:
        return 0.0
    if a is None:
        return float(b.abs().max()) if b.numel() else 0.0  # type: ignore[union-attr]
    if b is None:
        return float(a.abs().max()) if a.numel() else 0.0
    return float((a - b).abs().max()) if a.numel() else 0.0
