"""Tiny seeded InternVL (``internvl``): image tiles and video frames in ONE ``pixel_values``, prompt order.

Media as ``InternVLProcessor`` gives them: ``pixel_values`` ``[rows, 3, 32, 32]`` where an image is
``num_patches`` tile rows (``GotOcr2ImageProcessor``'s crops, then the thumbnail) and a video is one row
per frame, images and videos interleaved in the order the prompt names them (the processor merges
``pixel_values_videos`` into ``pixel_values`` and drops ``num_patches``). Each row gives
:data:`TOKENS_PER_ROW` = (32 / 4)^2 x 0.5^2 = 16 features (InternViT, pixel shuffle, the projector);
the text writes an image as ``<img> <IMG_CONTEXT> * (16 * tiles) </img>`` and a video as
``FrameK: <img> <IMG_CONTEXT> * 16 </img>`` per frame: every placeholder is the image token, so a
sample's rows are its placeholder tokens / 16.

======  ===============================================  ====
sample  media in prompt order                            rows
======  ===============================================  ====
0       image of 3 tiles                                 3
1       image of 1 tile, video of 2 frames               3
2       video of 3 frames                                3
3       image of 2 tiles, image of 1 tile                3
4, 5    text only                                        0
6       image of 5 tiles                                 5
7       video of 2 frames, image of 1 tile               3
======  ===============================================  ====

Vision: hidden 32, 2 layers, image 32, patch 4, layer scale; text: Qwen2, hidden 64, 2 layers, tied
embeddings (InternVL's default). The CLS token, position embeddings (zeros in transformers) and layer
scales (constants) are drawn (``seeded_distinct``).
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
    "ROWS_PER_SAMPLE",
    "TOKENS_PER_ROW",
    "build_batch",
    "build_config",
    "build_model",
    "build_processor",
    "reference_inputs",
]

MODEL_TYPE = "internvl"

PAD_TOKEN_ID = 0
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
IMAGE_START_TOKEN_ID = 3  # <img>
IMAGE_END_TOKEN_ID = 4  # </img>
IMAGE_TOKEN_ID = 5  # <IMG_CONTEXT>
_FIRST_TEXT_ID = 10
_VOCAB = 128
IMAGE_SIZE = 32
PATCH_SIZE = 4
TOKENS_PER_ROW = (IMAGE_SIZE // PATCH_SIZE) ** 2 // 4

#: per sample: text runs (ints), images ``("image", tiles)`` and videos ``("video", frames)``.
_SAMPLES: tuple[tuple[Any, ...], ...] = (
    (3, ("image", 3), 4),
    (2, ("image", 1), 1, ("video", 2), 2),
    (1, ("video", 3), 3),
    (2, ("image", 2), 1, ("image", 1), 2),
    (9,),
    (12,),
    (1, ("image", 5), 1),
    (2, ("video", 2), 1, ("image", 1), 1),
)
ROWS_PER_SAMPLE = [3, 3, 3, 3, 0, 0, 5, 3]


def build_config() -> Any:
    """The tiny ``InternVLConfig`` (InternViT 32 wide, 2 layers; Qwen2 64 wide, 2 layers)."""
    from transformers import InternVLConfig

    vision = tower_fields(image_size=[IMAGE_SIZE, IMAGE_SIZE], patch_size=[PATCH_SIZE, PATCH_SIZE])
    text = text_fields(_VOCAB, PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID, model_type="qwen2", max_position_embeddings=256)
    return InternVLConfig(
        vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN_ID, image_seq_length=TOKENS_PER_ROW,
        downsample_ratio=0.5,
    )


def build_model(seed: int = 0) -> torch.nn.Module:
    """The tiny ``InternVLForConditionalGeneration``, float32, eval mode, seeded (constants drawn)."""
    from transformers import InternVLForConditionalGeneration

    return seeded_distinct(InternVLForConditionalGeneration, build_config(), seed)


def _block(tokens: int) -> list[int]:
    return [IMAGE_START_TOKEN_ID] + [IMAGE_TOKEN_ID] * tokens + [IMAGE_END_TOKEN_ID]


def build_batch(seed: int = 0) -> dict[str, Tensor]:
    """``input_ids`` / ``attention_mask`` ``[8, S]`` (right-padded), ``pixel_values`` ``[23, 3, 32, 32]``
    (tiles and frames in prompt order)."""
    gen = torch.Generator().manual_seed(seed)

    def text(n: int) -> list[int]:
        return torch.randint(_FIRST_TEXT_ID, _VOCAB, (n,), generator=gen).tolist()

    rows: list[list[int]] = []
    n_rows = 0
    for sample in _SAMPLES:
        ids = [BOS_TOKEN_ID]
        for part in sample:
            if isinstance(part, int):
                ids += text(part)
            elif part[0] == "image":
                ids += _block(TOKENS_PER_ROW * part[1])
                n_rows += part[1]
            else:
                for _ in range(part[1]):  # "FrameK: " then the frame's block
                    ids += text(2) + _block(TOKENS_PER_ROW)
                n_rows += part[1]
        rows.append(ids + [EOS_TOKEN_ID])
    input_ids, attention_mask = right_padded(rows, PAD_TOKEN_ID)
    pixel_values = torch.randn(n_rows, 3, IMAGE_SIZE, IMAGE_SIZE, generator=gen)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "pixel_values": pixel_values}


def reference_inputs(batch: dict[str, Tensor]) -> dict[str, Any]:
    """Keyword arguments of the model's own full-batch forward."""
    return {k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values")}


def build_processor(image_backend: str = "torchvision") -> Any:
    """A real ``InternVLProcessor``: ``GotOcr2ImageProcessor`` (``...Pil`` with ``image_backend="pil"``)
    cutting images into at most 4 tiles of 32 x 32 plus the thumbnail, ``InternVLVideoProcessor`` at
    32 x 32 frames (frames as given), :data:`TOKENS_PER_ROW` tokens a row; a word-level tokenizer with
    the tiny ids (``<|im_start|>`` / ``<|im_end|>`` the turns at ``BOS_TOKEN_ID`` / ``EOS_TOKEN_ID``,
    ``<video>`` 6), a chatml chat template (an image is ``<IMG_CONTEXT>``, a video ``<video>``)."""
    import transformers

    from ._processors import image_processor_class, qwen_processor
    from ..word_tokenizer import TokenizerSpec, word_tokenizer

    square = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    images = image_processor_class("GotOcr2ImageProcessor", image_backend)(size=square, crop_to_patches=True, max_patches=4)
    videos = transformers.InternVLVideoProcessor(size=square, do_sample_frames=False)
    ids = {"<|endoftext|>": PAD_TOKEN_ID, "<|im_start|>": BOS_TOKEN_ID, "<|im_end|>": EOS_TOKEN_ID,
           "<img>": IMAGE_START_TOKEN_ID, "</img>": IMAGE_END_TOKEN_ID, "<IMG_CONTEXT>": IMAGE_TOKEN_ID, "<video>": 6}
    attributes = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                  "video_token": "<video>"}
    tokenizer = word_tokenizer(TokenizerSpec(_VOCAB, ids, pad="<|endoftext|>", eos="<|im_end|>", attributes=attributes))
    return qwen_processor("InternVLProcessor", tokenizer=tokenizer, images=images, videos=videos,
                          media={"image": "<IMG_CONTEXT>", "video": "<video>"}, image_seq_length=TOKENS_PER_ROW)
