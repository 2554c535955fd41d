"""Tiny seeded LLaVA-NeXT (``llava_next``): CLIP vision tower, Llama text model, anyres crops.

Geometry of the tiny model: the vision tower sees 16x16 crops cut in 4x4 patches, so every crop gives
``P * P = 16`` feature rows (the CLS row is dropped, ``vision_feature_select_strategy="default"``).
The pinpoints ``[[16, 32], [32, 16], [32, 32]]`` give a 1x2, 2x1 or 2x2 grid of crops, so an image has
``1 + grid`` crops (3 or 5) and ``16 + rows * (cols + 1)`` tokens, where ``rows x cols`` is the grid's
feature map after the model strips the letterbox padding of the original aspect ratio (one
``image_newline`` row per feature row).

The batch (the same layout for every seed; the seed draws the pixels and the text tokens):

======  ======  ===========  =====  ======
sample  image   image_sizes  crops  tokens
======  ======  ===========  =====  ======
0       0       (10, 30)     3      34
1       1       (30, 12)     3      56
1       2       (24, 24)     5      88
2       3       (7, 5)       3      28
3       4       (33, 17)     5      56
4       -       text only
5       -       text only
6       5       (16, 16)     3      36
6       6       (9, 21)      3      52
7       7       (20, 20)     5      88
======  ======  ===========  =====  ======

``pixel_values`` is ``[8, 5, 3, 16, 16]`` (images x max crops), zero past each image's own crops;
``input_ids`` is ``[8, 150]`` (sample 1 is the longest), right-padded with the pad token 0. Split in 4
microbatches (``tensor_split`` rows 2, 2, 2, 2) the microbatches hold 3, 2, 0 and 3 images. Each image
is a contiguous run of image tokens; two images of one sample are separated by one text token.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig, LlavaNextForConditionalGeneration
from transformers.models.llava_next.modeling_llava_next import (
    get_anyres_image_grid_shape,
    image_size_to_num_patches,
    unpad_image,
)

from . import seeded
from ._batch import right_padded
from ._configs import text_fields, tower_fields

__all__ = [
    "IMAGES_PER_SAMPLE",
    "IMAGE_TOKEN_ID",
    "MODEL_TYPE",
    "PAD_TOKEN_ID",
    "SAMPLE_IMAGE_SIZES",
    "build_batch",
    "build_config",
    "build_model",
    "build_processor",
    "crops_per_image",
    "reference_inputs",
    "tokens_per_image",
]

MODEL_TYPE = "llava_next"

VOCAB_SIZE = 128
PAD_TOKEN_ID = 0
IMAGE_TOKEN_ID = VOCAB_SIZE - 1
CROP_SIZE = 16
PATCH_SIZE = 4
GRID_PINPOINTS = [[16, 32], [32, 16], [32, 32]]

#: per sample, the original (height, width) of each of its images, in placeholder order.
SAMPLE_IMAGE_SIZES: tuple[tuple[tuple[int, int], ...], ...] = (
    ((10, 30),),
    ((30, 12), (24, 24)),
    ((7, 5),),
    ((33, 17),),
    (),
    (),
    ((16, 16), (9, 21)),
    ((20, 20),),
)
IMAGES_PER_SAMPLE: tuple[int, ...] = tuple(len(sizes) for sizes in SAMPLE_IMAGE_SIZES)

# text tokens before the first image, between two images, and after the last image (or the whole
# text of a text-only sample); chosen so samples differ in length and some need padding.
_PREFIX = (3, 2, 4, 2, 9, 5, 2, 3)
_SEPARATOR = 1
_SUFFIX = (5, 3, 6, 4, 0, 0, 2, 4)


def build_config() -> LlavaNextConfig:
    """The tiny LLaVA-NeXT config (CLIP vision 32 wide, Llama text 64 wide, 2 layers each)."""
    vision = CLIPVisionConfig(**tower_fields(image_size=CROP_SIZE, patch_size=PATCH_SIZE, num_channels=3, projection_dim=32))
    text = LlamaConfig(**text_fields(VOCAB_SIZE, PAD_TOKEN_ID, max_position_embeddings=512))
    return LlavaNextConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE_TOKEN_ID,
        image_grid_pinpoints=[list(p) for p in GRID_PINPOINTS],
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        image_seq_length=(CROP_SIZE // PATCH_SIZE) ** 2,
    )


def build_model(seed: int = 0) -> LlavaNextForConditionalGeneration:
    """The tiny model, float32, eval mode, weights drawn after ``torch.manual_seed(seed)``."""
    return seeded(LlavaNextForConditionalGeneration, build_config(), seed)


def crops_per_image(image_size: tuple[int, int]) -> int:
    """Crops of one image (base crop + anyres grid), by the model's own ``image_size_to_num_patches``."""
    return image_size_to_num_patches(list(image_size), GRID_PINPOINTS, CROP_SIZE)


