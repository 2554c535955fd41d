"""The encoder spread's plan: which pipeline rank encodes each microbatch of a step.

:func:`interleave_encoders` (with the background lane: in microbatch order, each to the least loaded
rank) or :func:`assign_encoders` (without it: contiguous blocks of balanced cost), chosen by
:func:`default_assign`; :func:`encoded_ahead`, how many of a rank's microbatches it encodes before the
schedule; :class:`SpreadPlan`, one step's assignment, the same on every rank. Plain Python: the
step-time model (:mod:`ppmedia.planning.stepmodel`) plans with the same rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

__all__ = [
    "AHEAD",
    "SpreadPlan",
    "assign_encoders",
    "default_assign",
    "encoded_ahead",
    "interleave_encoders",
]

#: with the background lane: the share of its microbatches a rank encodes before the schedule (the
#: first ones, which stage 0 needs first); the lane encodes the rest in the schedule's idle time.
AHEAD = 0.5


def encoded_ahead(n: int, ahead: float) -> int:
    """How many of a rank's ``n`` microbatches (the first, in order) it encodes before the schedule:
    ``ceil(ahead * n)``, at least one when it has any."""
    if not 0 <= ahead <= 1:
        raise ValueError(f"ahead: got {ahead}; expected a share 0..1")
    return min(n, max(1 if n else 0, math.ceil(ahead * n)))


def _linear_partition(costs: Sequence[float], parts: int) -> list[int]:
    """Cut points of ``costs`` into ``parts`` contiguous blocks: the largest block sum as small as
    possible, and among those cuts the most even (smallest sum of squares; ties: earlier ranks take
    more). ``bounds[i]:bounds[i + 1]`` is block ``i``; two dynamic programmes over ``O(parts n^2)``."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")

    def solve(cap: float | None) -> tuple[list[list[float]], list[list[int]]]:
        best = [[inf] * (n + 1) for _ in range(parts + 1)]
        cut = [[0] * (n + 1) for _ in range(parts + 1)]
        best[0][0] = 0.0
        for p in range(1, parts + 1):
            for j in range(n + 1):
                for i in range(j + 1):
                    if best[p - 1][i] == inf:
                        continue
                    block = prefix[j] - prefix[i]
                    if cap is None:
                        value = max(best[p - 1][i], block)
                    elif block > cap + 1e-9 * max(1.0, cap):
                        continue
                    else:
                        value = best[p - 1][i] + block * block
                    if value <= best[p][j] + 1e-12 * max(1.0, abs(value)):
                        best[p][j], cut[p][j] = value, i
        return best, cut

    largest, _ = solve(None)
    _, cut = solve(largest[parts][n])
    bounds = [n]
    for p in range(parts, 0, -1):
        bounds.append(cut[p][bounds[-1]])
    return bounds[::-1]


def assign_encoders(costs: Sequence[float], n_ranks: int, *, weights: Sequence[float] | None = None) -> list[int]:
    """The pipeline rank that encodes each microbatch.

    Contiguous blocks of microbatches with balanced vision cost, in rank order: rank 0 (the first
    stage's) encodes the first block, so it can start its first forward as soon as its own first
    chunk is encoded; later ranks encode later microbatches, which stage 0 needs later. A block may be
    empty (fewer microbatches with media than ranks). Microbatches without media (cost 0) go to the
    block they sit in and cost nothing.

    Args:
        costs: ``[n]`` vision cost per microbatch (any unit, ``>= 0``).
        n_ranks: pipeline ranks.
        weights: optional ``[n_ranks]`` relative speed (share) of each rank; default equal.

    Returns:
        ``[n]`` group ranks.
    """
    values = _checked_costs(costs, n_ranks, weights)
    owners = [0] * len(values)
    if n_ranks == 1 or not any(values):
        return owners
    if weights is None:
        bounds = _linear_partition(values, n_ranks)
    else:  # greedy on the cumulative shares: block r ends where the cost reaches its share
        total, share, bounds, acc = sum(values), 0.0, [0], 0.0
        for r in range(n_ranks - 1):
            share += float(weights[r]) / float(sum(weights))
            k = bounds[-1]
            while k < len(values) and acc + values[k] / 2 <= share * total:
                acc += values[k]
                k += 1
            bounds.append(k)
        bounds.append(len(values))
    for rank in range(n_ranks):
        for k in range(bounds[rank], bounds[rank + 1]):
            owners[k] = rank
    return owners


def interleave_encoders(costs: Sequence[float], n_ranks: int, *, weights: Sequence[float] | None = None) -> list[int]:
    """The pipeline rank that encodes each microbatch: in microbatch order (the order stage 0 needs
    them), each to the rank with the least vision cost so far (relative to its ``weights`` share;
    ties: the lower rank). Equal costs go round-robin (0, 1, ..., 0, 1, ...), so every rank's first
    microbatches are the step's first ones: what the background lane wants, where each rank encodes
    its first microbatches before the schedule and the rest while it runs. Microbatches without media
    (cost 0) go to the previous microbatch's rank (rank 0 first) and cost nothing.

    Args:
        costs: ``[n]`` vision cost per microbatch (any unit, ``>= 0``).
        n_ranks: pipeline ranks.
        weights: optional ``[n_ranks]`` relative speed (share) of each rank; default equal.

    Returns:
        ``[n]`` group ranks.
    """
    values = _checked_costs(costs, n_ranks, weights)
    shares = [1.0] * n_ranks if weights is None else [float(w) for w in weights]
    load = [0.0] * n_ranks
    owners: list[int] = []
    for c in values:
        if c == 0:
            owners.append(owners[-1] if owners else 0)
            continue
        rank = min(range(n_ranks), key=lambda r: (load[r] / shares[r], r))
        owners.append(rank)
        load[rank] += c
    return owners


def _checked_costs(costs: Sequence[float], n_ranks: int, weights: Sequence[float] | None) -> list[float]:
    if n_ranks < 1:
        raise ValueError(f"n_ranks: got {n_ranks}; expected >= 1")
    values = [float(c) for c in costs]
    if any(c < 0 or c != c for c in values):
        raise ValueError(f"costs: got {values}; expected costs >= 0")
    if weights is not None and (len(weights) != n_ranks or any(w <= 0 for w in weights)):
        raise ValueError(f"weights: got {list(weights)}; expected {n_ranks} positive shares")
    return values


def default_assign(background: bool) -> Callable[[Sequence[float], int], list[int]]:
    """The spread's assignment rule: :func:`interleave_encoders` with the background lane, else
    :func:`assign_encoders` (contiguous blocks, all encoded before the schedule)."""
    return interleave_encoders if background else assign_encoders


@dataclass(frozen=True)
class SpreadPlan:
    """One step's encoder assignment, computed the same way on every pipeline rank.

    Attributes:
        owners: ``[n]`` the pipeline-group rank that encodes each microbatch.
        costs: ``[n]`` each microbatch's vision cost (the adapter's cost model, MFLOP).
        rows: per microbatch, ``{modality: placeholder tokens}`` (the feature rows it needs).
        names: per microbatch, the ``(name, modality)`` pairs of the tensors its encoder sends, in
            send order (``adapter.encoder_output_names`` of each modality with rows).
    """

    owners: tuple[int, ...]
    costs: tuple[float, ...]
    rows: tuple[dict[str, int], ...]
    names: tuple[tuple[tuple[str, str], ...], ...]

    def encoded_by(self, rank: int) -> list[int]:
        """The microbatches ``rank`` encodes, in order."""
        return [k for k, owner in enumerate(self.owners) if owner == rank and self.names[k]]
