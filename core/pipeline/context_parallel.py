"""Context parallelism: the decoder's sequence divided over the ``cp`` ranks of every pipeline stage.

The ``cp`` ranks of a stage hold the same rows. Stage 0 embeds and merges the media on the FULL row and
computes its positions there (mRoPE, packed rows' per-sample positions, deepstack features); then it pads
the row to a multiple of ``2 x cp`` (:func:`padded_length`) and keeps its head-tail share
(:meth:`ContextShard.indices`: chunks ``c`` and ``2cp - 1 - c`` of ``2cp``, so causal work balances).
Every tensor that crosses a stage boundary is cut on its sequence axis (:meth:`ContextShard.shard`),
positions stay global, labels are shifted before sharding (:func:`context_loss` takes the shifted
labels of the whole row and shards them itself), and attention gathers keys and values over ``cp``
(:mod:`ppmedia.pipeline.cp_attention`). The loss of a rank is its local token sum over the WHOLE batch's
label-token count, so the gradients of the ``cp`` ranks add up (:func:`reduce_context_gradients`) to
the full row's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor, nn

__all__ = [
    "ContextShard",
    "context_loss",
    "context_problem",
    "enable_context_parallel",
    "local_length",
    "padded_length",
    "reduce_context_gradients",
]


def padded_length(S: int, cp: int) -> int:
    """The row length ``S`` rounded up to a multiple of ``2 x cp`` (head-tail chunks of equal size); ``S``
    itself at ``cp = 1`` (nothing is sharded)."""
    if cp == 1:
        return int(S)
    unit = 2 * cp
    return -(-int(S) // unit) * unit


def local_length(S: int, cp: int) -> int:
    """The sequence length each ``cp`` rank holds of a row of ``S`` tokens: ``padded_length(S, cp) / cp``.
    The one place every stage (and :func:`~ppmedia.pipeline.static_stage_args`) takes it from."""
    return padded_length(S, cp) // cp


@dataclass(frozen=True)
class ContextShard:
    """One rank's place in its ``cp`` group.

    Attributes:
        size: ``cp`` (ranks sharing each row).
        rank: this rank's index in the group (``0 .. cp-1``).
        group: the ``cp`` process group (``pipeline_mesh(...)["cp"].get_group()``); ``None`` only with
            ``size == 1``.
    """

    size: int
    rank: int
    group: Any = None

    def indices(self, S: int, rank: int | None = None, device: Any = None) -> Tensor:
        """Global token indices ``[S_local]`` (int64) that ``rank`` (default this one) holds of a
        PADDED row of ``S`` tokens: chunk ``rank`` then chunk ``2cp - 1 - rank`` of ``2cp`` equal chunks."""
        c = self.rank if rank is None else rank
        if self.size == 1:
            return torch.arange(S, device=device)
        if S % (2 * self.size):
            raise ValueError(f"context parallelism: row length {S} is not a multiple of 2 x cp = {2 * self.size}")
        chunk = S // (2 * self.size)
        head = torch.arange(c * chunk, (c + 1) * chunk, device=device)
        tail = torch.arange((2 * self.size - 1 - c) * chunk, (2 * self.size - c) * chunk, device=device)
        return torch.cat([head, tail])

    def gathered_indices(self, S: int, device: Any = None) -> Tensor:
        """``[S]``: the global index of every position of a tensor gathered over ``cp`` (ranks in order)."""
        return torch.cat([self.indices(S, r, device) for r in range(self.size)])

    def shard(self, tensor: Tensor, dim: int) -> Tensor:
        """This rank's share of a full (padded) row ``tensor`` along its sequence axis ``dim``."""
        index = self.indices(tensor.shape[dim], device=tensor.device)
        return tensor.index_select(dim, index)

    def gather(self, tensor: Tensor, dim: int) -> Tensor:
        """The full row of a tensor every ``cp`` rank holds a share of (``dim`` its sequence axis), in global
        order; no gradient (masks, segments, token types)."""
        import torch.distributed as dist

        if self.size == 1:
            return tensor
        moved = tensor.movedim(dim, 0).contiguous()
        out = torch.empty((self.size * moved.shape[0], *moved.shape[1:]), dtype=moved.dtype, device=moved.device)
        dist.all_gather_into_tensor(out, moved, group=self.group)
        S = out.shape[0]
        full = torch.empty_like(out)
        full[self.gathered_indices(S, out.device)] = out
        return full.movedim(0, dim)


