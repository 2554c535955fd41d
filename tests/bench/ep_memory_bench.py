"""Memory of expert parallelism inside the pipeline: pp=2 x dp=2 with ep=2 against pp=2 x dp=2 without
(4 processes, gloo on 127.0.0.1), and the all-to-all bytes of a step.

The model: a Qwen3-VL-MoE built from a config whose routed experts hold most of the parameters
(4 decoder layers, each 16 experts of width 512 over hidden 32: about 94% of the model). Each layout
runs one real 1F1B step (2 microbatches a replica, the tiny Qwen3-VL batch split over the replicas),
the gradient reductions train.py does, clipping and an AdamW step; then every rank counts the bytes of
its parameters, gradients and optimizer state (local shards, once). ``R = largest rank with ep2 /
largest rank without``: ideal ``(1 - f) + f / 2`` for an expert fraction ``f`` of the larger stage,
goal ``<= 0.55``.

The all-to-all bytes: every dispatch counts the rows it sent to OTHER ranks (the tokens out and the
results back, forward only; the backward sends as much again), against ``tokens x hidden x top-k x 2
x (ep-1)/ep x 4 bytes`` with ``tokens`` the tokens this rank routed (over layers and microbatches):
the expectation for routing spread evenly over the experts.
"""

from __future__ import annotations

import contextlib
import resource
from datetime import timedelta
from typing import Any

import torch

import fsdp_memory_bench as fsdp
from spawned import spawn_ranks, write_result

PP, DP, EP = 2, 2, 2
N_MICROBATCHES = 2
TARGET_R = 0.55


def build_model() -> torch.nn.Module:
    """The tiny Qwen3-VL-MoE with 4 layers of 16 wide experts (seeded)."""
    import transformers

    from ppmedia.testing.tiny_models import qwen3_vl

    text = qwen3_vl.text_config(4)
    text.update(num_experts=16, num_experts_per_tok=2, moe_intermediate_size=512, decoder_sparse_step=1)
    config = transformers.Qwen3VLMoeConfig(text_config=text, vision_config=qwen3_vl.vision_config(2),
                                           **qwen3_vl.token_ids())
    torch.manual_seed(0)
    return transformers.Qwen3VLMoeForConditionalGeneration(config).eval()


def _step(mesh: Any, ep: bool) -> dict[str, Any]:
    import ppmedia
    from ppmedia import pipeline
    from ppmedia.pipeline.expert_parallel import take_dispatch_bytes
    from ppmedia.testing.tiny_models import qwen3_vl as tiny

    model = build_model()
    tied = pipeline.tied_parameters(model)
    pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
    stages = pipeline.make_pipeline_stages(model, PP, [mesh["pp"].get_local_rank()], "cpu", group=pp_group)
    del model
    if ep:
        pipeline.apply_expert_parallel(stages, mesh["ep"])
    modules = [s.submod for s in stages]
    optimizers = pipeline.stage_optimizers(modules, lambda ps: torch.optim.AdamW(ps, lr=1e-4))
    schedule = pipeline.build_schedule("1f1b", stages, N_MICROBATCHES)
    config = modules[0].config
    adapter = ppmedia.get_adapter(config)
    batch = tiny.build_batch(0)
    num_valid = pipeline.count_valid_tokens(pipeline.make_labels(batch["input_ids"], config, adapter,
                                                                 attention_mask=batch["attention_mask"]))
    local = pipeline.shard_batch(batch, mesh["dp"].get_local_rank(), DP, **adapter.media_counts(batch, config))
    labels = pipeline.make_labels(local["input_ids"], config, adapter, attention_mask=local["attention_mask"])
    staged = ppmedia.split_media(local, N_MICROBATCHES, **adapter.media_counts(local, config))
    first = next((s for s in stages if s.is_first), None)
    take_dispatch_bytes()
    with ppmedia.stage_media(first, staged) if first is not None else contextlib.nullcontext():
        schedule.step(local["input_ids"], local["attention_mask"], target=labels, losses=[],
                      loss_kwargs={"num_valid_tokens": num_valid})
    sent, pairs = take_dispatch_bytes()
    pipeline.sync_tied_gradients(modules, tied, group=pp_group)
    pipeline.all_reduce_gradients(modules, group=dp_group)
    if ep:
        pipeline.reduce_expert_parallel_gradients(modules, mesh["edp"].get_group())
    pipeline.clip_grad_norm(modules, 1.0, tied=tied, group=pp_group)
    for optimizer in optimizers:
        optimizer.step()
    hidden = config.get_text_config().hidden_size
    expected = pairs * hidden * 4 * 2 * (EP - 1) / EP  # pairs = tokens x top-k
    return {**fsdp.held_bytes(modules, optimizers), "a2a_bytes": sent, "a2a_expected": expected}


def _worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    import torch.distributed as dist

    from ppmedia import pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        result: dict[str, Any] = {"rank": rank,
                                  "plain": _step(pipeline.pipeline_mesh(PP, DP, 1), False),
                                  "ep": _step(pipeline.pipeline_mesh(PP, DP, 1, ep=EP), True)}
        result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        write_result(out_dir, rank, result)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run() -> dict[str, Any]:
    """Spawn the 4 ranks; returns every rank's counts, ``R`` and the all-to-all bytes."""
    model = build_model()
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    fraction = experts / sum(p.numel() for p in model.parameters())
    del model
    ranks = spawn_ranks(_worker, PP * DP, "ppmedia-ep-memory-")
    sent = sum(r["ep"]["a2a_bytes"] for r in ranks)
    expected = sum(r["ep"]["a2a_expected"] for r in ranks)
    return {"pp": PP, "dp": DP, "ep": EP, "expert_fraction": fraction, "ranks": ranks,
            "R": max(r["ep"]["total"] for r in ranks) / max(r["plain"]["total"] for r in ranks),
            "a2a_bytes_per_step": sent, "a2a_expected_bytes": expected,
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks), "target": TARGET_R}


def report(result: dict[str, Any]) -> str:
    mib = 1 << 20
    lines = [
        f"14. expert-parallel memory: pp={result['pp']} x dp={result['dp']}, Qwen3-VL-MoE with "
        f"{result['expert_fraction']:.0%} of its parameters in routed experts (MiB held after one AdamW step)",
        f"   {'rank':>4}  {'without ep':>10}  {'with ep2':>9}  {'a2a MiB':>8}",
    ]
    for r in result["ranks"]:
        lines.append(f"   {r['rank']:>4}  {r['plain']['total'] / mib:10.2f}  {r['ep']['total'] / mib:9.2f}  "
                     f"{r['ep']['a2a_bytes'] / mib:8.3f}")
    lines.append(f"all-to-all bytes per step (forward, all ranks): {result['a2a_bytes_per_step']:,} against tokens x "
                 f"hidden x top-k x 2 x (ep-1)/ep x 4 B = {result['a2a_expected_bytes']:,.0f} "
                 f"(ratio {result['a2a_bytes_per_step'] / max(result['a2a_expected_bytes'], 1):.2f}; the backward "
                 f"sends as much again)")
    lines.append(f"ep-memory: largest rank's parameters + gradients + optimizer state at pp2 x dp2 with ep2 / without ep = "
                 f"{result['R']:.3f} (goal <= {result['target']:.2f})")
    return "\n".join(lines)
