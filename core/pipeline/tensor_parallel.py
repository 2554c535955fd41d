"""Tensor parallelism inside every pipeline stage (``pp x dp x tp``), with DTensor.

:func:`~ppmedia.pipeline.pipeline_mesh` lays ``world = dp x pp x tp`` ranks out as a ``(dp, pp, tp)``
device mesh (``rank = (dp_rank * pp + pp_rank) * tp + tp_rank``: the ``tp`` peers of a stage are
neighbours). :func:`apply_tensor_parallel` then parallelises each stage's language-model layers over
``mesh["tp"]`` with ``parallelize_module``:

* the plan is transformers' own ``base_model_tp_plan`` of the text config (module paths inside the
  language model, ``*`` a decoder layer index), else the family adapter's ``tp_plan(config)``;
  ``colwise`` is ``ColwiseParallel`` (output features sharded), ``rowwise`` is ``RowwiseParallel``
  (input features sharded, the output summed over ``tp``), ``replicated_with_grad_allreduce`` (Gemma 3's
  per-head ``q_norm`` / ``k_norm``) leaves the module whole and sums its gradient over ``tp``;
* the output head, when it is not tied to the embedding, is ``ColwiseParallel`` with its logits
  gathered (``Replicate``): every ``tp`` rank of the last stage computes the loss on whole logits;
  the embedding then is ``RowwiseParallel`` (its table split over the vocabulary, the looked-up rows
  summed over ``tp``); a tied pair stays whole;
* everything else (norms, rotary embeddings, the vision tower and projector) stays whole
  and replicated over ``tp``. What travels between stages stays plain tensors: the parallel modules
  take and give whole (replicated) activations.

The vision tower is replicated, but its work is not repeated: on the first stage microbatch ``k``'s
media are encoded by ``tp`` rank ``k % tp`` only, which broadcasts the features to its peers (one
flat broadcast per microbatch with media, ``[rows, H]`` float32 buffers whose shapes every peer knows
from the chunk's placeholders). The gradient that reaches the features is whole on every peer (the
first colwise layer sums it over ``tp``), and only the encoding rank backpropagates it into the
tower; so each rank's tower gradient is the sum over ITS microbatches, and
:func:`reduce_tensor_parallel_gradients` (after every step, before clipping and the optimizer) SUMS
the tower's gradients over ``tp``, like the replicated-with-all-reduce modules of the plan.

Refused before anything is sharded (:func:`check_tensor_parallel`): attention heads, key/value heads
or (for a sharded head) the vocabulary not divisible by ``tp``; a plan style ppmedia does not map; the
encoder spread (``make_pipeline_stages(..., encoder="spread")``) together with ``tp > 1`` (both split the
first stage's vision work, over ``tp`` and over the pipeline ranks; each ``tp`` column would encode its
share again).

FSDP2 over ``dp`` goes on top: :func:`~ppmedia.pipeline.apply_fsdp` with ``mesh["dp"]`` after this
function (parameters become 2-D ``DTensor`` shards over ``(dp, tp)``; ``full_tensor()`` gathers both).
"""

from __future__ import annotations

import copy
import re
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor, nn

from ..adapters.base import HostValues, VlmAdapter, config_value
from ..chunk import VlmMediaChunk
from .parallel import _sum_flat
from .stages import FEATURES_ATTRIBUTE, StageModule, _text_dims

__all__ = [
    "TP_STYLES",
    "apply_tensor_parallel",
    "check_tensor_parallel",
    "reduce_tensor_parallel_gradients",
    "tensor_parallel_plan",
]

#: the plan styles :func:`apply_tensor_parallel` maps (transformers' names).
TP_STYLES: tuple[str, ...] = ("colwise", "rowwise", "replicated_with_grad_allreduce")
#: the stage module's names of parameters whose gradients :func:`reduce_tensor_parallel_gradients` sums.
_REDUCED = "_ppmedia_tp_reduced"
_GROUP = "_ppmedia_tp_group"


