"""Tiny seeded MiniMax-M3-VL (``minimax_m3_vl``): Qwen-style flat patch rows, video chunks, a text model
with sparse (lightning-indexer) attention on every layer.

Media as the MiniMax-M3 processors give them: ``pixel_values`` ``[patches, D]`` (``D = 3 * 2 * 8 * 8 =
384``) with ``image_grid_thw`` ``[images, 3]``; videos in ``pixel_values_videos`` with one
``video_grid_thw`` row per **chunk** (the video processor cuts a video into chunks of at most
``vision_segment_max_frames`` temporal steps, ``num_chunks_per_video`` ``[videos]`` rows each). A grid row
``(t, h, w)`` gives ``t * h * w / 4`` features; the text writes an image as ``VISION_START, IMAGE * n,
VISION_END`` and a video as one such block per temporal step (``h * w / 4`` video tokens), each after a
two-token timestamp. ppmedia stages one grid row per video (a chunk), assigned to samples by its blocks.

The text model (hidden 64, 2 layers, both ``minimax_m3_sparse``: ``index_block_size`` 4, the top 2 key
blocks and the local one) reads the 1-D positions in every layer's indexer; they are the language
model's own default (``arange(S)``), which each stage computes itself. Layer 0 dense MLP, layer 1 MoE
(4 experts, 2 per token). The Gemma-style norm weights (``1 + w``, initialised to 0) are drawn.

======  =======================================================  ==================
sample  media (t, h, w) -> tokens                                grid rows (chunks)
======  =======================================================  ==================
0       image (1, 4, 4) -> 4                                     1
1       image (1, 4, 6) -> 6, image (1, 2, 2) -> 1 back to back  2
2       video of 3 steps: chunks (2, 4, 4), (1, 4, 4) -> 3 x 4   2 (one video)
3       image (1, 6, 4) -> 6, video (1, 2, 4) -> 1 x 2           1 + 1
4, 5    text only                                                0
6       image (1, 8, 8) -> 16, video chunks (2, 2, 2) x 2 -> 4x1 1 + 2 (one video)
7       image (1, 2, 4) -> 2, video (2, 4, 2) -> 2 x 2,          2 + 1
        image (1, 4, 2) -> 2
======  =======================================================  ==================
"""

from __future__ import annotations

from typing import Any

import torch

from . import seeded_distinct
from ._configs import text_fields, tower_fields
from ._qwen import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    IMAGE_TOKEN_ID,
    PAD_TOKEN_ID,
    VIDEO_TOKEN_ID,
    VISION_END_TOKEN_ID,
    VISION_START_TOKEN_ID,
    VOCAB,
    grid_batch,
)

__all__ = [
    "IMAGE_TOKEN_ID",
    "MODEL_TYPE",
    "PAD_TOKEN_ID",
    "PATCH_DIM",
    "SAMPLES",
    "VIDEO_TOKEN_ID",
    "VISION_END_TOKEN_ID",
    "VISION_START_TOKEN_ID",
    "build_batch",
    "build_config",
    "build_model",
    "build_processor",
    "reference_inputs",
]

MODEL_TYPE = "minimax_m3_vl"

PATCH_SIZE = 8
TEMPORAL = 2
MERGE = 2
PATCH_DIM = 3 * TEMPORAL * PATCH_SIZE * PATCH_SIZE

#: per sample: text runs (ints), images ``("image", (t, h, w))`` and videos ``("video", [chunks])``.
SAMPLES: tuple[tuple[Any, ...], ...] = (
    (3, ("image", (1, 4, 4)), 4),
    (2, ("image", (1, 4, 6)), ("image", (1, 2, 2)), 2),
    (4, ("video", ((2, 4, 4), (1, 4, 4))), 3),
    (1, ("image", (1, 6, 4)), 2, ("video", ((1, 2, 4),)), 3),
    (9,),
    (14,),
    (2, ("image", (1, 8, 8)), 1, ("video", ((2, 2, 2), (2, 2, 2))), 1),
    (1, ("image", (1, 2, 4)), 1, ("video", ((2, 4, 2),)), 1, ("image", (1, 4, 2)), 1),
)


