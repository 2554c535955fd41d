"""Tiny seeded Aya Vision (``aya_vision``): SigLIP vision tower, pixel-shuffle SwiGLU projector, Cohere 2 text.

SigLIP sees 16 x 16 tiles cut in 4 x 4 patches; the pixel shuffle (``downsample_factor`` 2) makes
:data:`TOKENS_PER_TILE` = 4 ``<|IMG_PATCH|>`` tokens a tile (169 in the released models). Cohere 2:
64 wide, 2 layers (a sliding-window layer of window 16, then a global one). As ``AyaVisionProcessor``
writes an image of ``n`` tiles: ``<|START_OF_IMG|>``, for each of the first ``n - 1`` tiles
``TILE_i`` and its patch tokens, ``TILE_GLOBAL`` and the last tile's (the thumbnail's) patch tokens,
``<|END_OF_IMG|>``; ``pixel_values`` ``[tiles, 3, 16, 16]`` holds the tiles in that order.

======  ========================  =====
sample  images (tiles each)       tiles
======  ========================  =====
0       1 (3: 2 tiles + thumb)    3
1       2 (1; 5)                  6
2       1 (1)                     1
3       1 (4)                     4
4       text only                 0
5       text only                 0
6       2 (1; 1) back to back     2
7       1 (3)                     3
======  ========================  =====

Split in 4 microbatches, microbatch 2 (samples 4 and 5) is text-only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import seeded_distinct
from ._batch import right_padded
from ._configs import text_fields, tower_fields

__all__ = [
    "IMAGE_TOKEN_ID",
    "MODEL_TYPE",
    "SAMPLES",
    "TOKENS_PER_TILE",
    "build_batch",
    "build_config",
    "build_model",
    "build_processor",
    "image_ids",
    "reference_inputs",
]

MODEL_TYPE = "aya_vision"

VOCAB_SIZE = 128
PAD_TOKEN_ID = 0
IMAGE_TOKEN_ID = VOCAB_SIZE - 1  # <|IMG_PATCH|>
START_TOKEN_ID = VOCAB_SIZE - 2  # <|START_OF_IMG|>
END_TOKEN_ID = VOCAB_SIZE - 3  # <|END_OF_IMG|>
GLOBAL_TOKEN_ID = VOCAB_SIZE - 4  # TILE_GLOBAL
TILE_TOKEN_ID = VOCAB_SIZE - 20  # TILE_1 .. TILE_12
IMAGE_SIZE = 16
PATCH_SIZE = 4
DOWNSAMPLE = 2
TOKENS_PER_TILE = (IMAGE_SIZE // PATCH_SIZE // DOWNSAMPLE) ** 2

#: per sample: the tiles of each of its images (a tile count > 1 includes the thumbnail).
SAMPLES: tuple[tuple[int, ...], ...] = ((3,), (1, 5), (1,), (4,), (), (), (1, 1), (3,))
_PREFIX = (3, 2, 4, 6, 9, 5, 2, 3)
_SUFFIX = (5, 3, 6, 4, 2, 7, 2, 4)


def build_config() -> Any:
    """The tiny ``AyaVisionConfig``."""
    from transformers import AyaVisionConfig, Cohere2Config, SiglipVisionConfig

    vision = SiglipVisionConfig(**tower_fields(image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, vision_use_head=False))
    text = Cohere2Config(**text_fields(
        VOCAB_SIZE, PAD_TOKEN_ID, max_position_embeddings=256, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
    ))
    return AyaVisionConfig(
        vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID, downsample_factor=DOWNSAMPLE,
        vision_feature_select_strategy="full", vision_feature_layer=-1,
    )


def build_model(seed: int = 0) -> torch.nn.Module:
    """The tiny ``AyaVisionForConditionalGeneration``, float32, eval mode, seeded (constants drawn)."""
    from transformers import AyaVisionForConditionalGeneration

    return seeded_distinct(AyaVisionForConditionalGeneration, build_config(), seed)


def image_ids(tiles: int, tokens_per_tile: int = TOKENS_PER_TILE) -> list[int]:
    """The ids ``AyaVisionProcessor`` writes for an image of ``tiles`` tiles (thumbnail included)."""
    patches = [IMAGE_TOKEN_ID] * tokens_per_tile
    ids = [START_TOKEN_ID]
    for i in range(1, tiles):
        ids += [TILE_TOKEN_ID + i, *patches]
    return ids + [GLOBAL_TOKEN_ID, *patches, END_TOKEN_ID]


def build_batch(seed: int = 0) -> dict[str, Tensor]:
    """``input_ids`` / ``attention_mask`` ``[8, S]`` (right-padded), ``pixel_values`` ``[19, 3, 16, 16]``."""
    gen = torch.Generator().manual_seed(seed)

    def text(n: int) -> list[int]:
        return torch.randint(3, TILE_TOKEN_ID, (n,), generator=gen).tolist()

    rows = []
    for i, images in enumerate(SAMPLES):
        ids = text(_PREFIX[i])
        for k, tiles in enumerate(images):
            ids += image_ids(tiles) + ([] if i == 6 and k == 0 else text(1))  # sample 6: back to back
        rows.append(ids + text(_SUFFIX[i]))
    input_ids, attention_mask = right_padded(rows, PAD_TOKEN_ID)
    tiles = sum(sum(s) for s in SAMPLES)
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "pixel_values": torch.randn(tiles, 3, IMAGE_SIZE, IMAGE_SIZE, generator=gen)}


def reference_inputs(batch: dict[str, Tensor]) -> dict[str, Any]:
    """Keyword arguments of the model's own full-batch forward."""
    return {k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values")}


def build_processor(image_backend: str = "torchvision") -> Any:
    """A real ``AyaVisionProcessor``: ``GotOcr2ImageProcessor`` (``...Pil`` with ``image_backend="pil"``)
    cutting images into at most 4 tiles of 16 x 16 plus the thumbnail, patch 4, downsample 2
    (:data:`TOKENS_PER_TILE` tokens a tile); a word-level tokenizer with the tiny ids (``<PAD>`` 0,
    ``<BOS_TOKEN>`` 1, ``<|END_OF_TURN_TOKEN|>`` 2, ``TILE_1`` .. ``TILE_12``), a plain chat template."""
    import transformers

    from ..word_tokenizer import TokenizerSpec, chat_template, word_tokenizer
    from ._processors import image_processor_class

    square = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    images = image_processor_class("GotOcr2ImageProcessor", image_backend)(size=square, crop_to_patches=True, min_patches=1,
                                                                            max_patches=4)
    ids = {"<PAD>": PAD_TOKEN_ID, "<BOS_TOKEN>": 1, "<|END_OF_TURN_TOKEN|>": 2, "<|IMG_PATCH|>": IMAGE_TOKEN_ID,
           "<|START_OF_IMG|>": START_TOKEN_ID, "<|END_OF_IMG|>": END_TOKEN_ID, "TILE_GLOBAL": GLOBAL_TOKEN_ID}
    ids.update({f"TILE_{i}": TILE_TOKEN_ID + i for i in range(1, 13)})
    tokenizer = word_tokenizer(TokenizerSpec(VOCAB_SIZE, ids, pad="<PAD>", eos="<|END_OF_TURN_TOKEN|>", bos="<BOS_TOKEN>"))
    return transformers.AyaVisionProcessor(image_processor=images, tokenizer=tokenizer, patch_size=PATCH_SIZE, img_size=IMAGE_SIZE,
                                           downsample_factor=DOWNSAMPLE, chat_template=chat_template("plain", {"image": "<image>"},
                                                                                                     bos="<BOS_TOKEN>"))
