"""Tiny seeded LLaVA-OneVision (``llava_onevision``): CLIP vision tower, Llama text model, anyres crops,
per-sample tiling and videos.

SigLIP (no CLS, ``vision_feature_select_strategy="full"``, as in the released checkpoints) sees 16x16
crops cut in 4x4 patches (``P = 4``: 16 feature rows per crop); Qwen2 text model 64 wide, 2 layers; pinpoints ``[[16, 32], [32, 16], [32, 32]]``; ``vision_aspect_ratio`` is
``"anyres_max_1"``, so a tiled image whose unpadded grid map holds more than ``1.1**2 * 16`` rows is
bilinearly downsampled, as big images are in the released models. What the processor writes:

* images: crops ``pixel_values`` ``[images, max_crops, 3, 16, 16]`` with ``image_sizes`` ``[images, 2]``,
  and ``batch_num_images`` with ONE ENTRY PER SAMPLE THAT HOLDS IMAGES (not per sample): an image of a
  one-image sample is tiled (base crop + grid crops), the images of a sample with several keep their
  base crop only (``16 + 1`` tokens: one newline);
* videos: ``pixel_values_videos`` ``[videos, frames, 3, 16, 16]`` and nothing else (no grid): each frame
  pooled to 2x2, so ``frames * 4 + 1`` tokens per video.

======  =====================================  =====================
sample  media                                  tokens
======  =====================================  =====================
0       image (10, 30), tiled (1x2 grid)       34
1       2 images back to back, base crops      17 + 17 (one run: only batch_num_images tells them apart)
2       video, 2 frames                        9
3       image (30, 12), tiled                  31
4       text only
5       text only
6       image (24, 24), tiled, downsampled     36, then a video: 9
7       video                                  9
======  =====================================  =====================

``batch_num_images`` is ``[1, 2, 1, 1]`` (samples 0, 1, 3, 6). In 4 microbatches (2, 2, 2, 2 samples)
microbatch 2 (samples 4, 5) is text-only; with an uneven 3 (3, 3, 2) every microbatch holds media.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from . import seeded_distinct
from ._batch import right_padded
from ._configs import text_fields, tower_fields

__all__ = ["BASE_TOKENS", "FRAMES", "IMAGE_TOKEN_ID", "MODEL_TYPE", "SAMPLES", "VIDEO_TOKENS", "VIDEO_TOKEN_ID",
           "build_batch", "build_config", "build_model", "build_processor", "reference_inputs", "tiled_tokens"]

MODEL_TYPE = "llava_onevision"

VOCAB_SIZE = 128
PAD_TOKEN_ID = 0
IMAGE_TOKEN_ID = VOCAB_SIZE - 1
VIDEO_TOKEN_ID = VOCAB_SIZE - 2
CROP = 16
PATCH = 4
PINPOINTS = [[16, 32], [32, 16], [32, 32]]
ASPECT = "anyres_max_1"
FRAMES = 2

#: per sample: the (height, width) of each image, then its number of videos.
SAMPLES: tuple[tuple[tuple[tuple[int, int], ...], int], ...] = (
    (((10, 30),), 0),
    (((30, 12), (16, 16)), 0),
    ((), 1),
    (((30, 12),), 0),
    ((), 0),
    ((), 0),
    (((24, 24),), 1),
    ((), 1),
)
_PREFIX = (3, 2, 4, 6, 9, 5, 2, 3)
_SUFFIX = (5, 3, 6, 4, 2, 7, 2, 4)


def build_config() -> Any:
    """The tiny ``LlavaOnevisionConfig``."""
    from transformers import LlavaOnevisionConfig, Qwen2Config, SiglipVisionConfig

    vision = SiglipVisionConfig(**tower_fields(image_size=CROP, patch_size=PATCH, vision_use_head=False))
    text = Qwen2Config(**text_fields(VOCAB_SIZE, PAD_TOKEN_ID, max_position_embeddings=512))
    return LlavaOnevisionConfig(
        vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID, video_token_index=VIDEO_TOKEN_ID,
        image_grid_pinpoints=[list(p) for p in PINPOINTS], vision_feature_layer=-1,
        vision_feature_select_strategy="full", vision_aspect_ratio=ASPECT,
    )


def build_model(seed: int = 0) -> torch.nn.Module:
    """The tiny ``LlavaOnevisionForConditionalGeneration``, float32, eval mode, seeded (constants drawn)."""
    from transformers import LlavaOnevisionForConditionalGeneration

    return seeded_distinct(LlavaOnevisionForConditionalGeneration, build_config(), seed)


def tiled_tokens(size: tuple[int, int]) -> int:
    """Tokens of an image of a one-image sample, with transformers' own grid and unpadding: base crop,
    unpadded grid map (downsampled past ``anyres_max_1``), one newline per map row."""
    from transformers.models.llava_onevision.modeling_llava_onevision import get_anyres_image_grid_shape, unpad_image

    side = CROP // PATCH
    grid_h, grid_w = get_anyres_image_grid_shape(list(size), PINPOINTS, CROP)
    rows, cols = unpad_image(torch.empty(1, grid_h * side, grid_w * side), list(size)).shape[1:]
    ratio = math.sqrt(rows * cols / (int(ASPECT.split("_")[-1]) * side * side))
    if ratio > 1.1:
        rows, cols = int(rows // ratio), int(cols // ratio)
    return side * side + rows * (cols + 1)


BASE_TOKENS = (CROP // PATCH) ** 2 + 1
VIDEO_TOKENS = FRAMES * math.ceil(CROP // PATCH / 2) ** 2 + 1


def _order(text_only_first: bool) -> list[int]:
    samples = list(range(len(SAMPLES)))
    if text_only_first:  # the text-only samples 4 and 5 first: microbatch 0 has no media
        samples = [4, 5] + [i for i in samples if i not in (4, 5)]
    return samples


def build_batch(seed: int = 0, *, text_only_first: bool = False) -> dict[str, Tensor]:
    """``input_ids``/``attention_mask`` ``[8, S]``, ``pixel_values`` ``[5, max_crops, 3, 16, 16]``,
    ``image_sizes`` ``[5, 2]``, ``batch_num_images`` ``[4]``, ``pixel_values_videos`` ``[3, 2, 3, 16, 16]``.

    ``text_only_first``: samples 4 and 5 (text only) come first, so microbatch 0 of 4 has no media."""
    from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

    gen = torch.Generator().manual_seed(seed)

    def text(n: int) -> list[int]:
        return torch.randint(3, VIDEO_TOKEN_ID, (n,), generator=gen).tolist()

    order = _order(text_only_first)
    rows = []
    for i in order:
        sizes, videos = SAMPLES[i]
        ids = text(_PREFIX[i])
        for size in sizes:  # back to back: one run of image tokens
            ids += [IMAGE_TOKEN_ID] * (tiled_tokens(size) if len(sizes) == 1 else BASE_TOKENS)
        for _ in range(videos):
            ids += text(1) + [VIDEO_TOKEN_ID] * VIDEO_TOKENS
        rows.append(ids + text(_SUFFIX[i]))
    input_ids, attention_mask = right_padded(rows, PAD_TOKEN_ID)
    images = [(size, len(SAMPLES[i][0]) == 1) for i in order for size in SAMPLES[i][0]]
    crops = [image_size_to_num_patches(list(size), PINPOINTS, CROP) if tiled else 1 for size, tiled in images]
    pixel_values = torch.zeros(len(images), max(crops), 3, CROP, CROP)
    for k, n in enumerate(crops):
        pixel_values[k, :n] = torch.randn(n, 3, CROP, CROP, generator=gen)
    n_videos = sum(v for _, v in SAMPLES)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "pixel_values": pixel_values,
        "image_sizes": torch.tensor([size for size, _ in images], dtype=torch.int64),
        "batch_num_images": torch.tensor([len(SAMPLES[i][0]) for i in order if SAMPLES[i][0]], dtype=torch.int64),
        "pixel_values_videos": torch.randn(n_videos, FRAMES, 3, CROP, CROP, generator=gen),
    }


def reference_inputs(batch: dict[str, Tensor]) -> dict[str, Any]:
    """Keyword arguments of the model's own full-batch forward."""
    keys = ("input_ids", "attention_mask", "pixel_values", "image_sizes", "batch_num_images", "pixel_values_videos")
    return {k: batch[k] for k in keys if k in batch}


