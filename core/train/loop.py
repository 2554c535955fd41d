"""The training loop: build a rank's stages, resume, train, checkpoint, evaluate, export (``main`` is
``examples/train.py`` and ``python -m ppmedia.train``). The package docstring says what a run does."""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist

from .. import pipeline
from ..testing import tiny_models

from .failures import NothingToTrain, report_failure
from .lora_options import lora_settings
from .metrics import rank_figures
from .options import parse_args, world_formula, world_size
from .profiling import StepProfiler
from .sinks import Sinks
from .sources import data_source, say


def model_dtype(args: argparse.Namespace) -> torch.dtype:
    """``--dtype``, else the checkpoint's own (``--model``), else float32."""
    if args.dtype:
        return getattr(torch, args.dtype)
    return pipeline.checkpoint_dtype(args.model) if args.model else torch.float32


def stage_modules(args: argparse.Namespace, n_stages: int, indices: list[int], device: torch.device,
                  ep_mesh: Any = None) -> list[Any]:
    """This rank's stage modules: from ``--model`` only these stages (built on meta, loaded from only
    the shards that hold them; with ``ep_mesh`` only this rank's experts), else the tiny family's
    seeded model cut (the same weights everywhere)."""
    dtype, layers = model_dtype(args), args.layers_per_stage
    if args.model:
        return pipeline.stages_from_pretrained(args.model, n_stages, stages=indices, layers_per_stage=layers,
                                               dtype=dtype, device=device, ep_mesh=ep_mesh)
    model = tiny_models.load(args.family).build_model(args.seed).to(device=device, dtype=dtype)
    return pipeline.build_stage_modules(model, n_stages, stages=indices, layers_per_stage=layers)


def build_stages(args: argparse.Namespace, pp_rank: int, pp_group: Any, device: torch.device,
                 ep_mesh: Any = None) -> list[Any]:
    """This rank's ``PipelineStage`` objects. ``--encoder spread``: with ``--model``, a rank without
    stage 0 also loads the checkpoint's vision side alone (``pipeline.vision_from_pretrained``); the
    tiny family's are cut from its full model, which gives such a rank its copy of the vision side."""
    layout = pipeline.schedule_layout(args.schedule)  # stages per rank and their placement (loop / V)
    n_stages, indices = layout.n_stages(args.pp), layout.stage_indices(pp_rank, args.pp)
    if args.encoder == "spread" and args.model:
        vision = None if 0 in indices else pipeline.vision_from_pretrained(args.model, dtype=model_dtype(args),
                                                                          device=device)
        return pipeline.make_pipeline_stages(stage_modules(args, n_stages, indices, device, ep_mesh), n_stages, indices,
                                             device, group=pp_group, encoder="spread", vision=vision)
    if args.encoder == "spread":
        model = tiny_models.load(args.family).build_model(args.seed).to(device=device, dtype=model_dtype(args))
        return pipeline.make_pipeline_stages(model, n_stages, indices, device, group=pp_group, encoder="spread",
                                             layers_per_stage=args.layers_per_stage)
    modules = stage_modules(args, n_stages, indices, device, ep_mesh)
    return pipeline.make_pipeline_stages(modules, n_stages, indices, device, group=pp_group,
                                         static_microbatch=static_placeholder(args))


def static_placeholder(args: argparse.Namespace) -> tuple[int, int] | None:
    """Static stage shapes (``(1, 1)``, rebuilt for every step's ``(b, S)`` by the schedule), so that no
    step runs torch's shape-inference forward of microbatch 0 (a step whose ``S`` differs from the last
    step's would, at every stage). ``None`` (inferred shapes) where static ones are not checked: with
    ``--tp`` (DTensor stages), ``--bf16`` (activations in another dtype than the parameters),
    ``--encoder spread`` and ``--cp`` (sequence-sharded activations)."""
    return None if args.tp > 1 or args.cp > 1 or args.bf16 or args.encoder != "stage0" else (1, 1)


