"""A small discrete-event model of pipeline schedules: predicted step time and bubble fraction.

Each stage runs its operations (forward ``F`` or backward ``B`` of one microbatch) in the order its
schedule issues them, one at a time. An operation starts when its stage is free and its input has
arrived: ``F(s, m)`` needs ``F(s - 1, m)`` (plus the send ``latency``), ``B(s, m)`` needs
``B(s + 1, m)`` (plus ``latency``) and, on the last stage, ``F(s, m)``. Orders follow
``torch.distributed.pipelining`` (torch 2.13):

* ``gpipe``: every forward, then every backward, microbatches in order;
* ``1f1b``: stage ``s`` of ``P`` runs ``min(n, P - s)`` forwards, then alternates one backward and
  one forward until the forwards are done, then the remaining backwards.

Costs are per stage and microbatch (seconds, or any unit). :func:`fit_calibration` derives them from
the per-operation times of a real run (the first stage's forward as ``text + per_unit * vision load``);
:func:`predict` turns per-microbatch vision loads into costs and simulates them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence, Union

import numpy as np

__all__ = [
    "SIMULATED_SCHEDULES",
    "Calibration",
    "Simulation",
    "fit_calibration",
    "predict",
    "schedule_order",
    "simulate",
]

SIMULATED_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")


def schedule_order(schedule: str, n_stages: int, n_microbatches: int, stage: int) -> list[tuple[str, int]]:
    """The operations stage ``stage`` runs, in order: ``("F" | "B", microbatch)``."""
    n = n_microbatches
    if schedule == "gpipe":
        return [("F", m) for m in range(n)] + [("B", m) for m in range(n)]
    if schedule == "1f1b":
        warmup = min(n, n_stages - stage)
        ops = [("F", m) for m in range(warmup)]
        forward = warmup
        for m in range(n):
            ops.append(("B", m))
            if forward < n:
                ops.append(("F", forward))
                forward += 1
        return ops
    raise ValueError(f"schedule: got {schedule!r}; expected one of {', '.join(SIMULATED_SCHEDULES)}")


@dataclass
class Simulation:
    """What :func:`simulate` predicts.

    Attributes:
        step_time: from the first operation's start to the last one's end.
        bubble: the idle share of all stages over the step, ``1 - sum(busy) / (stages * step_time)``.
        busy: per stage, the sum of its operations' costs.
        timeline: per stage, ``(op, microbatch, start, end)`` in order.
    """

    step_time: float
    bubble: float
    busy: list[float]
    timeline: list[list[tuple[str, int, float, float]]] = field(repr=False)


def _matrix(name: str, values: Costs, stages: int | None, n: int | None) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 2 or (stages is not None and array.shape != (stages, n)):
        want = f"[{stages}, {n}]" if stages is not None else "[stages, microbatches]"
        raise ValueError(f"{name}: shape {list(array.shape)}; expected {want} (per stage, per microbatch)")
    if not np.isfinite(array).all() or (array < 0).any():
        raise ValueError(f"{name}: expected finite costs >= 0")
    return array


#: per stage, per microbatch costs: nested sequences or a ``[stages, microbatches]`` array.
Costs = Union[Sequence[Sequence[float]], np.ndarray]


def simulate(
    schedule: str,
    forward: Costs,
    backward: Costs | None = None,
    *,
    latency: float = 0.0,
) -> Simulation:
    """Simulate one step of ``schedule`` (``gpipe`` or ``1f1b``).

    Args:
        forward: ``[stages][microbatches]`` forward cost of each stage on each microbatch.
        backward: the same for the backward; default ``2 * forward``.
        latency: time from an operation's end to its output's arrival at the next (or previous) stage.
    """
    fwd = _matrix("forward", forward, None, None)
    P, n = fwd.shape
    bwd = 2.0 * fwd if backward is None else _matrix("backward", backward, P, n)
    if latency < 0:
        raise ValueError(f"latency: got {latency}; expected >= 0")
    orders = [schedule_order(schedule, P, n, s) for s in range(P)]
    done: dict[tuple[str, int, int], float] = {}
    position = [0] * P
    free = [0.0] * P
    timeline: list[list[tuple[str, int, float, float]]] = [[] for _ in range(P)]
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(P):
            while position[s] < len(orders[s]):
                op, m = orders[s][position[s]]
                if op == "F":
                    dep = None if s == 0 else ("F", s - 1, m)
                    cost = fwd[s, m]
                else:
                    dep = ("F", s, m) if s == P - 1 else ("B", s + 1, m)
                    cost = bwd[s, m]
                if dep is not None and dep not in done:
                    break
                ready = 0.0 if dep is None else done[dep] + (latency if dep[1] != s else 0.0)
                start = max(free[s], ready)
                free[s] = start + cost
                done[(op, s, m)] = free[s]
                timeline[s].append((op, m, start, free[s]))
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen for the orders above; guards a broken order
            raise RuntimeError(f"{schedule}: the simulated schedule deadlocked")
    step = max(free)
    busy = [float(fwd[s].sum() + bwd[s].sum()) for s in range(P)]
    bubble = 1.0 - sum(busy) / (P * step) if step > 0 else 0.0
    return Simulation(step_time=step, bubble=bubble, busy=busy, timeline=timeline)


@dataclass
class Calibration:
    """Per-operation costs of a pipeline, in seconds (or relative units).

    Attributes:
        text_forward: per stage, the forward of one microbatch without vision work.
        vision_per_unit: extra first-stage forward time per unit of vision load.
        backward_ratio: per stage, backward / forward (vision included).
        latency: send-to-arrival time between stages.
    """

    text_forward: list[float]
    vision_per_unit: float
    backward_ratio: list[float]
    latency: float = 0.0

    def costs(self, loads: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
        """``(forward, backward)`` ``[stages, microbatches]`` for the per-microbatch vision ``loads``."""
        loads_a = np.asarray(loads, dtype=np.float64)
        fwd = np.repeat(np.asarray(self.text_forward, dtype=np.float64)[:, None], loads_a.size, axis=1)
        fwd[0] += self.vision_per_unit * loads_a
        return fwd, fwd * np.asarray(self.backward_ratio, dtype=np.float64)[:, None]

    @classmethod
    def relative(cls, loads: Sequence[float], n_stages: int, vision_share: float = 1.0) -> "Calibration":
        """Uncalibrated: a stage's text forward is 1, the mean microbatch's vision forward is
        ``vision_share`` of it, backward twice the forward, no latency."""
        mean = float(np.mean(loads)) if len(loads) else 0.0
        per_unit = vision_share / mean if mean > 0 else 0.0
        return cls([1.0] * n_stages, per_unit, [2.0] * n_stages, 0.0)


def fit_calibration(
    forward: Sequence[Sequence[float]],
    backward: Sequence[Sequence[float]],
    loads: Sequence[float],
    *,
    step_time: float | None = None,
    schedule: str = "1f1b",
) -> Calibration:
    """Fit a :class:`Calibration` to measured per-operation times of one run.

    The first stage's forwards are fitted as ``text + vision_per_unit * load`` (least squares over the
    microbatches; a single load level gives ``vision_per_unit = 0``); other stages' text forward is the
    mean of their forwards; ``backward_ratio`` is per stage ``sum(backward) / sum(forward)``. With the
    measured ``step_time``, ``latency`` is set so that the simulation of the measured costs gives that
    step time (0 when it already predicts more).
    """
    fwd = _matrix("forward", forward, None, None)
    P, n = fwd.shape
    bwd = _matrix("backward", backward, P, n)
    loads_a = np.asarray(loads, dtype=np.float64)
    if loads_a.shape != (n,):
        raise ValueError(f"loads: shape {list(loads_a.shape)}; expected [{n}] (one per microbatch)")
    if np.ptp(loads_a) > 0:
        slope, intercept = np.polyfit(loads_a, fwd[0], 1)
    else:
        slope, intercept = 0.0, float(fwd[0].mean())
    text = [float(intercept)] + [float(fwd[s].mean()) for s in range(1, P)]
    ratio = [float(bwd[s].sum() / fwd[s].sum()) if fwd[s].sum() > 0 else 2.0 for s in range(P)]
    latency = 0.0
    if step_time is not None and P > 1:
        low, high = 0.0, max(step_time, 0.0)
        if simulate(schedule, fwd, bwd).step_time < step_time:
            for _ in range(40):  # the step time grows monotonically with the latency
                mid = (low + high) / 2
                if simulate(schedule, fwd, bwd, latency=mid).step_time < step_time:
                    low = mid
                else:
                    high = mid
            latency = (low + high) / 2
    return Calibration(text, max(float(slope), 0.0), ratio, latency)


def predict(schedule: str, loads: Sequence[float], calibration: Calibration) -> Simulation:
    """Simulate ``schedule`` for microbatches with vision ``loads`` under ``calibration``."""
    fwd, bwd = calibration.costs(loads)
    return simulate(schedule, fwd, bwd, latency=calibration.latency)
