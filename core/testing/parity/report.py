"""Parity harness: a tiny model family through a REAL multi-process pipeline vs. the model itself.

:func:`run_parity` spawns ``world_size`` (default 2) worker processes talking gloo on 127.0.0.1 (or,
launched under ``torchrun``, runs the worker in the current process with environment rendezvous).
Each worker builds the same tiny seeded model (``ppmedia.testing.tiny_models``), its own pipeline stages
(:mod:`ppmedia.pipeline`) and runs every requested :class:`Scenario` for ``steps`` training steps::

    local = shard_batch(batch, dp_rank, dp, ...)            # dp > 1: this replica's samples and media
    staged = split_media(local, n, images_per_sample=..., videos_per_sample=...)
    with stage_media(first_stage, staged):
        schedule.step(input_ids, attention_mask, target=labels, losses=losses,
                      loss_kwargs={"num_valid_tokens": N})      # N: the GLOBAL batch's valid tokens
    sync_tied_gradients(..., pp_group); all_reduce_gradients(..., dp_group)   # dp > 1
    [clip_grad_norm]; compare with the reference; SGD step (pipeline and reference)

A scenario (:class:`Scenario`) picks the schedule (any torch ships), inferred or static shapes, the
``dp x pp`` layout (``pp = world_size // dp``; rank ``= dp_rank * pp + pp_rank``), the model's own
activation checkpointing, bfloat16 parameters and global-norm clipping, or stages loaded from a
checkpoint (``pretrained``: rank 0 writes the tiny model with ``save_pretrained`` once per family, in
many small shards, and every rank builds only its stages with
:func:`ppmedia.pipeline.stages_from_pretrained`; the ranks need a file system they share).

The reference is computed in the same worker, single-process, on the full batch, by the model's OWN
forward (``model(**reference_inputs(batch), labels=...)``, transformers' own loss: the mean token
cross-entropy, i.e. the same normalisation as :func:`ppmedia.pipeline.pipeline_loss` summed over the
microbatches). Each rank compares the gradients of every parameter its stages hold (vision encoder on
the first stage, language model everywhere) with the reference's; the last stage compares the loss.

The worker also checks, on the first stage, that its forward ran ``n + 1`` times on the first step of
a scenario with inferred shapes (the schedule's shape-inference forward) and ``n`` times otherwise, and
that every call consumed the media chunk of the microbatch whose rows it got (a mismatch in counts
would already raise in ``adapter.merge``), and that every media view it consumed covers exactly the
rows of its replica's microbatch in the GLOBAL batch's tensors. It counts the calls of the decoder
layers (twice per microbatch with activation checkpointing). A failed check raises in the worker,
which fails the run.

Results come back as a :class:`ParityReport` (per family: a per-microbatch table and, per scenario and
step, both losses, the max gradient differences split into vision and language model, wall times).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import inspect
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch

from ...cli.tables import format_table

__all__ = [
    "ALL_SCENARIOS",
    "BF16_GRAD_RTOL",
    "BF16_LOSS_TOLERANCE",
    "DEFAULT_SCENARIOS",
    "FAULTS",
    "FamilyReport",
    "MicrobatchInfo",
    "ParityError",
    "ParityReport",
    "Scenario",
    "ScenarioResult",
    "StepResult",
    "VARIANTS",
    "VARLEN_PAD",
    "exit_worker",
    "launched_by_torchrun",
    "main",
    "microbatch_table",
    "parse_scenarios",
    "run_parity",
    "run_worker",
]

#: deliberate breakages for proving that the harness can fail:
#: ``bare_module``: stage the media on the first stage's bare module (not the PipelineStage); with
#: inferred shapes the shape-inference forward then takes chunk 0 and the step runs out of chunks.
#: ``wrong_batch``: stage the media of a different batch with the same layout (same counts and
#: shapes, other pixels): nothing raises, the losses and gradients differ from the reference.
#: ``stale_copies`` (with ``/spread`` only): the encoder spread never refreshes its copies of the
#: vision tower, so after the first update the other ranks encode with old weights: nothing raises,
#: the second step's loss and gradients differ.
#: ``packed_positions`` (with ``/packed`` only): the stages get positions over the whole packed row
#: (1-D ``0 .. S-1``; mrope: the family's rope index of the row), not per sample.
#: ``packed_leak`` (with ``/packed`` only): in row 0 the mask lets sample 2 attend sample 1 (one boundary).
FAULTS: tuple[str, ...] = ("bare_module", "wrong_batch", "stale_copies", "unreduced_tower", "packed_positions", "packed_leak")
#: the packing faults (planted bugs of :mod:`ppmedia.packing`)
PACKED_FAULTS: tuple[str, ...] = ("packed_positions", "packed_leak")
#: samples per packed row of a ``/packed`` scenario (consecutive samples: the media keep their order)
PACKED_PER_ROW = 2
#: run variants that must still match (see :class:`Scenario`).
VARIANTS: tuple[str, ...] = ("text_only_first", "frozen_vision", "text_only_replica", "varlen", "eval")
_SHAPES = ("inferred", "static")
#: extra padding columns of the ``varlen`` variant's first batch of a step.
VARLEN_PAD = 3
#: bfloat16 parameters vs the float32 reference: the loss may differ by this much (absolute) ...
BF16_LOSS_TOLERANCE = 2e-3
#: ... and each gradient by this fraction of the largest reference gradient of its side.
BF16_GRAD_RTOL = 3e-2


class ParityError(RuntimeError):
    """A worker failed; the message carries the worker's traceback."""


_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Scenario:
    """One pipeline configuration.

    Attributes:
        schedule: ``gpipe``, ``1f1b``, ``interleaved`` or any torch schedule name, case-insensitive
            (``ZBVZeroBubble``, ``DualPipeV``, ...: :func:`ppmedia.pipeline.schedule_names`).
        shapes: ``inferred`` (the schedule infers shapes on the first step) or ``static``
            (``input_args``/``output_args`` on every stage).
        fault: ``None``, or one of :data:`FAULTS` to break the run on purpose.
        dp: data-parallel replicas; the pipeline has ``world_size // dp`` ranks, replica ``r`` takes
            the samples ``tensor_split(range(B), dp)[r]`` of the global batch and its media.
        checkpointing: the model's own activation checkpointing (vision blocks and decoder layers),
            in train mode.
        dtype: ``float32``, or ``bfloat16`` parameters (compared with the float32 reference).
        clip: clip gradients to half the reference's global norm (``ppmedia.pipeline.clip_grad_norm``
            vs ``torch.nn.utils.clip_grad_norm_`` on the reference).
        layers: decoder layers per stage (``layers_per_stage``), or ``None`` for
            :func:`~ppmedia.pipeline.default_layer_split`; e.g. ``(2, 0)`` puts every Qwen3-VL deepstack
            layer of the tiny model on stage 0, the default ``(1, 1)`` sends a deepstack level across.
        variant: ``None``, or one of :data:`VARIANTS`: ``text_only_first`` builds the batch with its
            text-only samples first (the tiny module's ``build_batch(seed, text_only_first=True)``), so
            the schedule infers shapes from a microbatch without media; ``frozen_vision`` freezes every
            parameter outside the language model (``requires_grad=False``) on both sides;
            ``text_only_replica`` fills the first half of the batch with the tiny batch's text-only
            samples (repeated) and the second half with its first half, media included: with ``dp2``
            replica 0 holds no media at all (its vision tower gets no gradient); ``varlen``
            accumulates two schedule steps before each optimizer step (and each comparison): another
            batch right-padded by :data:`VARLEN_PAD` columns (another sequence length ``S``), then the
            step's batch; the reference accumulates the same two, and the stages are never rebuilt;
            ``eval`` runs :func:`~ppmedia.pipeline.eval_step` (``schedule.eval``, forward only) on the
            step's batch before its training step, and its loss is compared with the reference's.
        balance: reorder the samples for an even vision load (``split_media(balance=...)`` with the
            adapter's ``image_costs``); the reference still runs the original order.
        encoder: ``stage0`` (the first stage runs the vision tower) or ``spread`` (every pipeline rank
            encodes a share: ``make_pipeline_stages(..., encoder="spread")``, token ``/spread``).
        lane: with the spread, its background lane (the default on CPU: later encodes and the vision
            backwards in the schedule's idle time); ``False`` (token ``/nolane``): every encode
            before the schedule, every vision backward after it, contiguous shares.
        pretrained: build the stages from a checkpoint of the tiny model
            (:func:`~ppmedia.pipeline.stages_from_pretrained`, each rank only its stages) instead of
            cutting the model in memory; the tiny module's ``build_checkpoint_model`` (if it has one)
            is the model written and the reference.
        fsdp: shard every stage with FSDP2 over the data-parallel mesh
            (:func:`ppmedia.pipeline.apply_fsdp`) instead of summing replicated gradients
            (``all_reduce_gradients``); gradients are compared after gathering them (``full_tensor()``).
            With ``dtype="bfloat16"`` the parameters stay float32 and FSDP2's mixed precision computes
            in bfloat16 (gradients reduced in float32).
        microbatches: microbatches per step for this scenario (default: the run's ``n_microbatches``),
            e.g. ``mb4`` for DualPipeV, which needs at least as many microbatches as stages.
        tp: tensor-parallel ranks per stage (token ``tpN``): the pipeline has ``world_size // (dp * tp)``
            ranks, each stage's language model is split with :func:`~ppmedia.pipeline.apply_tensor_parallel`
            and the tower's gradients summed with ``reduce_tensor_parallel_gradients`` (skipped by the
            fault ``unreduced_tower``).
        presplit: feed the schedule pre-split microbatches (token ``/presplit``:
            ``schedule.step(**ppmedia.microbatch_inputs(staged, ...).step_kwargs())``, each
            microbatch's media its own ``media`` keyword input) instead of staging the media on the
            first stage (``stage_media``).
        packed: the pipeline runs the batch packed, :data:`PACKED_PER_ROW` consecutive samples a row
            (token ``/packed``: :func:`ppmedia.testing.packed.pack_batch`, stages marked with
            :func:`ppmedia.packing.enable_packing`); the reference still runs the unpacked batch.
    """

    schedule: str
    shapes: str = "inferred"
    fault: str | None = None
    dp: int = 1
    checkpointing: bool = False
    dtype: str = "float32"
    clip: bool = False
    layers: tuple[int, ...] | None = None
    variant: str | None = None
    balance: bool = False
    encoder: str = "stage0"
    lane: bool = True
    pretrained: bool = False
    fsdp: bool = False
    microbatches: int | None = None
    tp: int = 1
    presplit: bool = False
    packed: bool = False

    def __post_init__(self) -> None:
        from ...pipeline import schedule_layout

        try:
            schedule_layout(self.schedule)
        except ValueError as exc:
            raise ValueError(f"scenario schedule: {exc}") from None
        if self.shapes not in _SHAPES:
            raise ValueError(f"scenario shapes: got {self.shapes!r}; expected one of {', '.join(_SHAPES)}")
        if self.fault is not None and self.fault not in FAULTS:
            raise ValueError(f"scenario fault: got {self.fault!r}; expected None or one of {', '.join(FAULTS)}")
        if self.dp < 1 or self.tp < 1:
            raise ValueError(f"scenario dp/tp: got {self.dp}/{self.tp}; expected >= 1")
        if self.dtype not in _DTYPES:
            raise ValueError(f"scenario dtype: got {self.dtype!r}; expected one of {', '.join(_DTYPES)}")
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(int(n) for n in self.layers))
        if self.encoder not in ("stage0", "spread"):
            raise ValueError(f"scenario encoder: got {self.encoder!r}; expected stage0 or spread")
        if not self.lane and self.encoder != "spread":
            raise ValueError("scenario lane=False (/nolane) is an option of the encoder spread: add /spread")
        if self.variant is not None and self.variant not in VARIANTS:
            raise ValueError(f"scenario variant: got {self.variant!r}; expected None or one of {', '.join(VARIANTS)}")
        if self.presplit and self.fault == "bare_module":
            raise ValueError("scenario /presplit stages nothing on a module: bare_module does not apply")

    @property
    def name(self) -> str:
        """``schedule/shapes`` (plus ``/fault`` and option tokens, e.g. ``1f1b/static/dp2/clip``)."""
        return _scenario_name(self)


