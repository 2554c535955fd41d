"""One rank's pipeline for a parity scenario: its stages (cut from the tiny model, or loaded from a
checkpoint of it), tensor parallelism, FSDP2, packing (and its planted faults), the schedule, the
optimizers, and the single-process reference model beside them."""

from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from .batches import _build_batch, _pipeline_batch
from .groups import _Groups
from .probes import _PositionCheck
from .scenarios import Scenario, _Job


@dataclass
class _Built:
    """One rank's pipeline for one scenario, and its single-process reference."""

    stages: list[Any]
    modules: list[Any]
    schedule: Any
    first: Any
    tied: list[Any]
    owned: dict[str, tuple[torch.nn.Parameter, bool]]
    optimizer: Any
    reference: torch.nn.Module
    ref_optimizer: Any
    n_stages: int
    layers_per_stage: list[int]
    indices: list[int]
    positions: _PositionCheck | None = None


def _plant_packing_fault(fault: str | None, modules: Sequence[Any]) -> None:
    """:data:`PACKED_FAULTS`: break the packed stages on purpose (see :data:`FAULTS`)."""
    from ...packing import isolate, sample_positions

    for module in modules:
        if fault == "packed_positions":
            adapter = copy.copy(module.adapter)
            carried = any(w.name == "position_ids" for w in adapter.wire_tensors(module.config, 0))

            def whole_row(model: Any, segments: torch.Tensor, input_ids: Any = None, chunk: Any = None,
                          _a: Any = adapter, _carried: bool = carried) -> Any:
                valid = segments.ne(0).to(segments.dtype)
                if not _carried:
                    return sample_positions(valid)
                return None if input_ids is None else _a.position_ids(model, input_ids, chunk, valid)

            adapter.packed_position_ids = whole_row
            module.adapter = adapter
        elif fault == "packed_leak":
            def leak(kwargs: dict[str, Any], hidden: torch.Tensor, segments: torch.Tensor,
                     _orig: Any = module._isolate_samples, _m: Any = module) -> None:
                before = kwargs["attention_mask"]
                _orig(kwargs, hidden, segments)
                merged = segments.clone()
                merged[0][merged[0] == 2] = 1
                kwargs["attention_mask"] = isolate(_m.config, hidden, before, merged)

            module._isolate_samples = leak


def _stages(
    scenario: Scenario, pristine: torch.nn.Module, n_stages: int, indices: list[int], g: _Groups,
    layers_per_stage: list[int], static: tuple[int, int] | None, checkpoint: str | None,
) -> tuple[list[Any], list[Any]]:
    """This rank's PipelineStages and the tied parameter groups: cut from a copy of ``pristine``, or
    loaded from ``checkpoint`` (the ``pretrained`` scenarios)."""
    from ...pipeline import make_pipeline_stages, stages_from_pretrained, tied_parameters

    if scenario.pretrained:
        assert checkpoint is not None
        dtype = torch.bfloat16 if scenario.dtype == "bfloat16" else None
        tp_mesh = g.mesh["tp"] if scenario.tp > 1 else None  # tensor-parallel as loaded: each rank its shards
        ep_mesh = g.mesh["ep"] if scenario.ep > 1 else None  # expert-parallel as loaded: each rank its experts
        with _counted_reads() as read:
            modules = stages_from_pretrained(checkpoint, n_stages, stages=indices, layers_per_stage=layers_per_stage,
                                             dtype=dtype, tp_mesh=tp_mesh, ep_mesh=ep_mesh)
        modules[0].__dict__[_READ_ATTRIBUTE] = read[0]
        stages = make_pipeline_stages(modules, n_stages, indices, "cpu", group=g.pp_group, static_microbatch=static)
        return stages, list(modules[0].tied)
    model = copy.deepcopy(pristine)
    if scenario.dtype == "bfloat16" and not scenario.fsdp:  # with FSDP2: its mixed-precision policy
        model.to(torch.bfloat16)
    if scenario.checkpointing:
        enable: Any = getattr(model, "activation_checkpointing_enable", None) or getattr(model, "gradient_checkpointing_enable")
        enable()
        model.train()
    tied = tied_parameters(model)
    stages = make_pipeline_stages(
        model, n_stages, indices, "cpu", group=g.pp_group, layers_per_stage=layers_per_stage, static_microbatch=static,
        encoder=scenario.encoder,
    )
    return stages, tied  # the model itself is dropped: this rank keeps only its stages' modules


#: the first stage module's record of the checkpoint elements its rank read (``pretrained`` scenarios).
_READ_ATTRIBUTE = "_ppmedia_parity_elements_read"


@contextlib.contextmanager
def _counted_reads() -> Iterator[list[int]]:
    """Inside the block, the elements :func:`~ppmedia.pipeline.stages_from_pretrained` reads from
    the checkpoint's safetensors slices (``slice[index]``), summed into the yielded list's one item."""
    from ...pipeline import pretrained

    read = [0]
    original = pretrained.open_tensors

    class _Counted:
        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def __getitem__(self, index: Any) -> Any:
            out = self._inner[index]
            read[0] += int(out.numel())
            return out

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

    @contextlib.contextmanager
    def counted(checkpoint: Any, names: Any) -> Iterator[dict[str, Any]]:
        with original(checkpoint, names) as slices:
            yield {k: _Counted(v) for k, v in slices.items()}

    pretrained.open_tensors = counted
    try:
        yield read
    finally:
        pretrained.open_tensors = original


def _local_elements(modules: Sequence[Any]) -> int:
    """Elements of the stages' persistent tensors this rank holds (a ``DTensor``'s local shard)."""
    from torch.distributed.tensor import DTensor

    state = {n: t for m in modules for n, t in m.state_dict(keep_vars=True).items()}
    return sum(int((t.to_local() if isinstance(t, DTensor) else t).numel()) for t in
               {id(t): t for t in state.values()}.values())


