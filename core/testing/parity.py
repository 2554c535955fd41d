"""Parity harness: a tiny model family through a REAL multi-process pipeline vs. the model itself.

:func:`run_parity` spawns ``world_size`` (default 2) worker processes talking gloo on 127.0.0.1 (or,
launched under ``torchrun``, runs the worker in the current process with environment rendezvous).
Each worker builds the same tiny seeded model (``ppmedia.tiny``), its own pipeline stages
(:mod:`ppmedia.pipeline`) and runs every requested :class:`Scenario` for ``steps`` training steps::

    staged = split_media(batch, n, images_per_sample=..., videos_per_sample=...)
    with stage_media(first_stage, staged):
        schedule.step(input_ids, attention_mask, target=labels, losses=losses,
                      loss_kwargs={"num_valid_tokens": N})
    sync_tied_gradients(...); compare with the reference; SGD step (pipeline and reference)

The reference is computed in the same worker, single-process, on the full batch, by the model's OWN
forward (``model(**reference_inputs(batch), labels=...)``, transformers' own loss: the mean token
cross-entropy, i.e. the same normalisation as :func:`ppmedia.pipeline.pipeline_loss` summed over the
microbatches). Each rank compares the gradients of every parameter its stages hold (vision encoder on
the first stage, language model everywhere) with the reference's; the last stage compares the loss.

The worker also checks, on the first stage, that its forward ran ``n + 1`` times on the first step of
a scenario with inferred shapes (the schedule's shape-inference forward) and ``n`` times otherwise, and
that every call consumed the media chunk of the microbatch whose rows it got (a mismatch in counts
would already raise in ``adapter.merge``). A failed check raises in the worker, which fails the run.

Results come back as a :class:`ParityReport` (per family: a per-microbatch table and, per scenario and
step, both losses, the max gradient differences split into vision and language model, wall times).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Iterable, Sequence

import torch

from ..tables import format_table

__all__ = [
    "ALL_SCENARIOS",
    "DEFAULT_SCENARIOS",
    "FAULTS",
    "FamilyReport",
    "MicrobatchInfo",
    "ParityError",
    "ParityReport",
    "Scenario",
    "ScenarioResult",
    "StepResult",
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
FAULTS: tuple[str, ...] = ("bare_module", "wrong_batch")
_SHAPES = ("inferred", "static")


class ParityError(RuntimeError):
    """A worker failed; the message carries the worker's traceback."""


@dataclass(frozen=True)
class Scenario:
    """One pipeline configuration.

    Attributes:
        schedule: ``gpipe``, ``1f1b`` or ``interleaved`` (Interleaved1F1B, 2 stages per rank).
        shapes: ``inferred`` (the schedule infers shapes on the first step) or ``static``
            (``input_args``/``output_args`` on every stage).
        fault: ``None``, or one of :data:`FAULTS` to break the run on purpose.
        balance: reorder the samples for an even vision load (``split_media(balance=...)`` with the
            adapter's ``image_costs``); the reference still runs the original order.
    """

    schedule: str
    shapes: str = "inferred"
    fault: str | None = None
    balance: bool = False

    def __post_init__(self) -> None:
        from ..pipeline import SCHEDULES

        if self.schedule not in SCHEDULES:
            raise ValueError(f"scenario schedule: got {self.schedule!r}; expected one of {', '.join(SCHEDULES)}")
        if self.shapes not in _SHAPES:
            raise ValueError(f"scenario shapes: got {self.shapes!r}; expected one of {', '.join(_SHAPES)}")
        if self.fault is not None and self.fault not in FAULTS:
            raise ValueError(f"scenario fault: got {self.fault!r}; expected None or one of {', '.join(FAULTS)}")

    @property
    def name(self) -> str:
        """``schedule/shapes`` (plus ``/fault``, ``/balanced``)."""
        return "/".join([self.schedule, self.shapes] + ([self.fault] if self.fault else []) + (["balanced"] if self.balance else []))