def _scenario_name(sc: "Scenario | ScenarioResult") -> str:
    """``schedule/shapes[/fault][/dpN][/tpN][/fsdp][/mbN][/ckpt][/bf16][/clip][/layers=A+B][/variant]...[/presplit]``."""
    parts = [sc.schedule, sc.shapes] + ([sc.fault] if sc.fault else [])
    parts += [f"dp{sc.dp}"] if sc.dp != 1 else []
    parts += [f"tp{sc.tp}"] if getattr(sc, "tp", 1) != 1 else []
    parts += ["fsdp"] * sc.fsdp
    parts += [f"mb{sc.microbatches}"] if sc.microbatches is not None else []
    parts += ["ckpt"] * sc.checkpointing + ["bf16"] * (sc.dtype == "bfloat16") + ["clip"] * sc.clip
    if sc.layers is not None:
        parts.append("layers=" + "+".join(str(n) for n in sc.layers))
    if sc.variant is not None:
        parts.append(sc.variant)
    return "/".join(parts + ["balanced"] * sc.balance + ["pretrained"] * sc.pretrained
                    + ["spread"] * (getattr(sc, "encoder", "stage0") == "spread") + ["nolane"] * (not getattr(sc, "lane", True))
                    + ["presplit"] * getattr(sc, "presplit", False) + ["packed"] * getattr(sc, "packed", False))


#: GPipe and 1F1B, each with inferred and with static shapes.
DEFAULT_SCENARIOS: tuple[Scenario, ...] = tuple(
    Scenario(s, shapes) for s in ("gpipe", "1f1b") for shapes in _SHAPES
)
#: the defaults plus Interleaved1F1B (2 stages per rank) with both kinds of shapes.
ALL_SCENARIOS: tuple[Scenario, ...] = DEFAULT_SCENARIOS + tuple(Scenario("interleaved", s) for s in _SHAPES)


def parse_scenarios(specs: Iterable[str | Scenario]) -> list[Scenario]:
    """Scenarios from strings ``schedule[/shapes][/fault][/dpN][/tpN][/fsdp][/mbN][/ckpt][/bf16][/clip][/layers=A+B][/variant][/balanced][/pretrained][/spread][/nolane][/presplit][/packed]``
    (``"1f1b/static"``, ``"ZBVZeroBubble/static/dp2"``, ``"gpipe/static/layers=2+0"``) or :class:`Scenario`
    objects."""
    out = []
    for spec in specs:
        if isinstance(spec, Scenario):
            out.append(spec)
            continue
        schedule, *tokens = str(spec).replace(":", "/").split("/")
        kwargs: dict[str, Any] = {}
        for token in tokens:
            if token in _SHAPES:
                kwargs["shapes"] = token
            elif token in FAULTS:
                kwargs["fault"] = token
            elif token.startswith("dp") and token[2:].isdigit():
                kwargs["dp"] = int(token[2:])
            elif token.startswith("tp") and token[2:].isdigit():
                kwargs["tp"] = int(token[2:])
            elif token in ("ckpt", "clip"):
                kwargs["checkpointing" if token == "ckpt" else "clip"] = True
            elif token == "bf16":
                kwargs["dtype"] = "bfloat16"
            elif token.startswith("layers="):
                try:
                    kwargs["layers"] = tuple(int(n) for n in token[len("layers="):].split("+"))
                except ValueError:
                    raise ValueError(f"scenario {spec!r}: layers=A+B... takes integers") from None
            elif token in VARIANTS:
                kwargs["variant"] = token
            elif token == "balanced":
                kwargs["balance"] = True
            elif token == "pretrained":
                kwargs["pretrained"] = True
            elif token == "fsdp":
                kwargs["fsdp"] = True
            elif token.startswith("mb") and token[2:].isdigit():
                kwargs["microbatches"] = int(token[2:])
            elif token == "spread":
                kwargs["encoder"] = "spread"
            elif token == "nolane":
                kwargs["lane"] = False
            elif token == "presplit":
                kwargs["presplit"] = True
            elif token == "packed":
                kwargs["packed"] = True
            else:
                raise ValueError(
                    f"scenario {spec!r}: unknown part {token!r}; expected "
                    f"schedule[/shapes][/fault][/dpN][/tpN][/fsdp][/mbN][/ckpt][/bf16][/clip][/layers=A+B][/variant][/balanced][/pretrained][/spread][/nolane][/presplit][/packed]"
                )
        out.append(Scenario(schedule, **kwargs))
    return out


# --------------------------------------------------------------------------------------------------
# results


@dataclass
class MicrobatchInfo:
    """What one microbatch holds (for the demo's table)."""

    index: int
    samples: int
    images: int
    videos: int
    image_rows: int
    video_rows: int
    crop_rows: int
    placeholder_tokens: int
    replica: int = 0
    audios: int = 0

    @property
    def patch_rows(self) -> int:
        """Rows of every staged media tensor of the microbatch (images, videos, Step3 crops)."""
        return self.image_rows + self.video_rows + self.crop_rows

    @property
    def text_only(self) -> bool:
        return self.images == 0 and self.videos == 0 and self.crop_rows == 0 and self.audios == 0


@dataclass
class StepResult:
    """One training step of one scenario (merged over the ranks).

    Attributes:
        loss_pipeline: sum of the last stage's per-microbatch losses.
        loss_reference: the model's own full-batch loss.
        grad_diff_vision / grad_diff_lm: max |pipeline grad - reference grad| over the vision encoder's
            (first stage) and the language model's parameters (all stages); tied parameters after
            their gradients were summed across ranks (0.0 when no parameter of that side was compared:
            see ``vision_params_compared`` / ``lm_params_compared``).
        worst_param_vision / worst_param_lm: the full-model name of the parameter with that largest
            difference (``None``: none compared).
        params_compared: parameters compared, all ranks together (a tied parameter once per copy);
            vision_params_compared: of these, the vision encoder's.
        reference_grad_max_vision / reference_grad_max_lm: the largest reference gradient entry of each
            side, to show the comparison is not between zeros.
        wall_pipeline_s: the schedule step (slowest rank); wall_reference_s: the reference forward and
            backward (slowest rank).
        first_stage_calls: forward calls of stage 0 during the step; expected_first_stage_calls: ``n + 1``
            on the first step with inferred shapes, else ``n``.
        chunk_trace: per call of stage 0, the chunk index it consumed (== the microbatch of its rows).
        grad_norm_pipeline / grad_norm_reference: with ``clip``: the global gradient norm before
            clipping (``ppmedia.pipeline.clip_grad_norm`` / ``torch.nn.utils.clip_grad_norm_``).
        layer_calls / expected_layer_calls: calls of the decoder layers' first child module during the
            step, all ranks and replicas together: ``layers x n x dp`` (plus one forward per layer for
            shape inference), twice ``n`` with activation checkpointing (the backward recomputes each
            layer's forward). vision_layer_calls: the same for the vision tower's blocks (not checked:
            text-only microbatches skip the tower).
        media_rows: per replica, per chunk its first stage consumed: ``[dp_rank, chunk, field, start,
            stop]``, the rows of the GLOBAL batch's media tensor the staged view covers (checked
            in the worker against the replica's own samples).
        loss_eval: with the ``eval`` variant: the global loss of ``eval_step`` on the step's batch,
            before its training step (the same weights as ``loss_reference``); else ``None``.
        position_problems: with ``/packed``: every stage call whose language model got positions that
            do not restart at a sample's first token (its position differs from the row's first
            token's), in words. The loss cannot show it: rotary positions shifted by a constant
            within a sample leave its attention unchanged once samples are isolated.
    """

    step: int
    loss_pipeline: float
    loss_reference: float
    grad_diff_vision: float
    grad_diff_lm: float
    params_compared: int
    vision_params_compared: int
    reference_grad_max_vision: float
    reference_grad_max_lm: float
    wall_pipeline_s: float
    wall_reference_s: float
    first_stage_calls: int
    expected_first_stage_calls: int
    chunk_trace: list[int] = field(default_factory=list)
    grad_norm_pipeline: float | None = None
    grad_norm_reference: float | None = None
    layer_calls: int = -1
    expected_layer_calls: int = -1
    vision_layer_calls: int = -1
    media_rows: list[list[Any]] = field(default_factory=list)
    encoded: list[list[int]] = field(default_factory=list)
    loss_eval: float | None = None
    worst_param_vision: str | None = None
    worst_param_lm: str | None = None
    position_problems: list[str] = field(default_factory=list)

    @property
    def lm_params_compared(self) -> int:
        """Language-model parameters compared (all ranks together)."""
        return self.params_compared - self.vision_params_compared

    @property
    def loss_diff(self) -> float:
        return abs(self.loss_pipeline - self.loss_reference)

    @property
    def grad_diff(self) -> float:
        return max(self.grad_diff_vision, self.grad_diff_lm)