def build_processor(image_backend: str = "torchvision") -> Any:
    """A real ``LlavaOnevisionProcessor``: ``LlavaOnevisionImageProcessor`` (``...Pil`` with
    ``image_backend="pil"``) at 16 x 16 crops and the tiny pinpoints, ``LlavaOnevisionVideoProcessor`` at
    16 x 16 frames (frames as given), 16 tokens a crop, ``anyres_max_1``; a word-level tokenizer with the
    tiny ids (``<|im_start|>`` 1, ``<|im_end|>`` 2), a chatml chat template."""
    import transformers

    from ..word_tokenizer import TokenizerSpec, word_tokenizer
    from ._processors import image_processor_class, qwen_processor

    square = {"height": CROP, "width": CROP}
    images = image_processor_class("LlavaOnevisionImageProcessor", image_backend)(size=square, image_grid_pinpoints=PINPOINTS)
    videos = transformers.LlavaOnevisionVideoProcessor(size=square, do_sample_frames=False)
    ids = {"<|endoftext|>": PAD_TOKEN_ID, "<|im_start|>": 1, "<|im_end|>": 2, "<image>": IMAGE_TOKEN_ID, "<video>": VIDEO_TOKEN_ID}
    tokenizer = word_tokenizer(TokenizerSpec(VOCAB_SIZE, ids, pad="<|endoftext|>", eos="<|im_end|>",
                                             attributes={"image_token": "<image>", "video_token": "<video>"}))
    return qwen_processor("LlavaOnevisionProcessor", tokenizer=tokenizer, images=images, videos=videos,
                          media={"image": "<image>", "video": "<video>"}, num_image_tokens=(CROP // PATCH) ** 2,
                          vision_feature_select_strategy="full", vision_aspect_ratio=ASPECT)
