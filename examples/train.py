"""Train a vision-language model with pipeline x data (x tensor) parallelism and ppmedia's staged media.

Run it with torchrun; the world is ``pp x dp x tp`` processes (gloo on CPU here, nccl on GPUs)::

    torchrun --standalone --nproc-per-node 4 examples/train.py --family qwen2_5_vl --pp 2 --dp 2 \\
        --fsdp --schedule 1f1b --steps 20 --save-dir ckpt --save-every 10
    torchrun --standalone --nproc-per-node 2 examples/train.py --family qwen2_5_vl --pp 1 --dp 2 \\
        --fsdp --schedule 1f1b --steps 20 --save-dir ckpt --resume auto   # continues at step 10
    torchrun --standalone --nproc-per-node 2 examples/train.py --model demo-ckpt --data demo-data/train.jsonl \\
        --pp 2 --batch-size 4 --epochs 2 --lr 1e-3 --export trained   # fine-tune a checkpoint on data
    torchrun --standalone --nproc-per-node 2 examples/train.py --family qwen3_vl --pp 2 \\
        --encoder spread --trace step.svg                        # vision spread over both ranks, timeline
    torchrun --standalone --nproc-per-node 4 examples/train.py --family qwen2_5_vl --pp 2 --tp 2   # tensor parallel

With ``--model DIR --data PATH`` it fine-tunes a Hugging Face checkpoint on a data file or a
``datasets`` folder (``ppmedia.data``: the checkpoint's own processor and chat template, assistant-only
labels, each replica loading its share, media read only on the rank holding stage 0); without
``--data`` the tiny ``--family`` model trains on its 2 fixed stand-in batches (every rank holds the
global batch, replica ``r`` trains on its share). Each replica splits its rows into ``--microbatches``
microbatches for its pipeline. With ``--fsdp`` every stage is
sharded with FSDP2 over the replicas (gradients reduce-scattered as sums); without it every replica
holds whole stages and gradients are summed with one all-reduce. Then: tied embeddings summed across
the pipeline, gradients clipped to a global L2 norm, AdamW (one optimizer per stage module).
``--tp N`` splits every stage's language model over N ranks (``pipeline.apply_tensor_parallel``,
before FSDP2; the ranks laid out by ``pipeline.pipeline_mesh``; docs/tensor-parallel.md).

Checkpoints are torch.distributed.checkpoint folders ``--save-dir/step{N}/`` under full-model names,
published atomically; ``--resume`` takes one written at any ``pp x dp`` layout, with or without
``--fsdp`` (``auto``: the newest complete one under ``--save-dir``, or a fresh start if there is none).
``--encoder spread`` lets every pipeline rank encode a share of each step's media
(``pipeline.EncoderSpread``; see docs/encoder-spread.md; with ``--model`` a rank without stage 0 loads
the checkpoint's vision side alone, and with ``--data`` stage 0's rank, which reads the media, sends
each rank the pixels of its shares), ``--trace FILE.svg`` draws the last step's
measured per-rank timeline. ``--eval-every N`` adds the loss of a held-out batch (forward only) to every N-th step's log line.

Guards (``pipeline.guards``; docs/training.md "Guards"): every option is checked before anything starts
(argparse's one line, exit 2); every step's global batch is compared across the ranks by a fingerprint
(``--no-batch-check`` turns it off); a step whose loss or gradient norm is not finite stops the run before
its optimizer step and before any checkpoint (``--skip-nonfinite N`` skips at most N such steps);
``--resume`` applies this run's ``--lr`` from the resumed step and prints what changed; a fresh run
refuses a ``--save-dir`` holding another run's checkpoints (``--overwrite`` deletes them).

A rank that fails (an error, or a peer that died) prints ``train.py rank R: step S failed: ...`` and
exits with status 1; a dead peer is noticed at the next communication with it, at the latest after the
60 s process-group timeout.

Everything here is a library call (``ppmedia.pipeline``: ``stage_adamw``, ``learning_rate``, ``freeze``,
``train_step``, ``loader_shares``, ``step_record``, ...; docs/training.md "Fine-tuning with
examples/train.py"); the script only wires the flags to them. ``--export`` writes the trained stages
in their dtype with the processor's files.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ppmedia import pipeline
from ppmedia.testing import tiny_models

#: the seed of the held-out batch ``--eval-every`` evaluates (the training batches use seeds 0 and 1).
HELD_OUT_SEED = 1000
#: the stand-in run's length when neither --steps nor --epochs is given.
DEFAULT_STEPS = 4


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected comma-separated integers such as 2,3") from None


def _parts(text: str) -> list[str]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(pipeline.MODEL_PARTS))
    if unknown:
        raise argparse.ArgumentTypeError(f"got {unknown}; expected some of {','.join(pipeline.MODEL_PARTS)}")
    return parts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--family", default="qwen2_5_vl", choices=tiny_models.FAMILIES, metavar="FAMILY",
        help="the tiny seeded model and its stand-in batches (without --model / --data)")
    add("--model", help="a Hugging Face checkpoint directory to fine-tune (its processor too); needs --data")
    add("--data", help="training data: a JSON / JSONL file (LLaVA or messages style) or a datasets save_to_disk folder")
    add("--eval-data", help="held-out data in the same formats, evaluated every --eval-every steps")
    add("--media-dir", help="where relative media paths of the data point (default: the data file's folder)")
    add("--batch-size", type=int, default=8, help="the global batch in samples (split over the replicas)")
    add("--max-length", type=int, default=2048, help="the longest sample in tokens (longer ones are skipped)")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=int, help="train this many passes over --data")
    length.add_argument("--steps", type=int, help="train until this step (exclusive)")
    add("--no-shuffle", action="store_true", help="global batch i holds samples [i*B, (i+1)*B) in order")
    add("--seed", type=int, default=0, help="the shuffle's seed (and the tiny model's)")
    add("--workers", type=int, default=0, help="DataLoader worker processes per rank that reads media")
    add("--skip-bad-samples", action="store_true", help="skip (and count) bad records instead of stopping")
    add("--pack", action="store_true",
        help="pack each global batch's samples into rows of at most --max-length tokens (the same samples per step)")
    add("--pack-across-batches", type=int, default=0, metavar="N",
        help="with --pack: pool N consecutive global batches per replica before packing (fuller rows; changes "
             "which samples share a step)")
    add("--lr", type=float, default=1e-3, help="the peak learning rate")
    add("--weight-decay", type=float, default=0.01, help="AdamW's, not on norms, biases and embeddings")
    add("--warmup-steps", type=int, default=0, help="linear warm-up from 0 over this many steps")
    add("--lr-schedule", default="constant", choices=pipeline.LR_SCHEDULES, help="after the warm-up")
    add("--max-grad-norm", type=float, default=1.0)
    add("--dtype", choices=("float32", "bfloat16"), help="the parameters' dtype (default: the checkpoint's)")
    add("--device", default="cpu", choices=("cpu", "cuda"), help="cpu (gloo) or cuda (nccl, one GPU per rank)")
    add("--activation-checkpointing", action="store_true", help="recompute layer activations in the backward")
    add("--freeze", type=_parts, default=[], metavar="PARTS", help="comma-separated: vision,projector,language")
    add("--layers-per-stage", type=_int_list, metavar="N,N,...", help="decoder layers per stage (default: even)")
    add("--pp", type=int, default=2, help="pipeline ranks")
    add("--dp", type=int, default=1, help="data-parallel replicas (world = pp x dp x tp)")
    add("--tp", type=int, default=1, help="tensor-parallel ranks per stage (pipeline.apply_tensor_parallel)")
    add("--fsdp", action="store_true", help="shard every stage with FSDP2 over the replicas")
    add("--bf16", action="store_true", help="with --fsdp: compute in bfloat16 (float32 master weights)")
    add("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved or any torch schedule name")
    add("--microbatches", type=int, default=2, help="microbatches per replica and step")
    add("--save-dir", help="write DCP checkpoints under this folder (step{N}/)")
    add("--save-every", type=int, default=0, help="checkpoint after every N steps")
    add("--overwrite", action="store_true",
        help="a fresh run may delete another run's checkpoints under --save-dir (refused otherwise)")
    add("--resume", help="a checkpoint folder (step{N}) to continue from, or 'auto' (newest under --save-dir)")
    add("--skip-nonfinite", type=int, default=0, metavar="N",
        help="skip at most N steps whose loss or gradient norm is not finite (default: stop at the first)")
    add("--no-batch-check", action="store_true",
        help="do not compare a fingerprint of every step's batch across the ranks that must hold it")
    add("--loss-log", help="append one JSON line per step here (rank 0)")
    add("--export", help="write the trained model (and the processor) as a Hugging Face checkpoint here")
    add("--eval-every", type=int, default=0, help="every N steps, the held-out loss (forward only)")
    add("--encoder", default="stage0", choices=("stage0", "spread"),
        help="where the vision tower runs: on stage 0, or spread over the pipeline ranks")
    add("--presplit", action="store_true",
        help="feed the schedule pre-split microbatches (each one's media its own keyword input) instead of "
             "staging the media on stage 0")
    add("--trace", metavar="FILE.svg", help="draw the last step's measured per-rank timeline (replica 0's pipeline) here")
    return parser


def bad_option(args: argparse.Namespace) -> str | None:
    """The first bad or unpaired option (one line for ``parser.error``: exit 2 before anything starts)."""
    problem = pipeline.option_problem(
        {f"--{k.replace('_', '-')}": v for k, v in vars(args).items()},
        positive=("--pp", "--dp", "--tp", "--microbatches", "--steps", "--epochs", "--batch-size", "--max-length",
                  "--max-grad-norm"),
        non_negative=("--lr", "--weight-decay", "--warmup-steps", "--workers", "--save-every", "--eval-every",
                      "--skip-nonfinite", "--pack-across-batches"),
        together=(("--save-every", "--save-dir"), ("--overwrite", "--save-dir")),
    )
    if problem is None and args.save_dir and not args.save_every and args.resume != "auto":
        problem = f"--save-dir {args.save_dir} needs --save-every N (or --resume auto, which reads it): nothing would be saved"
    if problem is None:
        try:
            pipeline.schedule_layout(args.schedule)
        except ValueError as exc:
            problem = f"--schedule: {str(exc).removeprefix('schedule: ')}"
    for option, path in (("--model", args.model), ("--resume", None if args.resume == "auto" else args.resume)):
        if problem is None and path and not os.path.isdir(path):
            problem = f"{option} {path}: no such directory"
    for option, path in (("--data", args.data), ("--eval-data", args.eval_data)):
        if problem is None and path and not os.path.exists(path):
            problem = f"{option} {path}: no such file or directory"
    if problem is None and args.export and os.path.exists(args.export) and not os.path.isdir(args.export):
        problem = f"--export {args.export}: an existing file; expected a directory to write the checkpoint into"
    return problem


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Combinations of flags that cannot work: one ``parser.error`` (exit 2) before anything starts."""
    problem = bad_option(args)
    if problem:
        parser.error(problem)
    if args.model and not args.data:
        parser.error("--model fine-tunes a checkpoint on --data: give --data (the tiny stand-in batches only go "
                     "with --family)")
    if args.data and not args.model:
        parser.error("--data is processed with --model's own processor: give --model")
    if args.eval_data and not args.data:
        parser.error("--eval-data goes with --data")
    if args.data and bool(args.eval_every) != bool(args.eval_data):
        parser.error("with --data, --eval-every N evaluates --eval-data PATH: give both or neither")
    if args.epochs is not None and not args.data:
        parser.error("--epochs counts passes over --data: give --steps for the stand-in batches")
    if args.data and args.epochs is None and args.steps is None:
        parser.error("give --epochs or --steps")
    if args.pack and not args.data:
        parser.error("--pack packs the samples of --data: give --model and --data")
    if args.pack_across_batches and not args.pack:
        parser.error("--pack-across-batches N pools batches for --pack: give --pack too")
    if args.resume == "auto" and not args.save_dir:
        parser.error("--resume auto looks under --save-dir: give --save-dir")
    if args.bf16 and not args.fsdp:
        parser.error("--bf16 is FSDP2's mixed precision: give --fsdp too")
    untested = [flag for flag, on in (("--encoder spread", args.encoder == "spread"), ("--data", args.data),
                                      ("--presplit", args.presplit)) if on]
    if args.tp > 1 and untested:
        parser.error(f"--tp {args.tp} with {', '.join(untested)}: not supported (docs/tensor-parallel.md); "
                     f"drop one of them")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: torch.cuda.is_available() is False here (torch {torch.__version__}); "
                     f"use --device cpu")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    if args.steps is None and args.epochs is None:
        args.steps = DEFAULT_STEPS
    return args


