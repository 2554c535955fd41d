"""Start a checked :class:`~ppmedia.train.config.TrainConfig`: in place under an existing ``torchrun``
(``RANK`` and ``WORLD_SIZE`` set), else ``nproc_per_node`` local processes through torch's own elastic
launcher, ``python -m torch.distributed.run ... -m ppmedia.train ARGV`` (``--standalone`` on one node;
with ``nnodes`` > 1 a c10d rendezvous at ``rdzv_endpoint``, one such command per node)."""

from __future__ import annotations

import os
import subprocess
import sys

from .config import TrainConfig

__all__ = ["in_torchrun", "launch", "launcher_command"]


def in_torchrun() -> bool:
    """Whether this process is one of a launcher's ranks (``RANK`` and ``WORLD_SIZE`` set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launcher_command(config: TrainConfig) -> list[str]:
    """The ``torch.distributed.run`` command line that starts this node's processes of ``config``."""
    launch = config.launch
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(launch["nproc_per_node"])]
    nnodes = str(launch.get("nnodes", "1"))
    if nnodes == "1" and not launch.get("rdzv_endpoint"):
        command.append("--standalone")
    else:
        endpoint = str(launch["rdzv_endpoint"])
        command += ["--nnodes", nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                    "--rdzv-id", str(launch.get("rdzv_id") or f"ppmedia-{endpoint}")]
    if launch.get("local_addr"):
        command += ["--local-addr", str(launch["local_addr"])]
    return [*command, "-m", "ppmedia.train", *config.argv]


def launch(config: TrainConfig) -> int:
    """Run ``config``: in place under torchrun (this process is a rank), else the launcher's processes;
    returns the exit status (the launcher's: 1 when a rank failed, its one line already printed)."""
    if in_torchrun():
        from .loop import main

        main(config.argv)
        return 0
    return subprocess.call(launcher_command(config))
