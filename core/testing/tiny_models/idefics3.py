"""Tiny seeded Idefics3 (``idefics3``): SigLIP-style vision tower, pixel-shuffle connector, Llama text model.

Media as ``Idefics3ImageProcessor`` writes them, samples on axis 0: ``pixel_values`` ``[8, 5, 3, 16, 16]``
(each sample's crops, zero-padded to the batch's most) and ``pixel_attention_mask`` ``[8, 5, 16, 16]``;
4 image tokens a crop. The layout and the per-sample table are in
:mod:`ppmedia.testing.tiny_models._idefics`. The language model sits at ``model.model.text_model``.
Split in 4 microbatches, microbatch 2 (samples 4 and 5) holds only padding crops.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _idefics, seeded_distinct
from ._idefics import IMAGE_TOKEN_ID, SAMPLES, TOKENS_PER_CROP, build_batch, reference_inputs

__all__ = ["IMAGE_TOKEN_ID", "MODEL_TYPE", "SAMPLES", "TOKENS_PER_CROP", "build_batch", "build_config", "build_model",
           "build_processor", "reference_inputs"]

MODEL_TYPE = "idefics3"


def build_config() -> Any:
    """The tiny ``Idefics3Config``."""
    from transformers import Idefics3Config, Idefics3VisionConfig

    return Idefics3Config(
        vision_config=Idefics3VisionConfig(**_idefics.vision_kwargs()), text_config=_idefics.text_config(),
        scale_factor=_idefics.SCALE, image_token_id=IMAGE_TOKEN_ID, pad_token_id=_idefics.PAD_TOKEN_ID,
    )


def build_model(seed: int = 0) -> torch.nn.Module:
    """The tiny ``Idefics3ForConditionalGeneration``, float32, eval mode, seeded (constants drawn)."""
    from transformers import Idefics3ForConditionalGeneration

    return seeded_distinct(Idefics3ForConditionalGeneration, build_config(), seed)


def build_processor(image_backend: str = "torchvision") -> Any:
    """A real ``Idefics3Processor`` with ``Idefics3ImageProcessor`` (``...Pil`` with ``image_backend="pil"``):
    :func:`ppmedia.testing.tiny_models._idefics.build_processor`."""
    return _idefics.build_processor("Idefics3Processor", "Idefics3ImageProcessor", image_backend)