def model_dtype(args: argparse.Namespace) -> torch.dtype:
    """``--dtype``, else the checkpoint's own (``--model``), else float32."""
    if args.dtype:
        return getattr(torch, args.dtype)
    return pipeline.checkpoint_dtype(args.model) if args.model else torch.float32


def stage_modules(args: argparse.Namespace, n_stages: int, indices: list[int], device: torch.device) -> list[Any]:
    """This rank's stage modules: from ``--model`` only these stages (built on meta, loaded from only
    the shards that hold them), else the tiny family's seeded model cut (the same weights everywhere)."""
    dtype, layers = model_dtype(args), args.layers_per_stage
    if args.model:
        return pipeline.stages_from_pretrained(args.model, n_stages, stages=indices, layers_per_stage=layers,
                                               dtype=dtype, device=device)
    model = tiny_models.load(args.family).build_model(args.seed).to(device=device, dtype=dtype)
    return pipeline.build_stage_modules(model, n_stages, stages=indices, layers_per_stage=layers)


def build_stages(args: argparse.Namespace, pp_rank: int, pp_group: Any, device: torch.device) -> list[Any]:
    """This rank's ``PipelineStage`` objects. ``--encoder spread``: with ``--model``, a rank without
    stage 0 also loads the checkpoint's vision side alone (``pipeline.vision_from_pretrained``); the
    tiny family's are cut from its full model, which gives such a rank its copy of the vision side."""
    layout = pipeline.schedule_layout(args.schedule)  # stages per rank and their placement (loop / V)
    n_stages, indices = layout.n_stages(args.pp), layout.stage_indices(pp_rank, args.pp)
    if args.encoder == "spread" and args.model:
        vision = None if 0 in indices else pipeline.vision_from_pretrained(args.model, dtype=model_dtype(args),
                                                                          device=device)
        return pipeline.make_pipeline_stages(stage_modules(args, n_stages, indices, device), n_stages, indices,
                                             device, group=pp_group, encoder="spread", vision=vision)
    if args.encoder == "spread":
        model = tiny_models.load(args.family).build_model(args.seed).to(device=device, dtype=model_dtype(args))
        return pipeline.make_pipeline_stages(model, n_stages, indices, device, group=pp_group, encoder="spread",
                                             layers_per_stage=args.layers_per_stage)
    modules = stage_modules(args, n_stages, indices, device)
    return pipeline.make_pipeline_stages(modules, n_stages, indices, device, group=pp_group)


