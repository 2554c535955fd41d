"""Tiny seeded GLM-4.5V (``glm4v_moe``): GLM-4.1V's media and tokens (:mod:`ppmedia.testing.tiny_models.glm4v`)
with a mixture-of-experts text model, on the VIDEOS batch.

Videos as ``Glm4vVideoProcessor`` gives them (``pixel_values_videos`` ``[patches, 384]``,
``video_grid_thw`` ``[videos, 3]``), each frame an image block inside ``<|begin_of_video|> ...
<|end_of_video|>`` (the IMAGE token): samples 0, 1, 2, 3, 6, 7 hold one video each, 4 and 5 are text
only (see :data:`~ppmedia.testing.tiny_models.glm4v.VIDEO_SAMPLES`). The text model (``glm4v_moe_text``,
hidden 64, 2 layers): layer 0 dense, layer 1 MoE (4 routed experts, 2 per token, one shared), the
released model's partial rotary mrope.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import glm4v, seeded_distinct

__all__ = [
    "ADAPTER",
    "MODEL_TYPE",
    "build_batch",
    "build_config",
    "build_model",
    "build_processor",
    "reference_inputs",
]

#: the built-in adapter serving this tiny model (the GLM-4V adapter serves all three model types)
ADAPTER = "glm4v"
MODEL_TYPE = "glm4v_moe"
reference_inputs = glm4v.reference_inputs


def build_config() -> Any:
    """The tiny ``Glm4vMoeConfig``."""
    from transformers import Glm4vMoeConfig

    text = glm4v.text_config(
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=1.0,
    )
    return Glm4vMoeConfig(text_config=text, vision_config=glm4v.vision_config(), **glm4v.token_ids())


def build_model(seed: int = 0) -> torch.nn.Module:
    """The tiny ``Glm4vMoeForConditionalGeneration``, float32, eval mode, seeded (constants drawn)."""
    from transformers import Glm4vMoeForConditionalGeneration

    return seeded_distinct(Glm4vMoeForConditionalGeneration, build_config(), seed)


def build_batch(seed: int = 0) -> dict[str, Tensor]:
    """GLM-4.1V's videos batch (:func:`ppmedia.testing.tiny_models.glm4v.build_batch` ``variant="videos"``)."""
    return glm4v.build_batch(seed, variant="videos")


def build_processor(image_backend: str = "torchvision") -> Any:
    """GLM-4.1V's tiny processor (:func:`ppmedia.testing.tiny_models.glm4v.build_processor`): GLM-4.5V
    uses ``Glm4vProcessor``."""
    return glm4v.build_processor(image_backend)
