"""What fine-tuning sets on a rank's stage modules, and where they run.

* :func:`model_part` names the part of the model a parameter belongs to: ``language`` (the decoder
  stack, its embedding, norm and output head), ``projector`` (what maps the encoders' features into
  the text width: ``multi_modal_projector``, ``mm_projector``, ``merger``, ``connector``, ...) or
  ``vision`` (the media encoders: vision and audio towers); :func:`freeze` sets
  ``requires_grad=False`` on the parts named;
* :func:`enable_activation_checkpointing` recomputes each decoder / encoder layer's activations in the
  backward (transformers' own per-layer checkpointing, non-reentrant ``torch.utils.checkpoint``), and
  :func:`train_mode` puts modules in training mode (dropout on, checkpointing active);
* :func:`resolve_device` gives a rank's device and the process-group backend for it (``gloo`` on CPU,
  ``nccl`` on CUDA), refusing ``cuda`` where there is none.
"""

from __future__ import annotations

import functools
import os
from typing import Iterable, Sequence

import torch
from torch import nn

__all__ = ["MODEL_PARTS", "PROJECTOR_NAMES", "enable_activation_checkpointing", "freeze", "model_part",
           "resolve_device", "train_mode"]

#: the parts :func:`freeze` takes.
MODEL_PARTS = ("vision", "projector", "language")

#: module names (one component of a parameter's dotted name) that make a parameter the projector's.
PROJECTOR_NAMES = frozenset({
    "multi_modal_projector", "mm_projector", "merger", "merger_list", "deepstack_merger_list", "connector",
    "embed_vision", "embed_audio", "resampler_model", "image_newline", "vision_adapter",
    # Phi-4-multimodal's projections inside embed_tokens_extend
    "img_projection_up", "img_projection_down", "up_proj_for_speech", "down_proj_for_speech",
    "up_proj_for_vision_speech", "down_proj_for_vision_speech",
    "projector",  # VideoLLaMA3's model.projector
})


def model_part(name: str, module: nn.Module) -> str:
    """``"language"``, ``"projector"`` or ``"vision"`` for the parameter ``name`` of the stage
    ``module`` (a :class:`~ppmedia.pipeline.StageModule`, whose ``language_model_path`` and
    ``head_name`` say where the language side is)."""
    lm_path = getattr(module, "language_model_path", None) or "model.language_model"
    head = getattr(module, "head_name", None) or "lm_head"
    merge = getattr(module, "merge_path", None)  # encoders inside the decoder stack (Phi-4): not language
    inside_merge = isinstance(merge, str) and name.startswith(merge + ".")
    if not inside_merge and (name.startswith(lm_path + ".") or name == head or name.startswith(head + ".")):
        return "language"
    if PROJECTOR_NAMES.intersection(name.split(".")):
        return "projector"
    return "vision"


def freeze(modules: Sequence[nn.Module], parts: Iterable[str]) -> dict[str, int]:
    """``requires_grad=False`` on every parameter of ``modules`` in the named ``parts``
    (:data:`MODEL_PARTS`); returns the number of parameters frozen per part (those on this rank).

    Call it before :func:`~ppmedia.pipeline.apply_fsdp`. Frozen parameters get no gradient, no
    weight decay and no update; checkpoints and the export still hold them.

    Raises:
        ValueError: a part that is not one of :data:`MODEL_PARTS`.
    """
    wanted = set(parts)
    unknown = sorted(wanted - set(MODEL_PARTS))
    if unknown:
        raise ValueError(f"freeze: unknown part(s) {unknown}; expected some of {', '.join(MODEL_PARTS)}")
    frozen = {part: 0 for part in MODEL_PARTS}
    for module in modules:
        for name, param in module.named_parameters():
            part = model_part(name, module)
            if part in wanted:
                param.requires_grad_(False)
                frozen[part] += param.numel()
    return frozen


def enable_activation_checkpointing(modules: Sequence[nn.Module]) -> int:
    """Turn on transformers' activation checkpointing in every layer of ``modules`` that supports it
    (modules with a ``gradient_checkpointing`` flag: decoder and encoder layers), with non-reentrant
    ``torch.utils.checkpoint``; active in training mode only. Returns the number of modules set.
    Parameter names do not change (no wrapper module), so checkpoints and the export are unaffected."""
    from torch.utils.checkpoint import checkpoint

    func = functools.partial(checkpoint, use_reentrant=False)
    count = 0
    for module in modules:
        for sub in module.modules():
            if hasattr(sub, "gradient_checkpointing"):
                setattr(sub, "_gradient_checkpointing_func", func)
                setattr(sub, "gradient_checkpointing", True)
                count += 1
    return count


def train_mode(modules: Sequence[nn.Module], mode: bool = True) -> None:
    """``module.train(mode)`` for each module (stages come from ``from_pretrained``-style loading in
    eval mode: dropout off, checkpointing inactive)."""
    for module in modules:
        module.train(mode)


def resolve_device(kind: str, local_rank: int | None = None) -> tuple[torch.device, str]:
    """``(device, backend)`` for a rank: ``"cpu"`` -> ``(cpu, "gloo")``; ``"cuda"`` -> ``(cuda:LOCAL_RANK,
    "nccl")`` (``local_rank`` default: the ``LOCAL_RANK`` torchrun sets, else 0), after
    ``torch.cuda.set_device``.

    Raises:
        ValueError: an unknown ``kind``, or ``cuda`` where ``torch.cuda.is_available()`` is False or
            the local rank has no GPU.
    """
    if kind == "cpu":
        return torch.device("cpu"), "gloo"
    if kind != "cuda":
        raise ValueError(f"device {kind!r}; expected 'cpu' or 'cuda'")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda: torch.cuda.is_available() is False on this machine (no GPU, or a "
                         f"torch {torch.__version__} build without CUDA); use --device cpu")
    rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    if rank >= torch.cuda.device_count():
        raise ValueError(f"--device cuda: local rank {rank} but only {torch.cuda.device_count()} GPU(s) here")
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank), "nccl"
