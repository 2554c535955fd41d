"""Memory and step time of LoRA against full fine-tuning at pp=2 (2 processes, gloo on 127.0.0.1).

Model: section 8's mid-size Qwen2.5-VL (``fsdp_memory_bench.build_model``: text hidden 512, 8 decoder
layers, about 37 M parameters), its layers split as section 8 splits them. Each rank builds both
pipelines of its stage: full fine-tuning (``stage_adamw`` over every parameter) and LoRA rank 8, alpha 16
on the language model's attention and MLP projections (``pipeline.apply_lora``: the base frozen, only
the adapters in AdamW). Steps alternate full / LoRA (``pipeline.train_step``, 1F1B, 2 microbatches, the
tiny Qwen batch), ``REPS`` of each after a warm-up step; the times are medians. After the steps each
rank counts the bytes of the gradients and the optimizer state it holds (``fsdp_memory_bench.held_bytes``):
``R = largest rank's gradients + optimizer state with LoRA / the same with full fine-tuning`` (goal
``<= 0.10``). The parameters themselves are left out of R: LoRA keeps the whole base.
"""

from __future__ import annotations

import statistics
import time
from datetime import timedelta
from typing import Any

import torch

from fsdp_memory_bench import balanced_split, build_model, held_bytes
from spawned import spawn_ranks, write_result

PP = 2
RANK, ALPHA = 8, 16.0
N_MICROBATCHES = 2
REPS = 5
TARGET_R = 0.10


def _parts(mesh: Any, layers: list[int], lora: bool) -> Any:
    from ppmedia import pipeline

    model = build_model()
    stages = pipeline.make_pipeline_stages(model, PP, [mesh["pp"].get_local_rank()], "cpu",
                                           group=mesh["pp"].get_group(), layers_per_stage=layers)
    del model
    modules = [s.submod for s in stages]
    if lora:
        pipeline.apply_lora(modules, pipeline.LoraSettings(rank=RANK, alpha=ALPHA))
    pipeline.train_mode(modules)
    return pipeline.PipelineParts(
        schedule=pipeline.build_schedule("1f1b", stages, N_MICROBATCHES), first=next((s for s in stages if s.is_first), None),
        modules=modules, optimizers=pipeline.stage_adamw(modules, 1e-4, 0.0), tied=list(modules[0].tied),
        pp_group=mesh["pp"].get_group(), dp_group=mesh["dp"].get_group())


def _share(parts: Any) -> Any:
    from ppmedia import pipeline
    from ppmedia.registry import get_adapter
    from ppmedia.testing.tiny_models import qwen2_5_vl as tiny

    config = parts.modules[0].config
    return pipeline.share_of_global_batch(tiny.build_batch(0), config, get_adapter(config), 0, 1, N_MICROBATCHES,
                                          stages_media=parts.first is not None)


def _held(parts: Any) -> dict[str, int]:
    held = held_bytes(list(parts.modules), list(parts.optimizers))
    held["gradients_and_optimizer"] = held["gradients"] + held["optimizer"]
    return held


def _worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    import torch.distributed as dist

    from ppmedia import pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        mesh = pipeline.pipeline_mesh(PP)
        box = [balanced_split(build_model()) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        sides = {"full": _parts(mesh, box[0], False), "lora": _parts(mesh, box[0], True)}
        shares = {name: _share(parts) for name, parts in sides.items()}
        times: dict[str, list[float]] = {"full": [], "lora": []}
        for rep in range(REPS + 1):
            for name, parts in sides.items():  # alternated, repetition by repetition
                dist.barrier()
                started = time.perf_counter()
                pipeline.train_step(parts, shares[name], rep)
                if rep:  # the first is a warm-up
                    times[name].append(time.perf_counter() - started)
        result = {"rank": rank, "layers": box[0], **{name: _held(parts) for name, parts in sides.items()},
                  "step_s": {name: statistics.median(ts) for name, ts in times.items()}}
        write_result(out_dir, rank, result)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run() -> dict[str, Any]:
    """Spawn the 2 ranks; ``R`` and both step times (the slower rank's median)."""
    ranks = spawn_ranks(_worker, PP, "ppmedia-lora-memory-")
    lora = max(r["lora"]["gradients_and_optimizer"] for r in ranks)
    full = max(r["full"]["gradients_and_optimizer"] for r in ranks)
    return {"pp": PP, "rank": RANK, "alpha": ALPHA, "layers_per_stage": ranks[0]["layers"], "ranks": ranks,
            "R": lora / full, "target": TARGET_R,
            "step_s": {side: max(r["step_s"][side] for r in ranks) for side in ("full", "lora")}}


def report(result: dict[str, Any]) -> str:
    lines = ["lora memory: pp=2, LoRA rank 8 vs full fine-tuning (gradients + AdamW state, per rank)"]
    for r in result["ranks"]:
        lines.append(f"  rank {r['rank']}: full {r['full']['gradients_and_optimizer'] / 2**20:.1f} MiB, "
                     f"LoRA {r['lora']['gradients_and_optimizer'] / 2**20:.2f} MiB")
    step = result["step_s"]
    lines.append(f"  step time: full {step['full'] * 1e3:.0f} ms, LoRA {step['lora'] * 1e3:.0f} ms")
    lines.append(f"lora-memory: largest rank's gradients + optimizer state with LoRA rank 8 / full fine-tuning = "
                 f"{result['R']:.4f} (goal <= {result['target']})")
    return "\n".join(lines)
