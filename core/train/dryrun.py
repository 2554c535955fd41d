"""``--dry-run``: what each rank of a run will hold, from the checkpoint's ``config.json`` alone.

The whole model is built on the meta device (``pipeline.build_meta_model``: no tensor allocated, no
weight read) and cut into the run's stages (``pipeline.build_stage_modules``, the schedule's stage
placement, ``--layers-per-stage``); ``--freeze`` applies. Per rank (``rank = (d*pp + p)*tp + t``):

* parameters: its stages' parameter bytes in the run's dtype (``--dtype``, else the checkpoint's); with
  ``--encoder spread`` a rank without stage 0 holds a copy of the vision side too;
* gradients: the trainable parameters' bytes (the parameters' dtype);
* optimizer: AdamW's two moments per trainable parameter, in the parameters' dtype;
* ``--fsdp`` divides all three by ``--dp``; ``--tp`` divides the decoder layers' matrices (2-D
  parameters under the language model's ``layers``) by ``--tp``; an ``--ep`` option, where the parser
  has one, divides the experts' parameters (``.experts.`` in the name) by it. These are the sharded
  sizes, not DTensor's exact padding.

Activations, the communication buffers and the allocator's fragmentation are not counted: leave room
for them (docs/training.md "Recipes").
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch

from .. import pipeline
from ..pipeline.pretrained import build_meta_model, load_pretrained_config

__all__ = ["RankBytes", "rank_bytes", "report"]

GB = 1e9


@dataclass(frozen=True)
class RankBytes:
    """What one rank holds, in bytes (``parameters`` counts elements, the rest bytes)."""

    rank: int
    pp: int
    dp: int
    tp: int
    stages: tuple[int, ...]
    parameters: int
    parameter_bytes: float
    gradient_bytes: float
    optimizer_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes


def _divisor(name: str, param: torch.nn.Parameter, module: Any, args: argparse.Namespace) -> int:
    divisor = 1
    lm = f"{getattr(module, 'language_model_path', 'model.language_model')}.layers."
    if args.tp > 1 and param.dim() == 2 and name.startswith(lm):
        divisor *= args.tp
    ep = int(getattr(args, "ep", 1) or 1)
    if ep > 1 and ".experts." in name:
        divisor *= ep
    return divisor


def _pp_rank_bytes(modules: list[Any], vision: Any, args: argparse.Namespace, size: int) -> tuple[int, float, float]:
    """(parameters, parameter bytes, trainable bytes) of one pipeline rank's stages (one tp rank)."""
    seen: set[int] = set()
    count, held, trainable = 0, 0.0, 0.0
    named = [(n, p, m) for m in modules for n, p in m.named_parameters()]
    if vision is not None:
        named += [(n, p, vision) for n, p in vision.named_parameters()]
    for name, param, module in named:
        if id(param) in seen:
            continue
        seen.add(id(param))
        share = param.numel() / _divisor(name, param, module, args)
        count += param.numel()
        held += share * size
        if param.requires_grad:
            trainable += share * size
    return count, held, trainable


def rank_bytes(args: argparse.Namespace) -> tuple[Any, list[RankBytes]]:
    """The model's config and every rank's :class:`RankBytes` for the run ``args`` (``--model`` a folder
    with a ``config.json``; no weights needed)."""
    dtype = getattr(torch, args.dtype) if args.dtype else None
    config = load_pretrained_config(args.model, dtype)
    model = build_meta_model(config, config.dtype)
    layout = pipeline.schedule_layout(args.schedule)
    n_stages = layout.n_stages(args.pp)
    modules = pipeline.build_stage_modules(model, n_stages, layers_per_stage=args.layers_per_stage)
    if args.freeze:
        pipeline.freeze(modules, args.freeze)
    size = torch.empty((), dtype=config.dtype, device="meta").element_size()
    shard = args.dp if args.fsdp else 1
    per_pp = []
    for p in range(args.pp):
        indices = layout.stage_indices(p, args.pp)
        mine = [modules[i] for i in indices]
        vision = _vision_of(modules[0]) if args.encoder == "spread" and 0 not in indices else None
        count, held, trainable = _pp_rank_bytes(mine, vision, args, size)
        per_pp.append((tuple(indices), count, held, trainable))
    ranks = []
    for d in range(args.dp):
        for p, (held_stages, count, held, trainable) in enumerate(per_pp):
            for t in range(args.tp):
                ranks.append(RankBytes(rank=(d * args.pp + p) * args.tp + t, pp=p, dp=d, tp=t, stages=held_stages,
                                       parameters=count, parameter_bytes=held / shard,
                                       gradient_bytes=trainable / shard, optimizer_bytes=2 * trainable / shard))
    return config, sorted(ranks, key=lambda r: r.rank)


def _vision_of(stage0: Any) -> Any:
    """Stage 0's vision side (the parameters ``model_part`` calls vision or projector), as one module."""
    vision = torch.nn.Module()
    for name, param in stage0.named_parameters():
        if pipeline.model_part(name, stage0) != "language":
            vision.register_parameter(name.replace(".", "__"), param)
    return vision


def report(args: argparse.Namespace) -> str:
    """The dry run's printout: the model, the layout, one line per rank, the largest rank."""
    config, ranks = rank_bytes(args)
    extra = "".join(f" x {d}={getattr(args, d)}" for d in ("cp", "ep") if hasattr(args, d))
    lines = [f"dry run: {type(config).__name__.removesuffix('Config')} from {args.model}/config.json, "
             f"{str(config.dtype).removeprefix('torch.')}, pp={args.pp} x dp={args.dp} x tp={args.tp}{extra}, "
             f"schedule {args.schedule}{', fsdp' if args.fsdp else ''}"
             f"{', frozen: ' + ','.join(args.freeze) if args.freeze else ''}",
             f"{'rank':>4} {'pp':>3} {'dp':>3} {'tp':>3}  {'stages':<8} {'parameters':>14} {'params GB':>10} "
             f"{'grads GB':>9} {'optim GB':>9} {'total GB':>9}"]
    for r in ranks:
        lines.append(f"{r.rank:>4} {r.pp:>3} {r.dp:>3} {r.tp:>3}  {','.join(map(str, r.stages)):<8} {r.parameters:>14,} "
                     f"{r.parameter_bytes / GB:>10.2f} {r.gradient_bytes / GB:>9.2f} {r.optimizer_bytes / GB:>9.2f} "
                     f"{r.total_bytes / GB:>9.2f}")
    top = max(ranks, key=lambda r: r.total_bytes)
    lines.append(f"largest: rank {top.rank}, {top.total_bytes / GB:.2f} GB of parameters, gradients and optimizer "
                 f"state (activations and buffers not counted)")
    return "\n".join(lines)