def _export_round_trip(built: "_Built", g: _Groups, checkpoint: str) -> float:
    """``save_pretrained_stages`` from the (tensor-parallel) stages as loaded, beside ``checkpoint``;
    rank 0 reloads it with ``from_pretrained``: the largest difference to the checkpoint's model
    (every rank gets it)."""
    import shutil

    import torch.distributed as dist

    from ...pipeline import save_pretrained_stages

    out = checkpoint.rstrip(os.sep) + "-export"
    save_pretrained_stages(built.modules, out, group=g.pp_group)
    dist.barrier()
    diff = torch.zeros((), dtype=torch.float64)
    if dist.get_rank() == 0:
        model_class: Any = type(built.reference)
        exported = model_class.from_pretrained(out).state_dict()
        want = built.reference.state_dict()
        if set(exported) != set(want):
            diff.fill_(float("inf"))
        else:
            diff.fill_(max(float((exported[k].double() - want[k].double()).abs().max()) for k in want if want[k].numel()))
        shutil.rmtree(out)
    dist.all_reduce(diff)  # max of one non-zero entry: a sum
    return float(diff)


def _loaded(built: "_Built", scenario: Scenario, g: _Groups, checkpoint: str | None) -> dict[str, Any]:
    """``pretrained`` scenarios: the elements this rank read and holds; with ``tp > 1`` (before any
    step) the export round trip's largest difference to the checkpoint's model."""
    if not scenario.pretrained:
        return {}
    loaded = {"elements_read": built.modules[0].__dict__.get(_READ_ATTRIBUTE), "elements_held": _local_elements(built.modules)}
    if scenario.tp > 1:
        assert checkpoint is not None
        loaded["export_diff"] = _export_round_trip(built, g, checkpoint)
    return loaded


def _build(
    scenario: Scenario, job: _Job, g: _Groups, pristine: torch.nn.Module, tiny_module: Any, checkpoint: str | None = None
) -> _Built:
    from ...pipeline import build_schedule, default_layer_split, find_language_model, schedule_layout

    layout = schedule_layout(scenario.schedule)
    n_stages = layout.n_stages(g.pp)
    _, lm = find_language_model(pristine)
    if scenario.layers is not None:
        layers_per_stage = list(scenario.layers)
    else:
        layers_per_stage = default_layer_split(len(lm.layers), n_stages)
    indices = layout.stage_indices(g.pp_rank, g.pp)
    B, S = _pipeline_batch(scenario, _build_batch(tiny_module, scenario, job.seed), pristine.config)["input_ids"].shape
    n = scenario.microbatches or job.n_microbatches
    static = (B // g.dp // n, S) if scenario.shapes == "static" else None
    stages, tied = _stages(scenario, pristine, n_stages, indices, g, layers_per_stage, static, checkpoint)
    if scenario.tp > 1 and not scenario.pretrained:  # stages_from_pretrained(tp_mesh=) made them so
        from ...pipeline import apply_tensor_parallel

        apply_tensor_parallel(stages, g.mesh["tp"])
    if scenario.ep > 1 and not scenario.pretrained:  # stages_from_pretrained(ep_mesh=) made them so
        from ...pipeline import apply_expert_parallel

        apply_expert_parallel(stages, g.mesh["ep"])
    if scenario.ep > 1 and scenario.fault == "ep_order":
        from ...pipeline.expert_parallel import set_expert_fault

        set_expert_fault([st.submod for st in stages], "ep_order")
    if scenario.fsdp:
        from ...pipeline import apply_fsdp

        mixed = torch.bfloat16 if scenario.dtype == "bfloat16" else None
        apply_fsdp(stages, g.mesh["dp"], mixed_precision=mixed)
    modules = [st.submod for st in stages]
    if scenario.packed:
        from ...packing import enable_packing

        enable_packing(modules)
        _plant_packing_fault(scenario.fault, modules)
    schedule = build_schedule(scenario.schedule, stages, n)
    owned: dict[str, tuple[torch.nn.Parameter, bool]] = {}
    for module in modules:
        for name, param in module.named_parameters(remove_duplicate=False):
            owned[name] = (param, module.is_language_parameter(name))
    unique = list({id(p): p for p, _ in owned.values()}.values())
    reference = copy.deepcopy(pristine)
    if scenario.variant == "frozen_vision":  # the reference too: it runs the whole model
        is_language = modules[0].is_language_parameter
        for name, param in [*reference.named_parameters(), *(p for m in modules for p in m.named_parameters())]:
            if not is_language(name):
                param.requires_grad_(False)
    return _Built(
        stages, modules, schedule, next((st for st in stages if st.is_first), None), tied, owned,
        torch.optim.SGD(unique, lr=_lr(job, tiny_module)), reference,
        torch.optim.SGD(reference.parameters(), lr=_lr(job, tiny_module)),
        n_stages, layers_per_stage, indices, _PositionCheck(modules) if scenario.packed else None,
    )


def _lr(job: _Job, tiny_module: Any) -> float:
    """The SGD learning rate of a family's run: ``job.lr``, capped by its tiny module's ``MAX_PARITY_LR``.

    A tiny model may be so curved that one SGD step turns float32 rounding differences into gradient
    differences above the tolerance, in the model's own microbatched forward too (Gemma 4's: its
    RMSNorms of small vectors; see ``ppmedia.testing.tiny_models.gemma4``); its module then says how
    large a step keeps the comparison meaningful.
    """
    cap = getattr(tiny_module, "MAX_PARITY_LR", None)
    return job.lr if cap is None else min(job.lr, float(cap))
