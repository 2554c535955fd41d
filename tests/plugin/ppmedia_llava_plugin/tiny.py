"""Tiny seeded LLaVA-1.5 (``llava``) for the plugin's tests: the tiny-family protocol of ``ppmedia.testing``.

CLIP vision tower (16x16 images cut in 4x4 patches: 16 features per image after the CLS row is
dropped), Llama text model, 64 wide. The batch has 8 samples with 1, 2, 1, 1, 0, 0, 2, 1 images of
16 placeholder tokens each; split in 4 microbatches, microbatch 2 (samples 4 and 5) is text-only.
``pixel_values`` is ``[8, 3, 16, 16]`` (complete images, in placeholder order).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

from ppmedia.testing.tiny_models import seeded

MODEL_TYPE = "llava"

VOCAB_SIZE = 128
PAD_TOKEN_ID = 0
IMAGE_TOKEN_ID = VOCAB_SIZE - 1
IMAGE_SIZE = 16
PATCH_SIZE = 4
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2

IMAGES_PER_SAMPLE: tuple[int, ...] = (1, 2, 1, 1, 0, 0, 2, 1)
_PREFIX = (3, 2, 4, 2, 9, 5, 2, 3)  # text tokens before the first image (or the whole text)
_SUFFIX = (5, 3, 6, 4, 0, 0, 2, 4)  # text tokens after the last image


def build_config() -> LlavaConfig:
    """The tiny LLaVA-1.5 config."""
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=32,
    )
    text = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        pad_token_id=PAD_TOKEN_ID, bos_token_id=1, eos_token_id=2,
    )
    return LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN_ID,
        vision_feature_layer=-2, vision_feature_select_strategy="default", image_seq_length=TOKENS_PER_IMAGE,
    )


def build_model(seed: int = 0) -> LlavaForConditionalGeneration:
    """The tiny model, float32, eval mode, weights drawn after ``torch.manual_seed(seed)``."""
    return seeded(LlavaForConditionalGeneration, build_config(), seed)


def build_batch(seed: int = 0) -> dict[str, Tensor]:
    """``input_ids``/``attention_mask`` ``[8, S]`` (right-padded), ``pixel_values`` ``[8, 3, 16, 16]``."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for prefix, images, suffix in zip(_PREFIX, IMAGES_PER_SAMPLE, _SUFFIX):
        ids = torch.randint(3, IMAGE_TOKEN_ID, (prefix,), generator=gen).tolist()
        for j in range(images):
            ids += [IMAGE_TOKEN_ID] * TOKENS_PER_IMAGE + torch.randint(3, IMAGE_TOKEN_ID, (1,), generator=gen).tolist()
        ids += torch.randint(3, IMAGE_TOKEN_ID, (suffix,), generator=gen).tolist()
        rows.append(ids)
    seq = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), seq), PAD_TOKEN_ID, dtype=torch.int64)
    attention_mask = torch.zeros((len(rows), seq), dtype=torch.int64)
    for i, ids in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention_mask[i, : len(ids)] = 1
    pixel_values = torch.randn(sum(IMAGES_PER_SAMPLE), 3, IMAGE_SIZE, IMAGE_SIZE, generator=gen)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "pixel_values": pixel_values}


def reference_inputs(batch: dict[str, Tensor]) -> dict[str, Any]:
    """Keyword arguments of the model's own full-batch forward."""
    return {k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values")}
