"""Tiny seeded Qwen3-VL-MoE (``qwen3_vl_moe``) for the expert-parallel tests: Qwen3-VL's tokens, media
and batch (:mod:`ppmedia.testing.tiny_models.qwen3_vl`) with a mixture-of-experts text model (2 decoder
layers, both MoE: 4 fused routed experts ``mlp.experts.gate_up_proj`` / ``down_proj`` ``[4, ...]``, 2 per
token, softmax top-k renormalised). Loaded by its dotted name ``ppmedia.testing.tiny_models.qwen3_vl_moe``
(not one of the built-in :data:`~ppmedia.testing.tiny_models.FAMILIES`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import qwen3_vl

__all__ = ["ADAPTER", "MODEL_TYPE", "build_batch", "build_config", "build_model", "build_processor", "reference_inputs"]

#: the built-in adapter serving this tiny model (the Qwen3-VL adapter serves the MoE variant)
ADAPTER = "qwen3_vl"
MODEL_TYPE = "qwen3_vl_moe"
reference_inputs = qwen3_vl.reference_inputs


def build_model(seed: int = 0) -> torch.nn.Module:
    """The tiny ``Qwen3VLMoeForConditionalGeneration``, float32, eval mode, seeded."""
    return qwen3_vl.build_variant(MODEL_TYPE, seed)


def build_config() -> Any:
    """The tiny ``Qwen3VLMoeConfig``."""
    return build_model(0).config


def build_batch(seed: int = 0, *, text_only_first: bool = False) -> dict[str, Tensor]:
    """Qwen3-VL's mixed image + video batch (:func:`ppmedia.testing.tiny_models.qwen3_vl.build_batch`)."""
    return qwen3_vl.build_batch(seed, text_only_first=text_only_first)


def build_processor(image_backend: str = "torchvision") -> Any:
    """Qwen3-VL's tiny processor (:func:`ppmedia.testing.tiny_models.qwen3_vl.build_processor`): the tokens fit."""
    return qwen3_vl.build_processor(image_backend)