def build_config() -> Any:
    """The tiny ``MiniMaxM3VLConfig``."""
    from transformers import MiniMaxM3VLConfig

    text = text_fields(
        VOCAB, PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID, intermediate_size=32, dense_intermediate_size=128,
        shared_intermediate_size=32, head_dim=16, num_local_experts=4, num_experts_per_tok=2, index_n_heads=2,
        index_head_dim=8, index_block_size=4, index_topk_blocks=2, index_local_blocks=1,
        layer_types=["minimax_m3_sparse"] * 2, mlp_layer_types=["dense", "sparse"],
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
        max_position_embeddings=256,
    )
    vision = tower_fields(num_attention_heads=4, patch_size=PATCH_SIZE, temporal_patch_size=TEMPORAL,
                          spatial_merge_size=MERGE, image_size=64)
    return MiniMaxM3VLConfig(
        text_config=text, vision_config=vision, image_token_index=IMAGE_TOKEN_ID,
        video_token_index=VIDEO_TOKEN_ID, projector_hidden_size=64,
    )


def build_model(seed: int = 0) -> torch.nn.Module:
    """The tiny ``MiniMaxM3SparseForConditionalGeneration``, float32, eval mode, seeded (constants drawn)."""
    from transformers import MiniMaxM3SparseForConditionalGeneration

    return seeded_distinct(MiniMaxM3SparseForConditionalGeneration, build_config(), seed)


def build_batch(seed: int = 0, *, text_only_first: bool = False) -> dict[str, Any]:
    """The batch of the module docstring: ``input_ids`` / ``attention_mask`` ``[8, S]``, ``pixel_values``
    ``[patches, 384]``, ``image_grid_thw`` ``[7, 3]``, ``pixel_values_videos`` ``[patches, 384]``,
    ``video_grid_thw`` ``[7, 3]`` (chunks), ``num_chunks_per_video`` ``[4]``.

    ``text_only_first``: samples 4 and 5 first."""
    samples = SAMPLES[4:6] + SAMPLES[:4] + SAMPLES[6:] if text_only_first else SAMPLES
    return grid_batch(samples, seed, family=MODEL_TYPE, patch_dim=PATCH_DIM, merge=MERGE, video_steps=True,
                      chunk_counts=True)


def reference_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of the model's own full-batch forward (it does not read
    ``num_chunks_per_video``)."""
    keys = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
    return {k: batch[k] for k in keys}


#: the tiny processor's image and frame sizes: 16 to 64 pixels a side (multiples of patch x merge = 16).
MIN_PIXELS = 16 * 16
MAX_PIXELS = 64 * 48


def build_processor(image_backend: str = "torchvision") -> Any:
    """A real ``MiniMaxM3VLProcessor``: ``MiniMaxM3VLImageProcessor`` (torchvision only) and
    ``MiniMaxM3VLVideoProcessor`` at patch 8, temporal patch 2, merge 2, 256..3072 pixels a frame (frames
    as given), videos cut in chunks of at most 2 temporal steps; a word-level tokenizer with MiniMax's
    token names at the tiny ids (``<|im_start|>`` / ``<|im_end|>`` the turns), a chatml chat template.
    The processor's timestamps (``]<]0.1 seconds[>[``) are two unknown words each."""
    import transformers

    from ._processors import image_processor_class, qwen_processor, qwen_tokenizer

    common = {"patch_size": PATCH_SIZE, "temporal_patch_size": TEMPORAL, "merge_size": MERGE}
    images = image_processor_class("MiniMaxM3VLImageProcessor", image_backend)(
        **common, size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})
    videos = transformers.MiniMaxM3VLVideoProcessor(**common, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
                                                    vision_segment_max_frames=2, min_frames=1, do_sample_frames=False)
    names = transformers.MiniMaxM3VLProcessor
    ids = {"<|endoftext|>": PAD_TOKEN_ID, "<|im_start|>": BOS_TOKEN_ID, "<|im_end|>": EOS_TOKEN_ID,
           names.VISION_START_TOKEN: VISION_START_TOKEN_ID, names.VISION_END_TOKEN: VISION_END_TOKEN_ID,
           names.IMAGE_TOKEN: IMAGE_TOKEN_ID, names.VIDEO_TOKEN: VIDEO_TOKEN_ID}
    tokenizer = qwen_tokenizer(VOCAB, ids, image=names.IMAGE_TOKEN, video=names.VIDEO_TOKEN)
    return qwen_processor("MiniMaxM3VLProcessor", tokenizer=tokenizer, images=images, videos=videos,
                          media={"image": names.IMAGE_TOKEN, "video": names.VIDEO_TOKEN})
