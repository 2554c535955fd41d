"""Tiny seeded LLaVA-OneVision (``llava_onevision``) for the plugin's tests: the tiny-family protocol of
``ppmedia.testing``.

CLIP vision tower on 16x16 crops cut in 4x4 patches (``P = 4``: 16 feature rows per crop, CLS dropped),
Llama text model, 64 wide; pinpoints ``[[16, 32], [32, 16], [32, 32]]``. What the processor writes:

* images: LLaVA-NeXT crops ``pixel_values`` ``[images, max_crops, 3, 16, 16]`` with ``image_sizes``
  ``[images, 2]``, and ``batch_num_images`` with ONE ENTRY PER SAMPLE THAT HOLDS IMAGES (not per
  sample): a sample with one image is tiled (``16 + rows * (cols + 1)`` tokens, as LLaVA-NeXT), the
  images of a sample with several keep their base crop only (``16 + 1`` tokens: one newline);
* videos: ``pixel_values_videos`` ``[videos, frames, 3, 16, 16]`` and nothing else (no grid): each
  frame pooled to 2x2, so ``frames * 4 + 1`` tokens per video.

======  ===========================  ======
sample  media                        tokens
======  ===========================  ======
0       image (10, 30), tiled        34
1       2 images back to back        17 + 17 (one run: only batch_num_images tells them apart)
2       video, 2 frames              9
3       text only
4       text only
5       text only
6       image (24, 24), tiled, video 88 + 9
7       video                        9
======  ===========================  ======

``batch_num_images`` is ``[1, 2, 1]`` (samples 0, 1, 6). In 4 microbatches (2, 2, 2, 2 samples)
microbatch 2 (samples 4, 5) is text-only; with an uneven 3 (3, 3, 2) every microbatch holds media.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
)
from transformers.models.llava_next.modeling_llava_next import (
    get_anyres_image_grid_shape,
    image_size_to_num_patches,
    unpad_image,
)

from ppmedia.testing.tiny_models import seeded

MODEL_TYPE = "llava_onevision"

VOCAB_SIZE = 128
PAD_TOKEN_ID = 0
IMAGE_TOKEN_ID = VOCAB_SIZE - 1
VIDEO_TOKEN_ID = VOCAB_SIZE - 2
CROP = 16
PATCH = 4
PINPOINTS = [[16, 32], [32, 16], [32, 32]]
FRAMES = 2

#: per sample: the (height, width) of each image, then its videos.
SAMPLES: tuple[tuple[tuple[tuple[int, int], ...], int], ...] = (
    (((10, 30),), 0),
    (((30, 12), (16, 16)), 0),
    ((), 1),
    ((), 0),
    ((), 0),
    ((), 0),
    (((24, 24),), 1),
    ((), 1),
)
_PREFIX = (3, 2, 4, 6, 9, 5, 2, 3)
_SUFFIX = (5, 3, 6, 4, 2, 7, 2, 4)


def build_config() -> LlavaOnevisionConfig:
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=CROP, patch_size=PATCH, projection_dim=32,
    )
    text = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        pad_token_id=PAD_TOKEN_ID, bos_token_id=1, eos_token_id=2,
    )
    return LlavaOnevisionConfig(
        vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID, video_token_index=VIDEO_TOKEN_ID,
        image_grid_pinpoints=[list(p) for p in PINPOINTS], vision_feature_layer=-1,
        vision_feature_select_strategy="default", vision_aspect_ratio="anyres_max_9",
    )


def build_model(seed: int = 0) -> LlavaOnevisionForConditionalGeneration:
    """The tiny model, float32, eval mode, every weight drawn after ``torch.manual_seed(seed)``."""
    model = seeded(LlavaOnevisionForConditionalGeneration, build_config(), seed)
    with torch.no_grad():  # the newline row starts as zeros: draw it, so a misplaced newline shows
        model.model.image_newline.normal_(generator=torch.Generator().manual_seed(seed + 1))
    return model


def tiled_tokens(size: tuple[int, int]) -> int:
    """Tokens of an image of a one-image sample: base crop, unpadded grid, one newline per grid row."""
    side = CROP // PATCH
    grid_h, grid_w = get_anyres_image_grid_shape(list(size), PINPOINTS, CROP)
    rows, cols = unpad_image(torch.empty(1, grid_h * side, grid_w * side), list(size)).shape[1:]
    return side * side + rows * (cols + 1)


BASE_TOKENS = (CROP // PATCH) ** 2 + 1
VIDEO_TOKENS = FRAMES * math.ceil(CROP // PATCH / 2) ** 2 + 1


def build_batch(seed: int = 0) -> dict[str, Tensor]:
    """``input_ids``/``attention_mask`` ``[8, S]``, ``pixel_values`` ``[4, max_crops, 3, 16, 16]``,
    ``image_sizes`` ``[4, 2]``, ``batch_num_images`` ``[3]``, ``pixel_values_videos`` ``[3, 2, 3, 16, 16]``."""
    gen = torch.Generator().manual_seed(seed)

    def text(n: int) -> list[int]:
        return torch.randint(3, VIDEO_TOKEN_ID, (n,), generator=gen).tolist()

    rows = []
    for i, (sizes, videos) in enumerate(SAMPLES):
        ids = text(_PREFIX[i])
        for size in sizes:  # back to back: one run of image tokens
            ids += [IMAGE_TOKEN_ID] * (tiled_tokens(size) if len(sizes) == 1 else BASE_TOKENS)
        for _ in range(videos):
            ids += text(1) + [VIDEO_TOKEN_ID] * VIDEO_TOKENS
        rows.append(ids + text(_SUFFIX[i]))
    seq = max(map(len, rows))
    input_ids = torch.full((len(rows), seq), PAD_TOKEN_ID, dtype=torch.int64)
    attention_mask = torch.zeros_like(input_ids)
    for i, ids in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention_mask[i, : len(ids)] = 1
    sizes = [size for s, _ in SAMPLES for size in s]
    crops = [image_size_to_num_patches(list(size), PINPOINTS, CROP) for size in sizes]
    pixel_values = torch.zeros(len(sizes), max(crops), 3, CROP, CROP)
    for k, n in enumerate(crops):
        pixel_values[k, :n] = torch.randn(n, 3, CROP, CROP, generator=gen)
    n_videos = sum(v for _, v in SAMPLES)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "pixel_values": pixel_values,
        "image_sizes": torch.tensor(sizes, dtype=torch.int64),
        "batch_num_images": torch.tensor([len(s) for s, _ in SAMPLES if s], dtype=torch.int64),
        "pixel_values_videos": torch.randn(n_videos, FRAMES, 3, CROP, CROP, generator=gen),
    }


def reference_inputs(batch: dict[str, Tensor]) -> dict[str, Any]:
    """Keyword arguments of the model's own full-batch forward."""
    keys = ("input_ids", "attention_mask", "pixel_values", "image_sizes", "batch_num_images", "pixel_values_videos")
    return {k: batch[k] for k in keys}
