"""Tied parameters: an embedding tied to ``lm_head`` lives on the first AND the last stage.

Two things make a tied family train like the whole model: the optimizer must see each parameter
object once (:func:`stage_parameters`; a stage list's ``parameters()`` chained over stages lists a
tie twice when one rank holds both ends, and AdamW then steps it twice, with only a warning), and
the copies on different ranks must get the sum of their gradients (:func:`sync_tied_gradients`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

__all__ = ["TiedParameters", "stage_parameters", "sync_tied_gradients", "tied_parameters"]

@dataclass(frozen=True)
class TiedParameters:
    """Parameter names that are one tensor in the full model (e.g. ``lm_head.weight`` and
    ``model.language_model.embed_tokens.weight`` with ``tie_word_embeddings``)."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype


def tied_parameters(model: nn.Module) -> list[TiedParameters]:
    """Groups of names sharing one parameter in ``model`` (call it before splitting; same order on every rank)."""
    by_id: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
        params[id(param)] = param
    return [
        TiedParameters(tuple(names), tuple(params[i].shape), params[i].dtype)
        for i, names in by_id.items()
        if len(names) > 1
    ]


def _module_of(stage: Any) -> nn.Module:
    """A ``PipelineStage``'s module (``stage.submod``), or ``stage`` itself when it is a module."""
    module = getattr(stage, "submod", stage)
    if not isinstance(module, nn.Module):
        raise TypeError(f"got {type(stage).__name__}; expected PipelineStage objects or their modules")
    return module


def stage_parameters(stages: Sequence[Any]) -> list[nn.Parameter]:
    """Every parameter of this rank's stages, each parameter object once, in stage order.

    ``stages``: ``PipelineStage`` objects or their modules. What to hand one optimizer: with a tied
    embedding, a rank holding the first and the last stage (one process, or a V-shaped schedule) holds
    the embedding and ``lm_head`` as ONE parameter; listing it twice makes AdamW update it twice per
    step (torch only warns "duplicate parameters"). The gradients of both uses accumulate in that one
    parameter; copies on other ranks still need :func:`sync_tied_gradients`.

    Raises:
        ValueError: the stages hold no parameter at all (more stages than decoder layers), instead of
            torch's bare "optimizer got an empty parameter list".
    """
    seen: dict[int, nn.Parameter] = {}
    for stage in stages:
        for param in _module_of(stage).parameters():
            seen.setdefault(id(param), param)
    if stages and not seen:
        indices = [getattr(_module_of(s), "stage_index", "?") for s in stages]
        raise ValueError(
            f"stage_parameters: stages {indices} hold no parameters (no decoder layer, no embedding or head): more "
            f"pipeline stages than the model has decoder layers to give them; use fewer stages"
        )
    return list(seen.values())


def _full(grad: Any) -> Any:
    """The whole gradient: a ``DTensor`` (FSDP2 shard) gathered over its mesh, a plain tensor as is."""
    from torch.distributed.tensor import DTensor

    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def _like(total: torch.Tensor, param: nn.Parameter) -> Any:
    """``total`` laid out like ``param``: its own shard for a ``DTensor`` parameter (no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        return distribute_tensor(total.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
    return total.to(param.dtype, copy=True)


def sync_tied_gradients(
    modules: Sequence[Any], tied: Sequence[TiedParameters] | None = None, group: Any = None
) -> None:
    """Sum the gradients of tied parameters across the ranks holding their copies.

    ``modules``: this rank's stage modules or ``PipelineStage`` objects. ``tied``: the model's tied
    groups (:func:`tied_parameters` before the split); ``None`` takes the stage modules' own
    ``module.tied`` (set by :func:`~ppmedia.pipeline.build_stage_modules` and
    :func:`~ppmedia.pipeline.stages_from_pretrained`, the same on every rank).

    After a pipeline step the first stage's copy of a tied embedding holds the embedding's share of
    the gradient and the last stage's copy the head's; the full model's gradient is their sum. A
    collective: every rank of ``group`` must call it with the same ``tied`` list (a rank holding no
    copy contributes zeros). A rank holding several names of one group on one parameter object
    contributes it once; two copies on one rank (a V-shaped schedule's first and last stage, after
    :func:`~ppmedia.pipeline.apply_fsdp` gave them separate parameters) add up.

    FSDP2 stages (``DTensor`` shards): each copy's gradient is gathered over its data-parallel mesh
    (``full_tensor()``, collective among the replicas of this pipeline rank), the whole gradients are
    summed over ``group``, and each copy keeps its own shard of the sum.
    """
    import torch.distributed as dist

    modules = [_module_of(m) for m in modules]
    if tied is None:
        tied = tuple(getattr(modules[0], "tied", ())) if modules else ()
    for entry in tied:
        local: dict[int, nn.Parameter] = {}
        for module in modules:
            named = dict(module.named_parameters(remove_duplicate=False))
            for name in entry.names:
                if name in named:
                    local[id(named[name])] = named[name]
        params = list(local.values())
        device = params[0].device if params else torch.device("cpu")
        total = torch.zeros(entry.shape, dtype=entry.dtype, device=device)
        for p in params:
            if p.grad is not None:
                total += _full(p.grad).to(entry.dtype)
        dist.all_reduce(total, group=group)
        for p in params:
            if p.requires_grad:  # a frozen tie (a LoRA run's embedding) gets no gradient to hold
                p.grad = _like(total, p)
