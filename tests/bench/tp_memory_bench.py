"""Memory of tensor parallelism inside the pipeline: pp=2 x tp=2 (4 processes, gloo on 127.0.0.1).

The model, the step and the counting are ``fsdp_memory_bench``'s (Qwen2.5-VL built from a config,
about 37 M parameters, one real 1F1B step with AdamW, local shards counted once per rank): here every
stage's decoder layers, the untied head and the embedding are split over ``tp``
(:func:`ppmedia.pipeline.apply_tensor_parallel`), the vision tower and norms stay whole on each tp rank. The decoder layers are split over
the two stages so that the larger stage holds as few parameters per rank as possible, given what tp
shards. ``R = largest rank / one process``: ideal ``1 / (pp x tp) = 0.25``, goal ``<= 0.30``.
``run.py --tp-memory`` prints section 8's pp=2 x dp=2 FSDP2 figure beside it.
"""

from __future__ import annotations

import resource
from datetime import timedelta
from typing import Any

import torch

import fsdp_memory_bench as fsdp
from spawned import spawn_ranks, write_result

PP, TP = 2, 2
TARGET_R = 0.30


def tp_split(model: torch.nn.Module) -> list[int]:
    """Decoder layers per stage minimising the larger stage's parameters PER RANK (layers and head / tp)."""
    from ppmedia import pipeline

    _, lm = pipeline.find_language_model(model)
    layer = sum(p.numel() for p in lm.layers[0].parameters() if p.dim() > 1) / TP
    layer += sum(p.numel() for p in lm.layers[0].parameters() if p.dim() == 1)  # norms (whole); biases: small
    total = sum(p.numel() for p in model.parameters())
    head = sum(p.numel() for p in model.get_output_embeddings().parameters())
    body = sum(p.numel() for p in lm.layers.parameters())
    embedding = sum(p.numel() for p in model.get_input_embeddings().parameters())
    rest = total - body - head - embedding + embedding / TP  # vision tower, projector, final norm; the split embedding
    n = fsdp.LAYERS
    best = min(range(n + 1), key=lambda k: max(rest + k * layer, (n - k) * layer + head / TP))
    return [best, n - best]


def _layout(layers: list[int], mesh: Any) -> dict[str, int]:
    import contextlib

    import ppmedia
    from ppmedia import pipeline
    from ppmedia.testing.tiny_models import qwen2_5_vl as tiny

    model = fsdp.build_model()
    tied = pipeline.tied_parameters(model)
    pp_group = mesh["pp"].get_group()
    stages = pipeline.make_pipeline_stages(model, PP, [mesh["pp"].get_local_rank()], "cpu", group=pp_group,
                                           layers_per_stage=layers)
    del model
    modules = pipeline.apply_tensor_parallel(stages, mesh["tp"])
    optimizers = pipeline.stage_optimizers(modules, lambda ps: torch.optim.AdamW(ps, lr=1e-4))
    schedule = pipeline.build_schedule("1f1b", stages, fsdp.N_MICROBATCHES)
    config = modules[0].config
    adapter = ppmedia.get_adapter(config)
    batch = tiny.build_batch(0)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    labels = pipeline.make_labels(ids, config, adapter, attention_mask=mask)
    staged = ppmedia.split_media(batch, fsdp.N_MICROBATCHES, **adapter.media_counts(batch, config))
    first = next((s for s in stages if s.is_first), None)
    with ppmedia.stage_media(first, staged) if first is not None else contextlib.nullcontext():
        schedule.step(ids, mask, target=labels, losses=[], loss_kwargs={"num_valid_tokens": pipeline.count_valid_tokens(labels)})
    pipeline.reduce_tensor_parallel_gradients(modules)
    pipeline.sync_tied_gradients(modules, tied, group=pp_group)
    pipeline.clip_grad_norm(modules, 1.0, tied=tied, group=pp_group)
    for optimizer in optimizers:
        optimizer.step()
    return fsdp.held_bytes(modules, optimizers)


def _worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    import torch.distributed as dist

    from ppmedia import pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        mesh = pipeline.pipeline_mesh(PP, 1, TP)
        box = [tp_split(fsdp.build_model()) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        result: dict[str, Any] = {"rank": rank, "layers": box[0], "tp": _layout(box[0], mesh)}
        result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if rank == 0:
            result["one_process"] = fsdp._one_process()
        write_result(out_dir, rank, result)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run() -> dict[str, Any]:
    """Spawn the 4 ranks; returns every rank's counts and ``R``."""
    ranks = spawn_ranks(_worker, PP * TP, "ppmedia-tp-memory-")
    one = ranks[0]["one_process"]
    return {"pp": PP, "tp": TP, "layers_per_stage": ranks[0]["layers"], "one_process": one, "ranks": ranks,
            "R": max(r["tp"]["total"] for r in ranks) / one["total"],
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks), "target": TARGET_R}


def report(result: dict[str, Any]) -> str:
    mib = 1 << 20
    lines = [
        f"11. tensor-parallel memory: pp={result['pp']} x tp={result['tp']}, the section-8 model, decoder layers per "
        f"stage {result['layers_per_stage']} (MiB held after one AdamW step)",
        f"   {'rank':>4}  {'params':>8}  {'grads':>8}  {'optim':>8}  {'total':>8}  {'peak RSS':>9}",
    ]
    for r in result["ranks"]:
        h = r["tp"]
        lines.append(f"   {r['rank']:>4}  {h['parameters'] / mib:8.1f}  {h['gradients'] / mib:8.1f}  "
                     f"{h['optimizer'] / mib:8.1f}  {h['total'] / mib:8.1f}  {r['peak_rss_bytes'] / mib:9.0f}")
    lines.append(f"tp-memory: largest rank's parameters + gradients + optimizer state at pp2 x tp2 / one process's = "
                 f"{result['R']:.3f} (goal <= {result['target']:.2f}; pp2 x dp2 with FSDP2: section 8's fsdp-memory)")
    return "\n".join(lines)
