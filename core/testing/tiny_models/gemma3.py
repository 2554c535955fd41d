"""Tiny seeded Gemma 3 (``gemma3``): SigLIP vision tower, average-pool projector, Gemma 3 text model.

Geometry of the tiny model: SigLIP sees 32 x 32 images cut in 8 x 8 patches (a 4 x 4 patch grid); the
projector average-pools them to :data:`TOKENS_PER_IMAGE` = ``mm_tokens_per_image`` = 4 feature rows
per image, whatever the image showed. Every ``pixel_values`` row is one complete image
``[3, 32, 32]`` and one image block in the text::

    <boi> <image> * 4 <eoi>

Pan-and-scan (``Gemma3ImageProcessor(do_pan_and_scan=True)``) adds crops of an image as further rows
right after it, each with its own block; the model treats a crop exactly as an image. The processor
drops the ``num_crops`` it computed, so the rows of a sample are counted from its tokens (image
tokens / ``mm_tokens_per_image``, :meth:`ppmedia.adapters.gemma3.Gemma3Adapter.media_per_sample`).

Image tokens attend to the other tokens of their own block in both directions (``token_type_ids``,
1 at image tokens); everything else is causal. Layer 0 is a sliding-window layer (window 8), layer 1
full attention, so both of the model's masks are exercised.

The batch (the same layout for every seed; the seed draws the pixels and the text tokens):

======  ====================  =====  ============
sample  images (+ crops)      rows   image tokens
======  ====================  =====  ============
0       1                     1      4
1       1 (+2 crops), 1       4      16
2       1                     1      4
3       1 (+3 crops)          4      16
4       text only             0      0
5       text only             0      0
6       2                     2      8
7       1 (+2 crops)          3      12
======  ====================  =====  ============

``pixel_values`` is ``[15, 3, 32, 32]``; ``input_ids`` ``[8, S]`` right-padded with the pad token 0;
``token_type_ids`` ``[8, S]`` as the processor writes them. Split in 4 microbatches the microbatches
hold 5, 5, 0 and 5 rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

from . import seeded
from ._batch import right_padded
from ._configs import text_fields, tower_fields

__all__ = [
    "BOI_TOKEN_ID",
    "EOI_TOKEN_ID",
    "IMAGE_SIZE",
    "IMAGE_TOKEN_ID",
    "MODEL_TYPE",
    "PAD_TOKEN_ID",
    "ROWS_PER_IMAGE",
    "TOKENS_PER_IMAGE",
    "build_batch",
    "build_config",
    "build_model",
    "build_processor",
    "image_block_ids",
    "reference_inputs",
]

MODEL_TYPE = "gemma3"

VOCAB_SIZE = 128
PAD_TOKEN_ID = 0
BOI_TOKEN_ID = 125
EOI_TOKEN_ID = 126
IMAGE_TOKEN_ID = 127
_FIRST_TEXT_ID = 3
IMAGE_SIZE = 32
PATCH_SIZE = 8
TOKENS_PER_IMAGE = 4

#: per sample, ``1 + crops`` of each of its images (each entry: one image and its pan-and-scan crops).
ROWS_PER_IMAGE: tuple[tuple[int, ...], ...] = ((1,), (3, 1), (1,), (4,), (), (), (1, 1), (3,))

_PREFIX = (3, 2, 5, 2, 9, 6, 2, 3)
_SUFFIX = (4, 3, 6, 4, 0, 0, 2, 5)


def build_config() -> Gemma3Config:
    """The tiny Gemma 3 config (SigLIP 32 wide, Gemma 3 text 64 wide, 2 layers each)."""
    vision = SiglipVisionConfig(**tower_fields(image_size=IMAGE_SIZE, patch_size=PATCH_SIZE))
    text = Gemma3TextConfig(**text_fields(
        VOCAB_SIZE, PAD_TOKEN_ID, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=512,
    ))
    return Gemma3Config(
        vision_config=vision,
        text_config=text,
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        image_token_index=IMAGE_TOKEN_ID,
        boi_token_index=BOI_TOKEN_ID,
        eoi_token_index=EOI_TOKEN_ID,
    )


def build_model(seed: int = 0) -> Gemma3ForConditionalGeneration:
    """The tiny model, float32, eval mode, weights drawn after ``torch.manual_seed(seed)``.

    transformers initialises the projector weight ``mm_input_projection_weight`` to zeros (checkpoints
    overwrite it); then every image would give the same features and no test could tell images
    apart, so it is drawn from the seed too, as are the RMSNorm weights (zeros = scale 1 otherwise).
    """
    model = seeded(Gemma3ForConditionalGeneration, build_config(), seed)
    with torch.no_grad():
        projector: Any = getattr(model.model, "multi_modal_projector")
        projector.mm_input_projection_weight.normal_(0.0, 0.2)
        for name, param in model.named_parameters():
            if "norm" in name and param.dim() == 1 and "vision_tower" not in name:
                param.normal_(0.0, 0.1)
    return model


def image_block_ids() -> list[int]:
    """The tokens of one image (or crop) block: ``<boi> <image> * 4 <eoi>``."""
    return [BOI_TOKEN_ID] + [IMAGE_TOKEN_ID] * TOKENS_PER_IMAGE + [EOI_TOKEN_ID]


def build_batch(seed: int = 0) -> dict[str, Tensor]:
    """A processor-style batch of 8 samples (layout in the module docstring).

    Keys: ``input_ids``, ``attention_mask`` and ``token_type_ids`` ``[8, S]``, ``pixel_values``
    ``[15, 3, 32, 32]`` float32 (one row per image or crop, in token order).
    """
    gen = torch.Generator().manual_seed(seed)

    def text(n: int) -> list[int]:
        return torch.randint(_FIRST_TEXT_ID, BOI_TOKEN_ID, (n,), generator=gen).tolist()

    rows: list[list[int]] = []
    for i, images in enumerate(ROWS_PER_IMAGE):
        ids = text(_PREFIX[i])
        for j, blocks in enumerate(images):
            if j:
                ids += text(2)
            for b in range(blocks):  # the image, then its crops, as the processor writes them
                ids += image_block_ids() + (text(1) if b + 1 < blocks else [])
        ids += text(_SUFFIX[i])
        rows.append(ids)
    input_ids, attention_mask = right_padded(rows, PAD_TOKEN_ID)
    n_rows = sum(sum(images) for images in ROWS_PER_IMAGE)
    pixel_values = torch.randn(n_rows, 3, IMAGE_SIZE, IMAGE_SIZE, generator=gen)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "token_type_ids": (input_ids == IMAGE_TOKEN_ID).to(torch.int64),
        "pixel_values": pixel_values,
    }


def reference_inputs(batch: dict[str, Tensor]) -> dict[str, Any]:
    """Keyword arguments of the model's own full-batch forward (with ``token_type_ids``)."""
    return {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids", "pixel_values")}


def build_processor(image_backend: str = "torchvision") -> Any:
    """A real ``Gemma3Processor``: ``Gemma3ImageProcessor`` (``...Pil`` with ``image_backend="pil"``) at
    the tiny image size (32), ``TOKENS_PER_IMAGE`` tokens an image; a word-level tokenizer (``<pad>`` 0,
    ``<bos>`` 1, ``<eos>`` 2, ``<start_of_turn>`` 3, ``<end_of_turn>`` 4, ``<start_of_image>``
    ``BOI_TOKEN_ID``, ``<end_of_image>`` ``EOI_TOKEN_ID``, ``<image_soft_token>`` ``IMAGE_TOKEN_ID``),
    Gemma's chat template. Pan-and-scan is a call argument (``do_pan_and_scan=True`` with
    ``pan_and_scan_min_crop_size``, ``..._max_num_crops``, ``..._min_ratio_to_activate``)."""
    import transformers

    from ..word_tokenizer import TokenizerSpec, chat_template, word_tokenizer
    from ._processors import image_processor_class

    images = image_processor_class("Gemma3ImageProcessor", image_backend)(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    ids = {"<pad>": PAD_TOKEN_ID, "<bos>": 1, "<eos>": 2, "<start_of_turn>": 3, "<end_of_turn>": 4,
           "<start_of_image>": BOI_TOKEN_ID, "<end_of_image>": EOI_TOKEN_ID, "<image_soft_token>": IMAGE_TOKEN_ID}
    attributes = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer = word_tokenizer(TokenizerSpec(VOCAB_SIZE, ids, pad="<pad>", eos="<eos>", bos="<bos>", attributes=attributes))
    template = chat_template("gemma", {"image": "<start_of_image>"}, bos="<bos>", role_map={"assistant": "model"})
    return transformers.Gemma3Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=TOKENS_PER_IMAGE,
                                        chat_template=template)
