"""Tiny seeded SmolVLM (``smolvlm``): Idefics3's architecture (SigLIP-style tower, pixel-shuffle connector, Llama).

Media as ``SmolVLMImageProcessor`` writes them, samples on axis 0: ``pixel_values`` ``[8, 5, 3, 16, 16]``
(each sample's crops, zero-padded to the batch's most) and ``pixel_attention_mask`` ``[8, 5, 16, 16]``;
4 image tokens a crop. The layout and the per-sample table are in
:mod:`ppmedia.testing.tiny_models._idefics`. The language model sits at ``model.model.text_model``.
Split in 4 microbatches, microbatch 2 (samples 4 and 5) holds only padding crops: SmolVLM's own
``get_image_features`` invents a crop when a call has no real one, so that microbatch must not reach
the encoder. ``build_batch(seed, text_only_first=True)`` puts samples 4 and 5 first.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _idefics, seeded_distinct
from ._idefics import IMAGE_TOKEN_ID, SAMPLES, TOKENS_PER_CROP, build_batch, reference_inputs

__all__ = ["IMAGE_TOKEN_ID", "MODEL_TYPE", "SAMPLES", "TOKENS_PER_CROP", "build_batch", "build_config", "build_model",
           "build_processor", "reference_inputs"]

MODEL_TYPE = "smolvlm"


def build_config() -> Any:
    """The tiny ``SmolVLMConfig``."""
    from transformers import SmolVLMConfig, SmolVLMVisionConfig

    return SmolVLMConfig(
        vision_config=SmolVLMVisionConfig(**_idefics.vision_kwargs()), text_config=_idefics.text_config(),
        scale_factor=_idefics.SCALE, image_token_id=IMAGE_TOKEN_ID, pad_token_id=_idefics.PAD_TOKEN_ID,
    )


def build_model(seed: int = 0) -> torch.nn.Module:
    """The tiny ``SmolVLMForConditionalGeneration``, float32, eval mode, seeded (constants drawn)."""
    from transformers import SmolVLMForConditionalGeneration

    return seeded_distinct(SmolVLMForConditionalGeneration, build_config(), seed)


def build_processor(image_backend: str = "torchvision") -> Any:
    """A real ``SmolVLMProcessor`` (needs the ``num2words`` package: the ``data`` extra) with
    ``SmolVLMImageProcessor`` (``...Pil`` with ``image_backend="pil"``) at Idefics3's tiny crop
    (:func:`ppmedia.testing.tiny_models._idefics.build_processor`) and a ``SmolVLMVideoProcessor`` the
    same size (the class needs one; its videos are not tested here)."""
    import transformers

    crop = {"size": {"longest_edge": 2 * _idefics.CROP}, "max_image_size": {"longest_edge": _idefics.CROP}}
    videos = transformers.SmolVLMVideoProcessor(**crop, do_sample_frames=False)
    return _idefics.build_processor("SmolVLMProcessor", "SmolVLMImageProcessor", image_backend, video_processor=videos)
