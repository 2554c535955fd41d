"""Replay modelled operations in time: each rank runs its own operations in order, and a background lane
that only runs while they idle (the step model of :mod:`ppmedia.planning.stepmodel`).

An operation starts when its rank is free and every event it needs has happened (plus the latency the
need adds); when it ends it makes its events (after a delay: a send's latency). A rank's lane runs its
jobs in order, each once its needs have happened, in the time the rank's own operations leave idle: an
operation that becomes ready preempts the lane's job, which goes on when the rank idles again (so the
lane is drawn in pieces). This is how :class:`ppmedia.pipeline.lane.Lane` behaves on a rank with a
core (or device) of its own: its thread has the lowest priority. With ``cores`` (ranks sharing a
machine's CPU cores, as gloo processes on one host do) the lanes run on the cores the ranks' own
operations leave free, whichever rank is idle: ``cores - busy ranks`` cores shared by every lane with
a job ready, at most one core each (two ranks on two cores: a lane runs only while some rank idles,
at half speed while both lanes want that core). An operation may take a lane job back
(``takes_back``): if the lane has not started that job when the operation is ready, the operation runs
it first itself (drawn as an ``EI`` overlay) and the lane skips it, as the encoder spread's first stage
does with an encode its lane has not reached.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .timeline import Bar, Timeline

__all__ = ["Op", "replay"]

_EPS = 1e-12


@dataclass(eq=False)
class Op:
    """One modelled operation.

    Attributes:
        rank, kind, stage, mb: where and what (``stage``/``mb`` ``-1`` for per-step work).
        cost: how long it runs, in the model's unit.
        needs: ``(event, latency)``: it starts no earlier than each event's time plus the latency.
        makes: ``(event, delay)``: the events it makes, at its end plus the delay.
        takes_back: a job of the rank's lane this operation runs itself, first, if the lane has not
            started it when the operation is ready (the operation's needs on that job's events then
            do not count).
    """

    rank: int
    kind: str
    stage: int
    mb: int
    cost: float
    needs: list[tuple[Any, float]] = field(default_factory=list)
    makes: list[tuple[Any, float]] = field(default_factory=list)
    takes_back: "Op | None" = None
    taken: bool = False  # a lane job some operation took back


def lane_done(rank: int) -> tuple[str, int]:
    """The event a rank's lane makes when its last job is done (at once when it has none)."""
    return ("lane", rank)


class _Rank:
    def __init__(self, ops: list[Op], lane: list[Op]) -> None:
        self.ops, self.lane = ops, lane
        self.pos = self.lpos = 0
        self.running: tuple[Op, float, float] | None = None
        self.left: float | None = None  # the lane job's remaining cost
        self.piece: float | None = None  # when the lane's current piece started


def _ready_at(op: Op, done: dict[Any, float]) -> float | None:
    if any(key not in done for key, _ in op.needs):
        return None
    return max((done[key] + extra for key, extra in op.needs), default=0.0)


def _finish(op: Op, end: float, done: dict[Any, float]) -> None:
    for key, delay in op.makes:
        done[key] = end + delay