#: GPipe and 1F1B, each with inferred and with static shapes.
DEFAULT_SCENARIOS: tuple[Scenario, ...] = tuple(
    Scenario(s, shapes) for s in ("gpipe", "1f1b") for shapes in _SHAPES
)
#: the defaults plus Interleaved1F1B (2 stages per rank) with both kinds of shapes.
ALL_SCENARIOS: tuple[Scenario, ...] = DEFAULT_SCENARIOS + tuple(Scenario("interleaved", s) for s in _SHAPES)


def parse_scenarios(specs: Iterable[str | Scenario]) -> list[Scenario]:
    """Scenarios from strings ``schedule[/shapes[/fault]]`` (``"1f1b/static"``) or :class:`Scenario`."""
    out = []
    for spec in specs:
        if isinstance(spec, Scenario):
            out.append(spec)
            continue
        parts = str(spec).replace(":", "/").split("/")
        balance = "balanced" in parts[1:]
        parts = [parts[0]] + [p for p in parts[1:] if p != "balanced"]
        if not 1 <= len(parts) <= 3:
            raise ValueError(f"scenario {spec!r}: expected schedule[/shapes[/fault]][/balanced]")
        out.append(Scenario(*parts, balance=balance))
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

    @property
    def patch_rows(self) -> int:
        """Rows of every staged media tensor of the microbatch (images, videos, Step3 crops)."""
        return self.image_rows + self.video_rows + self.crop_rows

    @property
    def text_only(self) -> bool:
        return self.images == 0 and self.videos == 0 and self.crop_rows == 0