@dataclass
class ScenarioResult:
    """Every step of one scenario for one family."""

    family: str
    schedule: str
    shapes: str
    fault: str | None
    n_stages: int
    layers_per_stage: list[int]
    steps: list[StepResult]
    missing_params: list[str] = field(default_factory=list)
    dp: int = 1
    checkpointing: bool = False
    dtype: str = "float32"
    clip: bool = False
    stage_indices: list[list[int]] = field(default_factory=list)
    layers: list[int] | None = None  # the scenario's explicit layers_per_stage, if any
    variant: str | None = None
    balance: bool = False
    encoder: str = "stage0"
    lane: bool = True
    pretrained: bool = False
    fsdp: bool = False
    microbatches: int | None = None
    tp: int = 1
    presplit: bool = False
    #: ``pretrained`` scenarios: per rank (in rank order), checkpoint elements read and stage
    #: elements held (local shards), and with ``tp > 1`` the export round trip's largest difference.
    loaded: list[dict[str, Any]] = field(default_factory=list)
    packed: bool = False

    @property
    def name(self) -> str:
        return _scenario_name(self)

    @property
    def max_loss_diff(self) -> float:
        return max((s.loss_diff for s in self.steps), default=float("nan"))

    @property
    def max_grad_diff_vision(self) -> float:
        return max((s.grad_diff_vision for s in self.steps), default=float("nan"))

    @property
    def max_grad_diff_lm(self) -> float:
        return max((s.grad_diff_lm for s in self.steps), default=float("nan"))

    def passed(self, tolerance: float = 1e-5, rtol: float = 0.0) -> bool:
        """Every loss and gradient within ``tolerance + rtol * scale`` (float32; the scale: the
        reference loss, or the largest reference gradient entry of the side, vision or language model;
        bfloat16: :data:`BF16_LOSS_TOLERANCE` and :data:`BF16_GRAD_RTOL` of the largest reference
        gradient), every parameter compared, call counts right."""
        if not self.steps or self.missing_params:
            return False
        return not any(self.step_problems(s, tolerance, rtol) for s in self.steps)

    def step_problems(self, s: StepResult, tolerance: float = 1e-5, rtol: float = 0.0) -> list[str]:
        """What step ``s`` missed, one phrase each (empty: it passed), e.g. ``"grad LM 5.2e-01 >
        1.0e-05 (worst model.language_model.layers.1.mlp.up_proj.weight)"``."""
        if self.dtype == "bfloat16":
            loss_tol = BF16_LOSS_TOLERANCE
            vision_tol = BF16_GRAD_RTOL * s.reference_grad_max_vision
            lm_tol = BF16_GRAD_RTOL * s.reference_grad_max_lm
        else:
            loss_tol = tolerance + rtol * abs(s.loss_reference)
            vision_tol = tolerance + rtol * s.reference_grad_max_vision
            lm_tol = tolerance + rtol * s.reference_grad_max_lm
        problems = []
        if not s.loss_diff <= loss_tol:
            problems.append(f"loss |diff| {s.loss_diff:.1e} > {loss_tol:.1e}")
        for side, diff, tol, worst in (("vision", s.grad_diff_vision, vision_tol, s.worst_param_vision),
                                       ("LM", s.grad_diff_lm, lm_tol, s.worst_param_lm)):
            if not diff <= tol:
                problems.append(f"grad {side} {diff:.1e} > {tol:.1e} (worst {worst})")
        if s.first_stage_calls != s.expected_first_stage_calls:
            problems.append(f"stage-0 calls {s.first_stage_calls}, expected {s.expected_first_stage_calls}")
        if s.expected_layer_calls >= 0 and s.layer_calls != s.expected_layer_calls:
            problems.append(f"decoder layer calls {s.layer_calls}, expected {s.expected_layer_calls}")
        norm_rtol = BF16_GRAD_RTOL if self.dtype == "bfloat16" else max(1e-5, rtol)
        if s.grad_norm_pipeline is not None and s.grad_norm_reference is not None and not (
            abs(s.grad_norm_pipeline - s.grad_norm_reference) <= norm_rtol * s.grad_norm_reference
        ):
            problems.append(f"grad norm {s.grad_norm_pipeline:.7g} vs {s.grad_norm_reference:.7g} (rtol {norm_rtol:g})")
        problems += [f"positions: {p}" for p in s.position_problems[:1]]
        if s.loss_eval is not None and not abs(s.loss_eval - s.loss_reference) <= loss_tol:
            problems.append(f"eval loss {s.loss_eval:.7g} vs {s.loss_reference:.7g}")
        return problems


@dataclass
class FamilyReport:
    """One family: its batch split and its scenarios."""

    family: str
    model_type: str
    n_microbatches: int
    batch_size: int
    seq_len: int
    microbatches: list[MicrobatchInfo]
    scenarios: list[ScenarioResult]

    def scenario(self, name: str) -> ScenarioResult:
        for result in self.scenarios:  # schedule names are case-insensitive
            if result.name.lower() == name.lower():
                return result
        raise KeyError(f"{self.family}: no scenario {name!r}; ran {[r.name for r in self.scenarios]}")