def build(args: argparse.Namespace) -> dict[str, Any]:
    """Process groups, this rank's stages (frozen parts, checkpointing, train mode, FSDP2), the
    schedule and the optimizers (:class:`pipeline.PipelineParts` under ``ctx["parts"]``), and where
    the steps' batches come from (``ctx["source"]``)."""
    device, _ = pipeline.resolve_device(args.device)
    # rank = ((d*pp + p)*cp + c)*tp + t; the cp ranks of a replica's stage hold the same rows; with --ep, d = edp*ep + e
    mesh = pipeline.pipeline_mesh(args.pp, args.dp, args.tp, cp=args.cp, ep=args.ep, device_type=device.type)
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
    ep_mesh = mesh["ep"] if args.ep > 1 else None
    # --model: sharded on meta, only this rank's experts read (the tp plan applies first: experts stay out of it)
    stages = build_stages(args, pp_rank, pp_group, device, ep_mesh if args.tp == 1 else None)
    if args.tp > 1:  # before FSDP2 and the optimizers: DTensor shards over tp
        pipeline.apply_tensor_parallel(stages, mesh["tp"])
    if ep_mesh is not None and (args.tp > 1 or not args.model):  # the routed experts over ep, before FSDP2
        pipeline.apply_expert_parallel(stages, ep_mesh)
    modules = [stage.submod for stage in stages]
    lora = lora_settings(args)
    if lora is not None:  # after tensor parallelism (adapters sharded like their layers), before FSDP2
        pipeline.apply_lora(modules, lora)
    spread = pipeline.encoder_spread_of(stages) if args.encoder == "spread" else None
    if spread is not None and args.data:  # the loader reads media on stage 0's rank: it sends each rank its shares
        spread.media_from_first_stage = True
    if args.freeze:
        pipeline.freeze(modules, args.freeze)
    if args.activation_checkpointing:
        pipeline.enable_activation_checkpointing(modules)
    pipeline.train_mode(modules if spread is None or spread.vision in modules else [*modules, spread.vision])
    if args.pack:  # every stage isolates the samples of a packed row (a family that cannot is refused here)
        from ppmedia import packing

        packing.enable_packing(modules)
    if args.fsdp:
        pipeline.apply_fsdp(stages, mesh["dp"], mixed_precision=torch.bfloat16 if args.bf16 else None)
    loss_fn = None
    if args.cp > 1:  # every stage's sequence divided over cp (a family that cannot is refused here too)
        shard = pipeline.ContextShard(args.cp, mesh["cp"].get_local_rank(), mesh["cp"].get_group())
        pipeline.enable_context_parallel(modules, shard, vision=getattr(args, "cp_vision", None))
        loss_fn = pipeline.context_loss(shard)
    parts = pipeline.PipelineParts(
        schedule=pipeline.build_schedule(args.schedule, stages, args.microbatches, loss_fn=loss_fn),
        first=next((s for s in stages if s.is_first), None), modules=modules,
        optimizers=pipeline.stage_adamw(modules, args.lr, args.weight_decay), tied=list(modules[0].tied),
        pp_group=pp_group, dp_group=dp_group, sharded=args.fsdp, max_grad_norm=args.max_grad_norm, spread=spread,
        tracer=pipeline.StepTracer(stages, spread) if args.trace else None,
        guard=pipeline.NonFiniteGuard(args.skip_nonfinite), presplit=args.presplit,
        tp_group=mesh["tp"].get_group() if args.tp > 1 else None,
        expert_parallel=ep_mesh is not None, edp_group=mesh["edp"].get_group() if ep_mesh is not None else None,
        cp_group=mesh["cp"].get_group() if args.cp > 1 else None,
    )
    ctx = {"parts": parts, "config": modules[0].config, "adapter": modules[0].adapter, "device": device,
           "dtype": model_dtype(args), "pp_rank": pp_rank, "dp_rank": dp_rank, "modules": modules,
           "optimizers": parts.optimizers, "run_id": None, "stages": stages}
    ctx["source"] = data_source(ctx, args)
    return ctx


def draw_trace(ctx: dict[str, Any], args: argparse.Namespace) -> None:
    """The last step's measured timeline of replica 0's pipeline, as an SVG (written by its rank 0)."""
    from ppmedia.planning.timeline import write_svg

    parts = ctx["parts"]
    title = f"measured: {args.family}, {args.schedule}, pp={args.pp}, vision {args.encoder}"
    timeline = parts.tracer.timeline(title, group=parts.pp_group)  # collective over the pipeline
    if ctx["dp_rank"] == 0 and ctx["pp_rank"] == 0:
        write_svg(args.trace, [[timeline]], f"examples/train.py --encoder {args.encoder}: one step")
        print(f"wrote {args.trace}: step {timeline.step_time * 1e3:.1f} ms, bubble {timeline.bubble:.0%}", flush=True)


