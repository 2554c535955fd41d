"""FSDP2 (``torch.distributed.fsdp.fully_shard``) inside every pipeline stage, over the data-parallel mesh.

:func:`apply_fsdp` shards each of a rank's stage modules over the ``dp`` dimension of a ``(dp, pp)``
device mesh: one FSDP group per decoder layer, and the stage root (embedding, vision tower, projector,
final norm, ``lm_head``, whatever the stage holds besides its decoder layers) as the last group. Every
parameter, gradient and optimizer state is then held as a ``DTensor`` shard (``Shard(0)``) at rest;
``param.full_tensor()`` / ``param.grad.full_tensor()`` gather the whole tensor (a collective over the
``dp`` group: every replica of the pipeline rank calls it, in the same order).

Why the vision tower is part of the stage root's group, not one group per vision block: a replica
whose microbatch holds no image skips the tower. Per-block groups would then all-gather (forward) and
reduce-scatter (backward) on some replicas and not on others, and a gloo/NCCL collective issued on one
replica only pairs with the next unrelated collective of the others (a deadlock or silently wrong
data). The stage root runs on every microbatch of every replica, so its all-gather is uniform, and
before the step's reduce-scatter every parameter that got no gradient on a replica gets a zero one
(in the dtype FSDP2 accumulates in: with a mixed-precision policy torch's own zero fill,
``set_reduce_scatter_unused_params``, would mix bfloat16 zeros with float32 sums and fail). Under a pipeline schedule torch keeps every group unsharded from its
first use until the step's last backward (``PipelineStage`` runs the backward without gradient sync
and reduce-scatters once, in ``perform_reduce_grad``), so grouping the tower with the root costs no
memory during the step; at rest the tower is sharded like everything else.

With the encoder spread (``make_pipeline_stages(..., encoder="spread")``) the first stage's vision
side is left out of its FSDP2 group (``ignored_params``): it stays whole and replicated over the
replicas, which the spread needs (it broadcasts whole weights to the other pipeline ranks and runs the
tower outside the stage's forward); the spread sums its gradients over the replicas itself
(:meth:`~ppmedia.pipeline.EncoderSpread.shard_over`).

Gradients are summed over the replicas, not averaged (``set_gradient_divide_factor(1.0)`` with
``set_force_sum_reduction_for_comms(True)``, which gloo needs): :func:`~ppmedia.pipeline.pipeline_loss`
divides by the GLOBAL batch's valid tokens, so the sum is the full batch's gradient. Do not call
:func:`~ppmedia.pipeline.all_reduce_gradients` on sharded stages (it refuses ``DTensor`` gradients);
:func:`~ppmedia.pipeline.sync_tied_gradients` and :func:`~ppmedia.pipeline.clip_grad_norm` work on them.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

__all__ = [
    "SPLIT_BACKWARD_RESHARD_REASON",
    "apply_fsdp",
    "check_fsdp_schedule",
    "is_sharded",
    "reshards_after_forward",
    "splits_backward",
]

#: why :func:`check_fsdp_schedule` refuses a split-backward schedule for stages whose FSDP2 groups
#: reshard after forward.
SPLIT_BACKWARD_RESHARD_REASON = (
    "it splits each backward into an input part and a weight part, and with FSDP2 groups resharded "
    "after their forward (apply_fsdp(reshard_after_forward=True)) the weight part computed wrong "
    "gradients (measured on Qwen2.5-VL at pp=2 x dp=2: decoder gradients off by 0.14 under "
    "ZBVZeroBubble and InterleavedZeroBubble, by 0.05 under DualPipeV, nothing raised); shard with "
    "reshard_after_forward=False (the default) or use a full-backward schedule (GPipe, 1F1B, "
    "Interleaved1F1B, LoopedBFS)"
)


def splits_backward(schedule: Any) -> bool:
    """Whether ``schedule`` runs input and weight backwards separately (its action list holds ``I``
    actions: InterleavedZeroBubble, ZBVZeroBubble, DualPipeV in torch 2.13)."""
    order = getattr(schedule, "pipeline_order", None) or {}
    return any(
        getattr(getattr(a, "computation_type", None), "value", None) == "I"
        for actions in order.values() for a in actions if a is not None
    )


def reshards_after_forward(module: nn.Module) -> bool:
    """Whether an FSDP2 group inside ``module`` frees its gathered parameters after its forward, read
    from torch's own FSDP state (however the module was sharded: :func:`apply_fsdp`, or
    ``fully_shard`` called directly, whose default ``reshard_after_forward=None`` means ``True`` for
    every group but the root).

    Per group, torch keeps ``post_forward_mesh_info`` (``None``: the parameters stay gathered after
    the forward); ``set_reshard_after_forward`` changes it. The stage root sharded with the default
    is skipped: torch turns its resharding off when it finds it is the root (at its first forward).
    """
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        state = sub._get_fsdp_state()
        if sub is module and getattr(state, "_auto_reshard_after_forward", False):
            continue
        for group in getattr(state, "_fsdp_param_groups", None) or ():
            if getattr(group, "post_forward_mesh_info", None) is not None:
                return True
    return False


def check_fsdp_schedule(schedule: Any, stages: Sequence[Any]) -> None:
    """Refuse, with the reason, a built schedule that cannot run these FSDP2 stages.

    Every torch schedule runs stages sharded by :func:`apply_fsdp` with its default
    ``reshard_after_forward=False``. A split-backward schedule (:func:`splits_backward`) is refused
    for stages holding any FSDP2 group that reshards after its forward (:func:`reshards_after_forward`,
    read from torch's state, not from how ppmedia sharded it: :data:`SPLIT_BACKWARD_RESHARD_REASON`).
    :func:`~ppmedia.pipeline.build_schedule` calls it for every schedule.

    Raises:
        ValueError: the schedule and the stages' sharding do not go together.
    """
    if not splits_backward(schedule):
        return
    modules = [getattr(s, "submod", s) for s in stages]
    resharding = [m for m in modules if isinstance(m, nn.Module) and reshards_after_forward(m)]
    if resharding:
        name = type(schedule).__name__.removeprefix("Schedule")
        indices = [getattr(m, "stage_index", "?") for m in resharding]
        raise ValueError(f"schedule {name} cannot run FSDP2 stages {indices}: {SPLIT_BACKWARD_RESHARD_REASON}")


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` (a stage module) was sharded with FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _modules_of(stages: Sequence[Any]) -> list[Any]:
    from .stages import stage_modules_of

    modules = stage_modules_of(stages, "apply_fsdp")
    for module in modules:
        if is_sharded(module):
            raise ValueError(f"apply_fsdp: stage {module.stage_index} is already sharded with FSDP2")
    return modules


def _untie_across_modules(modules: Sequence[nn.Module]) -> int:
    """Give each module its own copy of a parameter it shares with an EARLIER module of this rank.

    A V-shaped schedule puts the first and the last stage on one rank; with a tied embedding both then
    hold one parameter object, which two FSDP roots cannot share. The copies start equal, get their
    own gradient shares (summed by :func:`~ppmedia.pipeline.sync_tied_gradients`) and stay equal.
    Returns the number of parameters copied.
    """
    owner: dict[int, int] = {}
    copied = 0
    for index, module in enumerate(modules):
        clones: dict[int, nn.Parameter] = {}
        for sub in module.modules():
            for name, param in list(sub._parameters.items()):
                if param is None:
                    continue
                first = owner.setdefault(id(param), index)
                if first == index and id(param) not in clones:
                    continue
                if id(param) not in clones:
                    clones[id(param)] = nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)
                    copied += 1
                sub._parameters[name] = clones[id(param)]
        for clone in clones.values():
            owner[id(clone)] = index
    return copied


def _fsdp_params(module: nn.Module) -> list[Any]:
    """The FSDP2 parameter records of every group in ``module`` (torch internals, read only here)."""
    from torch.distributed.fsdp import FSDPModule

    records = []
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            for group in sub._get_fsdp_state()._fsdp_param_groups:
                records.extend(group.fsdp_params)
    return records


def _accumulate(module: nn.Module) -> None:
    """Fold every gathered parameter's new gradient into FSDP2's accumulated one, in the reduce dtype.

    FSDP2 does this in a group's post-backward hook, which autograd runs only for groups whose
    forward inputs require grad: not for stage 0's root (its inputs are token ids), and not for a
    group whose forward did not run (the vision tower on a text-only microbatch). Left alone, such a
    group ends the step with some gradients in bfloat16 and others already accumulated in float32,
    and FSDP2's reduce-scatter refuses mixed dtypes ("expects uniform gradient dtype").
    """
    for record in _fsdp_params(module):
        param = getattr(record, "_unsharded_param", None)
        if param is None:
            continue
        if record.unsharded_accumulated_grad is not None and param.grad is not None:
            record.unsharded_accumulated_grad += param.grad
            param.grad = None
        record.to_accumulated_grad_if_needed()


def _zero_fill(module: nn.Module) -> None:
    """Give every trainable gathered parameter without a gradient a zero one, in the dtype the others
    are held in, so every replica reduce-scatters the same tensors (a replica whose microbatches had no
    image has no vision-tower gradient; FSDP2's own zero fill uses the parameter dtype, which breaks
    mixed precision)."""
    for record in _fsdp_params(module):
        param = getattr(record, "_unsharded_param", None)
        if param is None or not record.sharded_param.requires_grad:
            continue
        if record.unsharded_accumulated_grad is not None or param.grad is not None:
            continue
        reduce_dtype = record.reduce_dtype
        if reduce_dtype is not None and reduce_dtype != param.dtype:
            record.unsharded_accumulated_grad = torch.zeros_like(param, dtype=reduce_dtype)
        else:
            param.grad = torch.zeros_like(param)


def _keep_gradients_uniform(stage: Any, module: nn.Module) -> None:
    """Wrap ``stage``'s backward and gradient reduction (``PipelineStage`` methods) with
    :func:`_accumulate` and :func:`_zero_fill`."""
    backward = stage.backward_maybe_with_nosync
    reduce = stage.perform_reduce_grad

    def backward_then_accumulate(*args: Any, **kwargs: Any) -> Any:
        result = backward(*args, **kwargs)
        _accumulate(module)
        return result

    def uniform_then_reduce(*args: Any, **kwargs: Any) -> Any:
        _accumulate(module)
        _zero_fill(module)
        return reduce(*args, **kwargs)

    stage.backward_maybe_with_nosync = backward_then_accumulate
    stage.perform_reduce_grad = uniform_then_reduce


def _expert_shards(module: nn.Module) -> set[nn.Parameter]:
    """Expert shards (:func:`~ppmedia.pipeline.apply_expert_parallel`): left out of FSDP2 (already
    split over ``ep``; their gradients summed over ``edp`` by ``reduce_expert_parallel_gradients``)."""
    from .expert_parallel import is_expert_shard

    return {p for p in module.parameters() if is_expert_shard(p)}


def _spread_vision(module: nn.Module, mesh: Any) -> set[nn.Parameter]:
    """With the encoder spread (``make_pipeline_stages(..., encoder="spread")``): the first stage's
    vision parameters, which stay whole (:meth:`~ppmedia.pipeline.EncoderSpread.shard_over`)."""
    from .encoder import SPREAD_ATTRIBUTE

    spread = module.__dict__.get(SPREAD_ATTRIBUTE)
    if spread is None or spread.vision is not module:
        return set()
    return spread.shard_over(mesh)


def _policies(mixed_precision: Any) -> tuple[Any, Any]:
    """(policy of the decoder layers, policy of the stage root) for ``mixed_precision``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mixed_precision is None:
        return MixedPrecisionPolicy(), MixedPrecisionPolicy()
    if isinstance(mixed_precision, torch.dtype):
        mixed_precision = MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32)
    if not isinstance(mixed_precision, MixedPrecisionPolicy):
        raise TypeError(
            f"apply_fsdp: mixed_precision is a {type(mixed_precision).__name__}; expected None, a torch.dtype "
            f"(the compute dtype) or a torch.distributed.fsdp.MixedPrecisionPolicy"
        )
    root = MixedPrecisionPolicy(
        param_dtype=mixed_precision.param_dtype,
        reduce_dtype=mixed_precision.reduce_dtype,
        # what travels between stages (and the logits) stays in the parameters' own dtype, so the
        # stages' static input_args/output_args and the loss are the same as without the policy
        output_dtype=mixed_precision.output_dtype or torch.float32,
        cast_forward_inputs=mixed_precision.cast_forward_inputs,
    )
    return mixed_precision, root