@dataclass
class ParityReport:
    """Everything one run returned."""

    world_size: int
    tolerance: float
    launcher: str
    wall_s: float
    families: list[FamilyReport]
    rtol: float = 0.0

    def family(self, name: str) -> FamilyReport:
        for report in self.families:
            if report.family == name:
                return report
        raise KeyError(f"no family {name!r} in this report; ran {[f.family for f in self.families]}")

    @property
    def ok(self) -> bool:
        """Every scenario without a deliberate fault passed."""
        return all(self.family_ok(f.family) for f in self.families)

    def family_ok(self, name: str) -> bool:
        """Every scenario of family ``name`` without a deliberate fault passed."""
        return all(s.passed(self.tolerance, self.rtol) for s in self.family(name).scenarios if s.fault is None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ParityReport":
        families = []
        for f in data["families"]:
            scenarios = [
                ScenarioResult(**{**s, "steps": [StepResult(**st) for st in s["steps"]]}) for s in f["scenarios"]
            ]
            micro = [MicrobatchInfo(**m) for m in f["microbatches"]]
            families.append(FamilyReport(**{**f, "microbatches": micro, "scenarios": scenarios}))
        return cls(**{**data, "families": families})

    def format(self) -> str:
        """Plain-text tables: the microbatches of each family, then every scenario and step."""
        lines: list[str] = []
        for f in self.families:
            lines.append(
                f"{f.family} ({f.model_type}): {f.batch_size} samples x {f.seq_len} tokens, "
                f"{f.n_microbatches} microbatches"
            )
            lines.append(
                _table(
                    ("replica", "mb", "samples", "images", "videos", "audios", "patch rows", "placeholders", ""),
                    [
                        (m.replica, m.index, m.samples, m.images, m.videos, m.audios, m.patch_rows, m.placeholder_tokens,
                         "text-only" if m.text_only else "")
                        for m in f.microbatches
                    ],
                )
            )
            rows, problems = self._scenario_rows(f)
            lines.append(
                _table(
                    ("scenario", "step", "loss (pipeline)", "loss (reference)", "|diff|", "grad vision", "grad LM",
                     "stage-0 calls", "step s", ""),
                    rows,
                )
            )
            lines += problems
            lines.append("")
        verdict = "PASS" if self.ok else "FAIL"
        rtol = f", rtol {self.rtol:g}" if self.rtol else ""
        lines.append(f"{verdict}: tolerance {self.tolerance:g}{rtol}, {self.world_size} processes ({self.launcher}), {self.wall_s:.1f} s")
        return "\n".join(lines)

    def _scenario_rows(self, f: FamilyReport) -> tuple[list[tuple[Any, ...]], list[str]]:
        """The scenario table's rows, and one line per failing step saying what it missed."""
        rows, problems = [], []
        for s in f.scenarios:
            passed = s.passed(self.tolerance, self.rtol)
            if s.missing_params and s.fault is None:
                problems.append(f"{s.name}: parameters on no stage: {', '.join(s.missing_params[:5])}"
                                + (f" and {len(s.missing_params) - 5} more" if len(s.missing_params) > 5 else ""))
            for st in s.steps:
                verdict = "ok" if passed else ("FAIL" if s.fault is None else "fails (expected)")
                rows.append(
                    (s.name, st.step, f"{st.loss_pipeline:.7f}", f"{st.loss_reference:.7f}", f"{st.loss_diff:.1e}",
                     _grad_cell(st.grad_diff_vision, st.vision_params_compared),
                     _grad_cell(st.grad_diff_lm, st.lm_params_compared),
                     f"{st.first_stage_calls}/{st.expected_first_stage_calls}", f"{st.wall_pipeline_s:.3f}", verdict)
                )
                missed = s.step_problems(st, self.tolerance, self.rtol)
                if missed:
                    problems.append(f"{s.name} step {st.step} {'FAIL' if s.fault is None else 'fails (expected)'}: "
                                    + "; ".join(missed))
        return rows, problems


def _grad_cell(diff: float, compared: int) -> str:
    return f"{diff:.1e}" if compared else "no parameters compared"


_table = format_table


# --------------------------------------------------------------------------------------------------
# the per-microbatch table (no processes needed)


def _split(adapter: Any, config: Any, batch: dict[str, Any], n: int) -> Any:
    from ...producer.split import split_media
    return split_media(batch, n, **adapter.media_counts(batch, config))


def _balanced_split(adapter: Any, config: Any, local: dict[str, Any], n: int) -> Any:
    """``split_media(local, n, balance=adapter's image_costs)``: pops the media from ``local`` and
    reorders its ``[B, ...]`` entries (new tensors; the caller's batch keeps its order)."""
    import functools

    from ...producer.split import split_media

    cost = functools.partial(adapter.image_costs, config=config)
    return split_media(local, n, **adapter.media_counts(local, config), balance=cost)


def _microbatch_infos(adapter: Any, config: Any, batch: dict[str, Any], n: int, dp: int = 1) -> list[MicrobatchInfo]:
    """Per microbatch (per replica with ``dp > 1``: replica ``r``'s microbatch ``k`` holds the global
    batch's ``tensor_split(range(B), dp * n)[r * n + k]`` samples when the shares are even)."""
    ids = batch["input_ids"]
    staged = _split(adapter, config, dict(batch), n * dp)
    placeholders = torch.zeros(ids.shape[0], dtype=torch.int64)
    for mask in adapter.placeholder_masks(ids, config).values():
        placeholders += mask.sum(dim=1)
    infos = []
    for k, (a, b) in enumerate(staged.samples):
        infos.append(
            MicrobatchInfo(
                index=k % n,
                replica=k // n,
                samples=b - a,
                images=staged.images[k],
                videos=staged.videos[k],
                image_rows=staged.image_rows[k],
                video_rows=staged.video_rows[k],
                crop_rows=staged.crop_rows[k],
                placeholder_tokens=int(placeholders[a:b].sum()),
                audios=staged.audios[k],
            )
        )
    return infos


def microbatch_table(family: str, n_microbatches: int = 4, seed: int = 0) -> list[MicrobatchInfo]:
    """What each microbatch of ``family``'s tiny batch holds (builds only the config, no model)."""
    from .. import tiny_models as tiny
    from ...registry import get_adapter

    module = tiny.load(family)
    config = module.build_config()
    return _microbatch_infos(get_adapter(config), config, module.build_batch(seed), n_microbatches)


# --------------------------------------------------------------------------------------------------
# the worker


@dataclass
class _Job:
    families: list[str]
    scenarios: list[dict[str, Any]]
    steps: int
    n_microbatches: int
    seed: int
    lr: float
    extra: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # family -> its own scenarios

    def all_families(self) -> list[str]:
        return self.families + [f for f in self.extra if f not in self.families]

    def scenarios_of(self, family: str) -> list[dict[str, Any]]:
        return (self.scenarios if family in self.families else []) + self.extra.get(family, [])


def _max_abs_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None and b is None:
        return 0.0
    if a is None:
        return float(b.abs().max()) if b.numel() else 0.0  # type: ignore[union-attr]
    if b is None:
        return float(a.abs().max()) if a.numel() else 0.0
    return float((a - b).abs().max()) if a.numel() else 0.0


def _microbatch_of(ids: torch.Tensor, input_ids: torch.Tensor, samples: Sequence[tuple[int, int]]) -> int:
    """Which microbatch's rows ``ids`` are (-1: none)."""
    for k, (a, b) in enumerate(samples):
        rows = input_ids[a:b]
        if rows.shape == ids.shape and torch.equal(rows, ids):
            return k
    return -1


@dataclass
class _Groups:
    """This rank's place in the ``dp x pp x tp`` layout (rank = (dp_rank * pp + pp_rank) * tp + tp_rank)."""

    pp: int
    dp: int
    pp_rank: int
    dp_rank: int
    pp_group: Any
    dp_group: Any
    mesh: Any = None  # the (dp, pp, tp) DeviceMesh, when dp > 1 or tp > 1
    tp_rank: int = 0


_GROUP_CACHE: dict[tuple[int, ...], _Groups] = {}


def _groups(world: int, rank: int, dp: int, tp: int = 1) -> _Groups:
    """The pipeline and data-parallel groups of a ``dp x (world // (dp * tp)) x tp`` layout, from
    :func:`~ppmedia.pipeline.pipeline_mesh` (created once per layout: ``new_group`` is collective, so
    every rank creates every group in the same order); ``dp = tp = 1``: the world is the pipeline."""
    if (world, dp, tp) in _GROUP_CACHE:
        return _GROUP_CACHE[(world, dp, tp)]
    pp = world // (dp * tp)
    if dp == 1 and tp == 1:
        groups = _Groups(pp, 1, rank, 0, None, None)
    else:
        from ...pipeline import pipeline_mesh

        mesh = pipeline_mesh(pp, dp, tp)  # rank = (d * pp + p) * tp + t
        groups = _Groups(pp, dp, (rank // tp) % pp, rank // (tp * pp), mesh["pp"].get_group(), mesh["dp"].get_group(),
                         mesh, rank % tp)
    _GROUP_CACHE[(world, dp, tp)] = groups
    return groups


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


def _build_batch(tiny_module: Any, scenario: Scenario, seed: int) -> dict[str, Any]:
    """The tiny batch of ``seed``, in the scenario's sample order."""
    if scenario.variant == "text_only_first":
        return dict(tiny_module.build_batch(seed, text_only_first=True))
    if scenario.variant == "text_only_replica":
        return _text_only_first_half(tiny_module, dict(tiny_module.build_batch(seed)))
    return dict(tiny_module.build_batch(seed))


def _pipeline_batch(scenario: Scenario, batch: dict[str, Any], config: Any) -> dict[str, Any]:
    """What the pipeline runs: ``batch``, or with ``/packed`` its :data:`PACKED_PER_ROW` samples a row."""
    if not scenario.packed:
        return batch
    from ..packed import in_order_rows, pack_batch

    pad = getattr(config.get_text_config(), "pad_token_id", None)
    return pack_batch(batch, in_order_rows(int(batch["input_ids"].shape[0]), PACKED_PER_ROW), int(pad or 0))


class _PositionCheck:
    """Packed stages: records where a stage's language model got positions that do not restart per
    sample (a sample's first position must equal its row's first: 0, PaliGemma 1, mrope (0, 0, 0))."""

    def __init__(self, modules: Sequence[Any]) -> None:
        self.problems: list[str] = []
        self.handles = []
        for module in modules:
            self.handles.append(module.register_forward_pre_hook(self._segments))
            self.handles.append(module.stage_language_model.register_forward_pre_hook(
                functools.partial(self._positions, module.stage_index), with_kwargs=True))
        self.segments: torch.Tensor | None = None

    def _segments(self, module: Any, args: tuple[Any, ...]) -> None:
        self.segments = args[1] if len(args) > 1 else None

    def _positions(self, stage: int, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        positions, segments = kwargs.get("position_ids"), self.segments
        if positions is None or segments is None:
            self.problems.append(f"stage {stage}: no positions for packed rows")
            return
        p = positions if positions.dim() == 3 else positions[None]  # [axes, b, S]
        p = p.expand(p.shape[0], *segments.shape)
        starts = torch.zeros_like(segments, dtype=torch.bool)
        starts[:, 1:] = (segments[:, 1:] != segments[:, :-1]) & (segments[:, 1:] != 0)
        wrong = (p != p[:, :, :1]).any(dim=0) & starts
        if bool(wrong.any()):
            r, t = (int(v) for v in wrong.nonzero()[0])
            self.problems.append(f"stage {stage}: row {r}'s sample starting at token {t} has position "
                                 f"{p[:, r, t].tolist()}, its row's first token {p[:, r, 0].tolist()}")

    def take(self) -> list[str]:
        out, self.problems = self.problems, []
        return out

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


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


def _text_only_first_half(tiny_module: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """``B`` samples: the batch's text-only samples, repeated, for the first half; its first half,
    with exactly that half's media (views), for the second."""
    from ...pipeline.parallel import _PER_SAMPLE_MEDIA_KEYS
    from ...registry import get_adapter

    config = tiny_module.build_config()
    adapter = get_adapter(config)
    B = int(batch["input_ids"].shape[0])
    per_sample = _split(adapter, config, dict(batch), B)
    text_only = [k for k in range(B) if per_sample.chunk(k) is None]
    if not text_only:
        raise ValueError("text_only_replica: the tiny batch has no text-only sample")
    # repeated in alternating order, so no two microbatches of the half hold the same rows
    cycled = [i for r in range(B) for i in (text_only if r % 2 == 0 else text_only[::-1])]
    order = cycled[: B // 2] + list(range(B // 2))
    halves = _split(adapter, config, dict(batch), 2)
    media_keys = set(halves.sources.values())
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key in _PER_SAMPLE_MEDIA_KEYS:
            out[key] = torch.cat([torch.zeros_like(value[: B // 2]), value[: B // 2]])
        elif key in media_keys:
            out[key] = halves.chunks[next(f for f, k in halves.sources.items() if k == key)][0]
        elif isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == B:
            out[key] = value[order]
        else:
            out[key] = value
    return out


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
        with _counted_reads() as read:
            modules = stages_from_pretrained(checkpoint, n_stages, stages=indices, layers_per_stage=layers_per_stage,
                                             dtype=dtype, tp_mesh=tp_mesh)
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


class _Probe:
    """Hooks that watch one step: which chunk each first-stage forward takes (and which rows of the
    global batch's media it covers), and how often the decoder and vision layers run."""

    def __init__(self, built: _Built) -> None:
        from ...chunk import CURSOR_ATTRIBUTE, STAGED_ATTRIBUTES

        self.trace: list[tuple[int | None, int]] = []
        self.views: list[tuple[int, str, torch.Tensor]] = []
        self.layer_calls = 0
        self.vision_calls = 0
        self.layers = 0
        self.current: dict[str, Any] = {}
        self.handles: list[Any] = []

        def record(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            media = kwargs.get("media")  # pre-split: the microbatch's own input; else the staged lists
            cursor = module.__dict__.get(CURSOR_ATTRIBUTE) if media is None else media.index
            self.trace.append((cursor, _microbatch_of(args[0], self.current["input_ids"], self.current["samples"])))
            for name, attribute in STAGED_ATTRIBUTES.items():
                if media is not None:
                    view = None if media.chunk is None else getattr(media.chunk, name)
                    if view is not None:
                        self.views.append((media.index, name, view))
                    continue
                staged = module.__dict__.get(attribute)
                if cursor is not None and staged is not None and cursor < len(staged) and staged[cursor].numel():
                    self.views.append((cursor, name, staged[cursor]))

        def count(attr: str) -> Any:
            def hook(*_: Any) -> None:
                setattr(self, attr, getattr(self, attr) + 1)

            return hook

        if built.first is not None:
            self.handles.append(built.first.submod.register_forward_pre_hook(record, with_kwargs=True))
        for module in built.modules:
            decoder = list(module.stage_language_model.layers)
            self.layers += len(decoder)
            ids = {id(layer) for layer in decoder}
            for sub in module.modules():
                if isinstance(sub, _checkpoint_layer_class()):
                    child = next(iter(sub.children()), None)
                    if child is not None:
                        attr = "layer_calls" if id(sub) in ids else "vision_calls"
                        self.handles.append(child.register_forward_pre_hook(count(attr)))

    def reset(self, input_ids: torch.Tensor, samples: Any) -> None:
        self.current.update(input_ids=input_ids, samples=samples)
        self.trace.clear()
        self.views.clear()
        self.layer_calls = self.vision_calls = 0

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _checkpoint_layer_class() -> type[torch.nn.Module]:
    """transformers' checkpointable layer class (decoder layers and vision blocks)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return GradientCheckpointingLayer


def _media_rows(probe: _Probe, media_batch: dict[str, Any], global_split: Any, g: _Groups, n: int, where: str) -> list[list[Any]]:
    """Locate every consumed media view in the GLOBAL batch's tensor and check that it covers exactly
    the rows of this replica's microbatch (so no replica's media ever reach another)."""
    rows = []
    for chunk, name, view in probe.views:
        whole = media_batch[global_split.sources[name]]
        if view.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr():
            raise AssertionError(f"{where}: staged {name} of chunk {chunk} is not a view of the batch's tensor")
        stride = whole.stride(0) if whole.dim() else 1
        start = (view.storage_offset() - whole.storage_offset()) // max(stride, 1)
        expected = global_split.ranges[name][g.dp_rank * n + chunk]
        if (start, start + view.shape[0]) != tuple(expected):
            raise AssertionError(
                f"{where}: replica {g.dp_rank} chunk {chunk} staged {name} rows {start}:{start + view.shape[0]} "
                f"of the global batch; its own samples' rows are {expected[0]}:{expected[1]}"
            )
        rows.append([g.dp_rank, chunk, name, int(start), int(start + view.shape[0])])
    return rows


def _pipeline_step(built: _Built, scenario: Scenario, g: _Groups, local: dict[str, Any], media_local: dict[str, Any],
                   num_valid: int, probe: _Probe, adapter: Any, config: Any, n: int,
                   accumulate: bool = False) -> tuple[list[torch.Tensor], float, Any]:
    """One schedule step on this replica's share, then the tied and data-parallel reductions
    (``accumulate``: keep the gradients already there, and leave the reductions to the next step)."""
    from ...pipeline import all_reduce_gradients, make_labels, sync_tied_gradients
    from ...producer.presplit import microbatch_inputs
    from ...producer.staging import stage_media

    import torch.distributed as dist

    staged = _balanced_split(adapter, config, local, n) if scenario.balance else _split(adapter, config, dict(media_local), n)
    ids, mask = local["input_ids"], local["attention_mask"]  # reordered in place by a balanced split
    labels = make_labels(ids, config, adapter, attention_mask=mask)
    probe.reset(ids, staged.samples)
    if not (accumulate or scenario.variant == "varlen"):
        built.optimizer.zero_grad(set_to_none=True)
    losses: list[torch.Tensor] = []
    dist.barrier()
    t0 = time.perf_counter()
    staging: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if scenario.encoder == "spread":  # every rank: its share of the encoding; stage 0 also stages
        from ...pipeline import encoder_spread_of

        spread = encoder_spread_of(built.stages)
        if not scenario.lane:  # every encode before the schedule, every backward after it
            spread.set_background(False)
        if scenario.fault == "stale_copies":  # the copies keep the weights of the first step
            spread.refresh = lambda everything=True: None  # type: ignore[method-assign]
        staging = spread.step(staged, ids, stage=not scenario.presplit)
    elif built.first is not None and not scenario.presplit:
        staging = stage_media(built.first.submod if scenario.fault == "bare_module" else built.first, staged)
    loss_kwargs = {"num_valid_tokens": num_valid}
    with staging:
        if scenario.presplit:  # every rank the same microbatches; each one's media its own `media` input
            inputs = microbatch_inputs(staged, ids, mask, target=labels, loss_kwargs=loss_kwargs)
            built.schedule.step(**inputs.step_kwargs(), losses=losses)
        else:
            built.schedule.step(ids, mask, target=labels, losses=losses, loss_kwargs=loss_kwargs)
    if accumulate:
        return losses, time.perf_counter() - t0, staged
    if scenario.tp > 1 and scenario.fault != "unreduced_tower":
        from ...pipeline import reduce_tensor_parallel_gradients

        reduce_tensor_parallel_gradients(built.modules)
    sync_tied_gradients(built.modules, built.tied, group=g.pp_group)
    if g.dp > 1 and not scenario.fsdp:  # FSDP2 has reduce-scattered them over the dp mesh
        all_reduce_gradients(built.modules, group=g.dp_group)
    return losses, time.perf_counter() - t0, staged


def _eval_loss(built: _Built, scenario: Scenario, local: dict[str, Any], media_local: dict[str, Any], num_valid: int,
               probe: _Probe, adapter: Any, config: Any, n: int) -> float | None:
    """``eval``: the global loss of ``eval_step`` on this replica's share (staged or pre-split as the
    scenario says), before the step's training step; ``None`` for other variants."""
    if scenario.variant != "eval":
        return None
    from ...pipeline import eval_step, make_labels

    staged = _split(adapter, config, dict(media_local), n)
    ids, mask = local["input_ids"], local["attention_mask"]
    labels = make_labels(ids, config, adapter, attention_mask=mask)
    probe.reset(ids, staged.samples)  # its calls are not counted: the training step resets again
    first = built.first
    loss = eval_step(built.schedule, first, staged if (first is not None or scenario.presplit) else None,
                     ids, mask, labels, num_valid, presplit=scenario.presplit)
    return float(loss)


def _encoded_rows(built: _Built, scenario: Scenario, staged: Any, g: _Groups, where: str) -> list[list[int]]:
    """Spread: ``[dp_rank, pp_rank, microbatch]`` per chunk this rank encoded; checks that it encoded
    exactly its share of the plan and that the plan gives every microbatch with media an encoder."""
    if scenario.encoder != "spread":
        return []
    from ...pipeline import encoder_spread_of

    spread = encoder_spread_of(built.stages)
    plan = spread.last_plan
    assert plan is not None
    for k in range(staged.n_microbatches):
        chunk = staged.chunk(k)  # per-sample inputs alone (PaliGemma's token types) are no media to encode
        if bool(plan.names[k]) != (chunk is not None and chunk.has_media):
            raise AssertionError(f"{where}: microbatch {k}: plan {plan.names[k]} but chunk {staged.chunk(k)!r:.60}")
    if spread.last_encoded != plan.encoded_by(spread.rank):
        raise AssertionError(f"{where}: rank {spread.rank} encoded {spread.last_encoded}; its share is {plan.encoded_by(spread.rank)}")
    return [[g.dp_rank, spread.rank, k] for k in spread.last_encoded]


def _padded(batch: dict[str, Any], config: Any, columns: int) -> dict[str, Any]:
    """``batch`` with ``columns`` more padding positions at the end of every row (another ``S``)."""
    from ...adapters.base import config_value

    ids, mask = batch["input_ids"], batch["attention_mask"]
    pad = int(config_value(config, "pad_token_id", "text_config.pad_token_id"))
    extra = torch.full((ids.shape[0], columns), pad, dtype=ids.dtype)
    return dict(batch, input_ids=torch.cat([ids, extra], 1), attention_mask=torch.cat([mask, torch.zeros_like(extra)], 1))


def _accumulate_padded(built: _Built, scenario: Scenario, g: _Groups, seed: int, probe: _Probe, tiny_module: Any,
                       n: int) -> None:
    """``varlen``: zero the gradients, then one schedule step (and one reference forward and backward)
    on another batch, right-padded by :data:`VARLEN_PAD` columns; the step's own batch follows."""
    from ...pipeline import count_valid_tokens, make_labels, shard_batch
    from ...registry import get_adapter

    config = built.reference.config
    adapter = get_adapter(config)
    batch = _padded(dict(tiny_module.build_batch(seed)), config, VARLEN_PAD)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    num_valid = count_valid_tokens(make_labels(ids, config, adapter, attention_mask=mask))
    local = shard_batch(batch, g.dp_rank, g.dp, **adapter.media_counts(batch, config)) if g.dp > 1 else dict(batch)
    built.optimizer.zero_grad(set_to_none=True)
    _pipeline_step(built, scenario, g, local, dict(local), num_valid, probe, adapter, config, n, accumulate=True)
    _reference_step(built, tiny_module, batch, make_labels(ids, config, adapter, attention_mask=mask, shift=False))


def _reference_step(built: _Built, tiny_module: Any, batch: dict[str, Any], targets: torch.Tensor,
                    accumulate: bool = False) -> tuple[Any, float]:
    t0 = time.perf_counter()
    if not accumulate:
        built.ref_optimizer.zero_grad(set_to_none=True)
    inputs = dict(tiny_module.reference_inputs(batch))
    inputs.setdefault("use_cache", False)
    out = built.reference(**inputs, labels=targets)
    out.loss.backward()
    return out, time.perf_counter() - t0


def _clip_both(built: _Built, g: _Groups) -> tuple[float, float]:
    """Clip the reference to half its global norm with torch, the pipeline to the same with ppmedia."""
    from ...pipeline import clip_grad_norm

    ref_norm = float(torch.nn.utils.clip_grad_norm_(built.reference.parameters(), float("inf")))
    max_norm = 0.5 * ref_norm
    torch.nn.utils.clip_grad_norm_(built.reference.parameters(), max_norm)
    norm = clip_grad_norm(built.modules, max_norm, tied=built.tied, group=g.pp_group)
    return float(norm), ref_norm


def _compare(built: _Built) -> tuple[dict[bool, float], dict[bool, float], dict[bool, int], dict[bool, str | None]]:
    """Max |grad diff|, max |reference grad|, parameter counts and the parameter with the largest
    difference, per side (True: language model)."""
    ref_params = dict(built.reference.named_parameters(remove_duplicate=False))
    diffs = {True: 0.0, False: 0.0}
    scale = {True: 0.0, False: 0.0}
    counts = {True: 0, False: 0}
    worst: dict[bool, str | None] = {True: None, False: None}
    for name, (param, is_lm) in built.owned.items():  # the same order on every replica (collectives)
        ref_grad = ref_params[name].grad
        grad = None if param.grad is None else _full(param.grad).float()
        diff = _max_abs_diff(grad, ref_grad)
        if worst[is_lm] is None or diff > diffs[is_lm]:
            diffs[is_lm], worst[is_lm] = diff, name
        scale[is_lm] = max(scale[is_lm], _max_abs_diff(ref_grad, None))
        counts[is_lm] += 1
    return diffs, scale, counts, worst


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: an FSDP2 shard (``DTensor``) gathered over its data-parallel mesh."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _check_calls(probe: _Probe, built: _Built, scenario: Scenario, step: int, n: int, where: str) -> tuple[int, int]:
    """Stage 0 ran once per microbatch (plus the shape-inference forward) on its own chunk; returns
    the decoder layers' calls and the expected number."""
    # varlen: every schedule step has another S than the previous one, so shapes are inferred again;
    # eval: every step follows an eval() (a switch from training and back)
    inference = scenario.shapes == "inferred" and (step == 0 or scenario.variant in ("varlen", "eval"))
    expected_calls = n + inference
    if built.first is not None:
        if len(probe.trace) != expected_calls:
            raise AssertionError(f"{where}: stage 0's forward ran {len(probe.trace)} times; expected {expected_calls}")
        for cursor, microbatch in probe.trace:
            if cursor != microbatch or microbatch < 0:
                raise AssertionError(
                    f"{where}: stage 0 consumed chunk {cursor} for the rows of microbatch {microbatch} (trace {probe.trace})"
                )
    if scenario.checkpointing and (inference or _splits_backward(built.schedule)):
        # not a fixed count: torch's shape inference and its split backward (backward_input, then
        # backward_weight per parameter group) each re-run checkpointed layers; reported, not checked
        return expected_calls, -1
    expected_layers = probe.layers * (n * (2 if scenario.checkpointing else 1) + inference)
    return expected_calls, expected_layers


def _splits_backward(schedule: Any) -> bool:
    """Whether the schedule runs backward_input and backward_weight separately (zero-bubble ones)."""
    order = getattr(schedule, "pipeline_order", None) or {}
    return any(
        getattr(getattr(a, "computation_type", None), "value", None) == "I" for actions in order.values() for a in actions
    )


def _shares(scenario: Scenario, tiny_module: Any, batch: dict[str, Any], media_seed: int, g: _Groups, adapter: Any,
            config: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(media_batch, local, media_local)``: what the pipeline runs (``batch``, packed with ``/packed``; the
    reference runs ``batch``), the batch its media come from, and this replica's shares of both."""
    from ...pipeline import shard_batch

    rows = _pipeline_batch(scenario, batch, config)
    media_batch = _build_batch(tiny_module, scenario, media_seed) if scenario.fault == "wrong_batch" else rows
    media_counts = adapter.media_counts(rows, config)
    if g.dp > 1:
        return media_batch, shard_batch(rows, g.dp_rank, g.dp, **media_counts), shard_batch(media_batch, g.dp_rank, g.dp, **media_counts)
    return media_batch, dict(rows), dict(media_batch)


def _run_scenario(
    family: str, scenario: Scenario, job: _Job, rank: int, world: int, pristine: torch.nn.Module, tiny_module: Any,
    checkpoint: str | None = None,
) -> dict[str, Any]:
    from ...pipeline import count_valid_tokens, make_labels, shard_batch
    from ...registry import get_adapter

    n = scenario.microbatches or job.n_microbatches
    adapter, config = get_adapter(pristine), pristine.config
    g = _groups(world, rank, scenario.dp, scenario.tp)
    built = _build(scenario, job, g, pristine, tiny_module, checkpoint)
    loaded = _loaded(built, scenario, g, checkpoint)
    probe = _Probe(built)
    step_results = []
    try:
        for step in range(job.steps):
            where = f"{family} {scenario.name} step {step}"
            batch = _build_batch(tiny_module, scenario, job.seed + step)
            ids, mask = batch["input_ids"], batch["attention_mask"]
            num_valid = count_valid_tokens(make_labels(ids, config, adapter, attention_mask=mask))
            media_batch, local, media_local = _shares(scenario, tiny_module, batch, job.seed + 1000 + step, g, adapter, config)
            if scenario.variant == "varlen":
                _accumulate_padded(built, scenario, g, job.seed + 500 + step, probe, tiny_module, n)
            loss_eval = _eval_loss(built, scenario, local, media_local, num_valid, probe, adapter, config, n)
            losses, wall_pipeline, staged = _pipeline_step(built, scenario, g, local, media_local, num_valid, probe, adapter, config, n)
            targets = make_labels(ids, config, adapter, attention_mask=mask, shift=False)
            out, wall_reference = _reference_step(built, tiny_module, batch, targets, accumulate=scenario.variant == "varlen")
            norms = _clip_both(built, g) if scenario.clip else (None, None)
            diffs, scale, counts, worst = _compare(built)
            expected_calls, expected_layers = _check_calls(probe, built, scenario, step, n, where)
            global_split = _split(adapter, config, dict(media_batch), g.dp * n)
            step_results.append(
                {
                    "step": step,
                    # one last stage per replica: its tp peers' losses are the same loss
                    "loss_pipeline": float(sum(l.detach().float() for l in losses)) if losses and not g.tp_rank else None,
                    "loss_reference": float(out.loss.detach()),
                    "grad_diff_vision": diffs[False],
                    "grad_diff_lm": diffs[True],
                    "params_compared": len(built.owned),
                    "vision_params_compared": counts[False],
                    "worst_param_vision": worst[False],
                    "worst_param_lm": worst[True],
                    "reference_grad_max_vision": scale[False],
                    "reference_grad_max_lm": scale[True],
                    "wall_pipeline_s": wall_pipeline,
                    "wall_reference_s": wall_reference,
                    "first_stage_calls": len(probe.trace) if built.first is not None else None,
                    "expected_first_stage_calls": expected_calls,
                    "chunk_trace": [c for c, _ in probe.trace] if built.first is not None else None,
                    "grad_norm_pipeline": norms[0],
                    "grad_norm_reference": norms[1],
                    "layer_calls": probe.layer_calls,
                    "expected_layer_calls": expected_layers,
                    "vision_layer_calls": probe.vision_calls,
                    # a balanced split copies the media in the new order: nothing to locate in the batch
                    "media_rows": [] if scenario.balance else _media_rows(probe, media_batch, global_split, g, n, where),
                    "encoded": _encoded_rows(built, scenario, staged, g, where),
                    "loss_eval": loss_eval,
                    "position_problems": built.positions.take() if built.positions is not None else [],
                }
            )
            built.optimizer.step()
            built.ref_optimizer.step()
    finally:
        probe.remove()
        if built.positions is not None:
            built.positions.remove()
    return {
        "family": family,
        "scenario": asdict(scenario),
        "n_stages": built.n_stages,
        "layers_per_stage": built.layers_per_stage,
        "stage_indices": built.indices,
        "dp_rank": g.dp_rank,
        "tp_rank": g.tp_rank,
        "loaded": loaded,
        "owned": sorted(built.owned),
        "all_params": sorted(dict(built.reference.named_parameters(remove_duplicate=False))),
        "steps": step_results,
    }


def _run_family(family: str, job: _Job, rank: int, world: int) -> dict[str, Any]:
    from .. import tiny_models as tiny

    module = tiny.load(family)
    pristine = module.build_model(job.seed)
    batch = module.build_batch(job.seed)
    from ...registry import get_adapter

    specs = job.scenarios_of(family)
    dp = max((spec.get("dp", 1) for spec in specs), default=1)
    infos = _microbatch_infos(get_adapter(pristine), pristine.config, dict(batch), job.n_microbatches, dp)
    wants_checkpoint = any(spec.get("pretrained") for spec in specs)
    with _checkpoint(module, job, rank) if wants_checkpoint else contextlib.nullcontext((pristine, None)) as (written, path):
        results = [
            _run_scenario(family, Scenario(**spec), job, rank, world, written if spec.get("pretrained") else pristine,
                          module, path)
            for spec in specs
        ]
    return {
        "family": family,
        "model_type": pristine.config.model_type,
        "n_microbatches": job.n_microbatches,
        "batch_size": int(batch["input_ids"].shape[0]),
        "seq_len": int(batch["input_ids"].shape[1]),
        "microbatches": [asdict(i) for i in infos],
        "scenarios": results,
    }


@contextlib.contextmanager
def _checkpoint(tiny_module: Any, job: _Job, rank: int) -> Iterator[tuple[torch.nn.Module, str]]:
    """Rank 0 writes the tiny model (``build_checkpoint_model`` if the module has one, else
    ``build_model``) with ``save_pretrained`` in 40 KB shards; yields ``(model, directory)`` on every
    rank and removes the directory afterwards (collective: every rank enters)."""
    import shutil

    import torch.distributed as dist

    build = getattr(tiny_module, "build_checkpoint_model", tiny_module.build_model)
    model = build(job.seed)
    box: list[Any] = [None]
    if rank == 0:
        from transformers.utils import logging as hf_logging

        box[0] = tempfile.mkdtemp(prefix="ppmedia-parity-checkpoint-")
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            model.save_pretrained(box[0], max_shard_size="40KB")
        finally:
            if bars:
                hf_logging.enable_progress_bar()
    dist.broadcast_object_list(box, src=0)
    try:
        yield model, box[0]
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(box[0], ignore_errors=True)


def _merge_step(k: int, rows: list[dict[str, Any]]) -> StepResult:
    losses = [r["loss_pipeline"] for r in rows if r["loss_pipeline"] is not None]
    calls = next((r for r in rows if r["first_stage_calls"] is not None), rows[0])
    return StepResult(
        step=k,
        loss_pipeline=sum(losses) if losses else float("nan"),  # one last stage per replica
        loss_reference=rows[0]["loss_reference"],
        grad_diff_vision=max(r["grad_diff_vision"] for r in rows),
        grad_diff_lm=max(r["grad_diff_lm"] for r in rows),
        worst_param_vision=_worst(rows, "vision"),
        worst_param_lm=_worst(rows, "lm"),
        params_compared=sum(r["params_compared"] for r in rows),
        vision_params_compared=sum(r["vision_params_compared"] for r in rows),
        reference_grad_max_vision=max(r["reference_grad_max_vision"] for r in rows),
        reference_grad_max_lm=max(r["reference_grad_max_lm"] for r in rows),
        wall_pipeline_s=max(r["wall_pipeline_s"] for r in rows),
        wall_reference_s=max(r["wall_reference_s"] for r in rows),
        first_stage_calls=calls["first_stage_calls"] if calls["first_stage_calls"] is not None else -1,
        expected_first_stage_calls=calls["expected_first_stage_calls"],
        chunk_trace=list(calls["chunk_trace"] or []),
        grad_norm_pipeline=rows[0]["grad_norm_pipeline"],
        grad_norm_reference=rows[0]["grad_norm_reference"],
        layer_calls=sum(r["layer_calls"] for r in rows),
        expected_layer_calls=(
            -1 if any(r["expected_layer_calls"] < 0 for r in rows) else sum(r["expected_layer_calls"] for r in rows)
        ),
        vision_layer_calls=sum(r["vision_layer_calls"] for r in rows),
        media_rows=[row for r in rows for row in r["media_rows"]],
        encoded=[row for r in rows for row in r.get("encoded", [])],
        loss_eval=rows[0].get("loss_eval"),
        position_problems=[p for r in rows for p in r.get("position_problems", [])],
    )


def _worst(rows: list[dict[str, Any]], side: str) -> str | None:
    """The parameter with the largest gradient difference of ``side`` over every rank's rows."""
    named = [r for r in rows if r.get(f"worst_param_{side}") is not None]
    return max(named, key=lambda r: r[f"grad_diff_{side}"])[f"worst_param_{side}"] if named else None


def _merge_scenario(family: str, views: list[dict[str, Any]]) -> ScenarioResult:
    s0 = views[0]
    owned = set().union(*(v["owned"] for v in views))
    steps = [_merge_step(k, [v["steps"][k] for v in views]) for k in range(len(s0["steps"]))]
    sc = s0["scenario"]
    return ScenarioResult(
        family=family,
        schedule=sc["schedule"],
        shapes=sc["shapes"],
        fault=sc["fault"],
        n_stages=s0["n_stages"],
        layers_per_stage=list(s0["layers_per_stage"]),
        steps=steps,
        missing_params=sorted(set(s0["all_params"]) - owned),
        dp=sc["dp"],
        checkpointing=sc["checkpointing"],
        dtype=sc["dtype"],
        clip=sc["clip"],
        layers=None if sc.get("layers") is None else list(sc["layers"]),
        variant=sc.get("variant"),
        balance=sc.get("balance", False),
        encoder=sc.get("encoder", "stage0"),
        lane=sc.get("lane", True),
        pretrained=sc.get("pretrained", False),
        fsdp=sc.get("fsdp", False),
        microbatches=sc.get("microbatches"),
        tp=sc.get("tp", 1),
        presplit=sc.get("presplit", False),
        packed=sc.get("packed", False),
        stage_indices=[list(v["stage_indices"]) for v in views if v["dp_rank"] == 0 and not v.get("tp_rank")],
        loaded=[dict(v.get("loaded") or {}) for v in views],
    )


def _merge(per_rank: list[list[dict[str, Any]]], world: int, tolerance: float, launcher: str, wall: float) -> ParityReport:
    families = []
    for f_index, base in enumerate(per_rank[0]):
        scenarios = [
            _merge_scenario(base["family"], [per_rank[r][f_index]["scenarios"][s_index] for r in range(world)])
            for s_index in range(len(base["scenarios"]))
        ]
        families.append(
            FamilyReport(
                family=base["family"],
                model_type=base["model_type"],
                n_microbatches=base["n_microbatches"],
                batch_size=base["batch_size"],
                seq_len=base["seq_len"],
                microbatches=[MicrobatchInfo(**m) for m in base["microbatches"]],
                scenarios=scenarios,
            )
        )
    return ParityReport(world_size=world, tolerance=tolerance, launcher=launcher, wall_s=wall, families=families)


def run_worker(
    rank: int,
    world_size: int,
    init_method: str,
    job: dict[str, Any],
    tolerance: float = 1e-5,
    launcher: str = "spawn",
) -> ParityReport:
    """One worker of a parity run: joins the gloo group, runs every family and scenario of ``job``,
    gathers all ranks' results and returns the merged report (on every rank).

    ``job`` holds ``families``, ``scenarios`` (dicts of :class:`Scenario` fields), ``steps``,
    ``n_microbatches``, ``seed``, ``lr`` and optionally ``extra`` (family -> its own scenario dicts). ``init_method`` is ``tcp://127.0.0.1:PORT`` or ``env://``.

    With ``env://`` (torchrun) the process group is created on the first call and kept for later
    calls in the same process (``ppmedia demo`` runs one family per call): re-creating it would
    meet the previous incarnation's keys in torchrun's agent store, which breaks the ``dp``/``pp``
    sub-groups. The launcher's process ends with :func:`exit_worker`. A spawned worker destroys its
    group before returning.
    """
    import torch.distributed as dist

    torch.set_num_threads(1)
    spec = _Job(**job)
    start = time.perf_counter()
    keep = init_method == "env://"
    if not (keep and dist.is_initialized()):
        kwargs: dict[str, Any] = {"timeout": timedelta(seconds=60)}
        if keep:
            dist.init_process_group("gloo", init_method="env://", **kwargs)
        else:
            dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size, **kwargs)
    try:
        mine = [_run_family(family, spec, dist.get_rank(), dist.get_world_size()) for family in spec.all_families()]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        return _merge(gathered, dist.get_world_size(), tolerance, launcher, time.perf_counter() - start)
    finally:
        gc.collect()
        if not keep:
            _GROUP_CACHE.clear()  # the sub-groups die with the process group
            dist.destroy_process_group()


def _spawn_entry(rank: int, world_size: int, init_method: str, job: dict[str, Any], tolerance: float, out_dir: str) -> None:
    import faulthandler

    faulthandler.enable(all_threads=True)
    try:
        report = run_worker(rank, world_size, init_method, job, tolerance, launcher="spawn")
    except BaseException as exc:
        with open(os.path.join(out_dir, f"error-rank{rank}.txt"), "w") as fh:
            fh.write(_root_cause(exc).replace("\n", " ") + "\n" + traceback.format_exc())
        raise
    if rank == 0:
        path = os.path.join(out_dir, "report.json")
        with open(path + ".tmp", "w") as fh:
            json.dump(report.to_dict(), fh)
        os.replace(path + ".tmp", path)
    exit_worker(0)


def exit_worker(code: int) -> None:
    """End a finished gloo worker process with ``code``, without the interpreter's teardown.

    Now and then (about 1 run in 15 here) a gloo worker aborted during interpreter shutdown, after its
    work was done and its process group destroyed ("terminate called without an active exception"):
    a C++ thread of torch.distributed still joinable when its owner was destroyed at exit. The results
    are already written by then; skipping the teardown keeps that crash from failing a good run.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _root_cause(exc: BaseException) -> str:
    """``Type: message`` of the innermost exception of ``exc``'s chain (what actually went wrong)."""
    seen = {id(exc)}
    while True:
        inner = exc.__cause__ or exc.__context__
        if inner is None or id(inner) in seen:
            break
        seen.add(id(inner))
        exc = inner
    return f"{type(exc).__name__}: {exc}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_by_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (or another env:// launcher)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _validate(families: list[str], scenarios: list[Scenario], n_microbatches: int, world_size: int, steps: int) -> None:
    from ...pipeline import schedule_layout
    from .. import tiny_models as tiny

    for family in families:
        tiny.load(family)  # a built-in name or a plugin's dotted module name; ValueError/TypeError if neither
    if steps < 1:
        raise ValueError(f"steps: got {steps}; expected >= 1")
    if world_size < 1:
        raise ValueError(f"world_size: got {world_size}; expected >= 1")
    batch_size = 8  # every tiny batch
    if n_microbatches < 1 or batch_size % n_microbatches:
        raise ValueError(
            f"n_microbatches: got {n_microbatches}; the tiny batches have {batch_size} samples and the "
            f"schedules need equal microbatches: use 1, 2, 4 or 8"
        )
    for sc in scenarios:
        if world_size % (sc.dp * sc.tp):
            raise ValueError(f"{sc.name}: dp {sc.dp} x tp {sc.tp} does not divide the {world_size} processes")
        total = batch_size // PACKED_PER_ROW if sc.packed else batch_size
        rows = total // sc.dp if total % sc.dp == 0 else 0
        n = sc.microbatches or n_microbatches
        if rows == 0 or n < 1 or rows % n:
            raise ValueError(
                f"{sc.name}: {sc.dp} replicas of the {batch_size}-sample batch cannot each run {n} "
                f"equal microbatches"
            )
        n_stages = schedule_layout(sc.schedule).n_stages(world_size // (sc.dp * sc.tp))
        if sc.layers is not None and len(sc.layers) != n_stages:
            raise ValueError(f"{sc.name}: {len(sc.layers)} layer counts for {n_stages} stages")
        for family in families:
            _refuse_idle_ranks(family, sc, world_size // (sc.dp * sc.tp))
        if sc.variant == "text_only_first":
            for family in families:
                if "text_only_first" not in inspect.signature(tiny.load(family).build_batch).parameters:
                    raise ValueError(f"{sc.name}: the tiny {family} batch has no text_only_first order")
        if sc.fault == "stale_copies" and sc.encoder != "spread":
            raise ValueError(f"{sc.name}: the stale_copies fault breaks the encoder spread: add /spread")
        if sc.encoder == "spread" and sc.fault not in (None, "stale_copies"):
            raise ValueError(f"{sc.name}: the encoder spread runs no fault but stale_copies")
        if sc.encoder == "spread" and sc.pretrained:
            raise ValueError(f"{sc.name}: the encoder spread cuts its vision copies from the full model; "
                             f"stages_from_pretrained gives none: drop /pretrained or /spread")
        if sc.balance and (sc.dp != 1 or sc.fault is not None):
            raise ValueError(f"{sc.name}: balancing is run with one replica and no fault")
        if sc.pretrained and sc.checkpointing:
            raise ValueError(f"{sc.name}: a scenario loads its stages from a checkpoint or checkpoints activations, not both")
        if sc.fsdp and sc.dp < 2:
            raise ValueError(f"{sc.name}: fsdp shards over the data-parallel replicas: use dp2 or more")
        if sc.variant == "text_only_replica" and sc.dp != 2:
            raise ValueError(f"{sc.name}: text_only_replica gives replica 0 of two the text-only half: use dp2")
        if sc.fault in PACKED_FAULTS and not sc.packed:
            raise ValueError(f"{sc.name}: the {sc.fault} fault breaks packed rows: add /packed")
        if sc.packed and (sc.variant is not None or sc.balance or sc.encoder != "stage0" or sc.pretrained):
            raise ValueError(f"{sc.name}: /packed runs with stage0 encoding, no variant, balancing or checkpoint")
        if sc.fault == "unreduced_tower" and sc.tp < 2:
            raise ValueError(f"{sc.name}: the unreduced_tower fault breaks tensor parallelism: add /tp2")
        if sc.tp > 1 and sc.encoder == "spread":
            raise ValueError(f"{sc.name}: the encoder spread does not go with tensor parallelism")
        if sc.fault == "bare_module" and sc.shapes != "inferred":
            raise ValueError(f"{sc.name}: the bare_module fault only breaks a run with inferred shapes")


def _refuse_idle_ranks(family: str, sc: Scenario, pp: int) -> None:
    """A pipeline rank whose stages hold neither a decoder layer nor the first or last stage has nothing
    to train (and torch's optimizer refuses an empty parameter list): refuse it before spawning."""
    from ...pipeline import default_layer_split, schedule_layout
    from .. import tiny_models as tiny

    layout = schedule_layout(sc.schedule)
    n_stages = layout.n_stages(pp)
    config = tiny.load(family).build_config()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_layers = int(getattr(text, "num_hidden_layers"))
    layers = list(sc.layers) if sc.layers is not None else default_layer_split(num_layers, n_stages)
    for rank in range(pp):
        indices = layout.stage_indices(rank, pp)
        if all(layers[i] == 0 and 0 < i < n_stages - 1 for i in indices):
            raise ValueError(
                f"{sc.name}: {n_stages} pipeline stages ({pp} ranks x {layout.stages_per_rank}) for the {num_layers} decoder "
                f"layers of {family} (per stage {layers}): pipeline rank {rank} would hold only stages {indices}, "
                f"without a layer; use at most {max(1, (num_layers + 2) // layout.stages_per_rank)} pipeline ranks for "
                f"{layout.name}" + (", or a schedule with one stage per rank" if layout.stages_per_rank > 1 else "")
            )


def run_parity(
    families: str | Sequence[str],
    scenarios: Iterable[str | Scenario] = DEFAULT_SCENARIOS,
    *,
    steps: int = 2,
    n_microbatches: int = 4,
    seed: int = 0,
    lr: float = 1e-2,
    tolerance: float = 1e-5,
    world_size: int = 2,
    family_scenarios: Mapping[str, Iterable[str | Scenario]] | None = None,
    rtol: float = 0.0,
) -> ParityReport:
    """Run ``families`` through a real multi-process pipeline and compare with the model itself.

    Every family runs every scenario in ONE set of worker processes (starting a pair costs seconds).
    Under ``torchrun`` (:func:`launched_by_torchrun`) the current process is the worker: environment
    rendezvous, the launcher's world size; every rank returns the merged report.

    Args:
        families: one family name or several (``ppmedia.testing.tiny_models.FAMILIES``).
        scenarios: :class:`Scenario` objects or strings such as ``"1f1b/static"``.
        steps: training steps per scenario; an SGD step (``lr``) follows each, on both sides.
        n_microbatches: microbatches per step (the tiny batches have 8 samples).
        seed: model and batch seed (step ``k`` uses batch ``seed + k``).
        lr: the SGD learning rate of the steps, at most a tiny module's ``MAX_PARITY_LR`` (Gemma 4's
            tiny model: 1e-4).
        tolerance: what :meth:`ScenarioResult.passed` and :attr:`ParityReport.ok` accept: the
            absolute bound on the loss difference and on every gradient difference (float32).
        rtol: a relative bound beside it: a value passes within ``tolerance + rtol * scale``, the
            scale being the reference loss, or the largest reference gradient entry of the side
            (vision or language model). 0 (the default): absolute only. For families whose
            gradients are large (entries of 1e3 and more), where float32 rounding alone exceeds 1e-5.
        world_size: processes to spawn (ignored under torchrun).
        family_scenarios: more scenarios for single families, run in the same processes after
            ``scenarios`` (a family named only here runs only its own).

    Raises:
        ParityError: a worker failed (its traceback is in the message).
        ValueError: bad arguments (checked before anything starts).
    """
    if not (isinstance(tolerance, (int, float)) and tolerance >= 0 and isinstance(rtol, (int, float)) and rtol >= 0):
        raise ValueError(f"run_parity: tolerance {tolerance!r}, rtol {rtol!r}; expected numbers >= 0")
    names = [families] if isinstance(families, str) else list(families)
    specs = parse_scenarios(scenarios)
    extra = {family: parse_scenarios(more) for family, more in (family_scenarios or {}).items()}
    if launched_by_torchrun():
        world_size = int(os.environ["WORLD_SIZE"])
    _validate(names, specs, n_microbatches, world_size, steps)
    for family, more in extra.items():
        _validate([family], more, n_microbatches, world_size, steps)
    job = asdict(_Job(names, [asdict(s) for s in specs], steps, n_microbatches, seed, lr,
                      {family: [asdict(s) for s in more] for family, more in extra.items()}))

    if launched_by_torchrun():
        try:
            nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))  # torchrun's agents (nodes)
            launcher = f"torchrun, {nodes} nodes" if nodes > 1 else "torchrun"
            report = run_worker(int(os.environ["RANK"]), world_size, "env://", job, tolerance, launcher=launcher)
            report.rtol = rtol
            return report
        except Exception as exc:
            raise ParityError(f"parity worker failed on rank {os.environ['RANK']}: {_root_cause(exc)}") from exc

    import multiprocessing

    import torch.multiprocessing as mp

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(_MAIN_GUARD)
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    with tempfile.TemporaryDirectory(prefix="ppmedia-parity-") as out_dir:
        try:
            mp.spawn(
                _spawn_entry,
                args=(world_size, init_method, job, tolerance, out_dir),
                nprocs=world_size,
                join=True,
            )
        except Exception as exc:  # ProcessRaisedException / ProcessExitedException
            summaries, details = [], []
            for rank in range(world_size):
                path = os.path.join(out_dir, f"error-rank{rank}.txt")
                if os.path.exists(path):
                    with open(path) as fh:
                        summary, _, trace = fh.read().partition("\n")
                    summaries.append(f"rank {rank}: {summary}")
                    details.append(f"--- rank {rank} ---\n{trace}")
            if not summaries:  # no worker got as far as _spawn_entry
                summaries.append(f"{exc} (no worker reached the harness: a call of run_parity at the top level of a "
                                 f"script needs `if __name__ == \"__main__\":` around it, the workers import the script)")
            raise ParityError("parity worker failed: " + "; ".join(summaries) + "\n" + "\n".join(details)) from exc
        with open(os.path.join(out_dir, "report.json")) as fh:
            report = ParityReport.from_dict(json.load(fh))
        report.rtol = rtol
        return report


#: what a worker says when run_parity is called while it imports the script (no ``__main__`` guard)
_MAIN_GUARD = (
    "run_parity: called while a spawned worker imports the main module: the workers start by importing "
    "the script that called run_parity, so a call at its top level runs again in each of them; put the "
    "call under `if __name__ == \"__main__\":`"
)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ppmedia.testing.parity [FAMILY ...] [--scenario S ...] [--steps N] [--microbatches N] [--world-size N]``.

    Works as a plain command (spawns the workers) and under ``torchrun --nproc-per-node 2``.
    Prints the report (rank 0 only under torchrun); exit status 0 when every scenario passed.
    """
    import argparse

    from .. import tiny_models as tiny

    parser = argparse.ArgumentParser(prog="python -m ppmedia.testing.parity", description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", default=list(tiny.FAMILIES), help="families (default: all)")
    parser.add_argument(
        "--scenario", action="append",
        help="schedule[/shapes][/fault][/dpN][/tpN][/fsdp][/mbN][/ckpt][/bf16][/clip][/layers=A+B][/variant][/balanced][/pretrained][/spread][/nolane], e.g. ZBVZeroBubble/static/dp2 (repeatable; "
        "default: gpipe and 1f1b, both shapes); dpN needs N x pp processes (--world-size or torchrun)",
    )
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=2, help="processes to spawn (ignored under torchrun)")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="absolute bound on loss and gradient differences")
    parser.add_argument("--rtol", type=float, default=0.0,
                        help="relative bound beside it: pass within tolerance + rtol * scale (default 0)")
    args = parser.parse_args(argv)
    try:
        report = run_parity(
            args.families,
            args.scenario or DEFAULT_SCENARIOS,
            steps=args.steps,
            n_microbatches=args.microbatches,
            seed=args.seed,
            world_size=args.world_size,
            tolerance=args.tolerance,
            rtol=args.rtol,
        )
    except (ValueError, TypeError) as exc:  # arguments refused before anything started: one line
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    if not launched_by_torchrun() or os.environ.get("RANK") == "0":
        print(report.format())
    return 0 if report.ok else 1