@dataclass
class StepResult:
    """One training step of one scenario (merged over the ranks).

    Attributes:
        loss_pipeline: sum of the last stage's per-microbatch losses.
        loss_reference: the model's own full-batch loss.
        grad_diff_vision / grad_diff_lm: max |pipeline grad - reference grad| over the vision encoder's
            (first stage) and the language model's parameters (all stages); tied parameters after
            their gradients were summed across ranks.
        params_compared: parameters compared, all ranks together (a tied parameter once per copy);
            vision_params_compared: of these, the vision encoder's.
        reference_grad_max_vision / reference_grad_max_lm: the largest reference gradient entry of each
            side, to show the comparison is not between zeros.
        wall_pipeline_s: the schedule step (slowest rank); wall_reference_s: the reference forward and
            backward (slowest rank).
        first_stage_calls: forward calls of stage 0 during the step; expected_first_stage_calls: ``n + 1``
            on the first step with inferred shapes, else ``n``.
        chunk_trace: per call of stage 0, the chunk index it consumed (== the microbatch of its rows).
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
    balance: bool = False

    @property
    def name(self) -> str:
        return "/".join([self.schedule, self.shapes] + ([self.fault] if self.fault else []) + (["balanced"] if self.balance else []))

    @property
    def max_loss_diff(self) -> float:
        return max((s.loss_diff for s in self.steps), default=float("nan"))

    @property
    def max_grad_diff_vision(self) -> float:
        return max((s.grad_diff_vision for s in self.steps), default=float("nan"))

    @property
    def max_grad_diff_lm(self) -> float:
        return max((s.grad_diff_lm for s in self.steps), default=float("nan"))

    def passed(self, tolerance: float = 1e-5) -> bool:
        """Every loss and gradient within ``tolerance``, every parameter compared, call counts right."""
        if not self.steps or self.missing_params:
            return False
        return all(
            s.loss_diff <= tolerance
            and s.grad_diff_vision <= tolerance
            and s.grad_diff_lm <= tolerance
            and s.first_stage_calls == s.expected_first_stage_calls
            for s in self.steps
        )


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
        for result in self.scenarios:
            if result.name == name:
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

    def family(self, name: str) -> FamilyReport:
        for report in self.families:
            if report.family == name:
                return report
        raise KeyError(f"no family {name!r} in this report; ran {[f.family for f in self.families]}")

    @property
    def ok(self) -> bool:
        """Every scenario without a deliberate fault passed."""
        return all(s.passed(self.tolerance) for f in self.families for s in f.scenarios if s.fault is None)

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
                    ("mb", "samples", "images", "videos", "patch rows", "placeholders", ""),
                    [
                        (m.index, m.samples, m.images, m.videos, m.patch_rows, m.placeholder_tokens,
                         "text-only" if m.text_only else "")
                        for m in f.microbatches
                    ],
                )
            )
            rows = []
            for s in f.scenarios:
                for st in s.steps:
                    verdict = "ok" if s.passed(self.tolerance) else ("FAIL" if s.fault is None else "fails (expected)")
                    rows.append(
                        (s.name, st.step, f"{st.loss_pipeline:.7f}", f"{st.loss_reference:.7f}", f"{st.loss_diff:.1e}",
                         f"{st.grad_diff_vision:.1e}", f"{st.grad_diff_lm:.1e}",
                         f"{st.first_stage_calls}/{st.expected_first_stage_calls}", f"{st.wall_pipeline_s:.3f}", verdict)
                    )
            lines.append(
                _table(
                    ("scenario", "step", "loss (pipeline)", "loss (reference)", "|diff|", "grad vision", "grad LM",
                     "stage-0 calls", "step s", ""),
                    rows,
                )
            )
            lines.append("")
        verdict = "PASS" if self.ok else "FAIL"
        lines.append(f"{verdict}: tolerance {self.tolerance:g}, {self.world_size} processes ({self.launcher}), {self.wall_s:.1f} s")
        return "\n".join(lines)


_table = format_table


# --------------------------------------------------------------------------------------------------
# the per-microbatch table (no processes needed)


def _split(adapter: Any, config: Any, batch: dict[str, Any], n: int) -> Any:
    from ..split import split_media

    images, videos = adapter.media_per_sample(batch["input_ids"], config)
    return split_media(batch, n, images_per_sample=images, videos_per_sample=videos)


def _balanced_split(adapter: Any, config: Any, batch: dict[str, Any], n: int) -> tuple[dict[str, Any], Any]:
    """The batch reordered by ``split_media(balance=adapter's image_costs)``, and its split."""
    import functools

    from ..split import split_media

    work = dict(batch)
    images, videos = adapter.media_per_sample(work["input_ids"], config)
    cost = functools.partial(adapter.image_costs, config=config)
    return work, split_media(work, n, images_per_sample=images, videos_per_sample=videos, balance=cost)


def _microbatch_infos(adapter: Any, config: Any, batch: dict[str, Any], n: int) -> list[MicrobatchInfo]:
    ids = batch["input_ids"]
    staged = _split(adapter, config, dict(batch), n)
    placeholders = torch.zeros(ids.shape[0], dtype=torch.int64)
    for mask in adapter.placeholder_masks(ids, config).values():
        placeholders += mask.sum(dim=1)
    infos = []
    for k, (a, b) in enumerate(staged.samples):
        infos.append(
            MicrobatchInfo(
                index=k,
                samples=b - a,
                images=staged.images[k],
                videos=staged.videos[k],
                image_rows=staged.image_rows[k],
                video_rows=staged.video_rows[k],
                crop_rows=staged.crop_rows[k],
                placeholder_tokens=int(placeholders[a:b].sum()),
            )
        )
    return infos


def microbatch_table(family: str, n_microbatches: int = 4, seed: int = 0) -> list[MicrobatchInfo]:
    """What each microbatch of ``family``'s tiny batch holds (builds only the config, no model)."""
    from . import tiny_models as tiny
    from ..registry import get_adapter

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


def _run_scenario(
    family: str, scenario: Scenario, job: _Job, rank: int, world: int, pristine: torch.nn.Module, tiny_module: Any
) -> dict[str, Any]:
    from ..chunk import CURSOR_ATTRIBUTE
    from ..pipeline import (
        SCHEDULES,
        build_schedule,
        count_valid_tokens,
        default_layer_split,
        find_language_model,
        make_labels,
        make_pipeline_stages,
        stage_indices_for_rank,
        sync_tied_gradients,
        tied_parameters,
    )
    from ..registry import get_adapter
    from ..stage import stage_media

    import torch.distributed as dist

    n = job.n_microbatches
    adapter = get_adapter(pristine)
    config = pristine.config
    tied = tied_parameters(pristine)
    per_rank = SCHEDULES[scenario.schedule]
    n_stages = world * per_rank
    _, lm = find_language_model(pristine)
    layers_per_stage = default_layer_split(len(lm.layers), n_stages)
    indices = stage_indices_for_rank(rank, world, per_rank)

    model = copy.deepcopy(pristine)
    reference = copy.deepcopy(pristine)
    first_batch = tiny_module.build_batch(job.seed)
    B, S = first_batch["input_ids"].shape
    static = (B // n, S) if scenario.shapes == "static" else None
    stages = make_pipeline_stages(model, n_stages, indices, "cpu", layers_per_stage=layers_per_stage, static_microbatch=static)
    del model  # this rank keeps only its stages' modules
    modules = [st.submod for st in stages]
    schedule = build_schedule(scenario.schedule, stages, n)

    owned: dict[str, tuple[torch.nn.Parameter, bool]] = {}
    for module in modules:
        for name, param in module.named_parameters(remove_duplicate=False):
            owned[name] = (param, module.is_language_parameter(name))
    unique = list({id(p): p for p, _ in owned.values()}.values())
    optimizer = torch.optim.SGD(unique, lr=job.lr)
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=job.lr)

    first = next((st for st in stages if st.is_first), None)
    trace: list[tuple[int | None, int]] = []
    current: dict[str, Any] = {}
    handle = None
    if first is not None:
        def record(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            cursor = module.__dict__.get(CURSOR_ATTRIBUTE)
            trace.append((cursor, _microbatch_of(args[0], current["input_ids"], current["samples"])))

        handle = first.submod.register_forward_pre_hook(record)

    step_results = []
    try:
        for step in range(job.steps):
            batch = tiny_module.build_batch(job.seed + step)
            work, balanced = _balanced_split(adapter, config, batch, n) if scenario.balance else (batch, None)
            ids, mask = work["input_ids"], work["attention_mask"]
            labels = make_labels(ids, config, adapter, attention_mask=mask)
            targets = make_labels(batch["input_ids"], config, adapter, attention_mask=batch["attention_mask"], shift=False)
            num_valid = count_valid_tokens(labels)
            media_batch = tiny_module.build_batch(job.seed + 1000 + step) if scenario.fault == "wrong_batch" else batch
            staged = balanced or _split(adapter, config, dict(media_batch), n)
            current.update(input_ids=ids, samples=staged.samples)
            trace.clear()

            optimizer.zero_grad(set_to_none=True)
            losses: list[torch.Tensor] = []
            dist.barrier()
            t0 = time.perf_counter()
            if first is not None:
                target = first.submod if scenario.fault == "bare_module" else first
                staging = stage_media(target, staged)
            else:
                staging = contextlib.nullcontext()
            with staging:
                schedule.step(ids, mask, target=labels, losses=losses, loss_kwargs={"num_valid_tokens": num_valid})
            sync_tied_gradients(modules, tied)
            wall_pipeline = time.perf_counter() - t0

            t0 = time.perf_counter()
            ref_optimizer.zero_grad(set_to_none=True)
            inputs = dict(tiny_module.reference_inputs(batch))
            inputs.setdefault("use_cache", False)
            out = reference(**inputs, labels=targets)
            out.loss.backward()
            wall_reference = time.perf_counter() - t0

            diffs = {True: 0.0, False: 0.0}
            scale = {True: 0.0, False: 0.0}
            counts = {True: 0, False: 0}
            for name, (param, is_lm) in owned.items():
                ref_grad = ref_params[name].grad
                diffs[is_lm] = max(diffs[is_lm], _max_abs_diff(param.grad, ref_grad))
                scale[is_lm] = max(scale[is_lm], _max_abs_diff(ref_grad, None))
                counts[is_lm] += 1

            expected_calls = n + 1 if scenario.shapes == "inferred" and step == 0 else n
            if first is not None:
                calls = len(trace)
                if calls != expected_calls:
                    raise AssertionError(
                        f"{family} {scenario.name} step {step}: stage 0's forward ran {calls} times; "
                        f"expected {expected_calls}"
                    )
                for cursor, microbatch in trace:
                    if cursor != microbatch or microbatch < 0:
                        raise AssertionError(
                            f"{family} {scenario.name} step {step}: stage 0 consumed chunk {cursor} for the rows "
                            f"of microbatch {microbatch} (trace {trace})"
                        )
            step_results.append(
                {
                    "step": step,
                    "loss_pipeline": float(sum(l.detach() for l in losses)) if losses else None,
                    "loss_reference": float(out.loss.detach()),
                    "grad_diff_vision": diffs[False],
                    "grad_diff_lm": diffs[True],
                    "params_compared": len(owned),
                    "vision_params_compared": counts[False],
                    "reference_grad_max_vision": scale[False],
                    "reference_grad_max_lm": scale[True],
                    "wall_pipeline_s": wall_pipeline,
                    "wall_reference_s": wall_reference,
                    "first_stage_calls": len(trace) if first is not None else None,
                    "expected_first_stage_calls": expected_calls,
                    "chunk_trace": [c for c, _ in trace] if first is not None else None,
                }
            )
            optimizer.step()
            ref_optimizer.step()
    finally:
        if handle is not None:
            handle.remove()
    return {
        "family": family,
        "scenario": asdict(scenario),
        "n_stages": n_stages,
        "layers_per_stage": layers_per_stage,
        "owned": sorted(owned),
        "all_params": sorted(ref_params),
        "steps": step_results,
    }


def _run_family(family: str, job: _Job, rank: int, world: int) -> dict[str, Any]:
    from . import tiny_models as tiny

    module = tiny.load(family)
    pristine = module.build_model(job.seed)
    batch = module.build_batch(job.seed)
    from ..registry import get_adapter

    infos = _microbatch_infos(get_adapter(pristine), pristine.config, dict(batch), job.n_microbatches)
    results = [
        _run_scenario(family, Scenario(**spec), job, rank, world, pristine, module) for spec in job.scenarios
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


def _merge(per_rank: list[list[dict[str, Any]]], world: int, tolerance: float, launcher: str, wall: float) -> ParityReport:
    families = []
    for f_index, base in enumerate(per_rank[0]):
        scenarios = []
        for s_index, s0 in enumerate(base["scenarios"]):
            views = [per_rank[r][f_index]["scenarios"][s_index] for r in range(world)]
            owned = set().union(*(v["owned"] for v in views))
            missing = sorted(set(s0["all_params"]) - owned)
            steps = []
            for k in range(len(s0["steps"])):
                rows = [v["steps"][k] for v in views]
                loss = next((r["loss_pipeline"] for r in rows if r["loss_pipeline"] is not None), float("nan"))
                calls = next((r for r in rows if r["first_stage_calls"] is not None), rows[0])
                steps.append(
                    StepResult(
                        step=k,
                        loss_pipeline=loss,
                        loss_reference=rows[0]["loss_reference"],
                        grad_diff_vision=max(r["grad_diff_vision"] for r in rows),
                        grad_diff_lm=max(r["grad_diff_lm"] for r in rows),
                        params_compared=sum(r["params_compared"] for r in rows),
                        vision_params_compared=sum(r["vision_params_compared"] for r in rows),
                        reference_grad_max_vision=max(r["reference_grad_max_vision"] for r in rows),
                        reference_grad_max_lm=max(r["reference_grad_max_lm"] for r in rows),
                        wall_pipeline_s=max(r["wall_pipeline_s"] for r in rows),
                        wall_reference_s=max(r["wall_reference_s"] for r in rows),
                        first_stage_calls=calls["first_stage_calls"] if calls["first_stage_calls"] is not None else -1,
                        expected_first_stage_calls=calls["expected_first_stage_calls"],
                        chunk_trace=list(calls["chunk_trace"] or []),
                    )
                )
            sc = s0["scenario"]
            scenarios.append(
                ScenarioResult(
                    family=base["family"],
                    schedule=sc["schedule"],
                    shapes=sc["shapes"],
                    fault=sc["fault"],
                    n_stages=s0["n_stages"],
                    layers_per_stage=list(s0["layers_per_stage"]),
                    steps=steps,
                    missing_params=missing,
                    balance=sc.get("balance", False),
                )
            )
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
    ``n_microbatches``, ``seed`` and ``lr``. ``init_method`` is ``tcp://127.0.0.1:PORT`` or ``env://``.
    """
    import torch.distributed as dist

    torch.set_num_threads(1)
    spec = _Job(**job)
    start = time.perf_counter()
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=60)}
    if init_method == "env://":
        dist.init_process_group("gloo", init_method="env://", **kwargs)
    else:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size, **kwargs)
    try:
        mine = [_run_family(family, spec, dist.get_rank(), dist.get_world_size()) for family in spec.families]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        return _merge(gathered, dist.get_world_size(), tolerance, launcher, time.perf_counter() - start)
    finally:
        gc.collect()
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
    from . import tiny_models as tiny

    for family in families:
        if family not in tiny.FAMILIES:
            raise ValueError(f"unknown family {family!r}; known: {', '.join(tiny.FAMILIES)}")
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
        if sc.schedule == "interleaved" and n_microbatches % world_size:
            raise ValueError(
                f"{sc.name}: Interleaved1F1B needs n_microbatches ({n_microbatches}) to be a multiple of the "
                f"{world_size} ranks"
            )
        if sc.fault == "bare_module" and sc.shapes != "inferred":
            raise ValueError(f"{sc.name}: the bare_module fault only breaks a run with inferred shapes")


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
) -> ParityReport:
    """Run ``families`` through a real multi-process pipeline and compare with the model itself.

    Every family runs every scenario in ONE set of worker processes (starting a pair costs seconds).
    Under ``torchrun`` (:func:`launched_by_torchrun`) the current process is the worker: environment
    rendezvous, the launcher's world size; every rank returns the merged report.

    Args:
        families: one family name or several (``ppmedia.tiny.FAMILIES``).
        scenarios: :class:`Scenario` objects or strings such as ``"1f1b/static"``.
        steps: training steps per scenario; an SGD step (``lr``) follows each, on both sides.
        n_microbatches: microbatches per step (the tiny batches have 8 samples).
        seed: model and batch seed (step ``k`` uses batch ``seed + k``).
        tolerance: what :meth:`ScenarioResult.passed` and :attr:`ParityReport.ok` accept.
        world_size: processes to spawn (ignored under torchrun).

    Raises:
        ParityError: a worker failed (its traceback is in the message).
        ValueError: bad arguments (checked before anything starts).
    """
    names = [families] if isinstance(families, str) else list(families)
    specs = parse_scenarios(scenarios)
    if launched_by_torchrun():
        world_size = int(os.environ["WORLD_SIZE"])
    _validate(names, specs, n_microbatches, world_size, steps)
    job = asdict(_Job(names, [asdict(s) for s in specs], steps, n_microbatches, seed, lr))

    if launched_by_torchrun():
        try:
            return run_worker(int(os.environ["RANK"]), world_size, "env://", job, tolerance, launcher="torchrun")
        except Exception as exc:
            raise ParityError(f"parity worker failed on rank {os.environ['RANK']}: {_root_cause(exc)}") from exc

    import torch.multiprocessing as mp

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
            if not summaries:
                summaries.append(str(exc))
            raise ParityError("parity worker failed: " + "; ".join(summaries) + "\n" + "\n".join(details)) from exc
        with open(os.path.join(out_dir, "report.json")) as fh:
            return ParityReport.from_dict(json.load(fh))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ppmedia.testing.parity [FAMILY ...] [--scenario S ...] [--steps N] [--microbatches N]``.

    Works as a plain command (spawns the workers) and under ``torchrun --nproc-per-node 2``.
    Prints the report (rank 0 only under torchrun); exit status 0 when every scenario passed.
    """
    import argparse

    from . import tiny_models as tiny

    parser = argparse.ArgumentParser(prog="python -m ppmedia.testing.parity", description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", default=list(tiny.FAMILIES), help="families (default: all)")
    parser.add_argument("--scenario", action="append", help="schedule[/shapes] (repeatable; default: gpipe and 1f1b, both shapes)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    report = run_parity(
        args.families,
        args.scenario or DEFAULT_SCENARIOS,
        steps=args.steps,
        n_microbatches=args.microbatches,
        seed=args.seed,
    )
    if not launched_by_torchrun() or os.environ.get("RANK") == "0":
        print(report.format())
    return 0 if report.ok else 1


if __name__ == "__main__":
    code = main()
    if launched_by_torchrun():
        exit_worker(code)  # this process was a gloo worker: skip the teardown (see exit_worker)
    sys.exit(code)