def _pad_row(tensor: Tensor, S: int, value: int) -> Tensor:
    if tensor.shape[1] == S:
        return tensor
    pad = torch.full((tensor.shape[0], S - tensor.shape[1]), value, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([tensor, pad], dim=1)


def context_loss(shard: ContextShard) -> Callable[..., Tensor]:
    """The last stage's loss under context parallelism: ``loss(logits [b, S_local, V], labels [b, S],
    num_valid_tokens)``. ``labels`` are the whole row's SHIFTED labels (shifted before sharding:
    :func:`~ppmedia.pipeline.make_labels`), padded with ignored labels to the padded row and cut to this
    rank's share; the sum over the share is divided by the whole batch's label tokens
    (``num_valid_tokens``, counted before sharding and reduced over dp only)."""
    import torch.nn.functional as F

    from .loss import IGNORE_INDEX, SHIFTED_MARK, _check_shifted

    def loss(logits: Tensor, labels: Tensor, num_valid_tokens: int | Tensor | None = None) -> Tensor:
        _check_shifted(labels)
        labels = labels.masked_fill(labels == SHIFTED_MARK, IGNORE_INDEX)
        if num_valid_tokens is None:
            num_valid_tokens = (labels != IGNORE_INDEX).sum()
        local = shard.shard(_pad_row(labels, padded_length(labels.shape[1], shard.size), IGNORE_INDEX), 1)
        total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), local.reshape(-1).to(logits.device),
                                ignore_index=IGNORE_INDEX, reduction="sum")
        if isinstance(num_valid_tokens, Tensor):
            return total / num_valid_tokens.clamp(min=1).to(total.dtype)
        return total / max(int(num_valid_tokens), 1)

    return loss


def context_problem(config: Any, adapter: Any = None) -> str | None:
    """Why this model's decoder cannot be sharded over ``cp``, in words, or ``None``.

    Refused: whatever packing refuses (:func:`ppmedia.packing.packing_problem`: linear, recurrent or
    hybrid layers, chunked attention; the context-parallel attention replaces ``sdpa`` / ``eager``),
    an adapter's ``context_refusal`` (key-indexing state carried between layers: Gemma 4's shared KV,
    Mistral Large 4's top-k indices)."""
    from ..packing.isolation import packing_problem
    from .cp_attention import CP_ATTENTION

    model_type = getattr(config, "model_type", "?")
    refusal = getattr(adapter, "context_refusal", None)
    if refusal:
        return f"{model_type}: {refusal}"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    impl = getattr(text, "_attn_implementation", None)
    if impl == CP_ATTENTION:  # already enabled (another stage of this rank shares the config)
        return None
    problem = packing_problem(config)  # the layer types and attention (a packing layout refusal does not apply)
    if problem is not None:
        return problem.replace("packed samples", "a sharded row").replace("packing supports", "context parallelism supports")
    return None


def enable_context_parallel(modules: Iterable[Any], shard: ContextShard, vision: str | None = None) -> None:
    """Shard every stage module (or ``PipelineStage``) of this rank over ``shard``'s ``cp`` group: the
    text config's attention becomes the gathered one (:data:`~ppmedia.pipeline.cp_attention.CP_ATTENTION`;
    the vision tower keeps its own). Call it on every rank, before the schedule is built.

    ``vision``: stage 0's vision tower, ``"shard"`` (each cp rank encodes its share of a microbatch's
    images and videos, gathered back: :mod:`ppmedia.pipeline.cp_vision`) or ``"replicate"`` (every cp
    rank encodes them all); ``None``: shard where the family allows (:func:`~ppmedia.pipeline.cp_vision.
    vision_shard_problem`), else replicate.

    Raises:
        ValueError: the family cannot shard its decoder (:func:`context_problem`), naming ``--cp`` and why;
            ``vision`` is not a mode, or ``"shard"`` for a family that keeps its tower replicated.
    """
    from .cp_attention import CP_ATTENTION, register_cp_attention
    from .cp_vision import resolve_cp_vision

    register_cp_attention()
    for module in modules:
        module = getattr(module, "submod", module)
        problem = context_problem(module.config, module.adapter)
        if problem is not None:
            raise ValueError(f"--cp {shard.size}: context parallelism refused for {problem}")
        text = module.config.get_text_config() if hasattr(module.config, "get_text_config") else module.config
        if shard.size > 1:
            if text._attn_implementation != CP_ATTENTION:
                module.context_base_attention = text._attn_implementation or "sdpa"
            else:  # another stage of this rank shares the config: it recorded the model's own
                module.context_base_attention = getattr(text, "_ppmedia_base_attention", "sdpa")
            text._ppmedia_base_attention = module.context_base_attention
            text._attn_implementation = CP_ATTENTION
            for lm_config in _stage_text_configs(module):
                lm_config._attn_implementation = CP_ATTENTION
        module.context = shard if shard.size > 1 else None
        module.context_vision = resolve_cp_vision(module.adapter, vision)


def _stage_text_configs(module: Any) -> list[Any]:
    """The (shallow-copied) text configs of the stage's language model and its layers' attention."""
    found: dict[int, Any] = {}
    for sub in module.stage_language_model.modules():
        config = getattr(sub, "config", None)
        if config is not None and hasattr(config, "_attn_implementation") and not hasattr(config, "vision_config"):
            found[id(config)] = config
    return list(found.values())


def reduce_context_gradients(modules: Sequence[nn.Module], group: Any) -> None:
    """Sum every gradient (the vision tower's included) over the ``cp`` group: each rank's backward
    gave the part of its share of the rows. Call it before the data-parallel reduction and clipping, on
    every rank (a rank holding only padding or no media still takes part: a missing gradient counts 0)."""
    from .parallel import all_reduce_gradients

    all_reduce_gradients(modules, group=group)
