"""Tiny seeded Pixtral-backbone LLaVA (``llava`` with a ``pixtral`` vision tower, as Pixtral-12B):
images of different sizes, no patch merger, Mistral text model.

Pixtral cuts images into 8 x 8 patches (at most 48 x 48 pixels); each patch is one ``[IMG]`` token
(id 10), rows separated by ``[IMG_BREAK]`` (12), ``[IMG_END]`` (13) last. ``pixel_values``
``[images, 3, 48, 48]`` padded to the largest, ``image_sizes`` ``[images, 2]`` true sizes; the
``"full"`` select strategy keeps every patch (Pixtral has no CLS).

======  ==========================  ============
sample  image sizes                 image tokens
======  ==========================  ============
0       (16, 24)                    6
1       (8, 8), (24, 16)            1 + 6
2       (24, 32)                    12
3       (16, 16)                    4
4, 5    text only                   0
6       (8, 32), (16, 8)            4 + 2
7       (32, 32)                    16
======  ==========================  ============
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import seeded_distinct
from ._configs import pixtral_tower_fields, text_fields
from ._pixtral import PixtralLayout, pixtral_batch

__all__ = ["ADAPTER", "LAYOUT", "MODEL_TYPE", "build_batch", "build_config", "build_model", "build_processor", "reference_inputs"]

#: the built-in adapter serving this tiny model (its model type is llava's)
ADAPTER = "llava"
MODEL_TYPE = "llava"

PATCH_SIZE = 8
MAX_SIZE = 48
LAYOUT = PixtralLayout(
    step=PATCH_SIZE, max_size=MAX_SIZE, vocab=128, first_text_id=14, image=10, image_break=12, image_end=13, pad=0,
    sizes=(((16, 24),), ((8, 8), (24, 16)), ((24, 32),), ((16, 16),), (), (), ((8, 32), (16, 8)), ((32, 32),)),
    prefix=(3, 2, 5, 2, 9, 6, 2, 3),
    suffix=(4, 3, 6, 4, 0, 0, 2, 5),
)


def build_config() -> Any:
    """The tiny ``LlavaConfig`` with a ``PixtralVisionConfig`` tower and a ``MistralConfig`` text model."""
    from transformers import LlavaConfig, MistralConfig, PixtralVisionConfig

    vision = PixtralVisionConfig(**pixtral_tower_fields(MAX_SIZE, PATCH_SIZE))
    text = MistralConfig(**text_fields(LAYOUT.vocab, LAYOUT.pad, head_dim=16, max_position_embeddings=256, sliding_window=None))
    return LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=LAYOUT.image, vision_feature_layer=-1,
        vision_feature_select_strategy="full", projector_hidden_act="gelu",
    )


def build_model(seed: int = 0) -> torch.nn.Module:
    """The tiny ``LlavaForConditionalGeneration`` (Pixtral tower), float32, eval mode, seeded."""
    from transformers import LlavaForConditionalGeneration

    return seeded_distinct(LlavaForConditionalGeneration, build_config(), seed)


def build_batch(seed: int = 0) -> dict[str, Tensor]:
    """``input_ids`` / ``attention_mask`` ``[8, S]``, ``pixel_values`` ``[8, 3, 48, 48]``, ``image_sizes`` ``[8, 2]``."""
    return pixtral_batch(LAYOUT, seed)


def reference_inputs(batch: dict[str, Tensor]) -> dict[str, Any]:
    """Keyword arguments of the model's own full-batch forward."""
    return {k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values", "image_sizes")}


def build_processor(image_backend: str = "torchvision") -> Any:
    """A real ``PixtralProcessor`` (``PixtralImageProcessor`` or ``...Pil``) at patch 8, no merge, images
    of at most 48 pixels a side: :func:`ppmedia.testing.tiny_models._pixtral.pixtral_processor`."""
    from ._pixtral import pixtral_processor

    return pixtral_processor(LAYOUT, PATCH_SIZE, 1, image_backend)
