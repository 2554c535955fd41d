"""Why the encoder spread copies the vision tower instead of sharding it over the pipeline group.

``python tests/bench/tower_sync_bench.py [--repeats N]``: 2 gloo processes (one thread each), each
encoding 2 of the stage-0 benchmark's microbatches, forward and backward, with the benchmark's tower
(``stage0_bench.build_config``). Arms, alternated: ``compute`` (the tower alone, no communication),
``replicated`` (what ``EncoderSpread`` does: broadcast the weights from rank 0, encode, reduce the
gradients onto rank 0, blocking here: the spread overlaps both with other work), ``fsdp2``
(``fully_shard`` of every vision block and the tower over the 2 ranks: all-gathers in forward and
backward, a reduce-scatter of the gradients). Prints the median milliseconds per step.
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


def _worker(rank: int, port: int, repeats: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen2_5_VLForConditionalGeneration

    import ppmedia
    import stage0_bench as sb
    from ppmedia.pipeline import vision_replica
    from ppmedia.testing.parity import exit_worker

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        config = sb.build_config()
        model = Qwen2_5_VLForConditionalGeneration(config).float()
        adapter = ppmedia.get_adapter(config)
        batch = sb.build_batch()
        staged = ppmedia.split_media(dict(batch), sb.N_MICROBATCHES, **adapter.media_counts(batch, config))
        ids = batch["input_ids"]
        replica = vision_replica(model)
        params = list(replica.parameters())
        sharded = copy.deepcopy(replica)
        mesh = init_device_mesh("cpu", (2,))
        for block in sharded.model.visual.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(sharded.model.visual, mesh=mesh)
        mine = [2 * rank, 2 * rank + 1]  # two microbatches each

        def encode(module: Any) -> None:
            for k in mine:
                a, b = staged.samples[k]
                _, host = adapter.check_counts(ids[a:b], staged.chunk(k), config)
                out = adapter.encoder_outputs(module, staged.chunk(k), host)["image"]
                out.backward(torch.ones_like(out))

        def replicated() -> None:
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            dist.broadcast(flat, 0)
            encode(replica)
            grads = torch.cat([p.grad.reshape(-1) for p in params])
            dist.reduce(grads, 0)

        arms = {"compute": lambda: encode(replica), "replicated": replicated, "fsdp2": lambda: encode(sharded)}
        times: dict[str, list[float]] = {name: [] for name in arms}
        for rep in range(repeats + 2):
            names = list(arms)[rep % 3:] + list(arms)[:rep % 3]
            for name in names:
                dist.barrier()
                t0 = time.perf_counter()
                arms[name]()
                dist.barrier()
                if rep >= 2:
                    times[name].append(time.perf_counter() - t0)
                for module in (replica, sharded):
                    for p in module.parameters():
                        p.grad = None
        if rank == 0:
            n = sum(p.numel() for p in params)
            medians = {name: statistics.median(v) * 1e3 for name, v in times.items()}
            print(f"vision tower: {n / 1e6:.2f} M parameters ({n * 4 / 1e6:.1f} MB float32); 2 ranks, 2 microbatches "
                  f"each, forward + backward; median ms per step of {repeats}:")
            for name, value in medians.items():
                extra = value - medians["compute"]
                print(f"  {name:10s} {value:7.1f}" + ("" if name == "compute" else f"   (+{extra:.1f} communication)"))
            print(f"1-min load average {os.getloadavg()[0]:.2f}", flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_worker(0)


def main(argv: list[str] | None = None) -> int:
    import argparse

    import torch.multiprocessing as mp

    from ppmedia.testing.parity import _free_port

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args(argv)
    mp.spawn(_worker, args=(_free_port(), args.repeats), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
