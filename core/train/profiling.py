"""``--profile DIR``: a torch profiler trace of a few training steps, one file per rank.

The trace is ``torch.profiler``'s Chrome trace JSON (``DIR/rank{R}.<time>.pt.trace.json``): TensorBoard's
profiler plugin reads the folder (``tensorboard --logdir DIR``), and https://ui.perfetto.dev or
``chrome://tracing`` open a file. The first step (first-touch allocations, the loader's start) is
skipped, the second warms the profiler up, then :data:`PROFILED_STEPS` steps are recorded (a run of
fewer steps skips and warms up less: every run records at least its last step). Inside a step, ppmedia's
phases are labelled: ``ppmedia:data`` by the loop; ``ppmedia:schedule``, ``ppmedia:grad_sync``,
``ppmedia:clip``, ``ppmedia:sums`` and ``ppmedia:optimizer`` by :func:`ppmedia.pipeline.train_step`; and
every stage call of the schedule as ``PP:0F1`` (stage 0's forward of microbatch 1; ``B`` a backward,
``W`` a weight backward: the names torch's runtime schedules give their actions).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch

__all__ = ["PROFILED_STEPS", "StepProfiler"]

#: the steps recorded after the skipped first step and the warm-up step
PROFILED_STEPS = 3


class StepProfiler:
    """A context manager around a run's steps; call :meth:`step` after each one. Without ``folder`` it
    does nothing.

    Args:
        folder: where the trace is written (created); ``None``: no profiling.
        rank: this process's global rank (the file's name).
        steps: the steps the run will take.
        stages: this rank's ``PipelineStage`` objects: their compute calls are labelled (``PP:0F1``).
        cuda: record the GPU's activity too.

    Attributes:
        recorded: the recorded steps, counted from the run's first (``range``).
    """

    def __init__(self, folder: str | None, rank: int, steps: int, stages: Sequence[Any] = (),
                 cuda: bool = False) -> None:
        self.folder, self.profiler = folder, None
        skip, warmup = int(steps > 2), int(steps > 1)
        active = max(1, min(PROFILED_STEPS, steps - skip - warmup))
        self.recorded = range(skip + warmup, skip + warmup + active)
        if folder is None:
            return
        os.makedirs(folder, exist_ok=True)
        for stage in stages:
            for method, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"),
                                 ("backward_weight_one_chunk", "W")):
                _label(stage, method, kind)
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.profiler = profile(activities=activities, schedule=schedule(wait=skip, warmup=warmup, active=active, repeat=1),
                                on_trace_ready=tensorboard_trace_handler(folder, worker_name=f"rank{rank}"))

    def __enter__(self) -> "StepProfiler":
        if self.profiler is not None:
            self.profiler.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.profiler is not None:
            self.profiler.__exit__(*exc)

    def step(self) -> None:
        """One training step is done."""
        if self.profiler is not None:
            self.profiler.step()


def _label(stage: Any, method: str, kind: str) -> None:
    """Wrap ``stage.method`` (on the instance) in a profiler range ``PP:{stage}{kind}{microbatch}``."""
    original = getattr(stage, method, None)
    if original is None:
        return
    index = int(stage.stage_index)

    def labelled(mb: int, *args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(f"PP:{index}{kind}{mb}"):
            return original(mb, *args, **kwargs)

    setattr(stage, method, labelled)
