"""Memory of FSDP2 inside the pipeline: pp=2 x dp=2 (4 processes, gloo on 127.0.0.1), a mid-size model.

Model: Qwen2.5-VL built from a config (no download): text hidden 512, 8 decoder layers (intermediate
1376, 8 heads, 4 kv heads), vocabulary 8192, untied head; vision depth 4, hidden 256. About 37 M
parameters. The decoder layers are split over the two stages so that the larger stage holds as few
parameters as possible (stage 0 also holds the vision tower and the embedding, stage 1 the head): the
partition a user would choose. Every rank runs one real training step (the tiny Qwen batch's layout:
8 samples, 2 microbatches per replica, 1F1B, AdamW), then counts the bytes of the tensors it holds:

* parameters: each parameter's local tensor (an FSDP2 shard: ``DTensor.to_local()``; replicated: the
  whole tensor), each counted once;
* gradients: ``param.grad`` the same way;
* optimizer state: every tensor in each AdamW's ``state`` (``exp_avg``, ``exp_avg_sq``, ``step``).

The same run without ``apply_fsdp`` (replicated data parallelism: every replica holds whole stages)
gives the replicated figure; one process holding the whole model, its gradients and its AdamW state
(counted the same way, after one step) is the denominator. ``R = largest rank / one process``: ideal
``1 / (pp x dp) = 0.25``, goal ``<= 0.30``. Peak RSS (``getrusage``) of each rank is printed beside it:
it includes the whole model each rank builds before keeping its stages, and the transient gathers.
"""

from __future__ import annotations

import contextlib
import resource
from datetime import timedelta
from typing import Any

import torch

from spawned import spawn_ranks, write_result

PP, DP = 2, 2
N_MICROBATCHES = 2
LAYERS = 8
TARGET_R = 0.30


def build_config() -> Any:
    from transformers import Qwen2_5_VLConfig

    from ppmedia.testing.tiny_models import qwen2_5_vl as tiny

    text = {
        "vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": LAYERS,
        "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [8, 12, 12]},
        "pad_token_id": tiny.PAD_TOKEN_ID, "bos_token_id": tiny.BOS_TOKEN_ID, "eos_token_id": tiny.EOS_TOKEN_ID,
    }
    vision = {
        "depth": 4, "hidden_size": 256, "intermediate_size": 1024, "num_heads": 4, "in_channels": 3,
        "patch_size": tiny.PATCH_SIZE, "temporal_patch_size": tiny.TEMPORAL_PATCH_SIZE, "spatial_merge_size": tiny.MERGE,
        "window_size": 16, "out_hidden_size": 512, "fullatt_block_indexes": [1, 3],
    }
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=tiny.IMAGE_TOKEN_ID, video_token_id=tiny.VIDEO_TOKEN_ID,
        vision_start_token_id=tiny.VISION_START_TOKEN_ID, vision_end_token_id=tiny.VISION_END_TOKEN_ID,
    )


def build_model() -> torch.nn.Module:
    from transformers import Qwen2_5_VLForConditionalGeneration

    from ppmedia.testing.tiny_models import seeded

    return seeded(Qwen2_5_VLForConditionalGeneration, build_config(), 0)


def balanced_split(model: torch.nn.Module) -> list[int]:
    """Decoder layers per stage (2 stages) minimising the larger stage's parameter count."""
    from ppmedia import pipeline

    _, lm = pipeline.find_language_model(model)
    layer = sum(p.numel() for p in lm.layers[0].parameters())
    total = sum(p.numel() for p in model.parameters())
    head = sum(p.numel() for p in model.get_output_embeddings().parameters())
    norm = sum(p.numel() for p in lm.norm.parameters())
    rest = total - layer * LAYERS - head - norm  # vision tower, projector, embedding
    best = min(range(LAYERS + 1), key=lambda k: max(rest + k * layer, (LAYERS - k) * layer + head + norm))
    return [best, LAYERS - best]


