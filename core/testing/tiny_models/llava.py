"""Tiny seeded LLaVA-1.5 (``llava``): CLIP vision tower, MLP projector, Llama text model.

CLIP sees 16 x 16 images cut into 4 x 4 patches: 16 positions plus its CLS token; the ``"default"``
select strategy drops the CLS, so each image fills :data:`TOKENS_PER_IMAGE` = 16 placeholder tokens
(``image_token_id`` 127). ``pixel_values`` ``[images, 3, 16, 16]`` are complete images in placeholder
order. Sample 1 and sample 6 hold their two images back to back (one run of 32 placeholders), as
``LlavaProcessor`` writes ``<image><image>``: the adapter counts images per sample as placeholders / 16.

======  ======  ===========================
sample  images  layout
======  ======  ===========================
0       1       text, image, text
1       2       text, image image, text
2       1       text, image, text
3       1       text, image, text
4       0       text only
5       0       text only
6       2       text, image, text, image
7       1       text, image, text
======  ======  ===========================

Split in 4 microbatches, microbatch 2 (samples 4 and 5) is text-only. The 2-layer text model is split
one layer per stage; nothing crosses layers besides the hidden states.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import seeded_distinct
from ._batch import right_padded
from ._configs import text_fields, tower_fields

__all__ = [
    "IMAGE_SIZE",
    "IMAGE_TOKEN_ID",
    "MODEL_TYPE",
    "PAD_TOKEN_ID",
    "TOKENS_PER_IMAGE",
    "build_batch",
    "build_config",
    "build_model",
    "build_processor",
    "reference_inputs",
]

MODEL_TYPE = "llava"

VOCAB_SIZE = 128
PAD_TOKEN_ID = 0
IMAGE_TOKEN_ID = VOCAB_SIZE - 1
IMAGE_SIZE = 16
PATCH_SIZE = 4
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2

#: per sample: text runs and images, in token order ("I" one image; "II" two back to back).
_SAMPLES: tuple[tuple[Any, ...], ...] = (
    (3, "I", 5), (2, "II", 3), (4, "I", 6), (2, "I", 4), (9,), (5,), (2, "I", 2, "I", 2), (3, "I", 4),
)


def build_config() -> Any:
    """The tiny ``LlavaConfig`` (CLIP 32 wide, 2 layers; Llama 64 wide, 2 layers)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(**tower_fields(image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=32))
    text = LlamaConfig(**text_fields(VOCAB_SIZE, PAD_TOKEN_ID, max_position_embeddings=256))
    return LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN_ID, vision_feature_layer=-2,
        vision_feature_select_strategy="default", image_seq_length=TOKENS_PER_IMAGE,
    )


def build_model(seed: int = 0) -> torch.nn.Module:
    """The tiny ``LlavaForConditionalGeneration``, float32, eval mode, seeded (constants drawn)."""
    from transformers import LlavaForConditionalGeneration

    return seeded_distinct(LlavaForConditionalGeneration, build_config(), seed)


def build_batch(seed: int = 0) -> dict[str, Tensor]:
    """``input_ids`` / ``attention_mask`` ``[8, S]`` (right-padded), ``pixel_values`` ``[8, 3, 16, 16]``."""
    gen = torch.Generator().manual_seed(seed)
    rows, images = [], 0
    for sample in _SAMPLES:
        ids: list[int] = []
        for part in sample:
            if isinstance(part, int):
                ids += torch.randint(3, IMAGE_TOKEN_ID, (part,), generator=gen).tolist()
            else:
                ids += [IMAGE_TOKEN_ID] * (TOKENS_PER_IMAGE * len(part))
                images += len(part)
        rows.append(ids)
    input_ids, attention_mask = right_padded(rows, PAD_TOKEN_ID)
    pixel_values = torch.randn(images, 3, IMAGE_SIZE, IMAGE_SIZE, generator=gen)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "pixel_values": pixel_values}


def reference_inputs(batch: dict[str, Tensor]) -> dict[str, Any]:
    """Keyword arguments of the model's own full-batch forward."""
    return {k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values")}


def build_processor(image_backend: str = "torchvision") -> Any:
    """A real ``LlavaProcessor``: ``LlavaImageProcessor`` (``...Pil`` with ``image_backend="pil"``)
    resizing to 16 and center-cropping 16 x 16, :data:`TOKENS_PER_IMAGE` tokens an image (CLS dropped);
    a word-level tokenizer (``<pad>`` 0, ``<s>`` 1, ``</s>`` 2, ``<image>`` ``IMAGE_TOKEN_ID``), a plain
    chat template (the role word on its own line)."""
    import transformers

    from ..word_tokenizer import TokenizerSpec, chat_template, word_tokenizer
    from ._processors import image_processor_class

    images = image_processor_class("LlavaImageProcessor", image_backend)(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    ids = {"<pad>": PAD_TOKEN_ID, "<s>": 1, "</s>": 2, "<image>": IMAGE_TOKEN_ID}
    tokenizer = word_tokenizer(TokenizerSpec(VOCAB_SIZE, ids, pad="<pad>", eos="</s>", bos="<s>", attributes={"image_token": "<image>"}))
    return transformers.LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=PATCH_SIZE,
                                       vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                       chat_template=chat_template("plain", {"image": "<image>"}, bos="<s>"))
