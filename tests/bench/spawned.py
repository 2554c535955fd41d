"""The memory benchmarks' spawn: ``world`` ranks over gloo on 127.0.0.1, each writing one JSON result.

``spawn_ranks(worker, world, prefix)`` picks a free port, runs ``worker(rank, world, init_method,
out_dir)`` in ``world`` spawned processes (the worker writes its result with :func:`write_result`) and
returns the results in rank order.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from typing import Any, Callable


def write_result(out_dir: str, rank: int, result: dict[str, Any]) -> None:
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)


def spawn_ranks(worker: Callable[..., None], world: int, prefix: str) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix=prefix) as out_dir:
        mp.spawn(worker, args=(world, f"tcp://127.0.0.1:{port}", out_dir), nprocs=world, join=True)
        ranks = []
        for rank in range(world):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as fh:
                ranks.append(json.load(fh))
    return ranks
