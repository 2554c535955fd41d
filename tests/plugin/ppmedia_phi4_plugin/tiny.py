"""Tiny Phi-4-multimodal (``phi4_multimodal``): 2 decoder layers, hidden 64; vision tower 2 layers,
hidden 32, 16 x 16 crops of 4 x 4 patches (2 x 2 features a crop after pooling). A tiny-family module
(``ppmedia.testing.tiny_models.PROTOCOL``) for the example plugin beside it."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

MODEL_TYPE = "phi4_multimodal"
IMAGE_TOKEN_ID = 200
AUDIO_TOKEN_ID = 201
PAD_TOKEN_ID = 0
CROP = 16
#: per sample, its images as (height, width) in pixels; samples 4 and 5 text only
SAMPLES: tuple[tuple[tuple[int, int], ...], ...] = (
    ((16, 16),), ((16, 32), (16, 16)), ((32, 32),), ((16, 32),), (), (), ((32, 32),), ((16, 16),),
)


def build_config() -> Any:
    from transformers import Phi4MultimodalConfig

    return Phi4MultimodalConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=PAD_TOKEN_ID, bos_token_id=1, eos_token_id=2, max_position_embeddings=512,
        original_max_position_embeddings=512, embd_pdrop=0.0, tie_word_embeddings=False,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=CROP, patch_size=4, crop_size=CROP, feature_layer=-2, image_token_id=IMAGE_TOKEN_ID),
        audio_config=dict(hidden_size=32, intermediate_size=64, num_blocks=1, num_attention_heads=2,
                          audio_token_id=AUDIO_TOKEN_ID, input_size=16, nemo_conv_channels=16, time_reduction=8),
    )


def build_model(seed: int = 0) -> torch.nn.Module:
    from transformers import Phi4MultimodalForCausalLM

    from ppmedia.testing.tiny_models import seeded_distinct

    # drawn: transformers starts the crop separators (global/sub_img_feature_extensor) at zero
    return seeded_distinct(Phi4MultimodalForCausalLM, build_config(), seed)


#: build_batches' other structure: portrait images (every image of SAMPLES is square or landscape),
#: three in one sample, text-only samples first
PORTRAIT: tuple[tuple[tuple[int, int], ...], ...] = ((), ((32, 16),), ((32, 16), (16, 16), (48, 16)), ((16, 16),))


def build_batch(seed: int = 0) -> dict[str, Tensor]:
    """``input_ids``/``attention_mask`` ``[8, S]``, ``pixel_values`` ``[7, 5, 3, 16, 16]`` (padded
    crops, the global view first), ``image_sizes`` ``[7, 2]``."""
    return _batch(SAMPLES, seed)


def build_batches(seed: int = 0) -> list[dict[str, Tensor]]:
    """One batch of another structure (:data:`PORTRAIT`, 4 samples), checked by the kit besides."""
    return [_batch(PORTRAIT, seed + 1)]


def _batch(samples: tuple[tuple[tuple[int, int], ...], ...], seed: int) -> dict[str, Tensor]:
    from ppmedia_phi4_plugin import image_tokens

    config = build_config()
    gen = torch.Generator().manual_seed(seed)
    rows, crops, sizes = [], [], []
    for images in samples:
        ids = torch.randint(3, 190, (3,), generator=gen).tolist()
        for h, w in images:
            ids += [IMAGE_TOKEN_ID] * image_tokens(h, w, config) + torch.randint(3, 190, (2,), generator=gen).tolist()
            crops.append(torch.randn(1 + (h // CROP) * (w // CROP), 3, CROP, CROP, generator=gen))
            sizes.append([h, w])
        rows.append(ids)
    S = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), S), PAD_TOKEN_ID, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), S, dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, : len(r)] = torch.tensor(r)
        attention_mask[i, : len(r)] = 1
    pixel_values = torch.zeros(len(crops), max(c.shape[0] for c in crops), 3, CROP, CROP)
    for k, c in enumerate(crops):
        pixel_values[k, : c.shape[0]] = c
    return {"input_ids": input_ids, "attention_mask": attention_mask, "pixel_values": pixel_values,
            "image_sizes": torch.tensor(sizes, dtype=torch.long)}


def reference_inputs(batch: dict[str, Tensor]) -> dict[str, Any]:
    """The model's own forward: its keywords for the crops, their sizes and an all-ones patch mask."""
    pixels = batch.get("pixel_values")
    out: dict[str, Any] = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    if pixels is not None:
        patches = CROP // 4
        out.update(image_pixel_values=pixels, image_sizes=batch["image_sizes"],
                   image_attention_mask=torch.ones(*pixels.shape[:2], patches, patches, dtype=torch.bool))
    return out
