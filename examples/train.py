"""Train a vision-language model with pipeline x data parallelism and ppmedia's staged media.

Run it with torchrun; the world is ``pp x dp`` processes (gloo on CPU here, nccl on GPUs)::

    torchrun --standalone --nproc-per-node 4 examples/train.py --family qwen2_5_vl --pp 2 --dp 2 \\
        --fsdp --schedule 1f1b --steps 20 --save-dir ckpt --save-every 10
    torchrun --standalone --nproc-per-node 2 examples/train.py --family qwen2_5_vl --pp 1 --dp 2 \\
        --fsdp --schedule 1f1b --steps 20 --save-dir ckpt --resume auto   # continues at step 10
    torchrun --standalone --nproc-per-node 2 examples/train.py --model hf-ckpt --family qwen2_5_vl \\
        --pp 2 --steps 20 --export trained-hf                    # from and to a Hugging Face checkpoint
    torchrun --standalone --nproc-per-node 2 examples/train.py --family qwen3_vl --pp 2 \\
        --encoder spread --trace step.svg                        # vision spread over both ranks, timeline

Every rank sees the same global batch; replica ``r`` trains on its share (its samples, their media
only), split into ``--microbatches`` microbatches for its pipeline. With ``--fsdp`` every stage is
sharded with FSDP2 over the replicas (gradients reduce-scattered as sums); without it every replica
holds whole stages and gradients are summed with one all-reduce. Then: tied embeddings summed across
the pipeline, gradients clipped to a global L2 norm, AdamW (one optimizer per stage module).

Checkpoints are torch.distributed.checkpoint folders ``--save-dir/step{N}/`` under full-model names,
published atomically; ``--resume`` takes one written at any ``pp x dp`` layout, with or without
``--fsdp`` (``auto``: the newest complete one under ``--save-dir``, or a fresh start if there is none).
``--encoder spread`` lets every pipeline rank encode a share of each step's media
(``pipeline.EncoderSpread``; see docs/encoder-spread.md), ``--trace FILE.svg`` draws the last step's
measured per-rank timeline. ``--eval-every N`` adds the loss of a held-out batch (forward only) to every N-th step's log line.

A rank that fails (an error, or a peer that died) prints ``train.py rank R: step S failed: ...`` and
exits with status 1; a dead peer is noticed at the next communication with it, at the latest after the
60 s process-group timeout.

The models are ppmedia's tiny seeded ones (no download), or with ``--model`` a Hugging Face checkpoint
directory, of which each rank reads only its stages' tensors (``pipeline.stages_from_pretrained``);
``--export`` writes the trained model as a Hugging Face checkpoint at the end
(``pipeline.save_pretrained_stages``, from sharded stages too). The batches stand in for your
DataLoader (a processor's output: ``input_ids``, ``attention_mask`` and the media keys): ``--family``
picks the tiny family's, which must match ``--model``'s model type.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import traceback
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import ppmedia
from ppmedia import pipeline
from ppmedia.testing import tiny_models

#: the seed of the held-out batch ``--eval-every`` evaluates (the training batches use seeds 0 and 1).
HELD_OUT_SEED = 1000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen2_5_vl", choices=tiny_models.FAMILIES)
    parser.add_argument("--pp", type=int, default=2, help="pipeline ranks")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas (world = pp x dp)")
    parser.add_argument("--fsdp", action="store_true", help="shard every stage with FSDP2 over the replicas")
    parser.add_argument("--bf16", action="store_true", help="with --fsdp: compute in bfloat16 (float32 master weights)")
    parser.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved or any torch schedule name")
    parser.add_argument("--microbatches", type=int, default=2, help="microbatches per replica and step")
    parser.add_argument("--steps", type=int, default=4, help="train until this step (exclusive)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dir", help="write DCP checkpoints under this folder (step{N}/)")
    parser.add_argument("--save-every", type=int, default=0, help="checkpoint after every N steps")
    parser.add_argument("--resume", help="a checkpoint folder (step{N}) to continue from, or 'auto' (newest under --save-dir)")
    parser.add_argument("--loss-log", help="append one JSON line per step (global loss, grad norm) here (rank 0)")
    parser.add_argument("--model", help="a Hugging Face checkpoint directory to train (instead of the tiny family's model)")
    parser.add_argument("--export", help="write the trained model as a Hugging Face checkpoint in this directory")
    parser.add_argument("--eval-every", type=int, default=0, help="every N steps, the held-out batch's loss (forward only)")
    parser.add_argument("--encoder", default="stage0", choices=("stage0", "spread"),
                        help="where the vision tower runs: on stage 0, or spread over the pipeline ranks")
    parser.add_argument("--presplit", action="store_true",
                        help="feed the schedule pre-split microbatches (each one's media its own keyword input) "
                             "instead of staging the media on stage 0")
    parser.add_argument("--trace", metavar="FILE.svg",
                        help="draw the last step's measured per-rank timeline (replica 0's pipeline) here")
    args = parser.parse_args(argv)
    if args.encoder == "spread" and args.model:
        parser.error("--encoder spread cuts each rank's copy of the vision tower from the full model; "
                     "--model loads only each rank's stages: drop one of them")
    if args.resume == "auto" and not args.save_dir:
        parser.error("--resume auto looks under --save-dir: give --save-dir")
    if args.bf16 and not args.fsdp:
        parser.error("--bf16 is FSDP2's mixed precision: give --fsdp too")
    return args


def batches(family: str, start: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """The global batch of every step from ``start`` (a stand-in for a DataLoader: 2 fixed batches)."""
    module = tiny_models.load(family)
    step = start
    while True:
        yield step, module.build_batch(step % 2)
        step += 1


def replica_share(ctx: dict[str, Any], batch: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """This replica's rows, labels and staged media, and the GLOBAL batch's valid-token count."""
    config, adapter = ctx["config"], ctx["adapter"]
    ids, mask = batch["input_ids"], batch["attention_mask"]
    # the loss is normalised by the valid tokens of the GLOBAL batch: replicas' gradients then add up
    num_valid = pipeline.count_valid_tokens(pipeline.make_labels(ids, config, adapter, attention_mask=mask))
    # counts from the tokens (and, where tokens cannot tell, the batch's metadata: Qwen3-VL videos)
    local = pipeline.shard_batch(batch, ctx["dp_rank"], args.dp, **adapter.media_counts(batch, config))
    ids, mask = local["input_ids"], local["attention_mask"]
    labels = pipeline.make_labels(ids, config, adapter, attention_mask=mask)
    staged = ppmedia.split_media(local, args.microbatches, **adapter.media_counts(local, config))
    return {"ids": ids, "mask": mask, "labels": labels, "staged": staged, "num_valid": num_valid}


def train_step(ctx: dict[str, Any], batch: dict[str, Any], args: argparse.Namespace) -> tuple[float, float]:
    """One optimizer step on the global ``batch``; returns (global loss, grad norm before clipping)."""
    share, first = replica_share(ctx, batch, args), ctx["first"]
    for optimizer in ctx["optimizers"]:
        optimizer.zero_grad(set_to_none=True)
    losses: list[torch.Tensor] = []
    if ctx["tracer"] is not None:
        ctx["tracer"].start(group=ctx["pp_group"])
    if args.encoder == "spread":  # every pipeline rank encodes a share; stage 0 also stages the chunks
        staging = pipeline.encoder_spread_of(ctx["stages"]).step(share["staged"], share["ids"], stage=not args.presplit)
    elif args.presplit or first is None:
        staging = contextlib.nullcontext()
    else:
        staging = ppmedia.stage_media(first, share["staged"])
    loss_kwargs = {"num_valid_tokens": share["num_valid"]}
    with staging:
        if args.presplit:  # every rank: microbatch k's rows as its arguments, its media as its `media` keyword
            inputs = ppmedia.microbatch_inputs(share["staged"], share["ids"], share["mask"], target=share["labels"],
                                               loss_kwargs=loss_kwargs)
            ctx["schedule"].step(**inputs.step_kwargs(), losses=losses)
        else:
            ctx["schedule"].step(share["ids"], share["mask"], target=share["labels"], losses=losses,
                                 loss_kwargs=loss_kwargs)
    modules = ctx["modules"]
    pipeline.sync_tied_gradients(modules, ctx["tied"], group=ctx["pp_group"])
    if not args.fsdp:  # FSDP2 reduce-scattered the sums over the replicas already
        pipeline.all_reduce_gradients(modules, group=ctx["dp_group"])
    norm = pipeline.clip_grad_norm(modules, args.max_grad_norm, tied=ctx["tied"], group=ctx["pp_group"])
    for optimizer in ctx["optimizers"]:
        optimizer.step()

    loss = torch.stack(losses).sum().detach().float() if losses else torch.zeros(())
    dist.all_reduce(loss)  # one last stage per replica holds its share of the global mean
    return float(loss), float(norm)


def evaluate(ctx: dict[str, Any], batch: dict[str, Any], args: argparse.Namespace) -> float:
    """The global loss of ``batch``, forward only (no gradients; media staged and consumed once)."""
    share, first = replica_share(ctx, batch, args), ctx["first"]
    loss = pipeline.eval_step(ctx["schedule"], first, share["staged"] if first is not None or args.presplit else None,
                              share["ids"], share["mask"], share["labels"], share["num_valid"], presplit=args.presplit)
    return float(loss)


def stage_modules(args: argparse.Namespace, n_stages: int, indices: list[int]) -> list[Any]:
    """This rank's stage modules (``module.tied``: the model's tied parameter groups, the same on every
    rank).

    From ``--model``: built on the meta device, only these stages loaded, from only the shards that
    hold them. Else the tiny family's seeded model (the same weights on every rank), cut.
    """
    if args.model:
        modules = pipeline.stages_from_pretrained(args.model, n_stages, stages=indices)
        expected = tiny_models.load(args.family).MODEL_TYPE
        if modules[0].config.model_type != expected:
            raise ValueError(f"--model is a {modules[0].config.model_type} checkpoint; --family {args.family}'s "
                             f"stand-in batches are for {expected}")
        return modules
    model = tiny_models.load(args.family).build_model(args.seed)
    return pipeline.build_stage_modules(model, n_stages, stages=indices)  # the rest of the model is dropped


def spread_stages(args: argparse.Namespace, n_stages: int, indices: list[int], pp_group: Any) -> list[Any]:
    """``--encoder spread``: this rank's stages cut from the full tiny model, which also gives a rank
    without stage 0 its copy of the vision side (``make_pipeline_stages(..., encoder="spread")``)."""
    model = tiny_models.load(args.family).build_model(args.seed)
    return pipeline.make_pipeline_stages(model, n_stages, indices, "cpu", group=pp_group, encoder="spread")


def build_stages(args: argparse.Namespace, pp_rank: int, pp_group: Any) -> dict[str, Any]:
    """The model's config, adapter, tied names and this rank's pipeline stages (each rank holds only
    its stages)."""
    layout = pipeline.schedule_layout(args.schedule)  # stages per rank and their placement (loop / V)
    n_stages, indices = layout.n_stages(args.pp), layout.stage_indices(pp_rank, args.pp)
    if args.encoder == "spread":
        stages = spread_stages(args, n_stages, indices, pp_group)
        modules = [stage.submod for stage in stages]
    else:
        modules = stage_modules(args, n_stages, indices)
        stages = pipeline.make_pipeline_stages(modules, n_stages, indices, "cpu", group=pp_group)
    return {"config": modules[0].config, "adapter": modules[0].adapter, "tied": list(modules[0].tied), "stages": stages}


def build(args: argparse.Namespace) -> dict[str, Any]:
    """Process groups, this rank's stages (sharded with --fsdp), the schedule and the optimizers."""
    mesh = init_device_mesh("cpu", (args.dp, args.pp), mesh_dim_names=("dp", "pp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    ctx = build_stages(args, pp_rank, mesh["pp"].get_group())
    stages = ctx["stages"]
    if args.fsdp:
        pipeline.apply_fsdp(stages, mesh["dp"], mixed_precision=torch.bfloat16 if args.bf16 else None)
    modules = [stage.submod for stage in stages]
    ctx.update(
        pp_rank=pp_rank, dp_rank=dp_rank, pp_group=mesh["pp"].get_group(), dp_group=mesh["dp"].get_group(),
        modules=modules, first=next((s for s in stages if s.is_first), None),
        schedule=pipeline.build_schedule(args.schedule, stages, args.microbatches),
        optimizers=pipeline.stage_optimizers(modules, lambda params: torch.optim.AdamW(params, lr=args.lr)),
        tracer=None if not args.trace else pipeline.StepTracer(
            stages, pipeline.encoder_spread_of(stages) if args.encoder == "spread" else None),
    )
    return ctx


def draw_trace(ctx: dict[str, Any], args: argparse.Namespace) -> None:
    """The last step's measured timeline of replica 0's pipeline, as an SVG (written by its rank 0)."""
    from ppmedia.timeline import write_svg

    title = f"measured: {args.family}, {args.schedule}, pp={args.pp}, vision {args.encoder}"
    timeline = ctx["tracer"].timeline(title, group=ctx["pp_group"])  # collective over the pipeline
    if ctx["dp_rank"] == 0 and ctx["pp_rank"] == 0:
        write_svg(args.trace, [[timeline]], f"examples/train.py --encoder {args.encoder}: one step")
        print(f"wrote {args.trace}: step {timeline.step_time * 1e3:.1f} ms, bubble {timeline.bubble:.0%}", flush=True)


def resume(ctx: dict[str, Any], args: argparse.Namespace) -> int:
    """Load ``--resume`` (any layout) and return the step to continue at (0: nothing to resume)."""
    if not args.resume:
        return 0
    path = pipeline.latest_checkpoint(args.save_dir) if args.resume == "auto" else args.resume
    if path is None:
        _say(f"no complete checkpoint under {args.save_dir}: starting at step 0")
        return 0
    info = pipeline.load_checkpoint(path, ctx["modules"], ctx["optimizers"])
    _say(f"resumed from {path} (saved at pp={info['extra'].get('pp')} x dp={info['extra'].get('dp')}, "
         f"fsdp={info['extra'].get('fsdp')}): continuing at step {info['step']}")
    return int(info["step"])


def _say(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


def _log(args: argparse.Namespace, row: dict[str, Any]) -> None:
    if dist.get_rank() != 0:
        return
    text = f"step {row['step']}: loss {row['loss']:.6f} grad norm {row['grad_norm']:.4f}"
    print(text + (f" eval loss {row['eval_loss']:.6f}" if "eval_loss" in row else ""), flush=True)
    if args.loss_log:
        with open(args.loss_log, "a") as fh:
            fh.write(json.dumps(row) + "\n")


def run(args: argparse.Namespace, where: dict[str, Any]) -> None:
    """Build, resume, train (``where["step"]`` follows the step, for the failure message)."""
    ctx = build(args)
    held_out = tiny_models.load(args.family).build_batch(HELD_OUT_SEED) if args.eval_every else None
    start = where["step"] = resume(ctx, args)
    for step, batch in batches(args.family, start):
        if step >= args.steps:
            break
        where["step"] = step
        row: dict[str, Any] = {"step": step}
        if held_out is not None and step % args.eval_every == 0:  # the weights this step trains from
            row["eval_loss"] = evaluate(ctx, held_out, args)
        row["loss"], row["grad_norm"] = train_step(ctx, batch, args)
        _log(args, row)
        if args.save_dir and args.save_every and (step + 1) % args.save_every == 0:
            pipeline.save_checkpoint(args.save_dir, step + 1, ctx["modules"], ctx["optimizers"],
                                     extra={"family": args.family, "pp": args.pp, "dp": args.dp, "fsdp": args.fsdp})
    if ctx["tracer"] is not None:
        draw_trace(ctx, args)
    if args.export and (args.fsdp or ctx["dp_rank"] == 0):
        # each pipeline rank writes its stages' shards (FSDP2: every replica gathers, the first writes)
        pipeline.save_pretrained_stages(ctx["modules"], args.export, group=ctx["pp_group"])


def _cause(exc: BaseException) -> str:
    """``Type: message`` of the innermost exception (what went wrong: e.g. gloo's "Connection closed
    by peer"), and the outermost one's type and first line when it differs (where it surfaced)."""
    def line(e: BaseException) -> str:
        text = " ".join(str(e).split())
        return f"{type(e).__name__}: {text}" if text else type(e).__name__

    inner, seen = exc, {id(exc)}
    while (inner.__cause__ or inner.__context__) is not None and id(inner.__cause__ or inner.__context__) not in seen:
        inner = inner.__cause__ or inner.__context__  # type: ignore[assignment]
        seen.add(id(inner))
    return line(inner) if inner is exc else f"{line(inner)} (surfaced as {line(exc)[:200]})"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # CPU processes sharing cores: one intra-op thread each
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    where: dict[str, Any] = {"step": None}
    try:
        if dist.get_world_size() != args.pp * args.dp:
            raise ValueError(f"world size {dist.get_world_size()}; expected --pp x --dp = {args.pp * args.dp}")
        run(args, where)
    except BaseException as exc:  # a failed rank says so and exits non-zero, without waiting for its peers
        traceback.print_exc()
        print(f"train.py rank {dist.get_rank()}: step {where['step']} failed: {_cause(exc)}", file=sys.stderr, flush=True)
        os._exit(1)  # the process group may hang on a dead peer: skip its teardown
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
