"""A replica's samples of a window of global batches, grouped by length into its steps.

The loader's side of length-grouped sampling (as Hugging Face's ``group_by_length`` does): the shuffled
order is cut into windows of several global batches; inside a window, each replica sorts its samples by
token length and deals them out in runs of its share, so that a step's rows are of similar length and a
step padded to its longest row carries little padding. The steps of a window are then taken in an
order drawn from the seed, the epoch and the window (the same on every rank, at every layout, after a
resume), so that lengths do not climb through the window.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["group_steps", "step_order"]


def group_steps(samples: Sequence[dict[str, Any] | None], steps: int) -> list[list[int]]:
    """Per step its members: positions in ``samples`` (``steps`` shares of ``len(samples) // steps``,
    one after the other), shortest first, step ``k`` holding the ``k``-th run of the samples sorted
    by token length (ties: the earlier position first).

    Args:
        samples: :class:`~ppmedia.data.SampleProcessor` outputs (``input_ids`` ``[1, S]``); ``None``
            for a skipped sample (a filler row of one token: sorted as length 1).
        steps: how many steps' shares ``samples`` holds.

    Returns:
        ``steps`` lists of ``len(samples) // steps`` positions; every position exactly once.
    """
    if steps < 1 or len(samples) % steps:
        raise ValueError(f"group_steps: {len(samples)} samples do not make {steps} equal shares")
    share = len(samples) // steps
    lengths = [1 if s is None else int(s["input_ids"].shape[-1]) for s in samples]
    ranked = sorted(range(len(samples)), key=lambda i: (lengths[i], i))
    return [ranked[k * share : (k + 1) * share] for k in range(steps)]


def step_order(steps: int, seed: int, epoch: int, window_start: int) -> list[int]:
    """The order in which a window's ``steps`` grouped steps are taken: a permutation drawn from
    ``seed``, ``epoch`` and ``window_start`` (the window's first position in the epoch's order)."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + epoch) * 1_000_033 + window_start)
    return torch.randperm(steps, generator=gen).tolist()
