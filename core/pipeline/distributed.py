"""Starting the default process group the way a script was launched (torchrun or plain ``python``)."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

__all__ = ["TORCHRUN_VARIABLES", "init_distributed"]

#: the environment variables torchrun sets that ``init_process_group``'s ``env://`` reads.
TORCHRUN_VARIABLES: tuple[str, ...] = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def init_distributed(backend: str = "gloo", *, timeout: timedelta = timedelta(seconds=60)) -> tuple[int, int]:
    """Initialise ``torch.distributed``'s default group; returns ``(rank, world_size)``.

    Under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set) the group comes
    from the environment, as ``init_process_group(backend)`` would make it. Run as a plain ``python
    script.py`` (none of them set) it is a group of one process on 127.0.0.1 at a free port, so a
    one-process pipeline (e.g. an interleaved schedule's two stages on one rank) runs without a
    launcher. An already initialised group is kept as it is.

    Args:
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (CUDA).
        timeout: the group's timeout (it also bounds every send and receive).

    Raises:
        ValueError: only some of the torchrun variables are set (named, with the ones missing).
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    present = [name for name in TORCHRUN_VARIABLES if name in os.environ]
    if present and len(present) < len(TORCHRUN_VARIABLES):
        missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
        raise ValueError(
            f"init_distributed: the environment sets {', '.join(present)} but not {', '.join(missing)}; "
            f"launch with torchrun (it sets all of {', '.join(TORCHRUN_VARIABLES)}) or with none of them "
            f"for one process"
        )
    if present:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                                timeout=timeout)
    return dist.get_rank(), dist.get_world_size()
