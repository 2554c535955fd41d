"""Tiny seeded Qwen3-VL model (deepstack) and a mixed image + video batch.

Qwen3-VL stages flat patch rows like Qwen2.5-VL: ``pixel_values`` ``[patches, D]`` with
``image_grid_thw`` ``[images, 3]`` ``(t, h, w)`` in patches (``D = 3 * 2 * 16 * 16 = 1536``), videos in
``pixel_values_videos`` / ``video_grid_thw``. The vision tower merges ``2 x 2`` patch blocks. An image
is written ``VISION_START, IMAGE * (h * w / 4), VISION_END``; a video, as the Qwen3-VL processor writes
it, is one block per temporal step, each after its timestamp text (two text tokens here, standing for
``<0.5 seconds>``): ``ts ts VISION_START, VIDEO * (h * w / 4), VISION_END`` repeated ``t`` times.

The vision tower (2 blocks) returns two deepstack feature sets (``deepstack_visual_indexes = [0, 1]``);
the language model (2 decoder layers, hidden 32) adds set ``i`` after layer ``i``. With the default
2-stage split (one layer each) set 1 crosses the stage boundary. ``text_config(n)`` and
``vision_config(levels)`` build deeper variants for tests.

Batch layout (``build_batch``), 8 samples right-padded to ``S = SEQ_LEN`` with ``PAD_TOKEN_ID``::

    sample  media (t, h, w) -> placeholder tokens
    0       image (1, 4, 4) -> 4
    1       image (1, 4, 6) -> 6, image (1, 2, 2) -> 1
    2       video (2, 4, 4) -> 2 blocks of 4
    3       image (1, 6, 4) -> 6, video (3, 2, 4) -> 3 blocks of 2
    4       text only
    5       text only
    6       image (1, 8, 8) -> 16, video (1, 2, 2) -> 1 block of 1
    7       image (1, 2, 4) -> 2, video (2, 4, 2) -> 2 blocks of 2, image (1, 4, 2) -> 2

7 images (148 patch rows, 37 tokens), 4 videos (76 patch rows, 8 blocks, 19 tokens). Split in 4
microbatches: 0 images only, 1 and 3 images and videos, 2 (samples 4 and 5) text-only. Sample 3's
3-step video and sample 6's 1-step video show why tokens alone cannot count videos.
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
    "IMAGE_TOKEN_ID",
    "MODEL_TYPE",
    "PAD_TOKEN_ID",
    "PATCH_DIM",
    "SAMPLES",
    "SEQ_LEN",
    "VIDEO_TOKEN_ID",
    "VISION_END_TOKEN_ID",
    "VISION_START_TOKEN_ID",
    "VARIANTS",
    "build_batch",
    "build_config",
    "build_model",
    "build_processor",
    "build_variant",
    "reference_inputs",
]

MODEL_TYPE = "qwen3_vl"

CHANNELS = 3
PATCH_SIZE = 16
TEMPORAL_PATCH_SIZE = 2
MERGE = 2
PATCH_DIM = CHANNELS * TEMPORAL_PATCH_SIZE * PATCH_SIZE * PATCH_SIZE
SEQ_LEN = 34

SAMPLES: tuple[tuple[Any, ...], ...] = (
    (3, ("image", (1, 4, 4)), 4),
    (2, ("image", (1, 4, 6)), 3, ("image", (1, 2, 2)), 2),
    (4, ("video", (2, 4, 4)), 5),
    (1, ("image", (1, 6, 4)), 2, ("video", (3, 2, 4)), 3),
    (9,),
    (14,),
    (2, ("image", (1, 8, 8)), 1, ("video", (1, 2, 2)), 1),
    (1, ("image", (1, 2, 4)), 1, ("video", (2, 4, 2)), 1, ("image", (1, 4, 2)), 1),
)


def text_config(num_layers: int = 2) -> dict[str, Any]:
    """The tiny text config (hidden 32, ``num_layers`` layers, interleaved mrope ``[2, 1, 1]``)."""
    # mrope_section sums to head_dim / 2 = 4
    return text_fields(
        VOCAB, PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID, width=32, num_hidden_layers=num_layers, head_dim=8,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    )


def vision_config(deepstack_levels: int = 2) -> dict[str, Any]:
    """The tiny vision config (hidden 32, patch 16); one deepstack set after each of the first
    ``deepstack_levels`` blocks (depth ``max(2, deepstack_levels)``; 0: no deepstack key)."""
    config = grid_tower_fields(
        depth=max(2, deepstack_levels), num_heads=4, in_channels=CHANNELS, patch_size=PATCH_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE, spatial_merge_size=MERGE, out_hidden_size=32, num_position_embeddings=64,
    )
    if deepstack_levels:
        config["deepstack_visual_indexes"] = list(range(deepstack_levels))
    return config


def token_ids() -> dict[str, int]:
    return {
        "image_token_id": IMAGE_TOKEN_ID,
        "video_token_id": VIDEO_TOKEN_ID,
        "vision_start_token_id": VISION_START_TOKEN_ID,
        "vision_end_token_id": VISION_END_TOKEN_ID,
    }


def build_config() -> Any:
    """The tiny :class:`~transformers.Qwen3VLConfig`."""
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(text_config=text_config(), vision_config=vision_config(), **token_ids())


def build_model(seed: int = 0) -> torch.nn.Module:
    """A :class:`~transformers.Qwen3VLForConditionalGeneration`, float32, eval mode, seeded."""
    from transformers import Qwen3VLForConditionalGeneration

    return seeded(Qwen3VLForConditionalGeneration, build_config(), seed)


#: the model types the same adapter serves, each with a tiny variant (:func:`build_variant`).
VARIANTS: tuple[str, ...] = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")


def build_variant(model_type: str, seed: int = 0, *, num_layers: int = 2, deepstack_levels: int = 2) -> torch.nn.Module:
    """A tiny model of any of :data:`VARIANTS`, same token ids and batch layout as :func:`build_model`.

    ``qwen3_vl_moe``: 4 experts, 2 per token. ``qwen3_5`` / ``qwen3_5_moe``: no deepstack (the Qwen3.5
    vision tower has none; ``deepstack_levels`` is ignored), linear-attention and full-attention layers
    alternating. ``num_layers`` / ``deepstack_levels`` build deeper Qwen3-VL variants.
    """
    import transformers

    text, vision = text_config(num_layers), vision_config(deepstack_levels)
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    if model_type.startswith("qwen3_5"):
        vision = vision_config(0)
        text.update(
            layer_types=(["linear_attention", "full_attention"] * num_layers)[:num_layers],
            linear_conv_kernel_dim=2, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_num_key_heads=2, linear_num_value_heads=4,
        )
    if model_type == "qwen3_vl_moe":
        text.update(moe, decoder_sparse_step=1)
    elif model_type == "qwen3_5_moe":
        text.update(moe, shared_expert_intermediate_size=16)
    names = {
        "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
        "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration"),
        "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
        "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration"),
    }
    if model_type not in names:
        raise ValueError(f"model_type: got {model_type!r}; expected one of {', '.join(VARIANTS)}")
    config_name, model_name = names[model_type]
    config = getattr(transformers, config_name)(text_config=text, vision_config=vision, **token_ids())
    return seeded(getattr(transformers, model_name), config, seed)


def build_batch(seed: int = 0, *, text_only_first: bool = False) -> dict[str, Tensor]:
    """The processor-style batch described in the module docstring, drawn from ``seed``.

    ``text_only_first``: samples 4 and 5 (text only) come first (order 4, 5, 0, 1, 2, 3, 6, 7), so
    microbatch 0 has no media.

    Keys: ``input_ids`` / ``attention_mask`` ``[8, SEQ_LEN]``, ``pixel_values`` ``[148, 1536]``,
    ``image_grid_thw`` ``[7, 3]``, ``pixel_values_videos`` ``[76, 1536]``, ``video_grid_thw`` ``[4, 3]``.
    """
    samples = SAMPLES[4:6] + SAMPLES[:4] + SAMPLES[6:] if text_only_first else SAMPLES
    return grid_batch(samples, seed, family=MODEL_TYPE, patch_dim=PATCH_DIM, merge=MERGE, video_steps=True, seq_len=SEQ_LEN)


def reference_inputs(batch: dict[str, Tensor]) -> dict[str, Any]:
    """Keyword arguments of the model's own full-batch forward on ``batch`` (adds ``mm_token_type_ids``:
    text 0, image 1, video 2, which its position computation requires)."""
    return grid_reference_inputs(batch)


#: the tiny processor's image and video frame sizes: 32 to 96 pixels a side (multiples of patch x merge = 32).
MIN_PIXELS = 32 * 32
MAX_PIXELS = 96 * 64


def build_processor(image_backend: str = "torchvision") -> Any:
    """A real ``Qwen3VLProcessor``: ``Qwen2VLImageProcessor`` (``...Pil`` with ``image_backend="pil"``)
    and ``Qwen3VLVideoProcessor`` at patch 16, temporal patch 2, merge 2, 1024..6144 pixels a frame
    (frames as given: no sampling); Qwen's tokenizer names at the tiny ids, a chatml chat template.
    The processor writes each temporal step of a video after its timestamp (``<0.1 seconds>``: two
    words outside the vocabulary, so two unknown-token ids)."""
    from ._processors import qwen_vl_processor

    return qwen_vl_processor("Qwen3VLProcessor", "Qwen3VLVideoProcessor", image_backend, vocab_size=VOCAB,
                             token_ids=PROCESSOR_TOKEN_IDS, sizes=(PATCH_SIZE, TEMPORAL_PATCH_SIZE, MERGE),
                             pixels=(MIN_PIXELS, MAX_PIXELS),
                             media={"image": "<|vision_start|><|image_pad|><|vision_end|>", "video": "<|video_pad|>"},
                             vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>")
