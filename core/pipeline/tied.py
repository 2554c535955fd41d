"""Tied parameters: an embedding tied to ``lm_head`` lives on the first AND the last stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

__all__ = ["TiedParameters", "sync_tied_gradients", "tied_parameters"]



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


def sync_tied_gradients(
    modules: Sequence[nn.Module], tied: Sequence[TiedParameters], group: Any = None
) -> None:
    """Sum the gradients of tied parameters across the ranks holding their copies.

    After a pipeline step the first stage's copy of a tied embedding holds the embedding's share of
    the gradient and the last stage's copy the head's; the full model's gradient is their sum. A
    collective: every rank of ``group`` must call it with the same ``tied`` list (a rank holding no
    copy contributes zeros). A rank holding several names of one group on one parameter object
    contributes it once.
    """
    import torch.distributed as dist

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
                total += p.grad
        dist.all_reduce(total, group=group)
        for p in params:
            p.grad = total.to(p.dtype) if len(params) == 1 else total.to(p.dtype, copy=True)
