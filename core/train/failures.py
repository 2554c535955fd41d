"""A failed training run says so once: one line on the rank that saw the failure first, its traceback in
a per-rank log file that the line names, the other ranks quiet (their tracebacks in their own files).

The line is ``train.py: FILE:LINE: problem (rank R; traceback: PATH)`` for a bad record (a
:class:`ppmedia.data.DataError` anywhere in the exception's chain), else ``train.py: step N: Type:
message (rank R; traceback: PATH)``, or ``train.py: setup: ...`` for a failure before the first step.
Which rank speaks is decided by the process group's store (``add`` on one key: the first to count 1);
a rank that cannot reach the store (its host died) speaks too, so a failure is never silent.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from typing import NoReturn

from .. import pipeline

__all__ = ["NothingToTrain", "failure_message", "log_path", "report_failure"]

#: the store key the failing ranks count on: the first one to count 1 prints the line
_FAILED_KEY = "ppmedia/train/failed"


class NothingToTrain(ValueError):
    """The run's first global batch holds no label token: every sample was skipped or has no assistant
    turn, so the optimizer would step on a loss of 0 (raised before that step)."""


def log_path(rank: int) -> str:
    """``PPMEDIA_LOG_DIR`` (default: ``ppmedia-train-RUN`` in the temp folder, RUN torchrun's run id or
    the process id) ``/rank{rank}.log``: where a failed rank writes its traceback."""
    run = os.environ.get("TORCHELASTIC_RUN_ID") or str(os.getpid())
    folder = os.environ.get("PPMEDIA_LOG_DIR") or os.path.join(tempfile.gettempdir(), f"ppmedia-train-{run}")
    return os.path.join(folder, f"rank{rank}.log")


def _data_error(exc: BaseException) -> BaseException | None:
    from ..data import DataError

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, DataError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def failure_message(exc: BaseException, step: int | None) -> str:
    """The failure as the text after ``train.py: ``: ``FILE:LINE: problem`` for a bad record, else
    ``step N: Type: message`` (``setup: ...`` when no step had started)."""
    bad = _data_error(exc)
    if bad is not None:
        return " ".join(str(bad).split())
    if isinstance(exc, NothingToTrain):
        return str(exc)
    where = "setup" if step is None else f"step {step}"
    return f"{where}: {pipeline.failure_line(exc)}"


def _first_to_fail() -> bool:
    """Whether this rank is the first to report (the store counts the failing ranks); True when the
    store cannot be reached."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return True
        return int(distributed_c10d._get_default_store().add(_FAILED_KEY, 1)) == 1
    except Exception:  # noqa: BLE001  the store's host is gone: speak rather than stay silent
        return True


def report_failure(exc: BaseException, step: int | None, rank: int) -> NoReturn:
    """Write the traceback to :func:`log_path`, print the one line when this rank failed first, and exit
    with status 1 without the process group's teardown (a peer may be dead)."""
    path = log_path(rank)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a") as fh:
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=fh)
    except OSError as err:
        path = f"not written: {err}"
    if _first_to_fail():
        print(f"train.py: {failure_message(exc, step)} (rank {rank}; traceback: {path})", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)