def build(args: argparse.Namespace) -> dict[str, Any]:
    """Process groups, this rank's stages (frozen parts, checkpointing, train mode, FSDP2), the
    schedule and the optimizers (:class:`pipeline.PipelineParts` under ``ctx["parts"]``), and where
    the steps' batches come from (``ctx["source"]``)."""
    device, _ = pipeline.resolve_device(args.device)
    mesh = pipeline.pipeline_mesh(args.pp, args.dp, args.tp, device_type=device.type)  # rank = (d*pp + p)*tp + t
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
    stages = build_stages(args, pp_rank, pp_group, device)
    if args.tp > 1:  # before FSDP2 and the optimizers: DTensor shards over tp
        pipeline.apply_tensor_parallel(stages, mesh["tp"])
    modules = [stage.submod for stage in stages]
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
    parts = pipeline.PipelineParts(
        schedule=pipeline.build_schedule(args.schedule, stages, args.microbatches),
        first=next((s for s in stages if s.is_first), None), modules=modules,
        optimizers=pipeline.stage_adamw(modules, args.lr, args.weight_decay), tied=list(modules[0].tied),
        pp_group=pp_group, dp_group=dp_group, sharded=args.fsdp, max_grad_norm=args.max_grad_norm, spread=spread,
        tracer=pipeline.StepTracer(stages, spread) if args.trace else None,
        guard=pipeline.NonFiniteGuard(args.skip_nonfinite), presplit=args.presplit,
        tp_group=mesh["tp"].get_group() if args.tp > 1 else None,
    )
    ctx = {"parts": parts, "config": modules[0].config, "adapter": modules[0].adapter, "device": device,
           "dtype": model_dtype(args), "pp_rank": pp_rank, "dp_rank": dp_rank, "modules": modules,
           "optimizers": parts.optimizers, "run_id": None}
    ctx["source"] = data_source(ctx, args)
    return ctx