def resume(ctx: dict[str, Any], args: argparse.Namespace) -> int:
    """Load ``--resume`` (any layout; the data position too) and return the step to continue at."""
    if not args.resume:
        return 0
    path = pipeline.latest_checkpoint(args.save_dir) if args.resume == "auto" else args.resume
    if path is None:
        say(f"no complete checkpoint under {args.save_dir}: starting at step 0")
        return 0
    parts = ctx["parts"]
    # this run's --lr (and any other optimizer setting) applies from the resumed step, not the saved one
    info = pipeline.load_checkpoint(path, parts.modules, parts.optimizers, hyperparameters="current")
    ctx["run_id"] = info.get("run_id")
    extra = info["extra"]
    ctx["source"].load_state_dict(extra.get("data") or {}, int(info["step"]))
    ep = f" x ep={extra['ep']}" if extra.get("ep", 1) > 1 else ""
    say(f"resumed from {path} (saved at pp={extra.get('pp')} x dp={extra.get('dp')} x cp={extra.get('cp', 1)} x "
        f"tp={extra.get('tp', 1)}{ep}, "
         f"fsdp={extra.get('fsdp')}): continuing at step {info['step']}")
    if info["hyperparameters_changed"]:
        say(f"optimizer settings of this run apply from step {info['step']}: {'; '.join(info['hyperparameters_changed'])}")
    return int(info["step"])


def train_one(ctx: dict[str, Any], args: argparse.Namespace, step: int, share: Any, source: Any,
              held_out: Any, started: float) -> dict[str, Any]:
    """One step: the learning rate, the held-out loss when due, the optimizer step; its record."""
    parts = ctx["parts"]
    lr = pipeline.learning_rate(step, args.lr, schedule=args.lr_schedule, warmup_steps=args.warmup_steps,
                                total_steps=source.total_steps())
    pipeline.set_learning_rate(parts.optimizers, lr)
    eval_loss = None
    if held_out is not None and step % args.eval_every == 0:  # the weights this step trains from
        pause = time.perf_counter()
        eval_loss = pipeline.eval_loss(parts, held_out())
        started += time.perf_counter() - pause
    result = pipeline.train_step(parts, share, step)
    return pipeline.step_record(step, loss=result.loss, tokens=share.num_valid_tokens, samples=share.samples,
                                skipped=share.skipped, lr=lr, grad_norm=result.grad_norm,
                                step_time_s=time.perf_counter() - started, padding_fraction=result.padding_fraction,
                                eval_loss=eval_loss, nonfinite=result.nonfinite)


def run(args: argparse.Namespace, where: dict[str, Any]) -> None:
    """Build, resume, train (``where["step"]`` follows the step, for the failure message), export."""
    ctx = build(args)
    parts, source = ctx["parts"], ctx["source"]
    start = where["step"] = resume(ctx, args)
    if args.save_dir and args.save_every:  # the checkpoints of another run are not mixed with this one's
        if start == 0:  # a fresh run (nothing resumed): a new identity, recorded in its checkpoints
            ctx["run_id"] = pipeline.new_run_id()
        pipeline.claim_save_dir(args.save_dir, ctx["run_id"], overwrite=args.overwrite)
    total = source.total_steps()
    held_out = source.held_out if args.eval_every else None
    rank0 = dist.get_rank() == 0
    progress = pipeline.Progress(total, start) if rank0 else None
    log = pipeline.LossLog(args.loss_log) if rank0 and args.loss_log else None
    sinks = Sinks(args) if rank0 else None
    shares = source.shares(start)
    profiler = StepProfiler(args.profile, dist.get_rank(), total - start, ctx["stages"], cuda=ctx["device"].type == "cuda")
    with profiler:
        for step in range(start, total):
            where["step"] = step
            started = time.perf_counter()
            with torch.profiler.record_function("ppmedia:data"):
                share = next(shares)
            if step == start and share.num_valid_tokens == 0:  # the same on every rank: all stop here
                raise NothingToTrain(nothing_to_train(args, step, share))
            record = train_one(ctx, args, step, share, source, held_out, started)
            record.update(rank_figures(ctx, share, record["step_time_s"]))  # collective: every rank's peak memory
            last = step + 1 == total
            if last and held_out is not None:  # the final model, evaluated once more
                record["final_eval_loss"] = pipeline.eval_loss(parts, held_out())
            _report(record, step, log, sinks, progress)
            if args.save_dir and args.save_every and ((step + 1) % args.save_every == 0 or last):
                pipeline.save_checkpoint(args.save_dir, step + 1, parts.modules, parts.optimizers, extra={
                    "family": args.family, "pp": args.pp, "dp": args.dp, "tp": args.tp, "cp": args.cp, "ep": args.ep,
                    "fsdp": args.fsdp, "data": source.state_dict()},
                    run_id=ctx["run_id"])
            profiler.step()
    if args.profile:
        steps = f"{start + profiler.recorded[0]}..{start + profiler.recorded[-1]}"
        say(f"wrote the profiler trace of steps {steps} to {args.profile} (TensorBoard: tensorboard --logdir "
            f"{args.profile}; Perfetto: its rank*.pt.trace.json files)")
    if held_out is not None and total > start:
        say(f"final model: eval loss {record['final_eval_loss']:.6f}")
    if progress is not None:
        progress.close()
    if sinks is not None:
        sinks.close()
    if args.data:  # collective: what each rank read (DataLoader workers' opens are counted in the workers)
        say(media_reads_line())
    if parts.spread is not None:  # collective: who encoded what
        encoded: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(encoded, parts.spread.last_encoded)
        say("encoder spread, last step: microbatches encoded per rank: "
             + ", ".join(f"{r}: {mine}" for r, mine in enumerate(encoded)))
    if parts.tracer is not None:
        draw_trace(ctx, args)
    if args.export or args.export_merged:
        export(ctx, args)