def apply_fsdp(
    stages: Sequence[Any],
    mesh: Any,
    *,
    mixed_precision: Any = None,
    reshard_after_forward: bool = False,
) -> list[Any]:
    """Shard this rank's stage modules with FSDP2 over the data-parallel ``mesh``.

    Call it after :func:`~ppmedia.pipeline.make_pipeline_stages` (the ``PipelineStage`` objects keep
    their modules: ``fully_shard`` changes a module in place) and before building the optimizer (the
    parameters become ``DTensor`` shards). Every replica of the pipeline rank must call it alike.

    Args:
        stages: this rank's ``PipelineStage`` objects (or their :class:`~ppmedia.pipeline.StageModule`).
        mesh: the data-parallel ``DeviceMesh``: ``mesh["dp"]`` of a ``(dp, pp)`` mesh (1-D: FSDP), or a
            2-D ``(dp_replicate, dp_shard)`` mesh (HSDP: replicated across the first dimension,
            sharded across the second; not tested here: it needs 8 processes with pp=2).
        mixed_precision: ``None`` (compute in the parameters' dtype), a ``torch.dtype`` such as
            ``torch.bfloat16`` (compute in it, reduce gradients and keep master weights in float32),
            or a ``torch.distributed.fsdp.MixedPrecisionPolicy``. The stage root's outputs are cast
            back to float32 (``output_dtype``) unless the policy names another output dtype.
        reshard_after_forward: free each decoder layer's gathered parameters after its forward (and
            gather again in backward). Default ``False``, as torchtitan does under pipeline parallelism:
            every microbatch would otherwise gather every layer twice. ``True`` does not go with a
            split-backward schedule (:func:`check_fsdp_schedule` refuses it).

    Returns:
        The stage modules, sharded (the same objects; their class is now an ``FSDPModule`` subclass).

    Raises:
        TypeError: ``stages`` are not ppmedia stages; a bad ``mixed_precision``.
        ValueError: a stage is already sharded.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    modules = _modules_of(stages)
    layer_policy, root_policy = _policies(mixed_precision)
    _untie_across_modules(modules)
    for module in modules:
        for layer in module.stage_language_model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=layer_policy, reshard_after_forward=reshard_after_forward,
                        ignored_params=_expert_shards(layer) or None)
        fully_shard(module, mesh=mesh, mp_policy=root_policy, reshard_after_forward=reshard_after_forward,
                    ignored_params=(_spread_vision(module, mesh) | _expert_shards(module)) or None)
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                # a sum over replicas (the loss is a share of the global mean), as plain sums on the wire
                sub.set_gradient_divide_factor(1.0)
                sub.set_force_sum_reduction_for_comms(True)
                # a replica without images leaves the vision tower without gradients: reduce zeros then
                sub.set_reduce_scatter_unused_params(True, recurse=False)
    for stage, module in zip(stages, modules):
        if stage is not module and hasattr(stage, "perform_reduce_grad"):
            _keep_gradients_uniform(stage, module)
    return modules
