"""What a parity run asks for: a :class:`Scenario` (schedule, shapes, layout and options), its name and
the strings that spell it (:func:`parse_scenarios`), the planted faults and run variants, and the job a
worker receives (every family's scenarios)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    from .report import ScenarioResult

__all__ = [
    "ALL_SCENARIOS",
    "DEFAULT_SCENARIOS",
    "FAULTS",
    "Scenario",
    "VARIANTS",
    "VARLEN_PAD",
    "parse_scenarios",
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
#: ``ep_order`` (with ``/epN``): the experts' results are combined at the unsorted (token, k) positions
#: (tokens get other pairs' outputs back). ``ep_averaged`` (with ``/epN``): the expert shards' gradients
#: are averaged over the ``ep`` peers (which hold different experts) instead of summed over ``edp``.
FAULTS: tuple[str, ...] = ("bare_module", "wrong_batch", "stale_copies", "unreduced_tower", "packed_positions", "packed_leak",
                           "ep_order", "ep_averaged")
#: the packing faults (planted bugs of :mod:`ppmedia.packing`)
PACKED_FAULTS: tuple[str, ...] = ("packed_positions", "packed_leak")
#: samples per packed row of a ``/packed`` scenario (consecutive samples: the media keep their order)
PACKED_PER_ROW = 2
#: run variants that must still match (see :class:`Scenario`).
VARIANTS: tuple[str, ...] = ("text_only_first", "frozen_vision", "text_only_replica", "varlen", "eval")
_SHAPES = ("inferred", "static")
#: extra padding columns of the ``varlen`` variant's first batch of a step.
VARLEN_PAD = 3


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
        ep: expert-parallel ranks carved out of ``dp`` (token ``epN``): the routed experts sharded with
            :func:`~ppmedia.pipeline.apply_expert_parallel`, their gradients summed over ``edp``.
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
    ep: int = 1

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
        if self.ep < 1 or self.dp % self.ep:
            raise ValueError(f"scenario ep: got ep{self.ep} with dp{self.dp}; expected ep dividing dp")
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
    parts += [f"ep{sc.ep}"] if getattr(sc, "ep", 1) != 1 else []
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
            elif token.startswith("ep") and token[2:].isdigit():
                kwargs["ep"] = int(token[2:])
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
