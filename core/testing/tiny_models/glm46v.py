"""Tiny seeded GLM-4.6V (``glm46v``): GLM-4.1V's media, tokens and text model
(:mod:`ppmedia.testing.tiny_models.glm4v`) in ``Glm46VForConditionalGeneration``, on a batch with
images in some samples and videos in others.

``Glm46VModel`` builds its text model from ``text_config`` (``glm4v_text`` here) and takes GLM-4.1V's
inputs. transformers' own forward cannot run images and videos in one batch (its two placeholder masks
are both ``input_ids == image_token_id``), so this tiny batch is the images batch
(:data:`~ppmedia.testing.tiny_models.glm4v.IMAGE_SAMPLES`) with a different seed's draws of the same
layout; the video path runs in ``glm4v_moe``'s tiny family and the mixed batch in
``tests/test_glm4v_adapter.py`` against :func:`~ppmedia.testing.tiny_models.glm4v.mixed_reference`.
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
MODEL_TYPE = "glm46v"
reference_inputs = glm4v.reference_inputs


def build_config() -> Any:
    """The tiny ``Glm46VConfig`` (``glm4v_text`` / ``glm4v_vision`` sub-configs)."""
    from transformers import Glm46VConfig

    text = dict(glm4v.text_config(), model_type="glm4v_text")
    vision = dict(glm4v.vision_config(), model_type="glm4v_vision")
    return Glm46VConfig(text_config=text, vision_config=vision, **glm4v.token_ids())


def build_model(seed: int = 0) -> torch.nn.Module:
    """The tiny ``Glm46VForConditionalGeneration``, float32, eval mode, seeded (constants drawn)."""
    from transformers import Glm46VForConditionalGeneration

    return seeded_distinct(Glm46VForConditionalGeneration, build_config(), seed)


def build_batch(seed: int = 0) -> dict[str, Tensor]:
    """GLM-4.1V's images batch (:func:`ppmedia.testing.tiny_models.glm4v.build_batch`)."""
    return glm4v.build_batch(seed + 1, variant="images")


def build_processor(image_backend: str = "torchvision") -> Any:
    """A real ``Glm46VProcessor`` (``Glm46VImageProcessor``, ``Glm46VVideoProcessor``):
    :func:`ppmedia.testing.tiny_models.glm4v.glm_processor`."""
    return glm4v.glm_processor("Glm46VProcessor", "Glm46VImageProcessor", "Glm46VVideoProcessor", image_backend)
