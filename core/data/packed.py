"""A replica's samples of one global batch, or of a window of batches, packed into rows for its steps.

The loader's side of sequence packing: which of a replica's processed samples share a row
(:func:`ppmedia.packing.plan_rows`) and the packed batch of each step (:func:`ppmedia.packing.pack_samples`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["Packing", "pack_steps"]


@dataclass(frozen=True)
class Packing:
    """How a :class:`~ppmedia.data.ReplicaLoader` packs its batches.

    Attributes:
        max_length: tokens per row at most (the processor's ``max_length``).
        microbatches: the schedule's microbatches per replica and step: each step's row count is a
            multiple of it (equal microbatch shapes) and the rows are ordered so that the microbatches
            ``torch.tensor_split`` makes carry similar vision costs.
        across_batches: global batches whose samples are pooled before packing (1: each batch packed
            on its own, a step holds the same samples as unpacked). With ``W > 1`` the replica's
            shares of ``W`` consecutive batches are packed together and the rows dealt to the ``W``
            steps in turn: rows fill across batches, and which samples share a step changes.
        config: the model's config: the rows are ordered by their samples' vision costs
            (:func:`ppmedia.packing.sample_costs`, the balancing cost model); ``None``: fill order.
    """

    max_length: int
    microbatches: int = 1
    across_batches: int = 1
    config: Any = None

    def __post_init__(self) -> None:
        for name in ("max_length", "microbatches", "across_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Packing.{name}: got {value!r}; expected an int >= 1")


def _groups(lengths: list[int], costs: Sequence[float] | None, steps: int, packing: Packing) -> list[list[list[int]]]:
    """Per step its rows (indices into ``lengths``)."""
    from ..balance import balance_microbatches
    from ..packing import plan_rows, row_costs

    n = packing.microbatches
    if steps == 1:
        return [plan_rows(lengths, packing.max_length, costs, n_microbatches=n, multiple_of=n)]
    rows = plan_rows(lengths, packing.max_length, multiple_of=steps * n)  # first-fit decreasing order
    groups = [rows[j::steps] for j in range(steps)]  # dealt in turn: every step a like share of full rows
    if costs is None:
        return groups
    return [[group[i] for i in balance_microbatches(row_costs(group, costs), n)] for group in groups]


def pack_steps(samples: Sequence[dict[str, Any] | None], steps: int, packing: Packing,
               pad_id: int) -> list[tuple[dict[str, Any], list[int]]]:
    """The packed batches of ``steps`` steps from the samples of their shares (one after the other).

    Args:
        samples: :class:`~ppmedia.data.SampleProcessor` outputs; ``None`` for a skipped sample (left
            out of every row).
        steps: how many steps' shares ``samples`` holds (``packing.across_batches``, fewer at an
            epoch's end; 1: one batch).
        packing: the rows' length, the microbatches, the costs.
        pad_id: the tokenizer's padding id.

    Returns:
        Per step ``(batch, members)``: ``batch`` is :func:`ppmedia.packing.pack_samples`' packed batch
        (``[R, S]`` token keys, ``attention_mask`` holding each token's sample number within its row,
        0 on padding; ``R`` a multiple of ``packing.microbatches``) plus ``packed_rows``: per row the
        indices into ``members`` of its samples; ``members``: the step's samples as positions in
        ``samples``, ascending. With ``steps == 1`` the members are every kept sample.
    """
    from ..packing import pack_samples, sample_costs

    kept = [i for i, s in enumerate(samples) if s is not None]
    lengths = [int(samples[i]["input_ids"].shape[1]) for i in kept]  # type: ignore[index]
    costs = None
    if packing.config is not None and kept:
        costs = [float(c) for c in sample_costs([samples[i] for i in kept], packing.config)]  # type: ignore[misc]
    out = []
    for group in _groups(lengths, costs, steps, packing):
        group = group or [[] for _ in range(packing.microbatches)]  # no sample left: rows of padding only
        members = sorted(kept[i] for row in group for i in row)
        local = {position: k for k, position in enumerate(members)}
        rows = [[local[kept[i]] for i in row] for row in group]
        batch: dict[str, Any] = pack_samples([samples[p] for p in members], rows, pad_id)
        batch["packed_rows"] = rows
        out.append((batch, members))
    return out
