"""Tiny seeded Llama 4 (``llama4``): tiles of one size, the projector outside ``get_image_features``,
a text model with chunked and NoPE attention and a MoE layer.

Media as ``Llama4ImageProcessor`` gives them (built by hand in its layout; :func:`build_processor` is
the real processor): ``pixel_values`` ``[tiles, 3, 32, 32]``, every image's local tiles
(``ratio_h x ratio_w`` of them when the image is cut, none otherwise) and then its global tile, image
after image in prompt order. Each tile gives :data:`TOKENS_PER_TILE` = (32 / 4)^2 x 0.5^2 = 16
features (vision tower, pixel shuffle, vision adapter MLP; then the model's ``multi_modal_projector``,
which ``Llama4ForConditionalGeneration.forward`` runs outside ``get_image_features``). The text is what
``Llama4Processor`` writes::

    <|image_start|> (<|patch|> x 16 <|tile_x_separator|>? ... <|tile_y_separator|>) per row of tiles
                    <|image|> <|patch|> x 16 <|image_end|>

``<|patch|>`` is the config's ``image_token_id``: a sample's tiles are its patch tokens / 16.

======  ==========================================  =====
sample  images (ratio_h x ratio_w local tiles)      tiles
======  ==========================================  =====
0       one image, 1 x 2 local + global              3
1       one image, global only                       1
2       two images: 2 x 2 local + global; global     6
3       one image, global only                       1
4, 5    text only                                    0
6       one image, 2 x 1 local + global              3
7       two images back to back: global; global      2
======  ==========================================  =====

The text model (hidden 64, 2 layers): layer 0 rope with chunked attention (chunks of 8 tokens), dense
MLP; layer 1 NoPE with full attention and attention-temperature tuning (``floor_scale`` 4), MoE (4
experts, top 1, a shared expert). Vision: hidden 32, 2 layers, intermediate 128 = 4 x hidden (the
pixel-shuffled width the adapter MLP takes). Constants are drawn (``seeded_distinct``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import seeded_distinct
from ._batch import right_padded
from ._configs import text_fields, tower_fields

__all__ = [
    "IMAGE_END_TOKEN_ID",
    "IMAGE_SIZE",
    "IMAGE_START_TOKEN_ID",
    "IMAGE_TOKEN_ID",
    "MODEL_TYPE",
    "PATCH_TOKEN_ID",
    "TILES_PER_SAMPLE",
    "TOKENS_PER_TILE",
    "build_batch",
    "build_config",
    "build_model",
    "build_processor",
    "image_tokens",
    "reference_inputs",
]

MODEL_TYPE = "llama4"

PAD_TOKEN_ID = 0
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
IMAGE_START_TOKEN_ID = 3
IMAGE_END_TOKEN_ID = 4
IMAGE_TOKEN_ID = 5  # <|image|>: marks the global tile (no feature)
PATCH_TOKEN_ID = 6  # <|patch|>: the config's image_token_id, one per feature
TILE_X_TOKEN_ID = 7
TILE_Y_TOKEN_ID = 8
_FIRST_TEXT_ID = 10
_VOCAB = 128
IMAGE_SIZE = 32
PATCH_SIZE = 4
TOKENS_PER_TILE = (IMAGE_SIZE // PATCH_SIZE) ** 2 // 4

#: per sample: text runs (ints) and images ``(ratio_h, ratio_w)`` (``(1, 1)``: the global tile only).
_SAMPLES: tuple[tuple[Any, ...], ...] = (
    (3, (1, 2), 4),
    (2, (1, 1), 5),
    (1, (2, 2), 2, (1, 1), 1),
    (4, (1, 1), 2),
    (9,),
    (13,),
    (2, (2, 1), 3),
    (1, (1, 1), (1, 1), 2),
)
TILES_PER_SAMPLE = [3, 1, 6, 1, 0, 0, 3, 2]


def build_config() -> Any:
    """The tiny ``Llama4Config``."""
    from transformers import Llama4Config

    text = text_fields(
        _VOCAB, PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID, intermediate_size=32, intermediate_size_mlp=96, head_dim=16,
        num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layer_interval=2,
        attention_chunk_size=8, floor_scale=4, attn_scale=0.5, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        max_position_embeddings=256,
    )
    vision = tower_fields(
        intermediate_size=128, vision_output_dim=64, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, pixel_shuffle_ratio=0.5,
        projector_input_dim=64, projector_output_dim=64, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    )
    return Llama4Config(
        text_config=text, vision_config=vision, image_token_index=PATCH_TOKEN_ID,
        boi_token_index=IMAGE_START_TOKEN_ID, eoi_token_index=IMAGE_END_TOKEN_ID, pad_token_id=PAD_TOKEN_ID,
    )


def build_model(seed: int = 0) -> torch.nn.Module:
    """The tiny ``Llama4ForConditionalGeneration``, float32, eval mode, seeded (constants drawn)."""
    from transformers import Llama4ForConditionalGeneration

    return seeded_distinct(Llama4ForConditionalGeneration, build_config(), seed)


def image_tokens(ratio_h: int, ratio_w: int, per_tile: int = TOKENS_PER_TILE) -> list[int]:
    """The ids ``Llama4Processor`` writes for an image cut into ``ratio_h x ratio_w`` local tiles (none
    when both are 1) plus its global tile, ``per_tile`` patch tokens each."""
    ids = [IMAGE_START_TOKEN_ID]
    if ratio_h * ratio_w > 1:
        for _ in range(ratio_h):
            for x in range(ratio_w):
                ids += [PATCH_TOKEN_ID] * per_tile
                if x < ratio_w - 1:
                    ids.append(TILE_X_TOKEN_ID)
            ids.append(TILE_Y_TOKEN_ID)
    return ids + [IMAGE_TOKEN_ID] + [PATCH_TOKEN_ID] * per_tile + [IMAGE_END_TOKEN_ID]


def build_batch(seed: int = 0) -> dict[str, Tensor]:
    """``input_ids`` / ``attention_mask`` ``[8, S]`` (right-padded) and ``pixel_values`` ``[16, 3, 32, 32]``."""
    gen = torch.Generator().manual_seed(seed)
    rows: list[list[int]] = []
    tiles = 0
    for sample in _SAMPLES:
        ids = [BOS_TOKEN_ID]
        for part in sample:
            if isinstance(part, int):
                ids += torch.randint(_FIRST_TEXT_ID, _VOCAB, (part,), generator=gen).tolist()
            else:
                ids += image_tokens(*part)
                tiles += (part[0] * part[1] if part[0] * part[1] > 1 else 0) + 1
        rows.append(ids + [EOS_TOKEN_ID])
    input_ids, attention_mask = right_padded(rows, PAD_TOKEN_ID)
    pixel_values = torch.randn(tiles, 3, IMAGE_SIZE, IMAGE_SIZE, generator=gen)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "pixel_values": pixel_values}


def reference_inputs(batch: dict[str, Tensor]) -> dict[str, Any]:
    """Keyword arguments of the model's own full-batch forward."""
    return {k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values")}


def build_processor(image_backend: str = "torchvision") -> Any:
    """A real ``Llama4Processor``: ``Llama4ImageProcessor`` (torchvision only: ``image_backend="pil"`` is
    refused) cutting images into at most 4 tiles of 32 x 32 plus the global tile, patch 4, pixel
    shuffle 0.5 (:data:`TOKENS_PER_TILE` tokens a tile); a word-level tokenizer with the tiny ids
    (``<|begin_of_text|>`` 1, ``<|eot|>`` 2, ``<|header_start|>`` 9, ``<|header_end|>`` 10), Llama 4's
    chat style."""
    import transformers

    from ..word_tokenizer import TokenizerSpec, chat_template, word_tokenizer
    from ._processors import image_processor_class

    images = image_processor_class("Llama4ImageProcessor", image_backend)(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                                                          max_patches=4)
    ids = {"<|finetune_right_pad|>": PAD_TOKEN_ID, "<|begin_of_text|>": BOS_TOKEN_ID, "<|eot|>": EOS_TOKEN_ID,
           "<|image_start|>": IMAGE_START_TOKEN_ID, "<|image_end|>": IMAGE_END_TOKEN_ID, "<|image|>": IMAGE_TOKEN_ID,
           "<|patch|>": PATCH_TOKEN_ID, "<|tile_x_separator|>": TILE_X_TOKEN_ID, "<|tile_y_separator|>": TILE_Y_TOKEN_ID,
           "<|header_start|>": 9, "<|header_end|>": 10}
    tokenizer = word_tokenizer(TokenizerSpec(_VOCAB, ids, pad="<|finetune_right_pad|>", eos="<|eot|>", bos="<|begin_of_text|>"))
    return transformers.Llama4Processor(image_processor=images, tokenizer=tokenizer, patch_size=PATCH_SIZE, pixel_shuffle_ratio=0.5,
                                        chat_template=chat_template("llama4", {"image": "<|image|>"}, bos="<|begin_of_text|>"))
