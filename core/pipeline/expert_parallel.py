"""Expert parallelism inside every pipeline stage (``pp x dp x ep x tp``): the routed experts of each MoE
block sharded over ``ep`` ranks carved out of the data-parallel ones, tokens exchanged all-to-all.

:func:`~ppmedia.pipeline.pipeline_mesh` with ``ep=`` splits ``dp`` into ``edp x ep`` (``dp_rank =
edp_rank * ep + ep_rank``; the world stays ``pp x dp x tp``; every rank still reads its own share of the
data). :func:`apply_expert_parallel` then, on every stage module, finds the routed experts (transformers'
experts modules: fused ``gate_up_proj`` / ``down_proj`` ``[n_experts, ...]`` and any other parameter
whose dim 0 is the expert count) and:

* keeps rows ``[r * E/ep, (r+1) * E/ep)`` of each such parameter on ``ep`` rank ``r``, as a ``DTensor``
  ``Shard(0)`` over ``mesh["ep"]`` (so ``full_tensor()``, DCP and the export see whole tensors under the
  model's names, and transformers' loader reads only this rank's rows);
* replaces the experts' forward (the module's class gets a subclass, its names are unchanged) by
  :class:`ExpertDispatch`: the model's own block still routes (scores, normalisation, bias, group
  limits, shared experts: all its code), then the per-(token, k) rows are sorted by expert, the
  per-expert counts exchanged first, the rows sent with ``all_to_all_single_autograd``, the module's
  OWN experts forward run on the received rows (a shadow of the module with the local shards), the
  results sent back and combined with the router weights in ascending expert order, as the model's
  experts loop does. No capacity, no dropped tokens.

Gradients: an expert shard's gradient already sums the contributions of every ``ep`` peer's tokens
(the all-to-all's backward brings them home); :func:`reduce_expert_parallel_gradients` sums it over
the ``edp`` ranks that hold the same shard. :func:`~ppmedia.pipeline.all_reduce_gradients` leaves
expert shards out (summing them over ``dp`` would mix different experts); the global norm sums each
shard's squares over ``ep`` once (``DTensor``).

The token exchange is a seam: :class:`TokenDispatcher` (``exchange(rows, counts) -> (received,
received_counts)`` and ``restore(rows) -> rows``); :class:`AllToAllDispatcher` is the gloo / NCCL
default, a fused GPU dispatcher (DeepEP-style) subclasses it and is passed as ``dispatcher=``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

__all__ = [
    "EP_FAMILIES",
    "AllToAllDispatcher",
    "ExpertDispatch",
    "TokenDispatcher",
    "apply_expert_parallel",
    "check_expert_parallel",
    "expert_parallel_problem",
    "is_expert_shard",
    "reduce_expert_parallel_gradients",
    "routed_expert_count",
]

#: the families and what :func:`apply_expert_parallel` does with them: ``model_type -> (status, why)``.
#: ``built``: the block calls ``experts(hidden, top_k_index, top_k_weights)`` (weights per (token, k)),
#: which ppmedia dispatches; ``refused``: the reason.
EP_FAMILIES: dict[str, tuple[str, str]] = {
    "qwen3_vl_moe": ("built", "fused experts, softmax top-k renormalised (parity-tested)"),
    "qwen3_5_moe": ("built", "fused in memory (per-expert on disk), shared expert outside the experts"),
    "glm4v_moe": ("built", "sigmoid scores + correction bias, group-limited top-k, shared experts (parity-tested)"),
    "glm46v": ("built", "with a glm4v_moe text config (a dense glm4v one has no routed experts)"),
    "ernie4_5_vl_moe": ("built", "text and vision expert groups, each sharded and dispatched; every rank joins "
                                 "both groups' exchanges each layer (parity-tested)"),
    "qwen3_omni_moe_thinker": ("built", "the thinker's fused experts (the talker is not trained)"),
    "kimi_k25": ("built", "DeepSeek-V3 text: group-limited sigmoid top-k, shared experts"),
    "mistral3": ("built", "Mistral Small 4 (mistral4 text): DeepSeek-style block"),
    "mistral_large4": ("built", "DeepSeek-style block"),
    "minimax_m3_vl": ("built", "fused experts, routed by its own router"),
    "inkling_mm_model": ("built", "DeepSeek-style block with shared experts"),
    "llama4": ("refused", "Llama4TextMoe scales each token's INPUT by its sigmoid score and runs every expert on "
                          "every token (experts(routed_in)): there is no (token, expert) list to dispatch"),
}

#: text-config fields that hold the number of routed experts, in the order they are tried.
_EXPERT_COUNT_FIELDS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
_STATE = "_ppmedia_ep"


def routed_expert_count(config: Any) -> int:
    """The routed experts per MoE layer of ``config``'s text model (0: none)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in _EXPERT_COUNT_FIELDS:
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def expert_parallel_problem(config: Any, ep: int) -> str | None:
    """Why ``config`` cannot run at expert parallelism ``ep`` (one line naming ``--ep`` and the model
    type), or ``None``. Only the config is read: checked before anything is built."""
    if ep == 1:
        return None
    model_type = getattr(config, "model_type", type(config).__name__)
    status = EP_FAMILIES.get(model_type)
    if status is not None and status[0] == "refused":
        return f"--ep {ep}: model type {model_type} is refused: {status[1]}"
    experts = routed_expert_count(config)
    if experts == 0:
        return f"--ep {ep}: model type {model_type} has no routed experts (expected a mixture-of-experts model)"
    if experts % ep:
        return f"--ep {ep}: model type {model_type} has {experts} routed experts per layer, not divisible by {ep}"
    return None


