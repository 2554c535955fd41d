"""The training command's options: the parser and the checks that refuse a bad combination before anything
starts (argparse's one line, exit 2). Every option of ``ppmedia.train`` is here."""

from __future__ import annotations

import argparse
import os

import torch

from .. import pipeline
from ..pipeline.pretrained import load_pretrained_config
from ..testing import tiny_models
from .lora_options import add_lora_options, lora_problem
from .sources import data_refusal
from . import composition

#: the stand-in run's length when neither --steps nor --epochs is given.
DEFAULT_STEPS = 4
#: ``--group-by-length``'s default: global batches per window of length grouping (docs/performance.md)
DEFAULT_GROUP = 16
#: the parser's description
DESCRIPTION = "Train a vision-language model with pipeline x data (x tensor) parallelism and ppmedia's staged media."


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


#: the parallel options that multiply the world (those the parser has): ``pp x dp x tp x cp``; ``--ep`` is
#: carved out of the dp ranks, so it is not one
WORLD_DIMS = ("pp", "dp", "tp", "cp")


def world_size(args: argparse.Namespace) -> int:
    """The processes a run of ``args`` takes: the product of its :data:`WORLD_DIMS` options."""
    world = 1
    for dim in WORLD_DIMS:
        world *= int(getattr(args, dim, 1) or 1)
    return world


def world_formula(args: argparse.Namespace) -> str:
    """``--pp x --dp x --tp`` (and the other :data:`WORLD_DIMS` ``args`` has): for messages."""
    return " x ".join(f"--{dim}" for dim in WORLD_DIMS if hasattr(args, dim))