class _Replay:
    def __init__(self, ranks: list[list[Op]], lanes: list[list[Op]], cores: int | None = None,
                 lane_share: float = 1.0) -> None:
        self.ranks = [_Rank(ops, lane) for ops, lane in zip(ranks, lanes)]
        self.done: dict[Any, float] = {lane_done(r): 0.0 for r, lane in enumerate(lanes) if not lane}
        self.bars: list[Bar] = []
        self.now = 0.0
        self.cores, self.lane_share = cores, lane_share
        self.rates = [0.0] * len(ranks)  # each lane's speed now (share of a core)

    def _start_ready(self) -> None:
        """Start every operation that can start now (instant ones finish at once)."""
        started = True
        while started:
            started = False
            for r, rank in enumerate(self.ranks):
                while rank.running is None and rank.pos < len(rank.ops):
                    op, job, t = self._next_op(rank)
                    if t is None or t > self.now + _EPS:
                        break
                    cost = op.cost
                    if job is not None:  # runs the job itself, first
                        job.taken, cost = True, cost + job.cost
                        _finish(job, self.now + job.cost, self.done)
                        self.bars.append(Bar(r, "EI", self.now, self.now + job.cost, op.stage, job.mb))
                    rank.running = (op, self.now, self.now + cost)
                    started = True
                    if cost <= 0:
                        self._end_op(r)

    def _next_op(self, rank: _Rank) -> tuple[Op, Op | None, float | None]:
        """The rank's next operation, the lane job it would take back, and when it can start
        (``None``: an event it needs has not happened)."""
        op = rank.ops[rank.pos]
        job = op.takes_back if op.takes_back is not None and self._unstarted(rank, op.takes_back) else None
        return op, job, _ready_at(self._without(op, job), self.done)

    @staticmethod
    def _unstarted(rank: _Rank, job: Op) -> bool:
        index = next((i for i, j in enumerate(rank.lane) if j is job), None)
        if job.taken or index is None:
            return False
        return index > rank.lpos or (index == rank.lpos and rank.left is None)

    @staticmethod
    def _without(op: Op, job: Op | None) -> Op:
        if job is None:
            return op
        made = {key for key, _ in job.makes}
        return Op(op.rank, op.kind, op.stage, op.mb, op.cost, [n for n in op.needs if n[0] not in made])

    def _skip_taken(self, r: int) -> None:
        rank = self.ranks[r]
        while rank.lpos < len(rank.lane) and rank.lane[rank.lpos].taken and rank.left is None:
            rank.lpos += 1
            if rank.lpos == len(rank.lane):
                self.done[lane_done(r)] = self.now

    def _end_op(self, r: int) -> None:
        rank = self.ranks[r]
        assert rank.running is not None
        op, start, end = rank.running
        _finish(op, end, self.done)
        if op.cost > 0 or op.kind not in ("S", "R", "J"):  # an instant collective or join is no bar
            self.bars.append(Bar(r, op.kind, start, end, op.stage, op.mb))
        rank.running, rank.pos = None, rank.pos + 1

    def _close_piece(self, r: int) -> None:
        rank = self.ranks[r]
        if rank.piece is not None:
            if self.now > rank.piece + _EPS:
                job = rank.lane[rank.lpos]
                self.bars.append(Bar(r, job.kind, rank.piece, self.now, job.stage, job.mb))
            rank.piece = None

    def _lane_ready(self, rank: _Rank) -> bool:
        if rank.lpos >= len(rank.lane):
            return False
        t = _ready_at(rank.lane[rank.lpos], self.done)
        return t is not None and t <= self.now + _EPS

    def _run_lanes(self) -> None:
        """Each lane's speed from now on (its rank's operations preempt it; with ``cores``, the free
        cores shared), its drawn piece opened or closed accordingly."""
        for r in range(len(self.ranks)):
            self._skip_taken(r)
        ready = [self._lane_ready(rank) for rank in self.ranks]
        if self.cores is None:  # a core per rank: the lane runs while its rank idles
            self.rates = [1.0 if ok and rank.running is None else 0.0 for ok, rank in zip(ready, self.ranks)]
        else:
            busy = sum(1 for rank in self.ranks if rank.running is not None and rank.running[2] > rank.running[1])
            share = max(0.0, self.cores - busy) / max(1, sum(ready))
            self.rates = [min(1.0, share) * self.lane_share if ok else 0.0 for ok in ready]
        for r, rank in enumerate(self.ranks):
            if self.rates[r] <= 0:
                self._close_piece(r)
            elif rank.piece is None:
                rank.left = rank.lane[rank.lpos].cost if rank.left is None else rank.left
                rank.piece = self.now

    def _next_time(self) -> float | None:
        times = []
        for r, rank in enumerate(self.ranks):
            if rank.running is not None:
                times.append(rank.running[2])
            elif rank.pos < len(rank.ops):
                t = self._next_op(rank)[2]
                if t is not None:
                    times.append(max(t, self.now))
            if rank.piece is not None:
                assert rank.left is not None
                times.append(self.now + rank.left / self.rates[r])
            elif rank.lpos < len(rank.lane):  # a lane waiting for its job's events
                t = _ready_at(rank.lane[rank.lpos], self.done)
                if t is not None and t > self.now:
                    times.append(t)
        return min(times) if times else None

    def _advance(self, until: float) -> None:
        for r, rank in enumerate(self.ranks):
            if rank.piece is not None:
                assert rank.left is not None
                rank.left -= (until - self.now) * self.rates[r]
        self.now = until
        for r, rank in enumerate(self.ranks):
            if rank.running is not None and rank.running[2] <= self.now + _EPS:
                self._end_op(r)
            if rank.piece is not None and rank.left is not None and rank.left <= _EPS:
                job = rank.lane[rank.lpos]
                self._close_piece(r)
                _finish(job, self.now, self.done)
                rank.lpos, rank.left = rank.lpos + 1, None
                if rank.lpos == len(rank.lane):
                    self.done[lane_done(r)] = self.now

    def run(self, title: str) -> list[Bar]:
        while True:
            self._start_ready()
            self._run_lanes()
            if all(r.pos == len(r.ops) and r.lpos == len(r.lane) for r in self.ranks):
                return self.bars
            until = self._next_time()
            if until is None:
                raise RuntimeError(f"{title}: the modelled schedule deadlocked (a broken action order)")
            self._advance(until)


def replay(ranks: list[list[Op]], title: str, unit: str, lanes: list[list[Op]] | None = None,
           cores: int | None = None, lane_share: float = 1.0) -> Timeline:
    """Replay ``ranks`` (each rank's operations in order) and their ``lanes`` (each rank's background
    jobs in order; default none) into a :class:`~ppmedia.planning.timeline.Timeline`. ``cores``: the
    CPU cores all ranks and lanes share (``None``: a core or device per rank, its lane only in its idle
    time). ``lane_share``: with ``cores``, the part of a free core a lane's work gets (below 1 where
    the lane's thread loses time to the ranks' own: a hyperthread sibling, the interpreter lock).

    Raises:
        RuntimeError: the operations wait for each other in a cycle (an event nothing makes).
    """
    lanes = lanes if lanes is not None else [[] for _ in ranks]
    if len(lanes) != len(ranks):
        raise ValueError(f"lanes: {len(lanes)} for {len(ranks)} ranks; expected one per rank")
    if cores is not None and cores < 1:
        raise ValueError(f"cores: got {cores}; expected >= 1 or None")
    if not 0 < lane_share <= 1:
        raise ValueError(f"lane_share: got {lane_share}; expected 0 < share <= 1")
    return Timeline(title, len(ranks), _Replay(ranks, lanes, cores, lane_share).run(title), unit)