def tokens_per_image(image_size: tuple[int, int]) -> int:
    """Image tokens of one image, by the model's own grid and unpadding functions.

    ``P * P`` rows of the base crop, then the unpadded ``rows x cols`` grid feature map with one newline
    per row: ``P * P + rows * (cols + 1)``.
    """
    side = CROP_SIZE // PATCH_SIZE
    grid_h, grid_w = get_anyres_image_grid_shape(list(image_size), GRID_PINPOINTS, CROP_SIZE)
    rows, cols = unpad_image(torch.empty(1, grid_h * side, grid_w * side), list(image_size)).shape[1:]
    return side * side + rows * (cols + 1)


def build_batch(seed: int = 0) -> dict[str, Tensor]:
    """A processor-style batch of 8 samples (layout in the module docstring).

    Keys: ``input_ids`` and ``attention_mask`` ``[8, S]`` (right-padded with :data:`PAD_TOKEN_ID`),
    ``pixel_values`` ``[images, max_crops, 3, 16, 16]`` float32 zero-padded past each image's crops,
    ``image_sizes`` ``[images, 2]`` int64 original (height, width).
    """
    gen = torch.Generator().manual_seed(seed)

    def text(n: int) -> list[int]:
        # ids 3..IMAGE_TOKEN_ID-1: never the pad, bos, eos or image token
        return torch.randint(3, IMAGE_TOKEN_ID, (n,), generator=gen).tolist()

    rows: list[list[int]] = []
    for i, sizes in enumerate(SAMPLE_IMAGE_SIZES):
        ids = text(_PREFIX[i])
        for j, size in enumerate(sizes):
            if j:
                ids += text(_SEPARATOR)
            ids += [IMAGE_TOKEN_ID] * tokens_per_image(size)
        ids += text(_SUFFIX[i])
        rows.append(ids)
    input_ids, attention_mask = right_padded(rows, PAD_TOKEN_ID)

    all_sizes = [size for sizes in SAMPLE_IMAGE_SIZES for size in sizes]
    crops = [crops_per_image(size) for size in all_sizes]
    pixel_values = torch.zeros(len(all_sizes), max(crops), 3, CROP_SIZE, CROP_SIZE)
    for k, n in enumerate(crops):
        pixel_values[k, :n] = torch.randn(n, 3, CROP_SIZE, CROP_SIZE, generator=gen)
    image_sizes = torch.tensor(all_sizes, dtype=torch.int64)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "pixel_values": pixel_values,
        "image_sizes": image_sizes,
    }


def reference_inputs(batch: dict[str, Tensor]) -> dict[str, Any]:
    """Keyword arguments of the model's own full-batch forward."""
    return {k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values", "image_sizes")}


def build_processor(image_backend: str = "torchvision") -> Any:
    """A real ``LlavaNextProcessor``: ``LlavaNextImageProcessor`` (``...Pil`` with
    ``image_backend="pil"``) with the tiny crop size (16), shortest edge 16 and pinpoints; a word-level
    tokenizer (``<pad>`` 0, ``<s>`` 1, ``</s>`` 2, ``<image>`` ``IMAGE_TOKEN_ID``; ``[INST]`` 3,
    ``[/INST]`` 4), Mistral's ``[INST] ... [/INST]`` chat template."""
    import transformers

    from ..word_tokenizer import TokenizerSpec, chat_template, word_tokenizer
    from ._processors import image_processor_class

    images = image_processor_class("LlavaNextImageProcessor", image_backend)(
        size={"shortest_edge": CROP_SIZE}, crop_size={"height": CROP_SIZE, "width": CROP_SIZE},
        image_grid_pinpoints=[list(p) for p in GRID_PINPOINTS],
    )
    ids = {"<pad>": PAD_TOKEN_ID, "<s>": 1, "</s>": 2, "[INST]": 3, "[/INST]": 4, "<image>": IMAGE_TOKEN_ID}
    tokenizer = word_tokenizer(TokenizerSpec(VOCAB_SIZE, ids, pad="<pad>", eos="</s>", bos="<s>", attributes={"image_token": "<image>"}))
    return transformers.LlavaNextProcessor(
        image_processor=images, tokenizer=tokenizer, patch_size=PATCH_SIZE, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=chat_template("inst", {"image": "<image>\n"}, bos="<s>"),
    )
