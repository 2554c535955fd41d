"""Tiny seeded Qwen2.5-VL model and a mixed image + video batch.

Qwen2.5-VL stages flat patch rows: every image (or video) is cut into ``temporal_patch x patch x
patch`` pixel cubes, each flattened to one row of ``D = C * temporal_patch * patch * patch`` values,
and the rows of all images are concatenated on axis 0: ``pixel_values`` ``[patches, D]`` with
``image_grid_thw`` ``[images, 3]`` holding each image's ``(t, h, w)`` patch grid. Videos do the same
in ``pixel_values_videos`` / ``video_grid_thw``. The vision tower merges ``2 x 2`` patch blocks, so an
image or video contributes ``t * h * w / 4`` placeholder tokens, written as the processor writes them:
``VISION_START, IMAGE * n, VISION_END`` (``VIDEO`` for a video).

Tiny config: ``D = 3 * 2 * 4 * 4 = 96``; text hidden 64, vocabulary 128.

Batch layout (``build_batch``), 8 samples right-padded to ``S = SEQ_LEN = 28`` with ``PAD_TOKEN_ID``;
media in placeholder order, grids ``(t, h, w)`` in patches, then patch rows -> placeholder tokens::

    sample  media
    0       image (1, 4, 4) 16 -> 4
    1       image (1, 4, 6) 24 -> 6, image (1, 2, 2) 4 -> 1
    2       video (2, 4, 4) 32 -> 8
    3       image (1, 6, 4) 24 -> 6, video (2, 2, 4) 16 -> 4
    4       text only
    5       text only
    6       image (1, 8, 8) 64 -> 16
    7       image (1, 2, 4) 8 -> 2, video (2, 4, 2) 16 -> 4, image (1, 4, 2) 8 -> 2

That is 7 images (148 patch rows, 37 tokens) and 3 videos (64 patch rows, 16 tokens). Split in 4
microbatches: microbatch 0 has images only, 1 and 3 have images and videos, 2 (samples 4 and 5) is
text-only. Every sample starts with ``BOS`` and ends with ``EOS``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import seeded
from ._configs import grid_tower_fields, text_fields
from ._qwen import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    IMAGE_TOKEN_ID,
    PAD_TOKEN_ID,
    PROCESSOR_TOKEN_IDS,
    VIDEO_TOKEN_ID,
    VISION_END_TOKEN_ID,
    VISION_START_TOKEN_ID,
    VOCAB,
    grid_batch,
    grid_reference_inputs,
)

__all__ = [
    "BOS_TOKEN_ID",
    "EOS_TOKEN_ID",
    "IMAGE_TOKEN_ID",
    "MODEL_TYPE",
    "PAD_TOKEN_ID",
    "PATCH_DIM",
    "SAMPLES",
    "SEQ_LEN",
    "VIDEO_TOKEN_ID",
    "VISION_END_TOKEN_ID",
    "VISION_START_TOKEN_ID",
    "build_batch",
    "build_config",
    "build_model",
    "build_processor",
    "reference_inputs",
]

MODEL_TYPE = "qwen2_5_vl"

CHANNELS = 3
PATCH_SIZE = 4
TEMPORAL_PATCH_SIZE = 2
MERGE = 2
PATCH_DIM = CHANNELS * TEMPORAL_PATCH_SIZE * PATCH_SIZE * PATCH_SIZE
SEQ_LEN = 28

#: per sample, its sequence: an int is a run of that many text tokens, ``("image", (t, h, w))`` or
#: ``("video", (t, h, w))`` a media block.
SAMPLES: tuple[tuple[Any, ...], ...] = (
    (3, ("image", (1, 4, 4)), 4),
    (2, ("image", (1, 4, 6)), 3, ("image", (1, 2, 2)), 2),
    (4, ("video", (2, 4, 4)), 5),
    (1, ("image", (1, 6, 4)), 2, ("video", (2, 2, 4)), 3),
    (9,),
    (14,),
    (2, ("image", (1, 8, 8)), 6),
    (1, ("image", (1, 2, 4)), 1, ("video", (2, 4, 2)), 2, ("image", (1, 4, 2)), 1),
)


def build_config() -> Any:
    """The tiny :class:`~transformers.Qwen2_5_VLConfig` (text hidden 64, vision hidden 32)."""
    from transformers import Qwen2_5_VLConfig

    # mrope_section sums to head_dim / 2 = 64 / 4 / 2 = 8.
    text_config = text_fields(
        VOCAB, PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]},
    )
    vision_config = grid_tower_fields(
        in_channels=CHANNELS, patch_size=PATCH_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE, spatial_merge_size=MERGE,
        # 16 pixels = 2 merged units of 2 x 4-pixel patches: the 8x8 image spans several windows.
        window_size=16, out_hidden_size=64, fullatt_block_indexes=[1],
    )
    return Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_TOKEN_ID,
        vision_end_token_id=VISION_END_TOKEN_ID,
    )


def build_model(seed: int = 0) -> torch.nn.Module:
    """A :class:`~transformers.Qwen2_5_VLForConditionalGeneration`, float32, eval mode, seeded."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    return seeded(Qwen2_5_VLForConditionalGeneration, build_config(), seed)


def build_batch(seed: int = 0) -> dict[str, Tensor]:
    """The processor-style batch described in the module docstring, drawn from ``seed``.

    Keys: ``input_ids`` / ``attention_mask`` ``[8, SEQ_LEN]``, ``pixel_values`` ``[148, 96]``,
    ``image_grid_thw`` ``[7, 3]``, ``pixel_values_videos`` ``[64, 96]``, ``video_grid_thw`` ``[3, 3]``.
    """
    return grid_batch(SAMPLES, seed, family=MODEL_TYPE, patch_dim=PATCH_DIM, merge=MERGE, video_steps=False, seq_len=SEQ_LEN)


def reference_inputs(batch: dict[str, Tensor]) -> dict[str, Any]:
    """Keyword arguments of the model's own full-batch forward on ``batch``.

    Adds ``mm_token_type_ids`` (text 0, image 1, video 2): without it the model silently falls back to
    1-D positions instead of mrope.
    """
    return grid_reference_inputs(batch)


#: the tiny processor's image and video sizes: 8 to 32 pixels a side (multiples of patch x merge = 8).
MIN_PIXELS = 8 * 8
MAX_PIXELS = 32 * 32


def build_processor(image_backend: str = "torchvision") -> Any:
    """A real ``Qwen2_5_VLProcessor``: ``Qwen2VLImageProcessor`` (``...Pil`` with ``image_backend="pil"``)
    and ``Qwen2VLVideoProcessor`` at patch 4, temporal patch 2, merge 2, 64..1024 pixels a frame; a
    word-level tokenizer with the tiny ids (``<|im_start|>`` is ``BOS_TOKEN_ID``, ``<|im_end|>``
    ``EOS_TOKEN_ID``, ``<|endoftext|>`` ``PAD_TOKEN_ID``); a chatml chat template."""
    from ._processors import qwen_vl_processor

    return qwen_vl_processor("Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor", image_backend, vocab_size=VOCAB,
                             token_ids=PROCESSOR_TOKEN_IDS, sizes=(PATCH_SIZE, TEMPORAL_PATCH_SIZE, MERGE),
                             pixels=(MIN_PIXELS, MAX_PIXELS))