def build_parser(parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The training options (``parser_class``: the parser's class, e.g. one whose ``error`` raises)."""
    parser = parser_class(description=DESCRIPTION)
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
    add("--chat-template", metavar="FILE", help="a Jinja chat template file for a processor saved without one")
    add("--no-shuffle", action="store_true", help="global batch i holds samples [i*B, (i+1)*B) in order")
    add("--seed", type=int, default=0, help="the shuffle's seed (and the tiny model's)")
    add("--workers", type=int, default=0, help="DataLoader worker processes per rank that reads media")
    add("--skip-bad-samples", action="store_true", help="skip (and count) bad records instead of stopping")
    add("--pack", action="store_true",
        help="pack each global batch's samples into rows of at most --max-length tokens (the same samples per step)")
    add("--no-pack", dest="pack", action="store_false",
        help="one sample per row (the default; --pack turns packing on, the last of the two given wins)")
    add("--group-by-length", type=int, default=DEFAULT_GROUP, metavar="N",
        help="shuffled order: pool N global batches, sort them by length and deal them out to N steps, so a step's "
             "rows are of similar length (less padding; changes which samples share a step); 1: no grouping")
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
    add("--ep", type=int, default=1,
        help="expert-parallel ranks carved out of --dp (it must divide --dp): the routed experts sharded over them")
    add("--cp", type=int, default=1,
        help="context-parallel ranks per stage: each holds a share of every row's sequence (docs/context-parallel.md)")
    add("--cp-vision", choices=("shard", "replicate"), default=None,
        help="with --cp: stage 0's images and videos divided over the cp ranks and gathered (shard) or encoded "
             "by every cp rank (replicate); default shard where the family allows, else replicate")
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
    add("--dry-run", action="store_true",
        help="build every rank's stages on the meta device from --model's config.json alone and print the bytes "
             "of parameters, gradients and optimizer state per rank; nothing trains (no weights, no data read)")
    add("--tensorboard", metavar="DIR", help="write TensorBoard scalars here (rank 0; the tensorboard extra)")
    add("--wandb", metavar="PROJECT", help="log to this Weights & Biases project (rank 0; the wandb extra; "
                                         "WANDB_MODE=offline works without network)")
    add("--profile", metavar="DIR",
        help="write a torch profiler trace (TensorBoard / Perfetto JSON, one file per rank) of steps 2-4 here")
    add("--trace", metavar="FILE.svg", help="draw the last step's measured per-rank timeline (replica 0's pipeline) here")
    add_lora_options(parser)
    return parser


def bad_option(args: argparse.Namespace) -> str | None:
    """The first bad or unpaired option (one line for ``parser.error``: exit 2 before anything starts)."""
    problem = pipeline.option_problem(
        {f"--{k.replace('_', '-')}": v for k, v in vars(args).items()},
        positive=("--pp", "--dp", "--tp", "--ep", "--cp", "--microbatches", "--group-by-length", "--steps", "--epochs",
                  "--batch-size", "--max-length",
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
    for option, path in (("--data", args.data), ("--eval-data", args.eval_data), ("--chat-template", args.chat_template)):
        if problem is None and path and not os.path.exists(path) and not args.dry_run:
            problem = f"{option} {path}: no such file or directory"
    if problem is None and args.model and args.data:
        problem = data_refusal(args.model)
    if problem is None and args.export and os.path.exists(args.export) and not os.path.isdir(args.export):
        problem = f"--export {args.export}: an existing file; expected a directory to write the checkpoint into"
    if problem is None and args.profile and os.path.exists(args.profile) and not os.path.isdir(args.profile):
        problem = f"--profile {args.profile}: an existing file; expected a directory to write the trace into"
    if problem is None:  # the model's own config, read (not built): every rank refuses alike, before anything
        problem = model_config_problem(args) or layer_split_option_problem(args) or export_option_problem(args)
    return problem


def _batch_problem(batch_size: int, dp: int, microbatches: int, *, packed: bool) -> str | None:
    """Why ``--batch-size`` cannot be cut into ``--dp`` equal shares of ``--microbatches`` equal
    microbatches (one line), or ``None``. Packed rows (``--pack``) are made a multiple of the
    microbatches, so then only the replicas' shares must be equal."""
    if batch_size % dp:
        return (f"--batch-size {batch_size} does not split over --dp {dp} replicas: expected a multiple of {dp}")
    share = batch_size // dp
    if not packed and share % microbatches:
        return (f"--batch-size {batch_size} gives {share} samples per replica (--dp {dp}), which do not divide into "
                f"--microbatches {microbatches} equal microbatches (every microbatch of a step has the same rows): "
                f"expected a --batch-size that is a multiple of --dp x --microbatches = {dp * microbatches}")
    return None


def model_config_problem(args: argparse.Namespace) -> str | None:
    """``--model``'s ``config.json`` refused before anything starts, the same on every rank: one that
    transformers cannot read, a ``model_type`` contradicting its ``architectures``, a quantized
    checkpoint (``ppmedia.pipeline.pretrained.load_pretrained_config``), a config asking for the MoE routers'
    loss (:func:`ppmedia.pipeline.refuse_router_loss`)."""
    if not args.model or not os.path.isfile(os.path.join(args.model, "config.json")):
        return None  # no folder, or no config.json in it: the loader names what is missing
    try:
        pipeline.refuse_router_loss(load_pretrained_config(args.model))
    except (ValueError, TypeError) as exc:
        return f"--model {args.model}: {exc}"
    except OSError:  # no config.json at all: the loader names the file
        return None
    return None


def export_option_problem(args: argparse.Namespace) -> str | None:
    """``--export`` / ``--export-merged`` of a full model that transformers could not read back
    (:func:`ppmedia.pipeline.export_problem` on ``--model``'s config, built on meta): refused before the
    run trains for nothing. A LoRA ``--export`` writes the adapter only and is not checked."""
    targets = [(o, p) for o, p in (("--export", None if getattr(args, "lora_rank", 0) else args.export),
                                   ("--export-merged", getattr(args, "export_merged", None))) if p]
    if not targets or not args.model or not os.path.isfile(os.path.join(args.model, "config.json")):
        return None
    try:
        problem = pipeline.export_problem(load_pretrained_config(args.model))
    except Exception:  # noqa: BLE001 - a config that cannot be built is named by the loader itself
        return None
    if problem is None:
        return None
    option, path = targets[0]
    return (f"{option} {path}: the checkpoint would not load back with from_pretrained ({problem}); train without "
            f"{option} (the DCP checkpoints under --save-dir keep the weights)")


def decoder_layers(args: argparse.Namespace) -> tuple[int, str] | None:
    """The model's decoder layer count and how to name the model, read without building anything:
    ``--model``'s ``config.json``, else the tiny ``--family``'s config; ``None`` where it cannot be read
    (:func:`model_config_problem` or the loader says why)."""
    try:
        if args.model:
            if not os.path.isdir(args.model):
                return None
            config, model = load_pretrained_config(args.model), f"--model {args.model}"
        else:
            config, model = tiny_models.load(args.family).build_config(), f"the tiny {args.family} model"
        return int(config.get_text_config().num_hidden_layers), model
    except Exception:  # noqa: BLE001 - an unreadable config is refused with its file elsewhere
        return None


def layer_split_option_problem(args: argparse.Namespace) -> str | None:
    """``--pp`` (x the schedule's stages per rank) against the model's decoder layers, and
    ``--layers-per-stage`` against both: one line naming the stage count, the layer count and the
    option to change (:func:`ppmedia.pipeline.layer_split_problem`), the same on every rank."""
    layers = decoder_layers(args)
    if layers is None or args.pp < 1:
        return None
    num_layers, model = layers
    n_stages = pipeline.schedule_layout(args.schedule).n_stages(args.pp)
    per_rank = n_stages // args.pp
    stages_option = f"--pp {args.pp}" + (f" with --schedule {args.schedule} ({per_rank} stages per rank)" if per_rank > 1 else "")
    fewer = max(1, pipeline.max_stages(num_layers) // per_rank)
    fix = f"give --pp {fewer} or less" + (" (or a schedule with one stage per rank)" if per_rank > 1 else "")
    return pipeline.layer_split_problem(n_stages, num_layers, args.layers_per_stage, stages_option=stages_option,
                                        split_option="--layers-per-stage", model=model, fix=fix)


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Combinations of flags that cannot work: one ``parser.error`` (exit 2) before anything starts."""
    problem = bad_option(args)
    if problem:
        parser.error(problem)
    if args.dry_run and not args.model:
        parser.error("--dry-run builds the stages of --model's config.json: give --model")
    if args.model and not args.data and not args.dry_run:
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
    if args.data:
        problem = _batch_problem(args.batch_size, args.dp, args.microbatches, packed=args.pack)
        if problem:
            parser.error(problem)
    if args.pack_across_batches and not args.pack:
        parser.error("--pack-across-batches N pools batches for --pack: give --pack too")
    if args.resume == "auto" and not args.save_dir:
        parser.error("--resume auto looks under --save-dir: give --save-dir")
    if args.bf16 and not args.fsdp:
        parser.error("--bf16 is FSDP2's mixed precision: give --fsdp too")
    problem = composition.refusal(args)  # a refused pair of features (composition.py's table)
    if problem:
        parser.error(problem)
    if args.ep > 1:
        problem = _expert_parallel_problem(args)
        if problem:
            parser.error(problem)
    if getattr(args, "cp_vision", None) is not None and args.cp == 1:
        parser.error(f"--cp-vision {args.cp_vision} places stage 0's vision tower over the cp ranks: give --cp N (N > 1)")
    if args.cp > 1:
        problem = context_option_problem(args)
        if problem:
            parser.error(problem)
    problem = lora_problem(args)
    if problem:
        parser.error(problem)
    if args.device == "cuda" and not torch.cuda.is_available() and not args.dry_run:
        parser.error(f"--device cuda: torch.cuda.is_available() is False here (torch {torch.__version__}); "
                     f"use --device cpu")


def _expert_parallel_problem(args: argparse.Namespace) -> str | None:
    """``--ep``: it divides ``--dp``, goes with the other options, and the model has routed experts
    (only its config is read)."""
    if args.dp % args.ep:
        return f"--ep {args.ep} does not divide --dp {args.dp}: the expert-parallel ranks are carved out of the replicas"
    if args.model:
        from ..pipeline.pretrained import load_pretrained_config

        config = load_pretrained_config(args.model)
    else:
        config = tiny_models.load(args.family).build_config()
    return pipeline.expert_parallel_problem(config, args.ep)


def context_option_problem(args: argparse.Namespace) -> str | None:
    """Why ``--cp N`` cannot run with this family, in one line, or ``None`` (the options it does not go
    with are refused by the composition table, :mod:`.composition`)."""
    if args.model:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(args.model)
    else:
        from ..testing import tiny_models

        config = tiny_models.load(args.family).build_config()
    from ..registry import get_adapter

    adapter = get_adapter(config)
    problem = pipeline.context_problem(config, adapter)
    if problem is not None:
        return f"--cp {args.cp}: the decoder cannot be sharded: {problem}"
    replicated = pipeline.vision_shard_problem(adapter)
    if getattr(args, "cp_vision", None) == "shard" and replicated:
        return f"--cp-vision shard: {adapter.name} keeps its vision tower replicated over cp: {replicated}"
    return None


def parse_args(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """``argv`` parsed and checked (:func:`bad_option` and the combinations; ``parser.error`` on the first
    problem); ``parser``: default :func:`build_parser`'s."""
    parser = build_parser() if parser is None else parser
    args = parser.parse_args(argv)
    _check(parser, args)
    if args.steps is None and args.epochs is None:
        args.steps = DEFAULT_STEPS
    return args
