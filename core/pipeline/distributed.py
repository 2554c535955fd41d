"""Starting the default process group the way a script was launched (torchrun or plain ``python``),
and laying its ranks out as the ``(dp, pp, cp, tp)`` mesh every training path uses (:func:`pipeline_mesh`)."""

from __future__ import annotations

import os
import socket
import warnings
from datetime import timedelta
from typing import Any

__all__ = ["TORCHRUN_VARIABLES", "init_distributed", "pipeline_mesh"]

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


def pipeline_mesh(pp: int, dp: int = 1, tp: int = 1, *, cp: int = 1, ep: int = 1, device_type: str = "cpu") -> Any:
    """The ``(dp, pp, cp, tp)`` ``DeviceMesh`` of ``world = pp x dp x cp x tp`` ranks (dim names ``"dp"``,
    ``"pp"``, ``"cp"``, ``"tp"``; ``rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank``). Collective: every rank
    calls it, after ``init_process_group``. The one layout of ppmedia's training paths
    (``examples/train.py``, the parity harness, the benchmarks): the ``tp`` peers of a stage are
    neighbours; with ``tp = 1`` it is the ``(dp, pp)`` layout ``rank = dp_rank * pp + pp_rank`` that
    :func:`~ppmedia.pipeline.shard_batch` and the data loaders assume.

    Args:
        pp, dp, tp: pipeline ranks, data-parallel replicas, tensor-parallel ranks per stage.
        cp: context-parallel ranks per stage (each holds a share of every row's sequence:
            :func:`~ppmedia.pipeline.enable_context_parallel`); its group is ``mesh["cp"]``.
        ep: expert-parallel ranks carved out of ``dp`` (it must divide ``dp``; the world stays
            ``pp x dp x cp x tp``). With ``ep > 1`` the mesh is ``(edp, ep, pp, cp, tp)`` with ``dp`` the
            flattened ``(edp, ep)`` (``dp_rank = edp_rank * ep + ep_rank``: the ranks above are
            unchanged): ``mesh["ep"]`` is that of :func:`~ppmedia.pipeline.apply_expert_parallel`,
            ``mesh["edp"]`` the group of :func:`~ppmedia.pipeline.reduce_expert_parallel_gradients`.
            ``ep > 1`` with ``cp > 1`` is not built (refused).
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (nccl).

    ``mesh["pp"].get_group()`` is the pipeline group of :func:`~ppmedia.pipeline.make_pipeline_stages`,
    ``mesh["dp"]`` the data-parallel mesh of :func:`~ppmedia.pipeline.apply_fsdp` (its group that of
    :func:`~ppmedia.pipeline.all_reduce_gradients`), ``mesh["tp"]`` that of :func:`~ppmedia.pipeline.apply_tensor_parallel`.

    Raises:
        ValueError: a size below 1, ``ep`` does not divide ``dp``, ``ep`` with ``cp``, or ``pp * dp * cp * tp``
            is not the world size.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sizes = {"pp": pp, "dp": dp, "cp": cp, "tp": tp, "ep": ep}
    bad = {k: v for k, v in sizes.items() if int(v) < 1}
    if bad:
        raise ValueError(f"pipeline_mesh: sizes {bad}; expected each >= 1")
    world = dist.get_world_size()
    if pp * dp * cp * tp != world:
        raise ValueError(f"pipeline_mesh: pp {pp} x dp {dp} x cp {cp} x tp {tp} = {pp * dp * cp * tp}; the world has "
                         f"{world} ranks")
    if dp % ep:
        raise ValueError(f"pipeline_mesh: --ep {ep} does not divide --dp {dp} (the expert-parallel ranks are carved "
                         f"out of the data-parallel ones)")
    if ep == 1:
        return init_device_mesh(device_type, (dp, pp, cp, tp), mesh_dim_names=("dp", "pp", "cp", "tp"))
    if cp > 1:
        raise ValueError(f"pipeline_mesh: --ep {ep} with --cp {cp}: expert parallelism with context parallelism "
                         f"is not built")
    mesh = init_device_mesh(device_type, (dp // ep, ep, pp, cp, tp), mesh_dim_names=("edp", "ep", "pp", "cp", "tp"))
    mesh["edp", "ep"]._flatten("dp")
    # mesh["dp"] (a flattened dim sliced from the root) is how every training path reads the replicas
    warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh", category=UserWarning)
    return mesh
