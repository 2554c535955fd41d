"""Train a vision-language model with pipeline x data parallelism and ppmedia's staged media.

Run it with torchrun; the world is ``pp x dp`` processes (gloo on CPU here, nccl on GPUs)::

    torchrun --standalone --nproc-per-node 4 examples/train.py --family qwen2_5_vl --pp 2 --dp 2 \\
        --schedule 1f1b --steps 20 --save-dir ckpt --save-every 10
    torchrun --standalone --nproc-per-node 4 examples/train.py --family qwen2_5_vl --pp 2 --dp 2 \\
        --schedule 1f1b --steps 20 --resume ckpt/step10          # continues at step 10
    torchrun --standalone --nproc-per-node 2 examples/train.py --family qwen3_vl --pp 2 \\
        --encoder spread --trace step.svg                        # vision spread over both ranks, timeline

Every rank sees the same global batch; replica ``r`` trains on its share (its samples, their media
only), split into ``--microbatches`` microbatches for its pipeline. Gradients: tied embeddings summed
across the pipeline, then summed across replicas, then clipped to a global L2 norm (all stages, all
replicas), then AdamW. A checkpoint is one file per pipeline rank (``pp{rank}.pt``: its stages'
parameters and its optimizer state), written by replica 0 and read by every replica.

The models are ppmedia's tiny seeded ones (no download); replace ``build_model`` and ``batches`` with
``from_pretrained`` and your DataLoader (a processor's output: ``input_ids``, ``attention_mask`` and
the media keys).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import ppmedia
from ppmedia import pipeline
from ppmedia.testing import tiny_models


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen2_5_vl", choices=tiny_models.FAMILIES)
    parser.add_argument("--pp", type=int, default=2, help="pipeline ranks")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas (world = pp x dp)")
    parser.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved or any torch schedule name")
    parser.add_argument("--microbatches", type=int, default=2, help="microbatches per replica and step")
    parser.add_argument("--steps", type=int, default=4, help="train until this step (exclusive)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dir", help="write checkpoints under this folder (step{N}/pp{rank}.pt)")
    parser.add_argument("--save-every", type=int, default=0, help="checkpoint after every N steps")
    parser.add_argument("--resume", help="a checkpoint folder (step{N}) to continue from")
    parser.add_argument("--loss-log", help="append one JSON line per step (global loss, grad norm) here (rank 0)")
    parser.add_argument("--encoder", default="stage0", choices=("stage0", "spread"),
                        help="where the vision tower runs: on stage 0, or spread over the pipeline ranks")
    parser.add_argument("--trace", metavar="FILE.svg",
                        help="draw the last step's measured per-rank timeline (replica 0's pipeline) here")
    return parser.parse_args(argv)


def batches(family: str, start: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """The global batch of every step from ``start`` (a stand-in for a DataLoader: 2 fixed batches)."""
    module = tiny_models.load(family)
    step = start
    while True:
        yield step, module.build_batch(step % 2)
        step += 1


def train_step(ctx: dict[str, Any], batch: dict[str, Any], args: argparse.Namespace) -> tuple[float, float]:
    """One optimizer step on the global ``batch``; returns (global loss, grad norm before clipping)."""
    config, adapter, first = ctx["config"], ctx["adapter"], ctx["first"]
    ids, mask = batch["input_ids"], batch["attention_mask"]
    # the loss is normalised by the valid tokens of the GLOBAL batch: replicas' gradients then add up
    num_valid = pipeline.count_valid_tokens(pipeline.make_labels(ids, config, adapter, attention_mask=mask))
    # counts from the tokens (and, where tokens cannot tell, the batch's metadata: Qwen3-VL videos)
    local = pipeline.shard_batch(batch, ctx["dp_rank"], args.dp, **adapter.media_counts(batch, config))
    ids, mask = local["input_ids"], local["attention_mask"]
    labels = pipeline.make_labels(ids, config, adapter, attention_mask=mask)
    staged = ppmedia.split_media(local, args.microbatches, **adapter.media_counts(local, config))

    ctx["optimizer"].zero_grad(set_to_none=True)
    losses: list[torch.Tensor] = []
    if ctx["tracer"] is not None:
        ctx["tracer"].start(group=ctx["pp_group"])
    if args.encoder == "spread":  # every pipeline rank encodes a share; stage 0 also stages the chunks
        staging = pipeline.encoder_spread_of(ctx["stages"]).step(staged, ids)
    else:
        staging = ppmedia.stage_media(first, staged) if first is not None else contextlib.nullcontext()
    with staging:
        ctx["schedule"].step(ids, mask, target=labels, losses=losses, loss_kwargs={"num_valid_tokens": num_valid})
    modules = ctx["modules"]
    pipeline.sync_tied_gradients(modules, ctx["tied"], group=ctx["pp_group"])
    pipeline.all_reduce_gradients(modules, group=ctx["dp_group"])
    norm = pipeline.clip_grad_norm(modules, args.max_grad_norm, tied=ctx["tied"], group=ctx["pp_group"])
    ctx["optimizer"].step()

    loss = torch.stack(losses).sum().detach().float() if losses else torch.zeros(())
    dist.all_reduce(loss)  # one last stage per replica holds its share of the global mean
    return float(loss), float(norm)


def build(args: argparse.Namespace) -> dict[str, Any]:
    """Process groups, this rank's stages, the schedule and the optimizer."""
    mesh = init_device_mesh("cpu", (args.dp, args.pp), mesh_dim_names=("dp", "pp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()

    model = tiny_models.load(args.family).build_model(args.seed)  # the same weights on every rank
    config, adapter = model.config, ppmedia.get_adapter(model)
    tied = pipeline.tied_parameters(model)  # before the split: names that are one tensor
    layout = pipeline.schedule_layout(args.schedule)  # stages per rank and their placement (loop / V)
    stages = pipeline.make_pipeline_stages(
        model, layout.n_stages(args.pp), layout.stage_indices(pp_rank, args.pp), "cpu", group=pp_group,
        encoder=args.encoder,
    )
    del model  # each rank keeps only its stages
    modules = [stage.submod for stage in stages]
    params = list({id(p): p for m in modules for p in m.parameters()}.values())
    return {
        "pp_rank": pp_rank, "dp_rank": dp_rank, "pp_group": pp_group, "dp_group": dp_group,
        "config": config, "adapter": adapter, "tied": tied, "stages": stages, "modules": modules,
        "first": next((s for s in stages if s.is_first), None),
        "schedule": pipeline.build_schedule(args.schedule, stages, args.microbatches),
        "optimizer": torch.optim.AdamW(params, lr=args.lr),
        "tracer": None if not args.trace else pipeline.StepTracer(
            stages, pipeline.encoder_spread_of(stages) if args.encoder == "spread" else None),
    }


def draw_trace(ctx: dict[str, Any], args: argparse.Namespace) -> None:
    """The last step's measured timeline of replica 0's pipeline, as an SVG (written by its rank 0)."""
    from ppmedia.timeline import write_svg

    title = f"measured: {args.family}, {args.schedule}, pp={args.pp}, vision {args.encoder}"
    timeline = ctx["tracer"].timeline(title, group=ctx["pp_group"])  # collective over the pipeline
    if ctx["dp_rank"] == 0 and ctx["pp_rank"] == 0:
        write_svg(args.trace, [[timeline]], f"examples/train.py --encoder {args.encoder}: one step")
        print(f"wrote {args.trace}: step {timeline.step_time * 1e3:.1f} ms, bubble {timeline.bubble:.0%}", flush=True)


def save(ctx: dict[str, Any], folder: str, step: int) -> None:
    """Replica 0 writes one file per pipeline rank: its stages' state and its optimizer's."""
    if ctx["dp_rank"] == 0:
        os.makedirs(folder, exist_ok=True)
        state = {
            "step": step,
            "stages": {s.stage_index: s.submod.state_dict() for s in ctx["stages"]},
            "optimizer": ctx["optimizer"].state_dict(),
        }
        torch.save(state, os.path.join(folder, f"pp{ctx['pp_rank']}.pt"))
    dist.barrier()


def load(ctx: dict[str, Any], folder: str) -> int:
    """Every replica loads its pipeline rank's file; returns the step to continue at."""
    state = torch.load(os.path.join(folder, f"pp{ctx['pp_rank']}.pt"), weights_only=True)
    for stage in ctx["stages"]:
        stage.submod.load_state_dict(state["stages"][stage.stage_index])
    ctx["optimizer"].load_state_dict(state["optimizer"])
    return int(state["step"])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # CPU processes sharing cores: one intra-op thread each
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        if dist.get_world_size() != args.pp * args.dp:
            raise ValueError(f"world size {dist.get_world_size()}; expected --pp x --dp = {args.pp * args.dp}")
        ctx = build(args)
        start = load(ctx, args.resume) if args.resume else 0
        for step, batch in batches(args.family, start):
            if step >= args.steps:
                break
            loss, norm = train_step(ctx, batch, args)
            if dist.get_rank() == 0:
                print(f"step {step}: loss {loss:.6f} grad norm {norm:.4f}", flush=True)
                if args.loss_log:
                    with open(args.loss_log, "a") as fh:
                        fh.write(json.dumps({"step": step, "loss": loss, "grad_norm": norm}) + "\n")
            if args.save_dir and args.save_every and (step + 1) % args.save_every == 0:
                save(ctx, os.path.join(args.save_dir, f"step{step + 1}"), step + 1)
        if ctx["tracer"] is not None:
            draw_trace(ctx, args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