def tensor_parallel_plan(config: Any, adapter: VlmAdapter | None = None) -> dict[str, str]:
    """The language model's plan ``{module path: style}``: the text config's ``base_model_tp_plan``
    (plus the ``replicated_with_grad_allreduce`` entries of ``adapter.tp_plan(config)`` it lacks:
    Qwen3-VL-MoE's per-head ``q_norm`` / ``k_norm``), else ``adapter.tp_plan(config)``, without the entries of MoE routed experts (``mlp.experts``:
    transformers' ``packed_colwise`` / ``moe_tp_experts`` styles). Those experts stay whole on every
    ``tp`` rank: their input is the replicated hidden state, so each rank routes and computes every
    token and gets the experts' whole gradient (no reduction over ``tp``); shared experts and dense
    MLPs are split as the plan says.

    Raises:
        ValueError: neither gives one (the family cannot be tensor-parallel yet: name the adapter).
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    plan = getattr(text, "base_model_tp_plan", None)
    if adapter is None:
        from ..registry import get_adapter

        adapter = get_adapter(config)
    if not plan:
        plan = adapter.tp_plan(config)
    else:  # the adapter's per-head norms the transformers plan lacks (Qwen3-VL-MoE's q_norm / k_norm)
        own = adapter.tp_plan(config) or {}
        plan = {**plan, **{k: s for k, s in own.items() if s == "replicated_with_grad_allreduce" and k not in plan}}
    if not plan:
        raise ValueError(
            f"tensor parallelism: {type(text).__name__} has no base_model_tp_plan and "
            f"{type(adapter).__name__}.tp_plan returns none; give the adapter a tp_plan"
        )
    return {key: style for key, style in plan.items() if not _routed_experts(key)}


def _routed_experts(key: str) -> bool:
    """A plan entry of a MoE block's routed experts (``...mlp.experts``, ``...text_moe.experts.down_proj``;
    not ``shared_experts``): left out, the experts stay whole and replicated over ``tp``."""
    return "experts" in key.split(".")


def check_tensor_parallel(
    config: Any, tp: int, *, adapter: VlmAdapter | None = None, shard_head: bool = True
) -> dict[str, str]:
    """Refuse a model that ``tp`` ranks cannot split; returns its plan (:func:`tensor_parallel_plan`).

    Checks, before anything is built: every style of the plan is one of :data:`TP_STYLES`; the
    attention heads and key/value heads divide by ``tp`` (each rank keeps whole heads); with
    ``shard_head`` and an untied head, the vocabulary divides by ``tp``.

    Raises:
        ValueError: naming the config field, its value and ``tp``.
    """
    if int(tp) < 1:
        raise ValueError(f"tensor parallelism: tp {tp}; expected >= 1")
    plan = tensor_parallel_plan(config, adapter)
    for key, style in plan.items():
        if style not in TP_STYLES:
            raise ValueError(
                f"tensor parallelism: plan entry {key!r} has style {style!r}; expected one of {', '.join(TP_STYLES)}"
            )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(config_value(text, "num_attention_heads"))
    kv = getattr(text, "num_key_value_heads", None)
    fields = {"num_attention_heads": heads, "num_key_value_heads": heads if kv is None else int(kv)}
    if shard_head and not _tied(config):
        fields["vocab_size"] = _text_dims(config)[1]
    for name, value in fields.items():
        if value % tp:
            raise ValueError(
                f"tensor parallelism: {type(text).__name__}.{name} = {value} does not divide by tp = {tp}"
            )
    return plan


def _tied(config: Any) -> bool:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(config, "tie_word_embeddings", None) or getattr(text, "tie_word_embeddings", None))


def _pattern(key: str) -> re.Pattern[str]:
    """A plan key as a regular expression over module names (``*`` one path component)."""
    return re.compile("^" + re.escape(key).replace(r"\*", r"[^.]+") + "$")


def _styles(plan: Mapping[str, str]) -> tuple[dict[str, Any], list[re.Pattern[str]]]:
    """(``parallelize_module`` plan, patterns of the modules left whole with a summed gradient)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    parallel: dict[str, Any] = {}
    reduced = []
    for key, style in plan.items():
        if style == "colwise":
            parallel[key] = ColwiseParallel()
        elif style == "rowwise":
            parallel[key] = RowwiseParallel()
        else:
            reduced.append(_pattern(key))
    return parallel, reduced


def _stage_modules(stages: Sequence[Any]) -> list[StageModule]:
    from .fsdp import is_sharded
    from .stages import stage_modules_of

    modules = stage_modules_of(stages, "apply_tensor_parallel")
    for module in modules:
        if is_sharded(module):
            raise ValueError(f"apply_tensor_parallel: stage {module.stage_index} is sharded with FSDP2 already; "
                             f"apply tensor parallelism first, then apply_fsdp")
        if _REDUCED in module.__dict__:
            raise ValueError(f"apply_tensor_parallel: stage {module.stage_index} is tensor-parallel already")
    return modules


def _head_is_tied(module: StageModule) -> bool:
    names = {f"{module.head_name}.weight"}
    return any(names & set(entry.names) for entry in module.tied)