def _report(record: dict[str, Any], step: int, log: Any, sinks: Any, progress: Any) -> None:
    """One step's record to rank 0's loss log, TensorBoard / W&B and the progress bar (``None``: not this rank's)."""
    if log is not None:
        log.write(record)
    if sinks is not None:
        sinks.write(record)
        if "final_eval_loss" in record:
            sinks.final_eval(step + 1, record["final_eval_loss"])
    if progress is not None:
        progress.update(record)


def nothing_to_train(args: argparse.Namespace, step: int, share: Any) -> str:
    """Why the first global batch holds no label token, as one line."""
    batch = f"step {step}: the global batch of {args.batch_size} samples holds no label token"
    if share.samples == 0:
        why = (f"all were skipped ({share.skipped} samples skipped so far: longer than --max-length {args.max_length}, "
               f"or bad records with --skip-bad-samples; the warnings above name them)")
    else:
        why = f"its {share.samples} samples have no assistant turn to learn from"
    return f"{batch}: {why}; nothing to train on, stopping before the first optimizer step"


def media_reads_line() -> str:
    """One line: the media files each rank opened (``ppmedia.data.media_reads``; collective)."""
    from ppmedia import data

    reads = data.media_reads()
    return "media files opened per rank: " + ", ".join(f"{r}: {n} ({d} distinct)" for r, (n, d) in enumerate(reads))


def export(ctx: dict[str, Any], args: argparse.Namespace) -> None:
    """``--export``: the stages as a Hugging Face checkpoint in their dtype (with ``--lora-rank``: the PEFT
    adapter, every stage's), ``--export-merged``: the base with the adapters merged in; with each
    ``--model``'s processor files, so that ``AutoProcessor`` and ``AutoModelForImageTextToText`` (and
    ``peft.PeftModel.from_pretrained``) load it."""
    parts = ctx["parts"]
    if args.fsdp or ctx["dp_rank"] < args.ep:  # dp_rank < ep: the first edp replica (all its ep peers)
        # each pipeline rank writes its stages' shards (FSDP2 / --tp / --ep: every replica, tp or ep peer
        # gathers, the first writes)
        for path, lora in ((args.export, "adapter"), (args.export_merged, "merged")):
            if path:
                pipeline.save_pretrained_stages(parts.modules, path, group=parts.pp_group, lora=lora,
                                                base_model=args.model)
    for path in (args.export, args.export_merged):
        if path and args.model and dist.get_rank() == 0:
            copied = pipeline.copy_processor_files(args.model, path)
            print(f"exported {path} ({', '.join(copied) or 'no processor files'})", flush=True)
    dist.barrier()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.dry_run:  # one process, no process group: every rank's bytes from config.json
        from .dryrun import report

        print(report(args), flush=True)
        return
    torch.set_num_threads(1)  # CPU processes sharing cores: one intra-op thread each
    _, backend = pipeline.resolve_device(args.device)
    pipeline.init_distributed(backend, timeout=timedelta(seconds=60))  # torchrun's ranks, or one process
    where: dict[str, Any] = {"step": None}
    try:
        if dist.get_world_size() != world_size(args):
            raise ValueError(f"world size {dist.get_world_size()}; expected {world_formula(args)} = {world_size(args)}")
        run(args, where)
    except BaseException as exc:  # one line on the first failing rank, tracebacks to files; no teardown
        report_failure(exc, where["step"], dist.get_rank())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
