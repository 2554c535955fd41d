"""A step-time model of any torch pipeline schedule, with the vision work placed on stage 0 or spread.

:func:`predict_step` replays one step of a schedule in its own action order
(:func:`schedule_actions`: torch's ``pipeline_order`` for the multi-stage schedules, built without
processes; GPipe's and 1F1B's orders for the single-stage ones) from per-operation costs
(:class:`OpCosts`: one decoder layer's forward and backward on a microbatch, the first stage's
embedding and merge, the last stage's head and loss, the vision tower per unit of vision load, the
send latency). Each operation starts when its rank is free and its inputs have arrived:

* ``F`` of stage ``s`` waits for ``F`` of ``s - 1``; the backward of ``s`` (``B``, or ``I`` in
  split-backward schedules) for the backward of ``s + 1``, the last stage's for its ``F``; ``W``
  follows the stage's ``I``. torch runs the first stage's whole backward at its ``W`` (its ``I`` is
  empty), and so does the model;
* ``encoder="stage0"``: the vision forward of microbatch ``m`` is part of stage 0's ``F``, its backward
  part of stage 0's backward;
* ``encoder="spread"`` (:mod:`ppmedia.pipeline.encoder`): the ranks without stage 0 first receive the
  vision weights (``S``, half of :attr:`OpCosts.sync`); every rank encodes its microbatches (``E``,
  owners from :func:`ppmedia.pipeline.assign_encoders`, the runtime's own rule); stage 0's ``F`` of
  ``m`` waits for ``m``'s features; a rank runs the vision backward of its microbatches (each once
  stage 0's backward of it is done) on its background lane (``LV``: in the time its schedule idles,
  preempted by the schedule's work, then after the schedule), or with ``background=False`` after
  its schedule (``V``); the other ranks' gradients travel to stage 0 (``R``, the other half) once
  their share's backwards are done, while stage 0's rank finishes its own.

:func:`best_layer_split` searches ``layers_per_stage`` for the fastest step, and
:func:`compare_placements` gives the four placements ``ppmedia plan`` prints (vision on stage 0 with
the uniform split, with the best split for the batch, spread with the uniform and with its best
split). Every prediction carries its :class:`~ppmedia.planning.timeline.Timeline`.
"""

from __future__ import annotations

import functools
import itertools
import math
import types
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from .replay import Op as _Op
from .replay import lane_done, replay
from .timeline import Timeline

__all__ = [
    "AutoSplit",
    "OpCosts",
    "StepPrediction",
    "auto_layer_split",
    "best_layer_split",
    "compare_placements",
    "predict_step",
    "schedule_actions",
]

#: ``(stage, kind, microbatch)``; kind ``F``, ``B``, ``I`` or ``W``.
Action = tuple[int, str, int]
_COMPUTE = ("F", "B", "I", "W")


# --------------------------------------------------------------------------------------------------
# the schedule's own order


def _fake_stage(index: int, n_stages: int, rank: int, size: int) -> Any:
    """What a torch schedule's constructor reads of a stage (it needs no process group to order them)."""
    return types.SimpleNamespace(stage_index=index, num_stages=n_stages, group_rank=rank, group_size=size,
                                 is_first=index == 0, is_last=index == n_stages - 1, submod=None)


def _flatten(action: Any) -> list[Action]:
    if action is None:
        return []
    subs = getattr(action, "sub_actions", None)
    if subs:
        return [a for sub in subs for a in _flatten(sub)]
    kind = getattr(getattr(action, "computation_type", None), "value", None)
    if kind not in _COMPUTE:
        return []
    return [(int(action.stage_index), str(kind), int(action.microbatch_index))]


@functools.lru_cache(maxsize=128)
def _actions(schedule: str, n_ranks: int, n_microbatches: int) -> tuple[tuple[Action, ...], ...]:
    from ..pipeline import schedule_layout
    from .simulate import schedule_order

    layout = schedule_layout(schedule)
    if not layout.multi_stage:
        name = layout.name.lower()
        if name not in ("gpipe", "1f1b"):
            raise ValueError(f"schedule {layout.name}: no action order known for this single-stage schedule")
        return tuple(tuple((r, op, m) for op, m in schedule_order(name, n_ranks, n_microbatches, r))
                     for r in range(n_ranks))
    n_stages = layout.n_stages(n_ranks)
    stages = [_fake_stage(i, n_stages, 0, n_ranks) for i in layout.stage_indices(0, n_ranks)]
    built = layout.schedule_class(stages, n_microbatches, loss_fn=None, scale_grads=False)
    order = built.pipeline_order
    return tuple(tuple(a for action in order[r] for a in _flatten(action)) for r in range(n_ranks))


