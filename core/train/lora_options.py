"""The training command's LoRA options (``--lora-rank`` and the rest, ``--export-merged``) and their checks
before anything starts: bad values, pairs that do not go together, a target that matches no module of
the model (checked on the model built on the meta device), a resume whose checkpoint was trained
otherwise. docs/lora.md has what a LoRA run does."""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

from .. import pipeline

__all__ = ["add_lora_options", "lora_problem", "lora_settings"]

#: the LoRA options that need ``--lora-rank R > 0``.
_NEEDS_RANK = ("--lora-alpha", "--lora-dropout", "--lora-targets", "--lora-vision", "--export-merged")


def _targets(text: str) -> tuple[str, ...]:
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    if not parts:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected comma-separated module-name suffixes or "
                                         f"{pipeline.ALL_LINEAR}")
    return parts


def add_lora_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--lora-rank", type=int, default=0, metavar="R",
        help="train LoRA adapters of rank R on a frozen base (0: full fine-tuning); docs/lora.md")
    add("--lora-alpha", type=float, metavar="A", help="LoRA's alpha: the update is scaled by A / R (default: R)")
    add("--lora-dropout", type=float, metavar="P", help="dropout on the adapters' input, in [0, 1) (default 0)")
    add("--lora-targets", type=_targets, metavar="NAMES",
        help=f"comma-separated module-name suffixes, or {pipeline.ALL_LINEAR} (default: the language model's "
             f"{','.join(pipeline.DEFAULT_LORA_TARGETS)})")
    add("--lora-vision", action="store_true", help="adapt the vision tower and projector too")
    add("--export-merged", metavar="DIR",
        help="with --lora-rank: write the base with the adapters merged in as a Hugging Face checkpoint here")


def lora_settings(args: argparse.Namespace) -> pipeline.LoraSettings | None:
    """The run's :class:`~ppmedia.pipeline.LoraSettings`, or ``None`` (``--lora-rank 0``)."""
    if not args.lora_rank or args.lora_rank <= 0:
        return None
    alpha = float(args.lora_rank) if args.lora_alpha is None else float(args.lora_alpha)
    return pipeline.LoraSettings(rank=int(args.lora_rank), alpha=alpha, dropout=float(args.lora_dropout or 0.0),
                                 targets=args.lora_targets, vision=bool(args.lora_vision), seed=int(args.seed))


def _given(args: argparse.Namespace) -> list[str]:
    values = {"--lora-alpha": args.lora_alpha, "--lora-dropout": args.lora_dropout,
              "--lora-targets": args.lora_targets, "--lora-vision": args.lora_vision or None,
              "--export-merged": args.export_merged}
    return [name for name in _NEEDS_RANK if values[name] is not None]


def _values_problem(args: argparse.Namespace) -> str | None:
    if args.lora_rank < 0 or (args.lora_rank == 0 and _given(args)):
        return (f"--lora-rank {args.lora_rank}: expected a rank > 0"
                + (f" with {', '.join(_given(args))}" if _given(args) else " (or 0: no LoRA)"))
    if args.lora_alpha is not None and not (math.isfinite(args.lora_alpha) and args.lora_alpha > 0):
        return f"--lora-alpha {args.lora_alpha}: expected a finite number > 0"
    if args.lora_dropout is not None and not 0 <= args.lora_dropout < 1:
        return f"--lora-dropout {args.lora_dropout}: expected a probability in [0, 1)"
    if not args.lora_rank:
        return None
    if args.lora_vision and args.encoder == "spread":
        return ("--lora-vision with --encoder spread: not supported (the spread's copies of the vision tower would "
                "need their adapters' gradients summed); drop one of them")
    if args.lora_vision and args.tp > 1:
        return (f"--lora-vision with --tp {args.tp}: not supported (the tower is replicated over tp with its own "
                f"gradient reduction, which does not cover adapters); drop one of them")
    return None


def _model(args: argparse.Namespace) -> Any:
    """The model on the meta device (no tensor allocated): ``--model``'s config, or the tiny family's."""
    from ..pipeline.pretrained import build_meta_model
    from ..testing import tiny_models

    if args.model:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(args.model)
    else:
        config = tiny_models.load(args.family).build_config()
    return build_meta_model(config)


def _resume_problem(args: argparse.Namespace, here: dict[str, Any] | None) -> str | None:
    """The checkpoint ``--resume`` names (``auto``: the newest under ``--save-dir``) trained otherwise."""
    path: Any = args.resume
    if path == "auto":
        path = pipeline.latest_checkpoint(args.save_dir) if args.save_dir else None
    info_file = os.path.join(os.fspath(path), pipeline.CHECKPOINT_INFO) if path else None
    if info_file is None or not os.path.isfile(info_file):
        return None
    try:
        with open(info_file) as fh:
            saved = json.load(fh).get("lora")
    except (OSError, ValueError, AttributeError):
        return None  # load_checkpoint names a damaged file
    mismatch = pipeline.lora_mismatch(saved, here)
    return f"--resume {path}: {mismatch}" if mismatch else None


def lora_problem(args: argparse.Namespace) -> str | None:
    """The first problem of the LoRA options (one line for ``parser.error``: exit 2), or ``None``."""
    problem = _values_problem(args)
    settings = lora_settings(args)
    if problem is None and args.resume:
        problem = _resume_problem(args, settings.record() if settings is not None else None)
    if problem is None and settings is not None:
        try:
            pipeline.check_lora_targets(_model(args), settings)
        except ValueError as exc:
            problem = str(exc)
    if problem is None and args.export_merged and os.path.exists(args.export_merged) and not os.path.isdir(args.export_merged):
        problem = f"--export-merged {args.export_merged}: an existing file; expected a directory"
    return problem
