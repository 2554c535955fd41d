"""Per-step figures every rank measures and rank 0 logs: ``peak_memory_gb`` (one entry per rank) and, on
GPUs, ``mfu`` (model FLOPs utilisation).

**Peak memory.** On a GPU, ``torch.cuda.max_memory_allocated`` (the caching allocator's peak of live
tensors, since the process started); on CPU the process's resident peak (``getrusage``'s ``ru_maxrss``).

**FLOP count** (:func:`step_flops`), the usual training estimate of 6 FLOPs per parameter per token
(2 in the forward, 4 in the backward), for the vision tower too:

    FLOPs(rank, step) = 6 x P_language x T + 6 x P_vision x V

``P_language``: the rank's language-side parameters (divided by ``--tp``) (decoder layers, embeddings, head; a mixture of
experts counted whole, which overstates its active work); ``T``: the token positions of the replica's rows
(padding included: it is computed); ``P_vision``: the rank's vision and projector parameters (stage 0's,
or every rank's copy with ``--encoder spread``); ``V``: the vision tower's input tokens of the step, the
image / video placeholder tokens in the rows times ``spatial_merge_size ** 2`` where the vision config has
one (the patches before merging). Attention's quadratic term is left out (small next to the matrices at
the lengths fine-tuning uses). ``mfu`` = the sum over ranks / (step time x ranks x the GPU's peak dense
bf16 FLOP/s): :data:`PEAK_FLOPS` by device name, or ``PPMEDIA_PEAK_TFLOPS``.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Any

import torch
import torch.distributed as dist

from .. import pipeline

__all__ = ["PEAK_FLOPS", "parameter_split", "peak_flops", "peak_memory_gb", "rank_figures", "step_flops"]

#: dense bf16 FLOP/s by a substring of ``torch.cuda.get_device_name()`` (first match)
PEAK_FLOPS: tuple[tuple[str, float], ...] = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12),
                                             ("L40S", 362e12), ("A10G", 70e12), ("L4", 121e12))


def peak_memory_gb(device: torch.device) -> float:
    """This process's peak memory in GB: the CUDA allocator's on a GPU, the resident peak on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux, bytes on macOS
    return rss * (1 if sys.platform == "darwin" else 1024) / 1e9


def peak_flops(device: torch.device) -> float | None:
    """The GPU's peak dense bf16 FLOP/s (``PPMEDIA_PEAK_TFLOPS`` overrides), ``None`` on CPU or unknown."""
    if os.environ.get("PPMEDIA_PEAK_TFLOPS"):
        return float(os.environ["PPMEDIA_PEAK_TFLOPS"]) * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_FLOPS if key in name), None)


def parameter_split(modules: list[Any], vision: Any = None) -> tuple[int, int]:
    """(language, vision + projector) parameter counts of a rank's stage modules (each tensor once)."""
    seen: set[int] = set()
    language = other = 0
    for module in modules:
        for name, param in module.named_parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            n = param.numel()  # a DTensor's (FSDP2, --tp): the whole tensor's
            if pipeline.model_part(name, module) == "language":
                language += n
            else:
                other += n
    if vision is not None and all(vision is not m for m in modules):
        other += sum(p.numel() for p in vision.parameters() if id(p) not in seen)
    return language, other


def _vision_tokens(input_ids: torch.Tensor, config: Any) -> int:
    ids = [getattr(config, k, None) for k in ("image_token_id", "image_token_index", "video_token_id")]
    found = sum(int((input_ids == i).sum()) for i in ids if isinstance(i, int))
    merge = getattr(getattr(config, "vision_config", None), "spatial_merge_size", None)
    return found * (int(merge) ** 2 if isinstance(merge, int) else 1)


def step_flops(split: tuple[int, int], share: Any, config: Any, holds_vision: bool) -> float:
    """This rank's FLOPs of one training step (module docstring)."""
    language, vision = split
    flops = 6.0 * language * int(share.input_ids.numel())
    if holds_vision and vision:
        flops += 6.0 * vision * _vision_tokens(share.input_ids, config)
    return flops


def rank_figures(ctx: dict[str, Any], share: Any, step_time_s: float) -> dict[str, Any]:
    """``peak_memory_gb`` (a list, one per rank) and, where the GPU's peak is known, ``mfu``: one
    all-gather over the world (every rank calls it)."""
    device = ctx["device"]
    if "flop_split" not in ctx:
        parts = ctx["parts"]
        vision = parts.spread.vision if parts.spread is not None else None
        language, other = parameter_split(ctx["modules"], vision)
        tp = dist.get_world_size(parts.tp_group) if parts.tp_group is not None else 1
        ctx["flop_split"] = (language // tp, other)  # --tp: each rank computes its share of the language side
    holds_vision = ctx["parts"].first is not None or ctx["parts"].spread is not None
    mine = torch.tensor([peak_memory_gb(device), step_flops(ctx["flop_split"], share, ctx["config"], holds_vision)],
                        dtype=torch.float64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    figures: dict[str, Any] = {"peak_memory_gb": [round(float(g[0]), 4) for g in gathered]}
    peak = peak_flops(device)
    if peak and step_time_s > 0:
        figures["mfu"] = sum(float(g[1]) for g in gathered) / (step_time_s * len(gathered) * peak)
    return figures
