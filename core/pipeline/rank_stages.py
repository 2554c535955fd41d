"""A rank's ``torch.distributed.pipelining.PipelineStage`` objects (:func:`make_pipeline_stages`):
its stage modules (cut from a model by :func:`ppmedia.pipeline.build_stage_modules`, or prebuilt),
moved to the device, with static shapes if asked, and the encoder spread
(:class:`ppmedia.pipeline.EncoderSpread`) hung on them. Above both :mod:`ppmedia.pipeline.stages`
and :mod:`ppmedia.pipeline.encoder`, which therefore never import each other in a circle.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ..adapters.base import VlmAdapter
from .encoder import ENCODER_MODES, SPREAD_ATTRIBUTE, EncoderSpread, vision_replica
from .guards import agree
from .stages import StageModule, build_stage_modules, static_stage_args

__all__ = ["make_pipeline_stages"]


def _stage_modules(
    model: nn.Module | Sequence[StageModule],
    n_stages: int | None,
    stage_indices: Sequence[int] | None,
    layers_per_stage: Sequence[int] | str | None,
    adapter: VlmAdapter | None,
    auto_split: Any = None,
) -> tuple[list[StageModule], int, list[int]]:
    """``make_pipeline_stages``' modules: ``model`` cut, or the prebuilt ones checked."""
    if isinstance(model, nn.Module) and not isinstance(model, StageModule):
        if n_stages is None or stage_indices is None:
            raise TypeError("make_pipeline_stages(model, n_stages, stage_indices, ...): a model needs both")
        built = build_stage_modules(
            model, n_stages, stages=stage_indices, layers_per_stage=layers_per_stage, adapter=adapter,
            auto_split=auto_split,
        )
        return built, n_stages, list(stage_indices)
    modules = [model] if isinstance(model, StageModule) else list(model)
    if not modules or not all(isinstance(m, StageModule) for m in modules):
        raise TypeError(
            f"make_pipeline_stages: got {type(model).__name__}; expected a model or StageModule objects "
            f"(build_stage_modules / stages_from_pretrained)"
        )
    if layers_per_stage is not None or adapter is not None or auto_split is not None:
        raise TypeError(
            "make_pipeline_stages: layers_per_stage and adapter apply when cutting a model (auto_split too); "
            "these modules are cut"
        )
    indices = [m.stage_index for m in modules]
    lengths = {m.n_stages for m in modules}
    if len(lengths) != 1 or (n_stages is not None and lengths != {n_stages}):
        raise ValueError(f"n_stages: got {n_stages}; the modules belong to pipelines of {sorted(lengths)} stages")
    if stage_indices is not None and list(stage_indices) != indices:
        raise ValueError(f"stage_indices: got {list(stage_indices)}; the modules are stages {indices}")
    return modules, lengths.pop(), indices


def _to_device(module: nn.Module, device: torch.device) -> None:
    """Move ``module`` to ``device`` unless it is there already or holds meta tensors (left as they
    are: materialise them yourself, e.g. ``to_empty`` and a load); no data is copied needlessly."""
    tensors = [*module.parameters(), *module.buffers()]
    if any(t.is_meta for t in tensors) or all(t.device == device for t in tensors):
        return
    module.to(device)


def make_pipeline_stages(
    model: nn.Module | Sequence[StageModule],
    n_stages: int | None = None,
    stage_indices: Sequence[int] | None = None,
    device: torch.device | str = "cpu",
    *,
    group: Any = None,
    layers_per_stage: Sequence[int] | str | None = None,
    static_microbatch: tuple[int, int] | None = None,
    adapter: VlmAdapter | None = None,
    encoder: str = "stage0",
    auto_split: Any = None,
    vision: nn.Module | None = None,
) -> list[Any]:
    """``PipelineStage`` objects for the stages a rank owns (see :func:`build_stage_modules`).

    Args:
        model: the full model (each rank builds the same one; its modules are then pruned per stage),
            possibly built on the meta device; or this rank's prebuilt :class:`StageModule` objects
            (:func:`build_stage_modules`, :func:`stages_from_pretrained`), used as they are.
        n_stages: pipeline length (required with a model; checked against prebuilt modules).
        stage_indices: the stages of this rank (:func:`stage_indices_for_rank`; required with a
            model, checked against prebuilt modules).
        device: where the stages run. Modules elsewhere are moved there; modules already there, or
            holding meta tensors, are left as they are (no copy).
        group: the pipeline process group (default: the world).
        layers_per_stage: decoder layers per stage, or ``"auto"`` with ``auto_split`` (see
            :func:`build_stage_modules`; with a model only).
        static_microbatch: ``(microbatch_size, seq_len)``: give every stage static
            ``input_args``/``output_args`` (no shape-inference forward); ``None`` infers shapes on the
            first step (pass the first stage to :func:`ppmedia.stage_media` so it costs no chunk).
        adapter: the family adapter (with a model only; default: the registry's).
        encoder: ``"stage0"`` (the first stage runs the vision tower on its microbatches) or
            ``"spread"``: every pipeline rank encodes a share of each step's media
            (:class:`ppmedia.pipeline.EncoderSpread`, hung on every returned stage's module as
            ``encoder_spread``; ranks without stage 0 keep a copy of the vision side: ``vision``, or
            cut from ``model``, which must then be a full model with real tensors). Collective over
            ``group`` then: call it on every pipeline rank.
        auto_split: with ``layers_per_stage="auto"``, a :class:`ppmedia.planning.stepmodel.AutoSplit`.
        vision: with ``encoder="spread"`` and prebuilt modules (:func:`stages_from_pretrained`), the
            copy of the vision side a rank without stage 0 encodes with
            (:func:`~ppmedia.pipeline.vision_from_pretrained` of the same checkpoint); ignored on
            the rank holding stage 0, whose stage has its own.

    Returns:
        One ``torch.distributed.pipelining.PipelineStage`` per index, in order; ``stage.submod`` is
        the :class:`StageModule`.
    """
    from torch.distributed.pipelining import PipelineStage

    if encoder not in ENCODER_MODES:
        raise ValueError(f"encoder: got {encoder!r}; expected one of {', '.join(ENCODER_MODES)}")
    modules, n_stages, indices = _stage_modules(model, n_stages, stage_indices, layers_per_stage, adapter, auto_split)
    device = torch.device(device)
    stages = []
    for index, module in zip(indices, modules):
        _to_device(module, device)
        kwargs: dict[str, Any] = {}
        if static_microbatch is not None:
            dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
            inputs, outputs = static_stage_args(module, *static_microbatch, dtype=dtype, device=device)
            kwargs.update(input_args=inputs, output_args=outputs)
        stage = PipelineStage(module, index, n_stages, device, group=group, **kwargs)
        _restore_only_changed_buffers(stage)
        stages.append(stage)
    if vision is not None and encoder != "spread":
        raise TypeError("make_pipeline_stages: vision= is the spread's copy of the vision side; give encoder='spread'")
    if encoder != "stage0":
        _attach_spread(model, modules, stages, group, device, vision)
    return stages