class StandIn:
    """The tiny family's two fixed batches (seeds 0 and 1, alternating), the same global batch on every
    rank, each replica's share cut from it: a stand-in for a data loader."""

    def __init__(self, ctx: dict[str, Any], args: argparse.Namespace) -> None:
        self.ctx, self.args, self.module = ctx, args, tiny_models.load(args.family)

    def share(self, seed: int, step: int | None = None) -> pipeline.ReplicaShare:
        ctx = self.ctx
        batch = pipeline.batch_to(self.module.build_batch(seed), ctx["device"], ctx["dtype"])
        if step is not None and not self.args.no_batch_check:  # every rank must hold the same global batch
            pipeline.check_batch_agreement(batch, step=step)
        return pipeline.share_of_global_batch(batch, ctx["config"], ctx["adapter"], ctx["dp_rank"], self.args.dp,
                                              self.args.microbatches)

    def shares(self, start: int) -> Iterator[pipeline.ReplicaShare]:
        step = start
        while True:
            yield self.share(step % 2, step)
            step += 1

    def held_out(self) -> list[pipeline.ReplicaShare]:
        return [self.share(HELD_OUT_SEED)]

    def total_steps(self) -> int:
        return int(self.args.steps)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        return None


def draw_trace(ctx: dict[str, Any], args: argparse.Namespace) -> None:
    """The last step's measured timeline of replica 0's pipeline, as an SVG (written by its rank 0)."""
    from ppmedia.timeline import write_svg

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
        _say(f"no complete checkpoint under {args.save_dir}: starting at step 0")
        return 0
    parts = ctx["parts"]
    # this run's --lr (and any other optimizer setting) applies from the resumed step, not the saved one
    info = pipeline.load_checkpoint(path, parts.modules, parts.optimizers, hyperparameters="current")
    ctx["run_id"] = info.get("run_id")
    extra = info["extra"]
    ctx["source"].load_state_dict(extra.get("data") or {}, int(info["step"]))
    _say(f"resumed from {path} (saved at pp={extra.get('pp')} x dp={extra.get('dp')} x tp={extra.get('tp', 1)}, "
         f"fsdp={extra.get('fsdp')}): continuing at step {info['step']}")
    if info["hyperparameters_changed"]:
        _say(f"optimizer settings of this run apply from step {info['step']}: {'; '.join(info['hyperparameters_changed'])}")
    return int(info["step"])