def held_bytes(modules: list[Any], optimizers: list[Any]) -> dict[str, int]:
    """Bytes of the parameters, gradients and optimizer state this process holds (local shards)."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    params = {id(p): p for m in modules for p in m.parameters()}.values()
    out = {"parameters": 0, "gradients": 0, "optimizer": 0}
    for p in params:
        out["parameters"] += local(p).numel() * p.element_size()
        if p.grad is not None:
            out["gradients"] += local(p.grad).numel() * p.grad.element_size()
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    out["optimizer"] += local(value).numel() * value.element_size()
    out["total"] = sum(out.values())
    return out


def _train_one_step(stages: list[Any], schedule: Any, optimizers: list[Any], dp_rank: int, fsdp: bool,
                    dp_group: Any, tied: list[Any], pp_group: Any) -> None:
    import ppmedia
    from ppmedia import pipeline
    from ppmedia.testing.tiny_models import qwen2_5_vl as tiny

    config = stages[0].submod.config
    adapter = ppmedia.get_adapter(config)
    batch = tiny.build_batch(0)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    num_valid = pipeline.count_valid_tokens(pipeline.make_labels(ids, config, adapter, attention_mask=mask))
    local = pipeline.shard_batch(batch, dp_rank, DP, **adapter.media_counts(batch, config))
    labels = pipeline.make_labels(local["input_ids"], config, adapter, attention_mask=local["attention_mask"])
    staged = ppmedia.split_media(local, N_MICROBATCHES, **adapter.media_counts(local, config))
    first = next((s for s in stages if s.is_first), None)
    modules = [s.submod for s in stages]
    with ppmedia.stage_media(first, staged) if first is not None else contextlib.nullcontext():
        schedule.step(local["input_ids"], local["attention_mask"], target=labels, losses=[],
                      loss_kwargs={"num_valid_tokens": num_valid})
    pipeline.sync_tied_gradients(modules, tied, group=pp_group)
    if not fsdp:
        pipeline.all_reduce_gradients(modules, group=dp_group)
    pipeline.clip_grad_norm(modules, 1.0, tied=tied, group=pp_group)
    for optimizer in optimizers:
        optimizer.step()


def _layout(fsdp: bool, layers: list[int], mesh: Any) -> dict[str, Any]:
    """Build this rank's stages (sharded or not), train one step, count what it holds."""
    from ppmedia import pipeline

    model = build_model()
    tied = pipeline.tied_parameters(model)
    pp_rank = mesh["pp"].get_local_rank()
    stages = pipeline.make_pipeline_stages(model, PP, [pp_rank], "cpu", group=mesh["pp"].get_group(),
                                           layers_per_stage=layers)
    del model
    if fsdp:
        pipeline.apply_fsdp(stages, mesh["dp"])
    modules = [s.submod for s in stages]
    optimizers = pipeline.stage_optimizers(modules, lambda ps: torch.optim.AdamW(ps, lr=1e-4))
    schedule = pipeline.build_schedule("1f1b", stages, N_MICROBATCHES)
    _train_one_step(stages, schedule, optimizers, mesh["dp"].get_local_rank(), fsdp, mesh["dp"].get_group(),
                    tied, mesh["pp"].get_group())
    held = held_bytes(modules, optimizers)
    del stages, modules, optimizers, schedule
    return held


def _one_process() -> dict[str, int]:
    """The whole model in one process after one AdamW step (gradients drawn at random)."""
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    held = held_bytes([model], [optimizer])
    del model, optimizer
    return held


def _worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    import torch.distributed as dist

    from ppmedia import pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        mesh = pipeline.pipeline_mesh(PP, DP)
        layers = balanced_split(build_model()) if rank == 0 else None
        box = [layers]
        dist.broadcast_object_list(box, src=0)
        result: dict[str, Any] = {"rank": rank, "layers": box[0]}
        result["fsdp"] = _layout(True, box[0], mesh)  # first: the peak RSS so far is the FSDP2 run's
        result["peak_rss_fsdp_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        result["replicated"] = _layout(False, box[0], mesh)
        result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if rank == 0:
            result["one_process"] = _one_process()
        write_result(out_dir, rank, result)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run() -> dict[str, Any]:
    """Spawn the 4 ranks; returns every rank's counts, ``R`` (FSDP2) and the replicated ratio."""
    ranks = spawn_ranks(_worker, PP * DP, "ppmedia-fsdp-memory-")
    one = ranks[0]["one_process"]["total"]
    largest_fsdp = max(r["fsdp"]["total"] for r in ranks)
    largest_replicated = max(r["replicated"]["total"] for r in ranks)
    return {
        "pp": PP, "dp": DP, "layers_per_stage": ranks[0]["layers"], "one_process": ranks[0]["one_process"],
        "ranks": ranks, "R": largest_fsdp / one, "R_replicated": largest_replicated / one,
        "peak_rss_fsdp_bytes": max(r["peak_rss_fsdp_bytes"] for r in ranks),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks), "target": TARGET_R,
    }


def report(result: dict[str, Any]) -> str:
    mib = 1 << 20
    lines = [
        f"7. FSDP2 memory: pp={result['pp']} x dp={result['dp']}, Qwen2.5-VL-like {result['one_process']['parameters'] / 4e6:.1f} M "
        f"parameters, decoder layers per stage {result['layers_per_stage']} (MiB held after one AdamW step)",
        f"   {'rank':>4}  {'layout':>10}  {'params':>8}  {'grads':>8}  {'optim':>8}  {'total':>8}  {'peak RSS':>9}",
    ]
    for r in result["ranks"]:
        for layout, rss in (("fsdp", "peak_rss_fsdp_bytes"), ("replicated", "peak_rss_bytes")):
            h = r[layout]
            lines.append(f"   {r['rank']:>4}  {layout:>10}  {h['parameters'] / mib:8.1f}  {h['gradients'] / mib:8.1f}  "
                         f"{h['optimizer'] / mib:8.1f}  {h['total'] / mib:8.1f}  {r[rss] / mib:9.0f}")
    lines.append("   (peak RSS: FSDP2 row after the FSDP2 run, which comes first; replicated row after both. Each rank "
                 "builds the whole model before keeping its stages, which the peak includes.)")
    one = result["one_process"]
    lines.append(f"   one process: params {one['parameters'] / mib:.1f}, grads {one['gradients'] / mib:.1f}, "
                 f"optim {one['optimizer'] / mib:.1f}, total {one['total'] / mib:.1f} MiB")
    lines.append(f"fsdp-memory: largest rank's parameters + gradients + optimizer state / one process's = "
                 f"{result['R']:.3f} (replicated layout: {result['R_replicated']:.3f}; peak RSS of the largest "
                 f"rank {result['peak_rss_fsdp_bytes'] / mib:.0f} MiB with FSDP2, "
                 f"{result['peak_rss_bytes'] / mib:.0f} MiB after the replicated run too; goal <= {result['target']:.2f})")
    return "\n".join(lines)
