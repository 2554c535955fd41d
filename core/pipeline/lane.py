"""A background lane: jobs run in a fixed order on a low-priority thread, each once its input is ready.

The encoder spread (:mod:`ppmedia.pipeline.encoder`) runs each rank's vision backwards here, so they
fill the time the rank's schedule spends waiting for its neighbours instead of running after the
schedule. The lane's thread asks the operating system for the lowest priority it grants
(``SCHED_IDLE`` on Linux, else ``nice 19``): it runs only when a core would otherwise idle, and the
schedule's own work preempts it as soon as that is ready again. Its jobs are PyTorch calls that release
the GIL while they compute (an autograd backward does so for its whole length), so the schedule's
Python keeps running beside them.

Jobs run one after another in the order given (so gradients accumulate in the same order on every
run); a job that raises stops the lane, and :meth:`Lane.join` raises it again in the caller.
"""

from __future__ import annotations

import os
import threading
from typing import Callable, Sequence

import torch

__all__ = ["Lane", "lower_thread_priority", "restore_thread_priority"]

#: ``(wait, run)``: ``wait()`` blocks until the job's input is ready, then ``run()`` does the work.
Job = tuple[Callable[[], None], Callable[[], None]]


def lower_thread_priority() -> str:
    """Give the calling thread the lowest CPU priority available; returns what it got:
    ``"idle"`` (Linux ``SCHED_IDLE``), ``"nice"`` (``nice 19``) or ``"none"`` (neither allowed)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread
        return "idle"
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        return "nice"
    except (AttributeError, OSError):
        return "none"


def restore_thread_priority(tid: int) -> bool:
    """Give thread ``tid`` (a native id) the normal priority back (``SCHED_OTHER``, nice 0); ``False``
    where the operating system refuses (an unprivileged process without ``RLIMIT_NICE`` headroom)."""
    try:
        os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, tid, 0)
        return True
    except (AttributeError, OSError):
        return False


class Lane:
    """Run ``jobs`` in order on a daemon thread of the lowest priority; :meth:`join` waits for them.

    Args:
        jobs: ``(wait, run)`` pairs; the thread calls ``wait()`` then ``run()`` for each in turn.
        name: the thread's name (seen in debuggers and ``py-spy``).
        background: ``False`` runs nothing on a thread: :meth:`join` runs every job in the caller,
            as the code did without a lane (for comparison and for devices the lane is not made for).
        on_error: called on the lane's thread with a job's error, before the lane stops (to wake
            whoever waits for what the remaining jobs would have made).
    """

    def __init__(self, jobs: Sequence[Job], *, name: str = "ppmedia-lane", background: bool = True,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        self.jobs = list(jobs)
        self.on_error = on_error
        self.priority = "caller"
        self.error: BaseException | None = None
        self._cancelled = threading.Event()
        self._thread: threading.Thread | None = None
        self._threads = torch.get_num_threads()  # the caller's intra-op threads, for the lane's thread too
        self._tid: int | None = None
        self._boost = threading.Lock()
        self._boosted = False
        #: how many times :meth:`boost` raised the lane's priority (for traces and tests)
        self.boosts = 0
        if background and self.jobs:
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        self._tid = threading.get_native_id()
        self.priority = lower_thread_priority()
        # OpenMP's thread count is per thread: a new thread would compute with every core (its own
        # team, spinning against the processes' main threads) unless told the caller's count
        torch.set_num_threads(self._threads)
        try:
            for wait, run in self.jobs:
                wait()
                if self._cancelled.is_set():
                    return
                run()
                self._unboost()
        except BaseException as error:  # handed to join()
            self.error = error
            if self.on_error is not None:
                self.on_error(error)

    def boost(self, unless: threading.Event | None = None) -> bool:
        """The caller waits for the job the lane runs now: run it at the normal priority until it
        ends (the lane's low priority comes back with its next job), so that the wait does not last
        as long as the idle time other threads leave it. ``unless``: the event the awaited job sets
        when done, read under the lock the lane drops its boost with, so a job that has just ended
        does not pass the boost on to the next one. ``False`` where nothing changed (no thread,
        already boosted, ``unless`` set, the operating system refused)."""
        with self._boost:
            if self._tid is None or self._boosted or self.priority not in ("idle", "nice"):
                return False
            if unless is not None and unless.is_set():
                return False
            self._boosted = restore_thread_priority(self._tid)
            self.boosts += int(self._boosted)
            return self._boosted

    def _unboost(self) -> None:
        with self._boost:
            if self._boosted:
                lower_thread_priority()
                self._boosted = False

    def join(self) -> None:
        """Wait for every job (or run them here without a thread); re-raise a job's error."""
        if self._thread is None:
            for wait, run in self.jobs:
                wait()
                run()
            return
        self._thread.join()
        if self.error is not None:
            raise self.error

    def cancel(self) -> None:
        """Run no further job (the one running finishes; a ``wait()`` still blocks until it returns).
        For a step that failed: the caller does not join."""
        self._cancelled.set()