def apply_tensor_parallel(
    stages: Sequence[Any], mesh: Any, *, plan: Mapping[str, str] | None = None, shard_head: bool = True
) -> list[StageModule]:
    """Parallelise this rank's stage modules over the 1-D ``tp`` ``mesh`` (``pipeline_mesh(...)["tp"]``).

    Call it after :func:`~ppmedia.pipeline.make_pipeline_stages` and before
    :func:`~ppmedia.pipeline.apply_fsdp` and the optimizer; every ``tp`` peer alike. After each
    step call :func:`reduce_tensor_parallel_gradients` (then tied sync, data-parallel reduction, clipping).

    Args:
        stages: this rank's ``PipelineStage`` objects (or their :class:`~ppmedia.pipeline.StageModule`).
        mesh: the tensor-parallel ``DeviceMesh`` (1-D).
        plan: ``{module path in the language model: style}``; default :func:`tensor_parallel_plan`.
        shard_head: shard an untied output head and the embedding over the vocabulary (logits
            gathered, looked-up rows summed); a head tied to the embedding stays whole, and so does
            the embedding.

    Returns:
        The stage modules (the same objects, their listed linears now hold ``DTensor`` parameters).

    Raises:
        ValueError: anything :func:`check_tensor_parallel` refuses; stages already sharded (FSDP2 or
            tensor-parallel); an encoder spread on the stages.
        TypeError: ``stages`` are not ppmedia stages.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    modules = _stage_modules(stages)
    if not modules:
        return modules
    config, tp = modules[0].config, mesh.size()
    if plan is None:
        plan = check_tensor_parallel(config, tp, adapter=modules[0].adapter, shard_head=shard_head)
    if any(FEATURES_ATTRIBUTE in m.__dict__ or _spread_of(m) for m in modules):
        raise ValueError("apply_tensor_parallel: the encoder spread (encoder='spread') does not go with tp > 1: "
                         "both split the first stage's vision work (tp: microbatch k on tp rank k % tp; the "
                         "spread: microbatches over the pipeline ranks), and every tp column would encode its "
                         "share again; build the stages with encoder='stage0'")
    parallel, reduced = _styles(plan)
    for module in modules:
        lm = module.stage_language_model
        names = [f"{module.language_model_path}.{n}.{p}" for n, sub in lm.named_modules()
                 if any(r.match(n) for r in reduced) for p, _ in sub.named_parameters()]
        if parallel:
            parallelize_module(lm, mesh, parallel)
        untied = shard_head and not _head_is_tied(module)
        if module.is_last and untied:
            parallelize_module(module, mesh, {module.head_name: ColwiseParallel(output_layouts=Replicate())})
        if module.is_first and untied:
            embed = next(n for n, m in lm.named_children() if m is lm.get_input_embeddings())
            parallelize_module(lm, mesh, {embed: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())})
        if module.is_first:  # the replicated tower: each microbatch encoded by one tp rank
            names += [n for n, p in module.named_parameters() if not module.is_language_parameter(n)]
            module.__dict__[FEATURES_ATTRIBUTE] = _TensorParallelEncoding(module, mesh.get_group())
        module.__dict__[_REDUCED] = tuple(names)
        module.__dict__[_GROUP] = mesh.get_group()
    return modules


def _spread_of(module: nn.Module) -> bool:
    from .encoder import SPREAD_ATTRIBUTE

    return module.__dict__.get(SPREAD_ATTRIBUTE) is not None


def reduce_tensor_parallel_gradients(modules: Sequence[nn.Module]) -> None:
    """Sum over ``tp`` the gradients of each stage's replicated parameters that get only a share on
    each rank: the first stage's vision side (each rank backpropagates only the microbatches it
    encoded) and the plan's ``replicated_with_grad_allreduce`` modules (each rank's heads only).

    Call it on every rank after each pipeline step (before :func:`~ppmedia.pipeline.sync_tied_gradients`,
    clipping and the optimizer step), with the modules :func:`apply_tensor_parallel` returned. A
    missing gradient counts as zeros. FSDP2 shards (``DTensor`` over ``dp``): their local shards are
    summed (every ``tp`` peer holds the same shard). One flat ``all_reduce`` per dtype; then a
    gradient laid out otherwise than its parameter (the split embedding's partial sum) is
    reduce-scattered to the parameter's shard.
    """
    import torch.distributed as dist

    by_group: dict[int, tuple[Any, dict[torch.dtype, list[nn.Parameter]]]] = {}
    for module in modules:
        names = module.__dict__.get(_REDUCED)
        if names is None:
            raise ValueError(f"reduce_tensor_parallel_gradients: {type(module).__name__} is not tensor-parallel "
                             f"(apply_tensor_parallel)")
        group = module.__dict__[_GROUP]
        params = dict(module.named_parameters(remove_duplicate=False))
        _, by_dtype = by_group.setdefault(id(group), (group, {}))
        for name in names:
            param = params[name]
            if param.requires_grad and all(param is not p for p in by_dtype.get(param.dtype, [])):
                by_dtype.setdefault(param.dtype, []).append(param)
    for group, by_dtype in by_group.values():
        for dtype in sorted(by_dtype, key=str):
            _sum_flat(by_dtype[dtype], group, dist)
    _shard_like_parameters(modules)


def _shard_like_parameters(modules: Sequence[nn.Module]) -> None:
    """Lay each tensor-parallel gradient out like its parameter: the vocabulary-split embedding's
    gradient comes out of backward as a whole-size partial sum over ``tp``; reduce-scattered to the
    parameter's shard it holds 1/tp of the memory (FSDP2 shards are left to FSDP2)."""
    from torch.distributed.tensor import DTensor

    for module in modules:
        for param in module.parameters():
            grad = param.grad
            if (isinstance(param, DTensor) and isinstance(grad, DTensor) and grad.device_mesh == param.device_mesh
                    and grad.placements != param.placements):
                param.grad = grad.redistribute(param.device_mesh, param.placements)


# -- the vision tower's work split over tp ----------------------------------------------------------

class _TensorParallelEncoding:
    """Hung on the first stage (``FEATURES_ATTRIBUTE``): ``adapter_for(k, chunk)`` gives the adapter
    that encodes microbatch ``k`` on ``tp`` rank ``k % tp`` and receives its features elsewhere."""

    def __init__(self, module: StageModule, group: Any) -> None:
        import torch.distributed as dist

        self.module = module
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.hidden = _text_dims(module.config)[0]

    def adapter_for(self, k: int | None, chunk: VlmMediaChunk | None) -> VlmAdapter:
        adapter = self.module.adapter
        if chunk is None:
            return adapter
        proxy = copy.copy(adapter)
        proxy.__class__ = _shared_class(type(adapter))
        proxy.__dict__["_ppmedia_tp_encoding"] = (self, 0 if k is None else int(k) % self.size, adapter)
        return proxy

    def encoder_outputs(self, owner: int, adapter: VlmAdapter, model: nn.Module, chunk: VlmMediaChunk,
                        host: HostValues) -> dict[str, Tensor]:
        """The chunk's encoder outputs on every peer: computed (with their graph) on ``owner``,
        received elsewhere (no graph: the tower's gradient is the owner's)."""
        import torch.distributed as dist

        names = [(name, m) for m in host.totals if host.total(m) for name in adapter.encoder_output_names(model.config, m)]
        shapes = [[host.total(m), self.hidden] for _, m in names]
        src = dist.get_global_rank(self.group, owner)
        if self.rank == owner:
            outputs = adapter.encoder_outputs(model, chunk, host)
            for (name, m), want in zip(names, shapes):
                tensor = outputs.get(name)
                if tensor is None or list(tensor.shape) != want:
                    seen = "missing" if tensor is None else f"shape {list(tensor.shape)}"
                    raise ValueError(f"{type(adapter).__name__}.encoder_outputs: {name!r} is {seen}; expected {want} "
                                     f"(one row per {m} placeholder, the text hidden size)")
            flat = torch.cat([outputs[name].detach().float().reshape(-1) for name, _ in names])
            dist.broadcast(flat, src=src, group=self.group)
            return outputs
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        flat = torch.empty(sum(r * h for r, h in shapes), dtype=torch.float32, device=device)
        dist.broadcast(flat, src=src, group=self.group)
        out, offset = {}, 0
        for (name, _), (r, h) in zip(names, shapes):
            out[name] = flat[offset: offset + r * h].view(r, h)
            offset += r * h
        return out


_SHARED: dict[type, type] = {}


def _shared_class(cls: type) -> type:
    """A subclass of adapter class ``cls`` whose ``encoder_outputs``/``encode`` go through
    :meth:`_TensorParallelEncoding.encoder_outputs` (made once per class)."""
    if cls in _SHARED:
        return _SHARED[cls]

    def encoder_outputs(self: Any, model: nn.Module, chunk: VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        encoding, owner, adapter = self.__dict__["_ppmedia_tp_encoding"]
        return encoding.encoder_outputs(owner, adapter, model, chunk, host)

    def encode(self: Any, model: nn.Module, chunk: VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        return {m: t for m, t in self.encoder_outputs(model, chunk, host).items() if "." not in m}

    made = type(f"TensorParallel{cls.__name__}", (cls,), {"encoder_outputs": encoder_outputs, "encode": encode,
                                                          "__module__": __name__})
    _SHARED[cls] = made
    return made
