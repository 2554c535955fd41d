"""The context-parallel attention: local queries against the keys and values of the whole row.

:func:`cp_attention_forward` is registered with transformers' ``AttentionInterface`` as
:data:`CP_ATTENTION` and set on the language model's config only (the vision tower keeps its own). Each
call gathers K and V over the ``cp`` group with ``all_gather_single_autograd`` (its backward is a
reduce-scatter), then runs the attention core (:class:`GatheredCore`) under a mask evaluated from index
vectors on GLOBAL token indices (:class:`CpMask`): causal, the layer's sliding window, key padding,
packed rows' same-sample rule and the family's bidirectional blocks (Gemma 3's image blocks, PaliGemma's
prefix: ``adapter.attention_blocks``). The core is recomputed in the backward, so neither an ``S x S``
mask nor a score matrix is kept for it.

The stage sets the microbatch's :class:`CpMask` around its language model's forward (:func:`cp_mask_scope`);
the attention function reads it. Backends: :data:`CP_BACKENDS` maps a name to a core with
:class:`GatheredCore`'s signature (``"gathered"``, the one that trains on CPU; a GPU backend, torch's ring
attention for plain causal rows or FlexAttention with a block mask, registers there and is checked
against it).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

__all__ = ["CP_ATTENTION", "CP_BACKENDS", "CpMask", "GatheredCore", "cp_attention_forward", "cp_mask_scope",
           "register_cp_attention"]

#: the attention implementation name set on a context-parallel language model's config
CP_ATTENTION = "ppmedia_cp"

_CURRENT: contextvars.ContextVar["CpMask | None"] = contextvars.ContextVar("ppmedia_cp_mask", default=None)


@dataclass
class CpMask:
    """A microbatch's attention mask as index vectors (no ``S x S`` tensor).

    Attributes:
        q_index: ``[S_local]`` global index of every local query.
        k_index: ``[S]`` global index of every gathered key (ranks in order).
        q_segment, k_segment: ``[b, S_local]`` / ``[b, S]``: 0 on padding, else the sample number (packed
            rows) or 1.
        packed: whether keys must be in the query's sample.
        q_block, k_block: ``[b, S_local]`` / ``[b, S]`` bidirectional block ids (>= 0; -1 none) or ``None``.
        group: the ``cp`` process group.
        backend: a name of :data:`CP_BACKENDS`.
        blocks_windowed: whether a sliding window limits the bidirectional blocks too (Gemma 3) or the
            blocks are added after it (PaliGemma 2: ``create_sliding_window_causal_mask``'s blocks).
        soft_capping: whether the layer's score soft-capping applies (the model's own implementation was
            ``eager``; transformers' ``sdpa`` path ignores it, and the model's own run is the reference).
    """

    q_index: Tensor
    k_index: Tensor
    q_segment: Tensor
    k_segment: Tensor
    packed: bool
    q_block: Tensor | None
    k_block: Tensor | None
    group: Any
    backend: str = "gathered"
    soft_capping: bool = False
    blocks_windowed: bool = True

    def allowed(self, window: int | None) -> Tensor:
        """bool ``[b, 1, S_local, S]``: which keys each local query sees (built, used, dropped)."""
        q = self.q_index[:, None]
        k = self.k_index[None, :]
        visible = (k <= q)[None]
        blocks = None
        if self.q_block is not None and self.k_block is not None:
            qb = self.q_block[:, :, None]
            blocks = (qb == self.k_block[:, None, :]) & (qb >= 0)
        if blocks is not None and self.blocks_windowed:
            visible = visible | blocks
        if window is not None:
            visible = visible & ((q - k) < window)[None]
        if blocks is not None and not self.blocks_windowed:
            visible = visible | blocks
        visible = visible & (self.k_segment != 0)[:, None, :]
        if self.packed:
            visible = visible & (self.q_segment[:, :, None] == self.k_segment[:, None, :])
        return (visible | (q == k)[None])[:, None]


@contextlib.contextmanager
def cp_mask_scope(mask: CpMask) -> Iterator[None]:
    """Make ``mask`` the one :func:`cp_attention_forward` uses while the block runs (one stage forward)."""
    token = _CURRENT.set(mask)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def _core(q: Tensor, k: Tensor, v: Tensor, mask: CpMask, window: int | None, scaling: float | None,
          softcap: float | None = None) -> Tensor:
    """Local queries ``[b, h, Sl, d]`` against gathered ``k, v`` ``[b, hkv, S, d]``: ``[b, h, Sl, d]``
    (``softcap``: the scores soft-capped as Gemma 2's eager attention does)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    allowed = mask.allowed(window).to(q.device)
    if softcap is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scaling)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * scale / softcap) * softcap
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)


