"""Tiny seeded PaliGemma 2 (``paligemma``): SigLIP vision tower, linear projector, Gemma 2 text model.

SigLIP sees 16 x 16 images cut in 4 x 4 patches: :data:`TOKENS_PER_IMAGE` = 16 image tokens an image
(256 at 224 px in the released models). Gemma 2: 64 wide, 2 layers (one sliding-window layer of
window 16, one global), attention and final logit soft-capping. As ``PaliGemmaProcessor`` writes a
training sample: the sample's image tokens first (several images back to back), ``<bos>``, the
prompt, ``\\n``, then the suffix (the answer) and ``<eos>``. ``token_type_ids`` is 0 on the prefix
(images, ``<bos>``, prompt, ``\\n``: bidirectional attention) and 1 on the suffix (causal); the
prompt lengths differ per sample, so nothing in the ids tells the prefix's end.

======  ======  ======  ======
sample  images  prompt  suffix
======  ======  ======  ======
0       1       4       5
1       2       3       3
2       1       2       6
3       1       6       4
4       0       9       2
5       0       5       7
6       2       2       2
7       1       3       4
======  ======  ======  ======

Split in 4 microbatches, microbatch 2 (samples 4 and 5) is text-only (its prefix is still bidirectional).
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
    "TOKENS_PER_IMAGE",
    "build_batch",
    "build_config",
    "build_model",
    "build_processor",
    "reference_inputs",
]

MODEL_TYPE = "paligemma"

VOCAB_SIZE = 128
PAD_TOKEN_ID = 0
BOS_TOKEN_ID = 2
EOS_TOKEN_ID = 1
NEWLINE_TOKEN_ID = 108 % VOCAB_SIZE + 3
IMAGE_TOKEN_ID = VOCAB_SIZE - 1
IMAGE_SIZE = 16
PATCH_SIZE = 4
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2

#: per sample: (images, prompt tokens, suffix tokens)
SAMPLES: tuple[tuple[int, int, int], ...] = ((1, 4, 5), (2, 3, 3), (1, 2, 6), (1, 6, 4), (0, 9, 2), (0, 5, 7), (2, 2, 2), (1, 3, 4))


def build_config() -> Any:
    """The tiny ``PaliGemmaConfig`` (SigLIP 32 wide; Gemma 2 64 wide, sliding window 16, soft-capping)."""
    from transformers import Gemma2Config, PaliGemmaConfig, SiglipVisionConfig

    vision = SiglipVisionConfig(**tower_fields(image_size=IMAGE_SIZE, patch_size=PATCH_SIZE))
    text = Gemma2Config(**text_fields(
        VOCAB_SIZE, PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID, head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
        max_position_embeddings=256, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
    ))
    return PaliGemmaConfig(
        vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID, projection_dim=64, hidden_size=64,
        vocab_size=VOCAB_SIZE,
    )


def build_model(seed: int = 0) -> torch.nn.Module:
    """The tiny ``PaliGemmaForConditionalGeneration``, float32, eval mode, seeded (constants drawn)."""
    from transformers import PaliGemmaForConditionalGeneration

    return seeded_distinct(PaliGemmaForConditionalGeneration, build_config(), seed)


def build_batch(seed: int = 0) -> dict[str, Tensor]:
    """``input_ids`` / ``attention_mask`` / ``token_type_ids`` ``[8, S]`` (right-padded; padding has type
    1, as the processor pads), ``pixel_values`` ``[8, 3, 16, 16]``."""
    gen = torch.Generator().manual_seed(seed)

    def text(n: int) -> list[int]:
        return torch.randint(3, IMAGE_TOKEN_ID, (n,), generator=gen).tolist()

    rows, types = [], []
    for images, prompt, suffix in SAMPLES:
        prefix = [IMAGE_TOKEN_ID] * (TOKENS_PER_IMAGE * images) + [BOS_TOKEN_ID] + text(prompt) + [NEWLINE_TOKEN_ID]
        answer = text(suffix) + [EOS_TOKEN_ID]
        rows.append(prefix + answer)
        types.append([0] * len(prefix) + [1] * len(answer))
    input_ids, attention_mask = right_padded(rows, PAD_TOKEN_ID)
    token_type_ids, _ = right_padded(types, 1)  # padding: 1 (causal suffix), as the processor pads
    pixel_values = torch.randn(sum(s[0] for s in SAMPLES), 3, IMAGE_SIZE, IMAGE_SIZE, generator=gen)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids,
            "pixel_values": pixel_values}


def reference_inputs(batch: dict[str, Tensor]) -> dict[str, Any]:
    """Keyword arguments of the model's own full-batch forward (with the token types: its prefix-LM mask)."""
    return {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids", "pixel_values")}


def build_processor(image_backend: str = "torchvision") -> Any:
    """A real ``PaliGemmaProcessor``: ``SiglipImageProcessor`` (``...Pil`` with ``image_backend="pil"``)
    at 16 x 16, :data:`TOKENS_PER_IMAGE` tokens an image (the processor puts a sample's images first,
    then ``<bos>``, the prompt and ``\\n``; a ``suffix=`` call argument is the answer, token type 1); a
    word-level tokenizer with the tiny ids (``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<image>``
    ``IMAGE_TOKEN_ID``), a plain chat template whose image items write nothing (the processor places
    the images). The processor adds PaliGemma's ``<loc....>`` / ``<seg...>`` words past the tiny
    vocabulary; a prompt must not use them."""
    import transformers

    from ..word_tokenizer import TokenizerSpec, chat_template, word_tokenizer
    from ._processors import image_processor_class

    images = image_processor_class("SiglipImageProcessor", image_backend)(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    images.image_seq_length = TOKENS_PER_IMAGE
    ids = {"<pad>": PAD_TOKEN_ID, "<eos>": EOS_TOKEN_ID, "<bos>": BOS_TOKEN_ID, "<image>": IMAGE_TOKEN_ID}
    tokenizer = word_tokenizer(TokenizerSpec(VOCAB_SIZE, ids, pad="<pad>", eos="<eos>", bos="<bos>",
                                             attributes={"image_token": "<image>"}))
    return transformers.PaliGemmaProcessor(image_processor=images, tokenizer=tokenizer,
                                           chat_template=chat_template("plain", {"image": ""}))