def check_expert_parallel(config: Any, ep: int) -> int:
    """The routed experts per layer; raises ``ValueError`` with :func:`expert_parallel_problem`'s line."""
    problem = expert_parallel_problem(config, ep)
    if problem:
        raise ValueError(problem)
    return routed_expert_count(config)


def is_expert_shard(param: Any) -> bool:
    """Whether ``param`` is an expert shard of :func:`apply_expert_parallel` (a ``DTensor`` on the
    1-D ``ep`` mesh)."""
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor) and param.device_mesh.mesh_dim_names == ("ep",)


class TokenDispatcher:
    """The seam of the token exchange of one experts call (one instance per call).

    ``exchange(rows [N, H], counts [E])``: ``rows`` sorted by global expert, ``counts[e]`` rows for
    expert ``e``; returns the rows this rank's experts must run ``[M, H]`` (grouped by source rank,
    then local expert) and ``received_counts`` ``[ep, E/ep]``. ``restore(out [M, H])`` sends the
    results back: ``[N, H]`` in ``rows``' order. Both must be differentiable.
    """

    def exchange(self, rows: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def restore(self, out: Tensor) -> Tensor:
        raise NotImplementedError


class AllToAllDispatcher(TokenDispatcher):
    """Counts with ``all_to_all_single``, rows with ``all_to_all_single_autograd`` (gloo and NCCL)."""

    def __init__(self, group: Any, size: int) -> None:
        self.group, self.size = group, size
        self.sent: list[int] = []
        self.received: list[int] = []
        #: bytes this instance put on the wire (rows to other ranks, both directions)
        self.bytes_sent = 0

    def exchange(self, rows: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
        import torch.distributed as dist
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        per_rank = counts.reshape(self.size, -1)
        received = torch.empty_like(per_rank)
        dist.all_to_all_single(received, per_rank.contiguous(), group=self.group)
        self.sent, self.received = per_rank.sum(1).tolist(), received.sum(1).tolist()
        me = dist.get_rank(self.group)
        self.bytes_sent = (sum(self.sent) - self.sent[me]) * rows.shape[-1] * rows.element_size()
        out = all_to_all_single_autograd(rows.contiguous(), self.received, self.sent, self.group)
        return out, received

    def restore(self, out: Tensor) -> Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        me = _group_rank(self.group)
        self.bytes_sent += (sum(self.received) - self.received[me]) * out.shape[-1] * out.element_size()
        return all_to_all_single_autograd(out.contiguous(), self.sent, self.received, self.group)


def _group_rank(group: Any) -> int:
    import torch.distributed as dist

    return int(dist.get_rank(group))


#: bytes put on the wire by every dispatch since the last :func:`take_dispatch_bytes` (benchmarks).
_WIRE = {"bytes": 0, "pairs": 0}


def take_dispatch_bytes() -> tuple[int, int]:
    """(bytes sent by this rank's dispatches, (token, k) pairs dispatched) since the last call."""
    out = (_WIRE["bytes"], _WIRE["pairs"])
    _WIRE["bytes"] = _WIRE["pairs"] = 0
    return out


class ExpertDispatch:
    """One experts module's expert-parallel state: its ``ep`` group, its local expert range, the
    shadow module (the module's own class, ``num_experts = E / ep``) whose forward runs the local
    experts, and the dispatcher factory.

    ``fault``: ``"ep_order"`` (a planted bug for the parity tests) combines the returned rows at the
    positions of the UNSORTED (token, k) pairs: every token gets another pair's expert output.
    """

    def __init__(self, module: nn.Module, group: Any, size: int, rank: int, n_experts: int,
                 dispatcher: Callable[[Any, int], TokenDispatcher] | None = None) -> None:
        self.group, self.size, self.rank, self.n_experts = group, size, rank, n_experts
        self.n_local = n_experts // size
        self.dispatcher = dispatcher or AllToAllDispatcher
        self.fault: str | None = None
        shadow = object.__new__(type(module))
        shadow.__dict__.update(module.__dict__)
        for key, value in list(shadow.__dict__.items()):  # its own registries (hooks, parameters)
            if key.startswith("_") and isinstance(value, dict):
                shadow.__dict__[key] = type(value)(value) if key in ("_modules", "_buffers") else type(value)()
        shadow.__dict__["num_experts"] = self.n_local
        self.shadow = shadow

    def __call__(self, module: nn.Module, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """``hidden [T, H]``, ``top_k_index`` / ``top_k_weights`` ``[T, K]`` -> ``[T, H]`` (the model's
        experts' output for these tokens, all experts included)."""
        T, K = top_k_index.shape
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, k) pairs by expert: by destination rank
        token = torch.arange(T, device=hidden.device).repeat_interleave(K)
        counts = torch.bincount(flat, minlength=self.n_experts)
        dispatcher = self.dispatcher(self.group, self.size)
        received, received_counts = dispatcher.exchange(hidden[token[order]], counts)
        local = torch.arange(self.n_local, device=hidden.device).repeat(self.size)
        local_index = local.repeat_interleave(received_counts.reshape(-1))
        out = self._local_experts(module, received, local_index)
        back = dispatcher.restore(out)
        bytes_sent = getattr(dispatcher, "bytes_sent", 0)
        _WIRE["bytes"] += int(bytes_sent)
        _WIRE["pairs"] += T * K
        weights = top_k_weights.reshape(-1)[order]
        where = token if self.fault == "ep_order" else token[order]
        contrib = (back * weights[:, None]).to(hidden.dtype)
        return torch.zeros_like(hidden).index_add_(0, where, contrib)

    def _local_experts(self, module: nn.Module, rows: Tensor, local_index: Tensor) -> Tensor:
        """The module's own experts forward on ``rows`` with this rank's shards, weight 1 each."""
        shadow = self.shadow
        shadow.__dict__["training"] = module.training
        params = shadow.__dict__["_parameters"]
        for name, param in module._parameters.items():
            params[name] = None if param is None else _local(param)
        ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
        try:
            return shadow.forward(rows, local_index[:, None], ones)
        finally:
            params.clear()


def _local(tensor: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _ep_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    state: ExpertDispatch = self.__dict__[_STATE]
    return state(self, hidden_states, top_k_index, top_k_weights)


_CLASSES: dict[type, type] = {}


def _ep_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (cls,), {"forward": _ep_forward})
    return _CLASSES[cls]


def _is_routed_experts(module: nn.Module) -> bool:
    """A transformers experts module: ``num_experts`` and a parameter ``[num_experts, ...]``, called as
    ``experts(hidden, top_k_index, top_k_weights)`` (the ``use_experts_implementation`` classes)."""
    n = getattr(module, "num_experts", None)
    if not isinstance(n, int) or not hasattr(type(module), "_apply_gate"):
        return False
    return any(p is not None and p.dim() >= 1 and p.shape[0] == n for p in module._parameters.values())


def _shard_module(module: nn.Module, mesh: Any, dispatcher: Any) -> int:
    """Keep this rank's rows of ``module``'s ``[E, ...]`` parameters as ``Shard(0)`` DTensors; swap its
    forward. Returns the elements dropped."""
    from torch.distributed.tensor import DTensor, Shard

    size, rank = mesh.size(), mesh.get_local_rank()
    n = int(module.num_experts)  # type: ignore[arg-type]
    per = n // size
    state = ExpertDispatch(module, mesh.get_group(), size, rank, n, dispatcher)
    dropped = 0
    for name, param in list(module._parameters.items()):
        if param is None or param.dim() < 1 or param.shape[0] != n:
            continue
        rows = param.detach()[rank * per:(rank + 1) * per]
        rows = rows if rows.is_meta else rows.clone()
        shard = DTensor.from_local(rows, mesh, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride())
        module._parameters[name] = nn.Parameter(shard, requires_grad=param.requires_grad)
        dropped += param.numel() - rows.numel()
    module.__dict__[_STATE] = state
    module.__class__ = _ep_class(type(module))
    return dropped


def _ernie_block_forward(self: Any, hidden_states: Tensor, moe_mm_token_type_ids: Tensor | None = None) -> Any:
    """ERNIE 4.5 VL's MoE block with both expert groups called on every rank (a rank without vision
    tokens calls the vision group with none): the exchanges of the ``ep`` peers must pair up. Same
    outputs as the model's own block (the text group gets every token when there are no vision ones)."""
    B, S, H = hidden_states.shape
    shared = self.shared_experts(hidden_states) if self.shared_experts is not None else None
    vision = (moe_mm_token_type_ids.bool() if moe_mm_token_type_ids is not None
              else torch.zeros(B, S, dtype=torch.bool, device=hidden_states.device))
    final = torch.zeros_like(hidden_states)
    logits = torch.zeros(B * S, self.num_experts, device=hidden_states.device, dtype=torch.float)
    router = vision.reshape(-1)[:, None].expand(-1, self.num_experts)
    states = vision[..., None].expand(-1, -1, H)
    final[~states], logits[~router] = self.text_moe(hidden_states[~states])
    final[states], logits[router] = self.vision_moe(hidden_states[states])
    if shared is not None:
        final = final + shared
    return final, logits


def _patch_blocks(module: nn.Module) -> None:
    for sub in module.modules():
        if type(sub).__name__ == "Ernie4_5_VLMoeMoeBlock" and not getattr(sub, "_ppmedia_ep_block", False):
            sub.__dict__["_ppmedia_ep_block"] = True
            sub.forward = _ernie_block_forward.__get__(sub)


def apply_expert_parallel(stages: Sequence[Any], mesh: Any, *,
                          dispatcher: Callable[[Any, int], TokenDispatcher] | None = None) -> int:
    """Shard the routed experts of this rank's stages over the 1-D ``ep`` ``mesh``
    (``pipeline_mesh(..., ep=)["ep"]``) and dispatch their tokens all-to-all (module docstring).

    Call it on every rank, after :func:`~ppmedia.pipeline.apply_tensor_parallel` (the experts stay out
    of the tp plan) and before :func:`~ppmedia.pipeline.apply_fsdp` and the optimizer. Stages on the
    meta device (``stages_from_pretrained(ep_mesh=)``) are sharded before loading.

    Args:
        stages: ``PipelineStage`` objects or stage modules.
        mesh: the ``ep`` mesh; its size must divide every experts module's ``num_experts``.
        dispatcher: ``factory(group, ep_size) -> TokenDispatcher`` per experts call (the seam for
            fused GPU kernels); default :class:`AllToAllDispatcher`.

    Returns:
        The number of experts modules sharded.

    Raises:
        ValueError: the model type is refused, has no routed experts, or its expert count does not
            divide by ``ep`` (:func:`expert_parallel_problem`); the stages are already expert-parallel
            or FSDP2-sharded (apply this first).
    """
    from torch.distributed.fsdp import FSDPModule

    modules = [getattr(s, "submod", s) for s in stages]
    size = mesh.size()
    config = getattr(modules[0], "config", None)
    if config is not None:
        check_expert_parallel(config, size)
    if any(isinstance(m, FSDPModule) for module in modules for m in module.modules()):
        raise ValueError("apply_expert_parallel: the stages are sharded with FSDP2 already; apply expert "
                         "parallelism first")
    count = 0
    for module in modules:
        for sub in list(module.modules()):
            if _STATE in sub.__dict__:
                raise ValueError("apply_expert_parallel: the stages are expert-parallel already")
            if _is_routed_experts(sub):
                if int(sub.num_experts) % size:
                    raise ValueError(f"--ep {size}: {type(sub).__name__} has {sub.num_experts} experts, not "
                                     f"divisible by {size}")
                _shard_module(sub, mesh, dispatcher)
                count += 1
        _patch_blocks(module)
    return count


def expert_shards(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    """The expert shards of ``modules`` (each once), in their order."""
    seen: dict[int, nn.Parameter] = {}
    for module in modules:
        for param in module.parameters():
            if is_expert_shard(param):
                seen.setdefault(id(param), param)
    return list(seen.values())


def set_expert_fault(modules: Sequence[nn.Module], fault: str | None) -> None:
    """Plant (or clear, ``None``) a fault in every experts module's dispatch (parity tests only)."""
    for module in modules:
        for sub in module.modules():
            state = sub.__dict__.get(_STATE)
            if state is not None:
                state.fault = fault


def reduce_expert_parallel_gradients(modules: Sequence[nn.Module], group: Any = None, *, average_over: Any = None) -> None:
    """Sum the expert shards' gradients over ``group``: the ``edp`` ranks holding the same shards
    (``pipeline_mesh(..., ep=)["edp"].get_group()``; ``None`` or a group of one: nothing to do).
    Call it after the step, with :func:`~ppmedia.pipeline.all_reduce_gradients` (which leaves expert
    shards out) or FSDP2 (which ignores them), before clipping.

    ``average_over``: a planted bug for the parity tests: the gradients are AVERAGED over this group
    (the ``ep`` peers) instead.
    """
    import torch.distributed as dist

    from .parallel import _sum_flat

    params = [p for p in expert_shards(modules) if p.requires_grad]
    if not params:
        return
    if average_over is not None:
        _sum_flat(params, average_over, dist)
        for p in params:
            if p.grad is not None:
                _local(p.grad).div_(dist.get_world_size(average_over))
        return
    if group is None or dist.get_world_size(group) == 1:
        return
    _sum_flat(params, group, dist)