def schedule_actions(schedule: str, n_ranks: int, n_microbatches: int) -> list[list[Action]]:
    """Per pipeline rank, the compute actions ``(stage, kind, microbatch)`` it runs, in order.

    Multi-stage schedules: torch's own ``pipeline_order`` (the class is built on stand-in stages,
    which is all its constructor reads; sub-actions of overlapped ``F;B`` pairs in their order).
    GPipe and 1F1B: the order their ``_step_microbatches`` runs (1F1B: ``min(n, P - s)`` warm-up
    forwards, then one backward and one forward at a time).

    Raises:
        ValueError: unknown schedule, or torch refuses the layout (e.g. too few microbatches).
    """
    return [list(rank) for rank in _actions(schedule, n_ranks, n_microbatches)]


# --------------------------------------------------------------------------------------------------
# costs


@dataclass
class OpCosts:
    """Per-operation costs of one microbatch, in one unit (seconds when calibrated).

    Attributes:
        layer_forward / layer_backward: one decoder layer's forward / backward (input and weight
            gradients together; ``None``: twice the forward).
        vision_forward / vision_backward: the vision tower per unit of vision load (the adapter's cost
            model, MFLOP; backward ``None``: twice the forward).
        first_forward / first_backward: stage 0 besides its layers and the tower (embedding, merge).
        last_forward / last_backward: the last stage besides its layers (norm, head, loss).
        stage_forward / stage_backward: what any stage running at least one decoder layer adds once
            (the language model's masks and rotary embedding).
        weight_share: of a backward, the part split-backward schedules run as ``W``.
        latency: from an operation's end to its output's arrival on another rank (also features and
            their gradients of the encoder spread).
        sync: the encoder spread's per-step broadcast of the vision weights plus reduction of their
            gradients (half before the step, half after).
        unit: of all the above.
        cores: the CPU cores the pipeline ranks of one machine share with the spread's background
            lanes (gloo processes on one host); ``None``: a core or device per rank, each lane working
            only in its own rank's idle time. With ``cores`` the lanes share the cores the ranks leave
            free, whichever rank idles (:func:`ppmedia.planning.replay.replay`).
        lane_share: with ``cores``, the part of a free core a lane's work gets (``tests/bench/run.py
            --stage0`` measures it: a lane encoding while one rank computes and the other waits).
    """

    layer_forward: float
    vision_forward: float
    layer_backward: float | None = None
    vision_backward: float | None = None
    first_forward: float = 0.0
    first_backward: float = 0.0
    last_forward: float = 0.0
    last_backward: float = 0.0
    stage_forward: float = 0.0
    stage_backward: float = 0.0
    weight_share: float = 0.5
    latency: float = 0.0
    sync: float = 0.0
    unit: str = "units"
    cores: int | None = None
    lane_share: float = 1.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name == "cores" and value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"OpCosts.cores: got {value!r}; expected a count >= 1 or None")
            if name not in ("unit", "cores") and value is not None and (value != value or value < 0):
                raise ValueError(f"OpCosts.{name}: got {value}; expected a cost >= 0")
        if not 0 < self.lane_share <= 1:
            raise ValueError(f"OpCosts.lane_share: got {self.lane_share}; expected 0 < share <= 1")
        if not 0 <= self.weight_share <= 1:
            raise ValueError(f"OpCosts.weight_share: got {self.weight_share}; expected 0..1")

    @property
    def layer_bwd(self) -> float:
        return 2 * self.layer_forward if self.layer_backward is None else self.layer_backward

    @property
    def vision_bwd(self) -> float:
        return 2 * self.vision_forward if self.vision_backward is None else self.vision_backward

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "OpCosts":
        """From :meth:`to_dict`'s output (e.g. a ``--calibration`` JSON); unknown keys are refused."""
        known = {f for f in cls.__dataclass_fields__}
        extra = sorted(set(data) - known)
        if extra:
            raise ValueError(f"OpCosts: unknown fields {extra}; expected some of {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_config(cls, config: Any, microbatch_size: int, seq_len: int) -> "OpCosts":
        """An uncalibrated model in GFLOP: a decoder layer's matrix products and attention for
        ``microbatch_size x seq_len`` tokens, the head's, and the vision tower at 1 MFLOP per unit of
        the adapter's cost model; backward twice the forward; no latency."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        d = float(getattr(text, "hidden_size"))
        ff = float(getattr(text, "intermediate_size", None) or 4 * d)
        heads = int(getattr(text, "num_attention_heads", 1) or 1)
        kv = int(getattr(text, "num_key_value_heads", None) or heads)
        head_dim = float(getattr(text, "head_dim", None) or d / heads)
        vocab = float(getattr(text, "vocab_size", 0) or 0)
        tokens = float(microbatch_size * seq_len)
        weights = 2 * d * heads * head_dim + 2 * d * kv * head_dim + 3 * d * ff
        layer = tokens * (2 * weights + 4 * seq_len * heads * head_dim)
        return cls(layer_forward=layer / 1e9, vision_forward=1e6 / 1e9, last_forward=2 * tokens * d * vocab / 1e9,
                   last_backward=4 * tokens * d * vocab / 1e9, unit="GFLOP")


# --------------------------------------------------------------------------------------------------
# the replay


@dataclass
class StepPrediction:
    """One predicted step.

    Attributes:
        schedule, encoder: what was modelled (``encoder``: ``stage0`` or ``spread``).
        layers_per_stage: decoder layers per stage.
        step_time, bubble: the step's length and its ranks' idle share.
        timeline: every operation, per rank in its order.
        owners: with the spread, the rank encoding each microbatch.
        label: a short description (set by :func:`compare_placements`).
    """

    schedule: str
    encoder: str
    layers_per_stage: list[int]
    step_time: float
    bubble: float
    timeline: Timeline = field(repr=False)
    owners: list[int] | None = None
    label: str = ""


def _schedule_ops(schedule: str, costs: OpCosts, loads: Sequence[float], n_ranks: int,
                  layers: Sequence[int], encoder: str) -> list[list[_Op]]:
    """Each rank's schedule actions as operations with costs and dependencies."""
    orders = schedule_actions(schedule, n_ranks, len(loads))
    n_stages = len(layers)
    owner_of = {s: r for r, order in enumerate(orders) for s, _, _ in order}
    lat = {(a, b): 0.0 if owner_of.get(a) == owner_of.get(b) else costs.latency for a in range(n_stages) for b in range(n_stages)}
    out: list[list[_Op]] = [[] for _ in range(n_ranks)]
    for r, order in enumerate(orders):
        for s, kind, m in order:
            vision = float(loads[m]) if (s == 0 and encoder == "stage0") else 0.0
            some = layers[s] > 0
            fwd = layers[s] * costs.layer_forward + (costs.first_forward if s == 0 else 0.0) + (
                costs.last_forward if s == n_stages - 1 else 0.0) + vision * costs.vision_forward + some * costs.stage_forward
            bwd = layers[s] * costs.layer_bwd + (costs.first_backward if s == 0 else 0.0) + (
                costs.last_backward if s == n_stages - 1 else 0.0) + vision * costs.vision_bwd + some * costs.stage_backward
            grad_in = ("G", s + 1, m) if s < n_stages - 1 else ("F", s, m)
            grad_lat = lat[(s, s + 1)] if s < n_stages - 1 else 0.0
            if kind == "F":
                needs = [(("F", s - 1, m), lat[(s - 1, s)])] if s > 0 else (
                    [(("X", m), 0.0)] if encoder == "spread" and loads[m] > 0 else [])
                out[r].append(_Op(r, "F", s, m, fwd, needs, [(("F", s, m), 0.0)]))
            elif kind == "B":
                out[r].append(_Op(r, "B", s, m, bwd, [(grad_in, grad_lat)], [(("G", s, m), 0.0), (("D", s, m), 0.0)]))
            elif kind == "I":
                cost = 0.0 if s == 0 else bwd * (1 - costs.weight_share)  # torch: stage 0's I is empty
                out[r].append(_Op(r, "I", s, m, cost, [(grad_in, grad_lat)], [(("G", s, m), 0.0)]))
            else:
                cost = bwd if s == 0 else bwd * costs.weight_share
                out[r].append(_Op(r, "W", s, m, cost, [(("G", s, m), 0.0)], [(("D", s, m), 0.0)]))
    return out


def _spread_ops(costs: OpCosts, loads: Sequence[float], owners: Sequence[int], n_ranks: int,
                body: list[list[_Op]], background: bool = True,
                ahead: float = 1.0) -> tuple[list[list[_Op]], list[list[_Op]]]:
    """Wrap each rank's schedule with the spread's broadcast, encodes, vision backwards and reduce;
    returns each rank's operations and its background lane's jobs.

    As :class:`~ppmedia.pipeline.EncoderSpread` runs them: stage 0's rank broadcasts in the background
    and encodes at once, the other ranks wait for the weights (``S``, half of ``sync``). Each rank
    encodes the first :func:`~ppmedia.pipeline.encoder.encoded_ahead` of its microbatches before its
    schedule (``E``) and, with ``background``, the rest on its lane (``LE``), followed by its vision
    backwards (``LV``, each once stage 0's backward of it is done; stage 0's forward runs an encode of
    its own lane's itself when the lane has not started it, ``EI``); without, every encode comes
    first and the backwards follow the schedule (``V``). After its schedule stage 0's rank enters the
    reduction (contributing nothing) and finishes its own share while the other ranks' gradients
    travel (``R`` on those ranks, the other half, once their own backwards are done and stage 0 has
    entered); stage 0 ends when the sum has arrived."""
    from ..pipeline.encoder import encoded_ahead

    half = costs.sync / 2
    ranks, lanes = [], []
    for r in range(n_ranks):
        mine = [m for m, owner in enumerate(owners) if owner == r and loads[m] > 0]
        first = encoded_ahead(len(mine), ahead if background else 1.0)
        sent = 0.0 if r == 0 else costs.latency  # features cross to stage 0's rank
        encode = [_Op(r, "E", -1, m, loads[m] * costs.vision_forward, [], [(("X", m), sent)]) for m in mine]
        ready = [(("D", 0, m), 0.0 if r == 0 else costs.latency) for m in mine]
        ops = [_Op(r, "S", -1, -1, 0.0 if r == 0 else half)] + encode[:first] + body[r]
        lane: list[_Op] = []
        if r == 0:
            ops.append(_Op(r, "R", -1, -1, 0.0, [], [(("entered", 0), 0.0)]))
        if background:
            lane = [_Op(r, "LE", -1, e.mb, e.cost, [], e.makes) for e in encode[first:]]
            if r == 0:  # stage 0's forward takes back an encode its lane has not started
                forwards = {op.mb: op for op in ops if op.kind == "F" and op.stage == 0}
                for job in lane:
                    forwards[job.mb].takes_back = job
            lane += [_Op(r, "LV", -1, m, loads[m] * costs.vision_bwd, [need]) for m, need in zip(mine, ready)]
            ops.append(_Op(r, "J", -1, -1, 0.0, [(lane_done(r), 0.0)]))
        else:
            ops += [_Op(r, "V", -1, m, loads[m] * costs.vision_bwd, [need]) for m, need in zip(mine, ready)]
        if r == 0:
            ops.append(_Op(r, "R", -1, -1, 0.0, [(("reduced", q), 0.0) for q in range(1, n_ranks)]))
        else:
            ops.append(_Op(r, "R", -1, -1, half, [(("entered", 0), 0.0)], [(("reduced", r), 0.0)]))
        ranks.append(ops)
        lanes.append(lane)
    return ranks, lanes


def predict_step(
    schedule: str,
    costs: OpCosts,
    loads: Sequence[float],
    *,
    n_ranks: int,
    layers_per_stage: Sequence[int],
    encoder: str = "stage0",
    owners: Sequence[int] | None = None,
    background: bool = True,
    ahead: float | None = None,
    title: str = "",
) -> StepPrediction:
    """Predict one step of ``schedule`` on ``n_ranks`` pipeline ranks.

    Args:
        costs: per-operation costs.
        loads: ``[n]`` each microbatch's vision load (the unit ``costs.vision_forward`` is per).
        layers_per_stage: decoder layers per stage (``schedule_layout(schedule).n_stages(n_ranks)``).
        encoder: ``stage0`` or ``spread``.
        owners: spread: the encoding rank per microbatch (default: the runtime's rule,
            :func:`~ppmedia.pipeline.encoder.default_assign`, on ``loads``).
        background: spread: the later encodes and the vision backwards on each rank's background
            lane (the runtime's default on CPU), else before and after its schedule.
        ahead: spread with ``background``: the share of each rank's microbatches it encodes before
            its schedule (default the runtime's, :data:`~ppmedia.pipeline.encoder.AHEAD`).
    """
    from ..pipeline import schedule_layout
    from ..pipeline.encoder import AHEAD, ENCODER_MODES, default_assign

    if encoder not in ENCODER_MODES:
        raise ValueError(f"encoder: got {encoder!r}; expected one of {', '.join(ENCODER_MODES)}")
    n_stages = schedule_layout(schedule).n_stages(n_ranks)
    layers = [int(x) for x in layers_per_stage]
    if len(layers) != n_stages or any(x < 0 for x in layers):
        raise ValueError(f"layers_per_stage: got {layers}; expected {n_stages} counts >= 0 ({schedule} on {n_ranks} ranks)")
    body = _schedule_ops(schedule, costs, loads, n_ranks, layers, encoder)
    chosen, lanes = None, None
    if encoder == "spread":
        chosen = [int(o) for o in (owners if owners is not None else default_assign(background)(loads, n_ranks))]
        body, lanes = _spread_ops(costs, loads, chosen, n_ranks, body, background, AHEAD if ahead is None else ahead)
    name = title or f"{schedule}, vision {'spread' if encoder == 'spread' else 'on stage 0'}, layers {layers}"
    timeline = replay(body, name, costs.unit, lanes, cores=costs.cores, lane_share=costs.lane_share)
    return StepPrediction(schedule, encoder, layers, timeline.step_time, timeline.bubble, timeline, chosen)


def _compositions(total: int, parts: int) -> list[list[int]]:
    return [[b - a - 1 for a, b in zip((-1, *cut), (*cut, total + parts - 1))]
            for cut in itertools.combinations(range(total + parts - 1), parts - 1)]


def best_layer_split(
    schedule: str,
    costs: OpCosts,
    loads: Sequence[float],
    *,
    n_ranks: int,
    num_layers: int,
    encoder: str = "stage0",
    limit: int = 4000,
) -> StepPrediction:
    """The ``layers_per_stage`` with the shortest predicted step (ties: the most even split).

    Every split when there are at most ``limit`` of them, else a local search from the uniform split
    (moving one layer between two stages while the step gets shorter).
    """
    from ..pipeline import default_layer_split, layer_split_problem, schedule_layout

    n_stages = schedule_layout(schedule).n_stages(n_ranks)
    problem = layer_split_problem(n_stages, num_layers)
    if problem:  # no split gives every stage something to run
        raise ValueError(problem)

    def run(layers: Sequence[int]) -> StepPrediction:
        return predict_step(schedule, costs, loads, n_ranks=n_ranks, layers_per_stage=layers, encoder=encoder)

    def key(p: StepPrediction) -> tuple[float, int]:
        return (round(p.step_time, 12), max(p.layers_per_stage) - min(p.layers_per_stage))

    uniform = default_layer_split(num_layers, n_stages)
    if math.comb(num_layers + n_stages - 1, n_stages - 1) <= limit:  # a middle stage with no layer holds nothing
        return min((run(c) for c in _compositions(num_layers, n_stages)
                    if layer_split_problem(n_stages, num_layers, c) is None), key=key)
    best = run(uniform)
    improved = True
    while improved:
        improved = False
        for a, b in itertools.permutations(range(n_stages), 2):
            if best.layers_per_stage[a] == 0:
                continue
            layers = list(best.layers_per_stage)
            layers[a] -= 1
            layers[b] += 1
            if layer_split_problem(n_stages, num_layers, layers) is not None:
                continue
            trial = run(layers)
            if key(trial) < key(best):
                best, improved = trial, True
    return best


def compare_placements(
    schedule: str, costs: OpCosts, loads: Sequence[float], *, n_ranks: int, num_layers: int
) -> tuple[list[StepPrediction], StepPrediction]:
    """The four placements of the vision work ``ppmedia plan`` compares, and the fastest.

    ``(a)`` on stage 0 with :func:`~ppmedia.pipeline.default_layer_split`, ``(b)`` on stage 0 with
    :func:`best_layer_split` for these loads, ``(c)`` spread with the uniform split, ``(d)`` spread
    with its best split. Ties go to the earlier (simpler) option.
    """
    from ..pipeline import default_layer_split, schedule_layout

    uniform = default_layer_split(num_layers, schedule_layout(schedule).n_stages(n_ranks))
    a = predict_step(schedule, costs, loads, n_ranks=n_ranks, layers_per_stage=uniform)
    b = best_layer_split(schedule, costs, loads, n_ranks=n_ranks, num_layers=num_layers)
    c = predict_step(schedule, costs, loads, n_ranks=n_ranks, layers_per_stage=uniform, encoder="spread")
    d = best_layer_split(schedule, costs, loads, n_ranks=n_ranks, num_layers=num_layers, encoder="spread")
    for p, label in ((a, "(a) vision on stage 0, uniform split"), (b, "(b) vision on stage 0, best static split"),
                     (c, "(c) encoder spread, uniform split"), (d, "(d) encoder spread, best split")):
        p.label = label
        p.timeline.title = f"{label}: layers {p.layers_per_stage}"
    options = [a, b, c, d]
    return options, min(options, key=lambda p: round(p.step_time, 12))  # ties: the earlier option


@dataclass
class AutoSplit:
    """What ``layers_per_stage="auto"`` plans with (``build_stage_modules(..., auto_split=...)``).

    Attributes:
        batch: a representative processor batch (not modified): its vision load per microbatch and
            its sizes ``[B, S]`` are what the split is chosen for.
        n_microbatches: the schedule's ``n_microbatches``.
        schedule: the schedule name (any torch ships).
        costs: calibrated :class:`OpCosts` (e.g. ``tests/bench/run.py --stage0``'s); default the
            FLOPs model of the model's config (:meth:`OpCosts.from_config`).
        encoder: ``stage0`` (choose the split for the vision work on stage 0: option (b) of
            ``ppmedia plan``) or ``spread``.
    """

    batch: Any
    n_microbatches: int
    schedule: str = "1f1b"
    costs: OpCosts | None = None
    encoder: str = "stage0"

    def split_layers(self, config: Any, n_stages: int, adapter: Any = None, num_layers: int | None = None) -> list[int]:
        """``layers_per_stage`` for ``n_stages`` stages of a model of ``config``: what the stage cutter
        asks a ``layers_per_stage="auto"`` request for (:func:`auto_layer_split`'s best split)."""
        return list(auto_layer_split(config, n_stages, self, adapter, num_layers).layers_per_stage)


def auto_layer_split(config: Any, n_stages: int, request: AutoSplit, adapter: Any = None,
                     num_layers: int | None = None) -> StepPrediction:
    """The best ``layers_per_stage`` for ``request`` (:func:`best_layer_split` on the batch's vision
    loads, as ``ppmedia plan`` computes them).

    Raises:
        ValueError: ``n_stages`` does not fit the schedule's placement, or the batch cannot be split.
    """
    from ..pipeline import schedule_layout
    from .loads import plan_batch

    layout = schedule_layout(request.schedule)
    if n_stages % layout.stages_per_rank:
        raise ValueError(f"auto_split: {n_stages} stages; {layout.name} places {layout.stages_per_rank} per rank")
    if adapter is None:
        from ..registry import get_adapter

        adapter = get_adapter(config)
    loads = plan_batch(dict(request.batch), request.n_microbatches, adapter, config)["loads"]
    ids = request.batch["input_ids"]
    costs = request.costs or OpCosts.from_config(config, max(1, ids.shape[0] // request.n_microbatches), ids.shape[1])
    if num_layers is None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        num_layers = int(text.num_hidden_layers)
    return best_layer_split(request.schedule, costs, loads, n_ranks=n_stages // layout.stages_per_rank,
                            num_layers=num_layers, encoder=request.encoder)
