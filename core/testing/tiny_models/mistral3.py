"""Tiny seeded Mistral 3 (``mistral3``): Pixtral vision tower, patch merger, Mistral text model.

Geometry of the tiny model: Pixtral cuts an image into 8 x 8 patches (at most 64 x 64 pixels, 8 x 8
patches); the projector's patch merger joins 2 x 2 patches (``spatial_merge_size = 2``), so an image
of true size ``H x W`` (multiples of 16, as the processor resizes them) gives ``(H / 16) x (W / 16)``
image tokens. The text of one image, as ``PixtralProcessor`` writes it: per row of merged patches
``[IMG] * (W / 16)`` then ``[IMG_BREAK]``, with ``[IMG_END]`` instead of the last break. The token ids
are Mistral's tokenizer's: ``[IMG]`` 10 (``config.image_token_id``), ``[IMG_BREAK]`` 12, ``[IMG_END]`` 13
(the config does not hold the last two).

``pixel_values`` are the images padded with zeros to the batch's largest, ``[images, 3, 64, 64]``;
``image_sizes`` ``[images, 2]`` their true (height, width). The batch (same layout for every seed):

======  ==========================  =====  ============
sample  image sizes                 rows   image tokens
======  ==========================  =====  ============
0       (32, 48)                    1      6
1       (16, 16), (64, 32)          2      1 + 8
2       (48, 64)                    1      12
3       (32, 32)                    1      4
4       text only                   0      0
5       text only                   0      0
6       (16, 64), (32, 16)          2      4 + 2
7       (64, 64)                    1      16
======  ==========================  =====  ============

Split in 4 microbatches the microbatches hold 3, 2, 0 and 3 images.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

from . import seeded
from ._configs import pixtral_tower_fields, text_fields
from ._pixtral import PixtralLayout, pixtral_batch
from ._pixtral import image_ids as _image_ids

__all__ = [
    "IMAGE_BREAK_TOKEN_ID",
    "IMAGE_END_TOKEN_ID",
    "IMAGE_TOKEN_ID",
    "MAX_SIZE",
    "MERGE",
    "MODEL_TYPE",
    "PAD_TOKEN_ID",
    "PATCH_SIZE",
    "SAMPLE_IMAGE_SIZES",
    "build_batch",
    "build_config",
    "build_model",
    "build_processor",
    "image_ids",
    "reference_inputs",
    "tokens_per_image",
]

MODEL_TYPE = "mistral3"

VOCAB_SIZE = 128
PAD_TOKEN_ID = 0
IMAGE_TOKEN_ID = 10
IMAGE_BREAK_TOKEN_ID = 12
IMAGE_END_TOKEN_ID = 13
_FIRST_TEXT_ID = 14
PATCH_SIZE = 8
MERGE = 2
MAX_SIZE = 64

#: per sample, the true (height, width) of each of its images, in token order.
SAMPLE_IMAGE_SIZES: tuple[tuple[tuple[int, int], ...], ...] = (
    ((32, 48),),
    ((16, 16), (64, 32)),
    ((48, 64),),
    ((32, 32),),
    (),
    (),
    ((16, 64), (32, 16)),
    ((64, 64),),
)

_PREFIX = (3, 2, 5, 2, 9, 6, 2, 3)
_SUFFIX = (4, 3, 6, 4, 0, 0, 2, 5)


def build_config() -> Mistral3Config:
    """The tiny Mistral 3 config (Pixtral 32 wide, Mistral text 64 wide, 2 layers each)."""
    vision = PixtralVisionConfig(**pixtral_tower_fields(MAX_SIZE, PATCH_SIZE))
    text = MistralConfig(**text_fields(VOCAB_SIZE, PAD_TOKEN_ID, head_dim=16, max_position_embeddings=512, sliding_window=None))
    return Mistral3Config(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE_TOKEN_ID,
        spatial_merge_size=MERGE,
        vision_feature_layer=-1,
    )


def build_model(seed: int = 0) -> Mistral3ForConditionalGeneration:
    """The tiny model, float32, eval mode, weights drawn after ``torch.manual_seed(seed)``."""
    return seeded(Mistral3ForConditionalGeneration, build_config(), seed)


def tokens_per_image(size: tuple[int, int]) -> int:
    """``[IMG]`` tokens (= feature rows) of an image of true size ``(height, width)``."""
    return (size[0] // (PATCH_SIZE * MERGE)) * (size[1] // (PATCH_SIZE * MERGE))


_LAYOUT = PixtralLayout(
    step=PATCH_SIZE * MERGE, max_size=MAX_SIZE, vocab=VOCAB_SIZE, first_text_id=_FIRST_TEXT_ID,
    image=IMAGE_TOKEN_ID, image_break=IMAGE_BREAK_TOKEN_ID, image_end=IMAGE_END_TOKEN_ID, pad=PAD_TOKEN_ID,
    sizes=SAMPLE_IMAGE_SIZES, prefix=_PREFIX, suffix=_SUFFIX,
)


def image_ids(size: tuple[int, int]) -> list[int]:
    """The tokens of one image as ``PixtralProcessor`` writes them (rows, breaks, end)."""
    return _image_ids(_LAYOUT, size)


def build_batch(seed: int = 0) -> dict[str, Tensor]:
    """A processor-style batch of 8 samples (layout in the module docstring).

    Keys: ``input_ids`` and ``attention_mask`` ``[8, S]``, ``pixel_values`` ``[8, 3, 64, 64]`` float32
    (zero past each image's true size), ``image_sizes`` ``[8, 2]`` int64.
    """
    return pixtral_batch(_LAYOUT, seed)


def reference_inputs(batch: dict[str, Tensor]) -> dict[str, Any]:
    """Keyword arguments of the model's own full-batch forward."""
    return {k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values", "image_sizes")}


def build_processor(image_backend: str = "torchvision") -> Any:
    """A real ``PixtralProcessor`` (``PixtralImageProcessor`` or ``...Pil``) at vision patch 8, merge 2,
    images of at most 64 pixels a side: :func:`ppmedia.testing.tiny_models._pixtral.pixtral_processor`."""
    from ._pixtral import pixtral_processor

    return pixtral_processor(_LAYOUT, PATCH_SIZE, MERGE, image_backend)
