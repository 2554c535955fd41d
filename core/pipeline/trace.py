"""Measured per-action timelines of a real pipeline step (:class:`StepTracer`).

The tracer wraps each of a rank's ``PipelineStage`` objects' ``forward_one_chunk``,
``backward_one_chunk`` and ``backward_weight_one_chunk`` (the calls every torch schedule makes, in
its own order) and records when each ran; an :class:`~ppmedia.pipeline.encoder.EncoderSpread` adds its
broadcast, encodes, waits, vision backwards and reduction. :meth:`StepTracer.timeline` gathers every
pipeline rank's record into one :class:`~ppmedia.planning.timeline.Timeline` (times from the step's start, taken
right after a barrier on every rank), which :func:`ppmedia.planning.timeline.write_svg` draws.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from ..planning.timeline import Bar, Timeline

__all__ = ["StepTracer"]

_METHODS = (("forward_one_chunk", "F"), ("backward_one_chunk", "B"), ("backward_weight_one_chunk", "W"))


class StepTracer:
    """Records the compute actions of this rank's stages, and its encoder spread's work.

    Args:
        stages: this rank's ``PipelineStage`` objects.
        spread: this rank's :class:`~ppmedia.pipeline.EncoderSpread`, if any.

    Use::

        tracer = StepTracer(stages, spread)
        tracer.start(group=pp_group)           # a barrier, then the clock starts
        with spread.step(staged, ids):         # or stage_media(...)
            schedule.step(...)
        timeline = tracer.timeline("measured", group=pp_group)   # collective; the same on every rank
        tracer.remove()
    """

    def __init__(self, stages: Sequence[Any], spread: Any = None) -> None:
        self.stages = list(stages)
        self.spread = spread
        self.events: list[tuple[str, int, int, float, float]] = []  # kind, stage, microbatch, t0, t1
        self.t0 = time.perf_counter()
        self._originals: list[tuple[Any, str]] = []
        for stage in self.stages:
            for name, kind in _METHODS:
                self._wrap(stage, name, kind)

    def _wrap(self, stage: Any, name: str, kind: str) -> None:
        original = getattr(stage, name)
        index = int(stage.stage_index)
        events = self.events

        def timed(mb: int, *args: Any, **kwargs: Any) -> Any:
            full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
            label = "I" if kind == "B" and not full else kind
            t0 = time.perf_counter()
            try:
                return original(mb, *args, **kwargs)
            finally:
                events.append((label, index, int(mb), t0, time.perf_counter()))

        setattr(stage, name, timed)
        self._originals.append((stage, name))

    def start(self, group: Any = None) -> None:
        """Clear the record and start the clock (after a barrier over ``group``, when initialised)."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier(group=group)
        self.events.clear()
        if self.spread is not None:
            self.spread.trace = []
        self.t0 = time.perf_counter()

    def bars(self, rank: int) -> list[Bar]:
        """This rank's record as bars, in the order the actions ran (spread work included)."""
        found = list(self.events)
        for kind, mb, t0, t1 in (self.spread.trace or []) if self.spread is not None else []:
            found.append((kind, 0 if kind == "wait" else -1, mb, t0, t1))
        found.sort(key=lambda e: (e[3], e[4]))
        return [Bar(rank, kind, t0 - self.t0, t1 - self.t0, stage, mb) for kind, stage, mb, t0, t1 in found]

    def timeline(self, title: str = "measured", group: Any = None) -> Timeline:
        """Every pipeline rank's bars in one timeline (collective over ``group`` when initialised)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return Timeline(title, 1, self.bars(0))
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        gathered: list[Any] = [None] * size
        dist.all_gather_object(gathered, self.bars(rank), group=group)
        return Timeline(title, size, [bar for bars in gathered for bar in bars])

    def remove(self) -> None:
        """Put the stages' methods back."""
        for stage, name in self._originals:
            stage.__dict__.pop(name, None)
        self._originals.clear()