class GatheredCore(torch.autograd.Function):
    """The attention core, recomputed in the backward: forward keeps only ``q, k, v`` and the index
    vectors; backward rebuilds the mask and the scores and differentiates them."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, mask: CpMask, window: int | None,
                scaling: float | None, softcap: float | None = None) -> Tensor:
        ctx.save_for_backward(q, k, v)
        ctx.cp_mask, ctx.window, ctx.scaling, ctx.softcap = mask, window, scaling, softcap
        with torch.no_grad():
            return _core(q, k, v, mask, window, scaling, softcap)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            out = _core(inputs[0], inputs[1], inputs[2], ctx.cp_mask, ctx.window, ctx.scaling, ctx.softcap)
            grads = torch.autograd.grad(out, inputs, grad)
        return (*grads, None, None, None, None)


def _gathered_core(q: Tensor, k: Tensor, v: Tensor, mask: CpMask, window: int | None, scaling: float | None,
                   softcap: float | None = None) -> Tensor:
    out: Tensor = GatheredCore.apply(q, k, v, mask, window, scaling, softcap)
    return out


#: attention cores by backend name: ``core(q, k_all, v_all, mask, window, scaling, softcap) -> [b, h, Sl, d]``
CP_BACKENDS: dict[str, Callable[..., Tensor]] = {"gathered": _gathered_core}


def _gather_kv(key: Tensor, value: Tensor, group: Any) -> tuple[Tensor, Tensor]:
    """``[b, hkv, Sl, d]`` each -> ``[b, hkv, S, d]`` gathered over ``group`` (ranks in order), with autograd."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor, all_gather_single_autograd

    both = torch.stack([key, value]).movedim(3, 0).contiguous()  # [Sl, 2, b, hkv, d]
    gathered = all_gather_single_autograd(both, 0, group)
    if isinstance(gathered, AsyncCollectiveTensor):
        gathered = gathered.wait()
    full = gathered.movedim(0, 3)  # [2, b, hkv, S, d]
    return full[0], full[1]


def cp_attention_forward(module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                         scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention-function signature: ``query [b, h, Sl, d]``, ``key/value [b, hkv, Sl, d]``
    (this rank's share of the row); returns ``([b, Sl, h, d], None)``. The mask is the stage's
    :class:`CpMask` (``attention_mask`` from the model is ignored: it is ``None``, the name being unknown
    to transformers' mask builders)."""
    mask = _CURRENT.get()
    if mask is None:
        raise RuntimeError(f"{CP_ATTENTION} attention called outside a context-parallel stage forward (no CpMask set)")
    if dropout and module.training:
        raise ValueError(f"{CP_ATTENTION}: attention dropout {dropout} is not supported under context parallelism")
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    k_all, v_all = _gather_kv(key, value, mask.group)
    softcap = kwargs.get("softcap") if mask.soft_capping else None
    out = CP_BACKENDS[mask.backend](query, k_all, v_all, mask, int(window) if window else None, scaling,
                                    float(softcap) if softcap else None)
    return out.transpose(1, 2).contiguous(), None


def register_cp_attention() -> None:
    """Register :func:`cp_attention_forward` with transformers' ``AttentionInterface`` as :data:`CP_ATTENTION`
    (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(CP_ATTENTION, cp_attention_forward)
