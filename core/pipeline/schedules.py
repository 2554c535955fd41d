"""Schedules by torch's own name lookup, and where they place the stages (looped or V-shaped).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from .fsdp import check_fsdp_schedule
from .loss import pipeline_loss

__all__ = [
    "SCHEDULES",
    "SCHEDULE_ALIASES",
    "ScheduleLayout",
    "ShapeFollowingSchedule",
    "build_schedule",
    "schedule_argument",
    "schedule_choices",
    "schedule_layout",
    "schedule_names",
    "stage_indices_for_rank",
]

#: ppmedia's short schedule names with the number of stages each rank holds (every schedule torch
#: ships works too, by its own name: :func:`schedule_names`, :func:`schedule_layout`).
SCHEDULES: dict[str, int] = {"gpipe": 1, "1f1b": 1, "interleaved": 2}



def stage_indices_for_rank(rank: int, world_size: int, stages_per_rank: int = 1, style: str = "loop") -> list[int]:
    """The stages a rank holds, in increasing order.

    ``style="loop"``: stage ``i`` lives on rank ``i % world_size`` (``rank, rank + world_size, ...``),
    the layout of GPipe, 1F1B, Interleaved1F1B, LoopedBFS and InterleavedZeroBubble. ``style="v"``:
    the stages go down the ranks and come back (2 ranks, 4 stages: rank 0 holds 0 and 3, rank 1 holds
    1 and 2), the layout of ZBVZeroBubble and DualPipeV, whose first and last stage share rank 0.
    The mapping is torch's own (``torch.distributed.pipelining._utils.generate_stage_to_rank_mapping``).
    """
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    if not 0 <= rank < world_size or stages_per_rank < 1:
        raise ValueError(
            f"stage_indices_for_rank: got rank {rank}, world_size {world_size}, stages_per_rank "
            f"{stages_per_rank}; expected 0 <= rank < world_size and stages_per_rank >= 1"
        )
    mapping = generate_stage_to_rank_mapping(world_size, world_size * stages_per_rank, style=style)
    return sorted(stage for stage, owner in mapping.items() if owner == rank)


#: ppmedia's short schedule names and the torch schedule each stands for.
SCHEDULE_ALIASES: dict[str, str] = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B"}

#: schedules that torch builds with a V-shaped stage placement (``generate_stage_to_rank_mapping(...,
#: style="v")`` in their ``__init__``); torch exposes the style on no class attribute.
_V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


@dataclass(frozen=True)
class ScheduleLayout:
    """How a torch schedule places stages on the ranks of a pipeline group.

    Attributes:
        name: torch's name of the schedule (``"ZBVZeroBubble"``), as
            ``torch.distributed.pipelining.schedules.get_schedule_class`` takes it.
        schedule_class: the class.
        stages_per_rank: 1 for single-stage schedules (GPipe, 1F1B), else the requested number
            (default 2; V-shaped schedules need exactly 2).
        style: ``"loop"`` or ``"v"`` (see :func:`stage_indices_for_rank`).
    """

    name: str
    schedule_class: type
    stages_per_rank: int
    style: str

    @property
    def multi_stage(self) -> bool:
        """Whether the class takes a list of stages (``PipelineScheduleMulti``) rather than one."""
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle

        return not issubclass(self.schedule_class, PipelineScheduleSingle)

    def n_stages(self, pp_size: int) -> int:
        """The pipeline length on ``pp_size`` ranks."""
        return pp_size * self.stages_per_rank

    def stage_indices(self, pp_rank: int, pp_size: int) -> list[int]:
        """The stages pipeline rank ``pp_rank`` builds, in increasing order."""
        return stage_indices_for_rank(pp_rank, pp_size, self.stages_per_rank, self.style)


def schedule_names() -> list[str]:
    """Every schedule torch ships that :func:`build_schedule` can run (torch's names, e.g. ``GPipe``,
    ``ZBVZeroBubble``): the ``Schedule*`` classes of ``torch.distributed.pipelining.schedules`` that
    its ``get_schedule_class`` knows by name. The abstract bases (``PipelineScheduleSingle``,
    ``PipelineScheduleMulti``) are not schedules and are left out."""
    from torch.distributed.pipelining import schedules

    names = []
    for attr in sorted(vars(schedules)):
        if not attr.startswith("Schedule") or not isinstance(getattr(schedules, attr), type):
            continue
        try:
            if schedules.get_schedule_class(attr[len("Schedule"):]) is getattr(schedules, attr):
                names.append(attr[len("Schedule"):])
        except ValueError:
            continue
    return names



def schedule_choices() -> list[str]:
    """What a ``--schedule`` option accepts (``ppmedia demo``, ``ppmedia plan``): ppmedia's short names
    (:data:`SCHEDULE_ALIASES`), then every schedule torch ships (:func:`schedule_names`)."""
    short = set(SCHEDULE_ALIASES)
    return [*SCHEDULE_ALIASES, *(name for name in schedule_names() if name.lower() not in short)]


def schedule_argument(value: str) -> str:
    """A ``--schedule`` option's type: the canonical spelling of a name given in any case
    (``zbvzerobubble`` -> ``ZBVZeroBubble``); an unknown name comes back unchanged (argparse then
    reports it with the list of choices)."""
    for name in schedule_choices():
        if name.lower() == value.lower():
            return name
    return value

def schedule_layout(name: str, stages_per_rank: int | None = None) -> ScheduleLayout:
    """Resolve a schedule name (ppmedia's short ones or any of torch's, case-insensitive).

    The class comes from torch's own registry (``get_schedule_class``), not a table here.

    Raises:
        ValueError: unknown name (the message lists the known ones); an abstract base class;
            ``stages_per_rank`` other than 1 for a single-stage schedule or other than 2 for a V-shaped one.
    """
    from torch.distributed.pipelining import schedules

    torch_name = SCHEDULE_ALIASES.get(name.lower(), name)
    try:
        cls = schedules.get_schedule_class(torch_name)
    except ValueError:
        known = ", ".join([*SCHEDULE_ALIASES, *schedule_names()])
        raise ValueError(f"schedule: got {name!r}; expected one of {known} (case-insensitive)") from None
    if cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        raise ValueError(
            f"schedule {name!r}: {cls.__name__} is torch's abstract base class, not a schedule (it has no "
            f"order of forwards and backwards to run); pick one of {', '.join(schedule_names())}"
        )
    single = issubclass(cls, schedules.PipelineScheduleSingle)
    style = "v" if cls.__name__ in _V_SHAPED else "loop"
    default = 1 if single else 2
    per_rank = default if stages_per_rank is None else int(stages_per_rank)
    if (single or style == "v") and per_rank != default:
        what = "a single-stage schedule" if single else "a V-shaped schedule"
        raise ValueError(f"schedule {cls.__name__}: stages_per_rank {per_rank}; {what} needs exactly {default}")
    if per_rank < 1:
        raise ValueError(f"schedule {cls.__name__}: stages_per_rank {per_rank}; expected >= 1")
    return ScheduleLayout(cls.__name__[len("Schedule"):], cls, per_rank, style)


def _check_first_stage_order(schedule: Any, name: str) -> None:
    """Refuse a schedule whose first stage does not run its forwards in microbatch order.

    The first stage takes its media by cursor (one chunk per forward, in call order), so microbatch
    ``k``'s forward must be the ``k``-th forward of stage 0. Checked on the schedule's own action
    list (runtime schedules: ``pipeline_order``); single-stage schedules run forwards in order."""
    order = getattr(schedule, "pipeline_order", None)
    if not order:
        return
    seen: list[int] = []

    def visit(action: Any) -> None:
        if action is None:
            return
        for sub in getattr(action, "sub_actions", None) or ():
            visit(sub)
        kind = getattr(getattr(action, "computation_type", None), "value", None)
        if getattr(action, "stage_index", None) == 0 and kind == "F":
            seen.append(action.microbatch_index)

    for rank_actions in order.values():
        for action in rank_actions:
            visit(action)
    if seen != sorted(seen) or len(set(seen)) != len(seen):
        raise ValueError(
            f"schedule {name}: the first stage runs its forwards in microbatch order {seen}; staged media "
            f"are handed out by a cursor in call order, so they would reach the wrong microbatch"
        )


def build_schedule(
    name: str,
    stages: Sequence[Any],
    n_microbatches: int,
    loss_fn: Callable[..., Tensor] | None = None,
    **schedule_kwargs: Any,
) -> Any:
    """A ``torch.distributed.pipelining`` schedule by name.

    ``name`` is one of ppmedia's short names (``gpipe``, ``1f1b``, ``interleaved``) or any schedule
    torch ships, case-insensitively (``GPipe``, ``1F1B``, ``Interleaved1F1B``, ``LoopedBFS``,
    ``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV``: :func:`schedule_names`). ``stages``
    are this rank's ``PipelineStage`` objects, built for the indices of :func:`schedule_layout`
    (``layout.stage_indices(pp_rank, pp_size)``). Extra keyword arguments go to the schedule class.

    Gradients are not scaled by the number of microbatches (``scale_grads=False``):
    :func:`pipeline_loss` already divides by the valid tokens of the whole batch.

    The schedule is torch's class with two changes (a subclass, :class:`ShapeFollowingSchedule`):

    * a ``step()``/``eval()`` whose tensors (``input_ids``, ``attention_mask``, ``target``) have other
      shapes than the previous step's (a batch of another sequence length ``S``) re-initialises the
      stages for them: static ``input_args``/``output_args`` are rebuilt for the new ``(b, S)``
      (:func:`~ppmedia.pipeline.static_stage_args`), inferred shapes are inferred again. No stage is
      rebuilt. Pass the batch on every rank (as the examples do): a rank that passes no tensor cannot
      see the change.
    * re-initialisation (a new shape, or a switch between ``step()`` and ``eval()``) keeps every
      parameter's gradient: torch's stage clean-up after shape inference sets the gradients of
      FSDP2 stages to ``None``, which would silently drop the gradients accumulated over earlier
      ``step()`` calls before one optimizer step (NeMo Automodel's issue 3530).

    Raises:
        ValueError: unknown or abstract schedule; stages that do not match the schedule's placement;
            a schedule whose first stage would run microbatches out of order (the media cursor
            would hand them the wrong media); FSDP2 stages with a schedule that cannot run them
            (:func:`~ppmedia.pipeline.check_fsdp_schedule`); torch's own checks (e.g. too few
            microbatches).
    """
    if not stages:
        raise ValueError("build_schedule: got no stages; expected this rank's PipelineStage objects")
    layout = schedule_layout(name, len(stages))
    pp_rank, pp_size = stages[0].group_rank, stages[0].group_size
    got = [int(st.stage_index) for st in stages]
    want = layout.stage_indices(pp_rank, pp_size)
    if got != want or stages[0].num_stages != layout.n_stages(pp_size):
        raise ValueError(
            f"schedule {layout.name}: pipeline rank {pp_rank} of {pp_size} holds stages {got} of "
            f"{stages[0].num_stages}; this schedule places stages {want} of {layout.n_stages(pp_size)} on it "
            f"({layout.style} layout, {layout.stages_per_rank} per rank): build them with "
            f"schedule_layout({name!r}).stage_indices(pp_rank, pp_size)"
        )
    loss_fn = pipeline_loss if loss_fn is None else loss_fn
    target = list(stages) if layout.multi_stage else stages[0]
    schedule = _following_shapes(layout.schedule_class)(
        target, n_microbatches, loss_fn=loss_fn, scale_grads=False, **schedule_kwargs
    )
    check_fsdp_schedule(schedule, stages)  # reads each module's FSDP2 state (sharded by anyone)
    mapping = getattr(schedule, "stage_index_to_group_rank", None) or {}
    wrong = [i for i in got if i in mapping and mapping[i] != pp_rank]
    if wrong:  # the class placed them elsewhere than schedule_layout predicted
        raise ValueError(
            f"schedule {layout.name}: the schedule puts stages {wrong} on other ranks "
            f"({mapping}); rank {pp_rank} built them"
        )
    _check_first_stage_order(schedule, layout.name)
    return schedule


class ShapeFollowingSchedule:
    """Mixed into every schedule :func:`build_schedule` makes (before torch's class in the MRO).

    Follows the batch's shapes from step to step and keeps gradients across torch's stage
    re-initialisation; see :func:`build_schedule`. Use it as torch's schedule: ``step``, ``eval``.
    """

    _ppmedia_shapes: tuple[tuple[int, ...], ...] | None = None

    def step(self, *args: Any, target: Any = None, **kwargs: Any) -> Any:
        arg_mbs, target_mbs = kwargs.get("arg_mbs"), kwargs.get("target_mbs")
        if arg_mbs is not None or target_mbs is not None:  # pre-split: microbatch 0's shapes, times n
            self._ppmedia_follow(_presplit_shapes(arg_mbs, target_mbs, int(self._n_microbatches)))  # type: ignore[attr-defined]
        else:
            self._ppmedia_follow([tuple(t.shape) for t in (*args, target) if isinstance(t, Tensor)])
        return super().step(*args, target=target, **kwargs)  # type: ignore[misc]

    def _initialize_pp_stages(self, stages: Sequence[Any], *args: Any, **kwargs: Any) -> Any:
        saved = [(p, p.grad) for st in stages for p in st.submod.parameters()]
        try:
            return super()._initialize_pp_stages(stages, *args, **kwargs)  # type: ignore[misc]
        finally:
            for param, grad in saved:
                param.grad = grad

    def _ppmedia_follow(self, shapes: Sequence[tuple[int, ...]]) -> None:
        """Re-initialise the stages when the step's whole-batch tensor shapes differ from the last step's."""
        if not shapes:
            return
        key = tuple(shapes)
        if key != self._ppmedia_shapes:
            batch = next((s for s in key if len(s) == 2), None)
            # the first step too: static shapes given for another S than the first batch's
            _reinitialise(self, None if batch is None else (batch[0], batch[1]))
        self._ppmedia_shapes = key


def _presplit_shapes(arg_mbs: Any, target_mbs: Any, n: int) -> list[tuple[int, ...]]:
    """The whole-batch shapes of pre-split inputs (microbatch 0's, ``n`` times the rows); ``ValueError``
    when the microbatches' tensors differ in shape (torch sizes every microbatch's activations from
    microbatch 0's)."""
    def shapes(k: int) -> list[tuple[int, ...]]:
        args = arg_mbs[k] if arg_mbs is not None and isinstance(arg_mbs[k], tuple) else ()
        target = target_mbs[k] if target_mbs is not None else None
        return [tuple(t.shape) for t in (*args, target) if isinstance(t, Tensor)]

    lists = [m for m in (arg_mbs, target_mbs) if m is not None]
    if not all(isinstance(m, list) and len(m) == n for m in lists):
        return []  # torch's own checks name what is wrong
    count = n
    first = shapes(0)
    for k in range(1, count):
        if shapes(k) != first:
            raise ValueError(
                f"schedule: pre-split microbatch {k} has tensors of shapes {shapes(k)}; microbatch 0's are {first} "
                f"(every microbatch of a step must have the same shapes: torch sizes its receive buffers once)"
            )
    return [(s[0] * n, *s[1:]) if s else s for s in first]


def _reinitialise(schedule: Any, batch_shape: tuple[int, int] | None) -> None:
    """Make the next step initialise the stages again, static shapes rebuilt for ``(B, S)``."""
    stages = list(getattr(schedule, "_stages", None) or [schedule._stage])
    for stage in stages:
        meta = getattr(stage, "_user_meta", None)
        if meta is None or not meta.is_complete_for_forward():
            continue
        if batch_shape is None:
            raise ValueError(
                f"schedule: the step's tensors changed shape, but none is [B, S]; stage {stage.stage_index} has "
                f"static input_args/output_args that ppmedia rebuilds from (B, S)"
            )
        _restatic(schedule, stage, *batch_shape)
    for flag in ("_stage_forward_initialized", "_stage_backward_initialized",
                 "_stages_forward_initialized", "_stages_backward_initialized"):
        if hasattr(schedule, flag):
            setattr(schedule, flag, False)


def _restatic(schedule: Any, stage: Any, batch_size: int, seq_len: int) -> None:
    """Replace ``stage``'s static shapes by those of ``(batch_size, seq_len)`` (when they differ)."""
    from torch.distributed.pipelining._utils import _StageMeta, extract_tensor_metas

    from .stages import static_stage_args

    n = int(schedule._n_microbatches)
    if batch_size % n:
        raise ValueError(
            f"schedule: a batch of {batch_size} rows cannot make {n} equal microbatches (stage "
            f"{stage.stage_index} has static shapes)"
        )
    metas = [m for m in (*stage._user_meta.inputs, *stage._user_meta.outputs) if m.dtype.is_floating_point]
    dtype = metas[0].dtype if metas else torch.float32
    # metadata only (shapes, dtypes): on the meta device, so a [b, S, vocab] logits example costs no memory
    inputs, outputs = static_stage_args(stage.submod, batch_size // n, seq_len, dtype=dtype, device="meta")
    new_inputs, new_outputs = extract_tensor_metas(inputs) or (), extract_tensor_metas(outputs) or ()
    old = stage._user_meta
    if [m.shape for m in (*old.inputs, *old.outputs)] != [m.shape for m in (*new_inputs, *new_outputs)]:
        stage._user_meta = _StageMeta(inputs=tuple(new_inputs), outputs=tuple(new_outputs))


_FOLLOWING: dict[type, type] = {}


def _following_shapes(cls: type) -> type:
    """``cls`` with :class:`ShapeFollowingSchedule` mixed in (one subclass per torch class)."""
    if cls not in _FOLLOWING:
        _FOLLOWING[cls] = type(cls.__name__, (ShapeFollowingSchedule, cls), {"__module__": __name__})
    return _FOLLOWING[cls]