def _restore_only_changed_buffers(stage: Any) -> None:
    """Keep torch's shape-inference cleanup from bumping the version of buffers it did not change.

    torch 2.14 backs up every buffer of a stage before the shape-inference forward and backward of an
    inferred schedule's first step, then copies each back in place. The copy bumps a buffer's autograd
    version even when its contents never changed, so a graph that saved the buffer earlier (an encode
    of the encoder spread run before the schedule: CLIP's ``position_ids`` lookup saves them) fails in
    its backward ("modified by an inplace operation"). Buffers equal to their backup are dropped from
    the restore; a buffer the inference did change is still restored. A no-op on a torch without
    that cleanup.
    """
    cleanup = getattr(stage, "_post_metadata_inference_cleanup", None)
    if cleanup is None or not hasattr(stage, "_metadata_inference_buffer_backup"):
        return

    def restore_changed() -> None:
        backup = stage._metadata_inference_buffer_backup
        if backup is not None:
            stage._metadata_inference_buffer_backup = [
                (buffer, saved) for buffer, saved in backup
                if buffer.shape != saved.shape or not torch.equal(buffer, saved)
            ]
        cleanup()

    stage._post_metadata_inference_cleanup = restore_changed


def _spread_vision_side(model: nn.Module | Sequence[StageModule], modules: Sequence[StageModule], stages: Sequence[Any],
                        device: torch.device, vision: nn.Module | None = None) -> nn.Module:
    """The module whose vision side this rank's spread runs: its stage 0, ``vision``, or a copy cut
    from ``model``."""
    first = next((st for st in stages if st.is_first), None)
    if first is not None:
        return modules[list(stages).index(first)]
    if vision is not None:
        if any(t.is_meta for t in [*vision.parameters(), *vision.buffers()]):
            raise ValueError("make_pipeline_stages(encoder='spread'): vision= holds meta tensors; expected the "
                             "loaded vision side (vision_from_pretrained)")
        _to_device(vision, device)
        return vision
    if isinstance(model, nn.Module) and not isinstance(model, StageModule):
        vision = vision_replica(model, modules[0].adapter)
        if any(t.is_meta for t in [*vision.parameters(), *vision.buffers()]):
            raise ValueError(
                "make_pipeline_stages(encoder='spread'): the model is on the meta device, so this rank's copy "
                "of the vision side (it has no stage 0) would hold no data (its buffers, e.g. rotary "
                "inv_freq, are in no checkpoint); build the model with real tensors on ranks without stage 0"
            )
        _to_device(vision, device)
        return vision
    raise TypeError(
        f"make_pipeline_stages(encoder='spread'): this rank holds stages {[m.stage_index for m in modules]} "
        f"as prebuilt StageModule objects, but without stage 0 it needs its own copy of the vision side, "
        f"cut from the full model; pass the model, or vision=vision_from_pretrained(checkpoint) with the stages"
    )


def _attach_spread(model: nn.Module | Sequence[StageModule], modules: Sequence[StageModule], stages: Sequence[Any], group: Any,
                   device: torch.device, vision: nn.Module | None = None) -> None:
    """``encoder="spread"``: this rank's :class:`~ppmedia.pipeline.encoder.EncoderSpread` on every module.

    Only ranks without stage 0 can find a problem (no vision side to copy), and the spread's set-up
    is collective: the ranks agree first (:func:`~ppmedia.pipeline.agree`), so every rank raises the
    same error instead of the others waiting for the refusing one in ``new_group`` forever."""
    problem: Exception | None = None
    side: nn.Module | None = None
    try:
        side = _spread_vision_side(model, modules, stages, device, vision)
    except (TypeError, ValueError) as exc:
        problem = exc
    agree(problem, group, what="make_pipeline_stages(encoder='spread') refused")
    assert side is not None
    first = next((st for st in stages if st.is_first), None)
    spread = EncoderSpread(side, modules[0].adapter, first_stage=first, group=group)
    for module in modules:
        module.__dict__[SPREAD_ATTRIBUTE] = spread
