"""Interleaved timing: every repetition runs each side once, in a rotating order.

Running the sides of a comparison back to back inside each repetition exposes them to the same
machine state (frequency, cache, other processes); a ratio is then taken per repetition, so a slow
stretch of the machine slows both sides of a pair and drops out of the ratio. Results are medians.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = ["Side", "Timings", "interleaved"]


@dataclass
class Side:
    """One side of a comparison.

    Attributes:
        run: the timed call; receives what ``prepare`` returned.
        prepare: untimed, called right before each timed call (e.g. a fresh shallow copy of a batch
            that ``run`` pops keys from); ``None`` passes nothing.
        divide: the timed duration is divided by this (e.g. the number of calls inside ``run``).
    """

    run: Callable[..., Any]
    prepare: Callable[[], Any] | None = None
    divide: int = 1


@dataclass
class Timings:
    """Seconds per repetition and side (each already divided by the side's ``divide``)."""

    samples: dict[str, list[float]] = field(default_factory=dict)

    def median(self, name: str) -> float:
        return statistics.median(self.samples[name])

    def ratio(self, numerator: str, denominator: str) -> float:
        """Median over repetitions of ``numerator / denominator``, pair by pair."""
        pairs = zip(self.samples[numerator], self.samples[denominator], strict=True)
        return statistics.median(a / b for a, b in pairs)


def _once(side: Side) -> float:
    args = side.prepare() if side.prepare is not None else None
    if args is None:
        start = time.perf_counter_ns()
        side.run()
        stop = time.perf_counter_ns()
    else:
        start = time.perf_counter_ns()
        side.run(args)
        stop = time.perf_counter_ns()
    return (stop - start) * 1e-9 / side.divide


def interleaved(sides: Mapping[str, Side], repeats: int, warmup: int = 5) -> Timings:
    """Time every side ``repeats`` times, interleaved, after ``warmup`` untimed rounds.

    The garbage collector is off while timing (collected between repetitions), so a collection
    triggered by one side does not land in the other side's time.
    """
    names = list(sides)
    for _ in range(warmup):
        for name in names:
            _once(sides[name])
    timings = Timings({name: [] for name in names})
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for rep in range(repeats):
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                timings.samples[name].append(_once(sides[name]))
            if rep % 16 == 15:
                gc.collect()
    finally:
        if enabled:
            gc.enable()
    return timings
