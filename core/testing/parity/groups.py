"""The processes of a parity run: a rank's place in the ``dp x pp x tp`` layout and its process groups
(made once per layout), a free port for a spawned group, whether ``torchrun`` launched this process,
and how a finished worker ends (:func:`exit_worker`)."""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from typing import Any

__all__ = [
    "exit_worker",
    "launched_by_torchrun",
]


@dataclass
class _Groups:
    """This rank's place in the ``dp x pp x tp`` layout (rank = (dp_rank * pp + pp_rank) * tp + tp_rank)."""

    pp: int
    dp: int
    pp_rank: int
    dp_rank: int
    pp_group: Any
    dp_group: Any
    mesh: Any = None  # the (dp, pp, tp) DeviceMesh, when dp > 1 or tp > 1
    tp_rank: int = 0
    ep: int = 1  # expert-parallel ranks carved out of dp (mesh (edp, ep, pp, tp) with dp flattened)


_GROUP_CACHE: dict[tuple[int, ...], _Groups] = {}


def _groups(world: int, rank: int, dp: int, tp: int = 1, ep: int = 1) -> _Groups:
    """The pipeline and data-parallel groups of a ``dp x (world // (dp * tp)) x tp`` layout, from
    :func:`~ppmedia.pipeline.pipeline_mesh` (created once per layout: ``new_group`` is collective, so
    every rank creates every group in the same order); ``dp = tp = 1``: the world is the pipeline."""
    if (world, dp, tp, ep) in _GROUP_CACHE:
        return _GROUP_CACHE[(world, dp, tp, ep)]
    pp = world // (dp * tp)
    if dp == 1 and tp == 1:
        groups = _Groups(pp, 1, rank, 0, None, None)
    else:
        from ...pipeline import pipeline_mesh

        mesh = pipeline_mesh(pp, dp, tp, ep=ep)  # rank = (d * pp + p) * tp + t, d = edp * ep + e
        groups = _Groups(pp, dp, (rank // tp) % pp, rank // (tp * pp), mesh["pp"].get_group(), mesh["dp"].get_group(),
                         mesh, rank % tp, ep)
    _GROUP_CACHE[(world, dp, tp, ep)] = groups
    return groups


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_by_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (or another env:// launcher)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def exit_worker(code: int) -> None:
    """End a finished gloo worker process with ``code``, without the interpreter's teardown.

    Now and then (about 1 run in 15 here) a gloo worker aborted during interpreter shutdown, after its
    work was done and its process group destroyed ("terminate called without an active exception"):
    a C++ thread of torch.distributed still joinable when its owner was destroyed at exit. The results
    are already written by then; skipping the teardown keeps that crash from failing a good run.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _root_cause(exc: BaseException) -> str:
    """``Type: message`` of the innermost exception of ``exc``'s chain (what actually went wrong)."""
    seen = {id(exc)}
    while True:
        inner = exc.__cause__ or exc.__context__
        if inner is None or id(inner) in seen:
            break
        seen.add(id(inner))
        exc = inner
    return f"{type(exc).__name__}: {exc}"
