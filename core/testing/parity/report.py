"""What a parity run returns: a :class:`ParityReport` (per family a :class:`FamilyReport`: its
microbatches and, per scenario, a :class:`ScenarioResult` of :class:`StepResult` rows), the pass rules
and tolerances, the text tables, and the merging of every rank's rows into one report."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ...cli.tables import format_table
from .scenarios import _scenario_name

__all__ = [
    "BF16_GRAD_RTOL",
    "BF16_LOSS_TOLERANCE",
    "FamilyReport",
    "MicrobatchInfo",
    "ParityReport",
    "ScenarioResult",
    "StepResult",
]


#: bfloat16 parameters vs the float32 reference: the loss may differ by this much (absolute) ...
BF16_LOSS_TOLERANCE = 2e-3
#: ... and each gradient by this fraction of the largest reference gradient of its side.
BF16_GRAD_RTOL = 3e-2


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
    ep: int = 1

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
        ep=sc.get("ep", 1),
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