def _say(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


class DataSource:
    """``--data`` through ``ppmedia.data``: the checkpoint's own processor (``AutoProcessor``) per sample,
    this replica's share of every global batch, media read only on the rank holding stage 0."""

    def __init__(self, ctx: dict[str, Any], args: argparse.Namespace) -> None:
        import transformers

        from ppmedia import data

        self.ctx, self.args = ctx, args
        self.processor = data.SampleProcessor(transformers.AutoProcessor.from_pretrained(args.model),
                                              max_length=args.max_length, config=ctx["config"])
        self.loader = self._loader(args.data, shuffle=not args.no_shuffle)
        self.per_epoch = len(self.loader.dataset) // args.batch_size
        self._held_out: list[pipeline.ReplicaShare] | None = None
        if self.per_epoch == 0:
            raise ValueError(f"--data {args.data}: {len(self.loader.dataset)} usable samples, fewer than one global "
                             f"batch (--batch-size {args.batch_size})")

    def _loader(self, path: str, *, shuffle: bool) -> Any:
        from ppmedia import data

        ctx, args = self.ctx, self.args
        dataset = data.open_dataset(path, media_dir=args.media_dir, skip_bad_samples=args.skip_bad_samples)
        return data.ReplicaLoader(
            dataset, self.processor, global_batch_size=args.batch_size, dp_rank=ctx["dp_rank"], dp_size=args.dp,
            seed=args.seed, shuffle=shuffle, workers=args.workers, pp_group=ctx["parts"].pp_group,
            reads_media=ctx["parts"].first is not None, adapter=ctx["adapter"], skip_bad_samples=args.skip_bad_samples,
            dp_group=ctx["parts"].dp_group,  # the counts (and the saved skip count) over all replicas
            packing=self._packing() if args.pack else None)

    def _packing(self) -> Any:
        """``--pack``: rows of ``--max-length``, a multiple of ``--microbatches``, ordered by vision cost."""
        from ppmedia import data

        args = self.args
        return data.Packing(args.max_length, args.microbatches, max(1, args.pack_across_batches),
                            config=self.ctx["config"])

    def _shares(self, loader: Any, epochs: int | None) -> Iterator[pipeline.ReplicaShare]:
        ctx, parts = self.ctx, self.ctx["parts"]
        return pipeline.loader_shares(loader, ctx["config"], ctx["adapter"], self.args.microbatches,
                                      dp_group=parts.dp_group, stages_media=parts.first is not None,
                                      device=ctx["device"], dtype=ctx["dtype"], epochs=epochs)

    def shares(self, start: int) -> Iterator[pipeline.ReplicaShare]:
        for share in self._shares(self.loader, None):
            if not self.args.no_batch_check:  # the pipeline ranks of a replica must hold the same rows
                pipeline.check_batch_agreement({"input_ids": share.input_ids, "attention_mask": share.attention_mask,
                                                "labels": share.labels}, group=self.ctx["parts"].pp_group)
            yield share

    def held_out(self) -> list[pipeline.ReplicaShare]:
        """``--eval-data`` in order, processed once, kept for every evaluation."""
        if self._held_out is None:
            self._held_out = list(self._shares(self._loader(self.args.eval_data, shuffle=False), 1))
            if not self._held_out:
                raise ValueError(f"--eval-data {self.args.eval_data}: fewer samples than one global batch "
                                 f"(--batch-size {self.args.batch_size})")
        return self._held_out

    def total_steps(self) -> int:
        return int(self.args.steps) if self.args.steps is not None else int(self.args.epochs) * self.per_epoch

    def state_dict(self) -> dict[str, Any]:
        return dict(self.loader.state_dict())

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        if not state:
            raise ValueError(f"the checkpoint of step {step} holds no data loader position (saved without --data)")
        self.loader.load_state_dict(state)


def data_source(ctx: dict[str, Any], args: argparse.Namespace) -> Any:
    """Where the steps' shares come from: ``--data`` through ``ppmedia.data``, else the stand-in."""
    if args.data:
        return DataSource(ctx, args)
    _say(f"no --data: training the tiny {args.family} model on its 2 fixed stand-in batches")
    return StandIn(ctx, args)


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
    shares = source.shares(start)
    for step in range(start, total):
        where["step"] = step
        started = time.perf_counter()
        record = train_one(ctx, args, step, next(shares), source, held_out, started)
        if log is not None:
            log.write(record)
        if progress is not None:
            progress.update(record)
        if args.save_dir and args.save_every and (step + 1) % args.save_every == 0:
            pipeline.save_checkpoint(args.save_dir, step + 1, parts.modules, parts.optimizers, extra={
                "family": args.family, "pp": args.pp, "dp": args.dp, "tp": args.tp, "fsdp": args.fsdp,
                "data": source.state_dict()},
                run_id=ctx["run_id"])
    if progress is not None:
        progress.close()
    if args.data:  # collective: what each rank read (DataLoader workers' opens are counted in the workers)
        _say(media_reads_line())
    if parts.spread is not None:  # collective: who encoded what
        encoded: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(encoded, parts.spread.last_encoded)
        _say("encoder spread, last step: microbatches encoded per rank: "
             + ", ".join(f"{r}: {mine}" for r, mine in enumerate(encoded)))
    if parts.tracer is not None:
        draw_trace(ctx, args)
    if args.export:
        export(ctx, args)


def media_reads_line() -> str:
    """One line: the media files each rank opened (``ppmedia.data.media_reads``; collective)."""
    from ppmedia import data

    reads = data.media_reads()
    return "media files opened per rank: " + ", ".join(f"{r}: {n} ({d} distinct)" for r, (n, d) in enumerate(reads))


def export(ctx: dict[str, Any], args: argparse.Namespace) -> None:
    """``--export``: the stages as a Hugging Face checkpoint in their dtype, and ``--model``'s processor
    files, so that ``AutoProcessor`` and ``AutoModelForImageTextToText`` load it."""
    parts = ctx["parts"]
    if args.fsdp or ctx["dp_rank"] == 0:
        # each pipeline rank writes its stages' shards (FSDP2 / --tp: every replica or tp peer gathers,
        # the first writes)
        pipeline.save_pretrained_stages(parts.modules, args.export, group=parts.pp_group)
    if args.model and dist.get_rank() == 0:
        copied = pipeline.copy_processor_files(args.model, args.export)
        print(f"exported {args.export} ({', '.join(copied) or 'no processor files'})", flush=True)
    dist.barrier()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # CPU processes sharing cores: one intra-op thread each
    _, backend = pipeline.resolve_device(args.device)
    pipeline.init_distributed(backend, timeout=timedelta(seconds=60))  # torchrun's ranks, or one process
    where: dict[str, Any] = {"step": None}
    try:
        if dist.get_world_size() != args.pp * args.dp * args.tp:
            raise ValueError(f"world size {dist.get_world_size()}; expected --pp x --dp x --tp = "
                             f"{args.pp * args.dp * args.tp}")
        run(args, where)
    except BaseException as exc:  # a failed rank says so and exits non-zero, without waiting for its peers
        traceback.print_exc()
        print(f"train.py rank {dist.get_rank()}: step {where['step']} failed: {pipeline.failure_line(exc)}", file=sys.stderr, flush=True)
        os._exit(1)  # the process group may hang on a dead peer: skip its teardown
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
