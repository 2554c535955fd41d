"""Guards of a training run: what must hold before it starts and at every step, checked so that a
broken precondition stops the run with one clear error instead of a silently wrong result or a hang.

* :func:`option_problem`: numeric and paired options (a script's argparse values) checked before
  anything starts; returns the first problem as one line for ``parser.error`` (exit 2).
* :func:`agree`: a refusal one rank found, raised on EVERY rank of the group before anyone enters a
  collective the refusing rank would never reach (a rank left waiting there hangs past any timeout).
* :func:`batch_fingerprint` / :func:`check_batch_agreement`: every rank of a pipeline (and every
  replica) must be handed the same global batch; a cheap fingerprint of it is compared each step.
* :class:`NonFiniteGuard`: a non-finite loss or gradient norm stops the run before the optimizer
  step (and so before any checkpoint), naming the step, or skips at most ``limit`` such steps.
* :func:`failure_line`: an exception as one short line (the innermost cause first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

__all__ = [
    "BatchMismatchError",
    "NonFiniteError",
    "NonFiniteGuard",
    "agree",
    "batch_fingerprint",
    "check_batch_agreement",
    "failure_line",
    "option_problem",
]


# -- options ----------------------------------------------------------------------------------------
def option_problem(
    values: Mapping[str, Any],
    *,
    positive: Sequence[str] = (),
    non_negative: Sequence[str] = (),
    together: Sequence[tuple[str, str]] = (),
) -> str | None:
    """The first problem of ``values`` (option name -> value, ``None`` = not given), or ``None``.

    ``positive``: finite numbers > 0; ``non_negative``: finite numbers >= 0; ``together``: pairs ``(a, b)`` where
    giving ``a`` (set and not 0) needs ``b`` (set and not 0). Names are shown as given (``--lr``).
    """
    for name in positive:
        value = values.get(name)
        if value is not None and not (_finite(value) and value > 0):
            return f"{name} must be a finite number > 0 (got {value})"
    for name in non_negative:
        value = values.get(name)
        if value is not None and not (_finite(value) and value >= 0):
            return f"{name} must be a finite number >= 0 (got {value})"
    for first, second in together:
        if _given(values.get(first)) and not _given(values.get(second)):
            return f"{first} needs {second} (got {first} {values.get(first)} without {second})"
    return None


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _given(value: Any) -> bool:
    return value is not None and value is not False and value != 0 and value != ""


# -- agreement among ranks --------------------------------------------------------------------------
def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def agree(problem: BaseException | None, group: Any = None, *, what: str = "refused") -> None:
    """Raise on every rank of ``group`` if any rank has a ``problem``; return on all ranks otherwise.

    Call it where a check can come out differently on different ranks (each holds other stages,
    other files, another part of the model) and a collective follows: the ranks' findings are
    gathered (``all_gather_object``, itself reached by every rank), and every rank raises the same
    error, of the first refusing rank's exception type, naming every refusing rank (ranks with the
    same message share it: ``rank 0, 1: ...``). Without a
    process group the ``problem`` is raised as it is.
    """
    import torch.distributed as dist

    if not _distributed():
        if problem is not None:
            raise problem
        return
    local = None if problem is None else (type(problem).__name__, str(problem))
    found: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, local, group=group)
    refusing = [(rank, item) for rank, item in enumerate(found) if item is not None]
    if not refusing:
        return
    kind = type(problem) if problem is not None else _exception_type(refusing[0][1][0])
    by_message: dict[str, list[int]] = {}
    for rank, (_, message) in refusing:
        by_message.setdefault(message, []).append(rank)
    messages = "; ".join(f"rank {', '.join(map(str, ranks_))}: {message}" for message, ranks_ in by_message.items())
    ranks = ", ".join(str(rank) for rank, _ in refusing)
    raise kind(f"{what} on rank(s) {ranks} of {len(found)} (every rank raises this): {messages}")


def _exception_type(name: str) -> type[Exception]:
    import builtins

    kind = getattr(builtins, name, None)
    return kind if isinstance(kind, type) and issubclass(kind, Exception) else RuntimeError


# -- batch agreement --------------------------------------------------------------------------------
class BatchMismatchError(RuntimeError):
    """Ranks that must hold the same global batch hold different ones."""


_WEIGHTS = 1009  # positions are weighted 1..1009, so a permutation of values changes the fingerprint


def batch_fingerprint(batch: Mapping[str, Any]) -> torch.Tensor:
    """Four float64 numbers summarising ``batch`` (a processor's output: name -> tensor or other).

    The keys, shapes and dtypes (hashed), and for all tensors together: the sum of their values, the
    sum weighted by position, and the number of elements. Cost: one pass over the data (no copy of it
    beyond a float64 view per tensor); no host read (the caller compares it with a collective).
    """
    import zlib

    meta = []
    total = torch.zeros((), dtype=torch.float64)
    weighted = torch.zeros((), dtype=torch.float64)
    count = 0
    for key in sorted(batch):
        value = batch[key]
        if isinstance(value, torch.Tensor):
            meta.append(f"{key}:{tuple(value.shape)}:{value.dtype}")
            flat = value.detach().reshape(-1).to(torch.float64)
            weights = torch.arange(flat.numel(), dtype=torch.float64, device=flat.device).remainder_(_WEIGHTS).add_(1)
            total = total + flat.sum().cpu()
            weighted = weighted + (flat * weights).sum().cpu()
            count += flat.numel()
        else:
            meta.append(f"{key}:{value!r}")
    digest = zlib.crc32("|".join(meta).encode())
    return torch.stack([torch.tensor(float(digest), dtype=torch.float64), total, weighted,
                        torch.tensor(float(count), dtype=torch.float64)])


def check_batch_agreement(batch: Mapping[str, Any], group: Any = None, *, step: int | None = None) -> None:
    """Check that every rank of ``group`` (default: the world) holds the same ``batch``.

    A collective (one ``all_gather`` of 4 numbers per rank). Every rank compares every rank's
    :func:`batch_fingerprint` with the group's rank 0 and raises the same
    :class:`BatchMismatchError`, naming the ranks that differ, so none is left waiting.
    """
    import torch.distributed as dist

    if not _distributed():
        return
    mine = batch_fingerprint(batch)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    reference = gathered[0]
    differ = [r for r, other in enumerate(gathered) if not torch.equal(other, reference)]
    if differ:
        where = f"step {step}: " if step is not None else ""
        ranks = [dist.get_global_rank(group, r) if group is not None else r for r in differ]
        first = 0 if group is None else dist.get_global_rank(group, 0)
        raise BatchMismatchError(
            f"{where}rank(s) {', '.join(map(str, ranks))} hold another global batch than rank {first} (their "
            f"fingerprints differ: keys/shapes, sums or order); every rank of a pipeline and every replica must "
            f"be handed the same global batch (seed the data loader alike, or shard it by replica yourself)"
        )


# -- non-finite loss or gradients -------------------------------------------------------------------
class NonFiniteError(RuntimeError):
    """A step's loss or gradient norm is not finite."""


@dataclass
class NonFiniteGuard:
    """Stop (or skip) a step whose loss or gradient norm is NaN or infinite, before its optimizer step.

    ``limit``: how many such steps may be skipped over the run (0: the first one stops it). Give it the
    GLOBAL loss and norm (the same on every rank: the loss all-reduced, the norm from
    :func:`~ppmedia.pipeline.clip_grad_norm`), so every rank decides alike.
    """

    limit: int = 0
    skipped: int = 0

    def should_skip(self, step: int, loss: float, grad_norm: float) -> bool:
        """``False``: the step is finite, step the optimizer. ``True``: skip this step (zero the
        gradients, do not step). Raises :class:`NonFiniteError` once more than ``limit`` steps were
        non-finite."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            return False
        if self.skipped < self.limit:
            self.skipped += 1
            return True
        allowed = f" (skipped {self.skipped}, the most --skip-nonfinite allows)" if self.limit else ""
        raise NonFiniteError(
            f"step {step}: loss {loss} and gradient norm {grad_norm}: not finite; stopped before the optimizer "
            f"step and before any checkpoint of it{allowed}"
        )


# -- failures ---------------------------------------------------------------------------------------
def failure_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: message`` of the innermost exception of ``exc`` (its cause / context chain; DCP's
    ``CheckpointException``: the first rank's failure), squeezed to one line of at most ``limit``
    characters, with the outermost exception's type and first words when it differs."""
    def line(e: BaseException) -> str:
        text = " ".join(str(e).split())
        return f"{type(e).__name__}: {text}" if text else type(e).__name__

    inner, seen = exc, {id(exc)}
    while True:
        failures = getattr(inner, "failures", None)
        nxt = inner.__cause__ or inner.__context__
        if nxt is None and isinstance(failures, Mapping) and failures:
            first = next(iter(failures.values()))
            nxt = first[0] if isinstance(first, tuple) else first
        if not isinstance(nxt, BaseException) or id(nxt) in seen:
            break
        inner = nxt
        seen.add(id(inner))
    outer = type(exc).__name__ if getattr(exc, "failures", None) else line(exc)[:150]  # DCP's: tracebacks
    text = line(inner) if inner is exc else f"{line(inner)} (surfaced as {outer})"
    return text if len(text) <= limit else text[: limit - 3] + "..."
