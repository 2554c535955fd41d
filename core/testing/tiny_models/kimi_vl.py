"""Tiny seeded Kimi-K2.5 model (MoonViT vision tower, DeepSeek-V3 text model) and batch.

The Kimi-VL family stages patch-major pixels: every image is cut into ``P x P`` patches in row-major
grid order and the patches of all images are concatenated on axis 0, ``pixel_values`` ``[patches, C,
P, P]`` with ``P = vision_config.patch_size``. Each image's patch grid is ``(h, w)``; Kimi-VL
checkpoints stage it as ``image_grid_hws`` ``[images, 2]``, while transformers'
``Kimi_K25ForConditionalGeneration`` takes ``image_grid_thw`` ``[images, 3]`` with ``t = 1``. The
vision tower pools ``2 x 2`` patch blocks, so an image contributes ``h * w / 4`` placeholder tokens.

Batch layout (``build_batch``), right-padded to ``S = 24`` with ``PAD_TOKEN_ID``::

    sample  images (grid h x w -> tokens)
    0       4x4 -> 4
    1       2x4 -> 2, 4x2 -> 2
    2       2x2 -> 1
    3       6x4 -> 6
    4       text only
    5       text only
    6       2x6 -> 3, 4x4 -> 4
    7       4x6 -> 6

Each image is written as ``VISION_START, IMAGE * n, VISION_END`` after a short text prefix; every
sample starts with ``BOS``. Split in 4 microbatches, microbatch 2 (samples 4 and 5) is text-only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import seeded
from ._configs import text_fields, tower_fields

__all__ = [
    "BOS_TOKEN_ID",
    "EOS_TOKEN_ID",
    "IMAGE_GRIDS",
    "IMAGE_TOKEN_ID",
    "MODEL_TYPE",
    "PAD_TOKEN_ID",
    "SEQ_LEN",
    "VIDEO_TOKEN_ID",
    "VISION_END_TOKEN_ID",
    "VISION_START_TOKEN_ID",
    "build_batch",
    "build_checkpoint_model",
    "build_config",
    "build_model",
    "build_processor",
    "reference_inputs",
]

MODEL_TYPE = "kimi_k25"

PAD_TOKEN_ID = 0
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
VISION_START_TOKEN_ID = 3
IMAGE_TOKEN_ID = 4
VISION_END_TOKEN_ID = 5
VIDEO_TOKEN_ID = 6
_FIRST_TEXT_ID = 10
_VOCAB = 128

PATCH_SIZE = 4
CHANNELS = 3
MERGE = (2, 2)
SEQ_LEN = 24

#: per sample, the (h, w) patch grid of each of its images, in placeholder order.
IMAGE_GRIDS: tuple[tuple[tuple[int, int], ...], ...] = (
    ((4, 4),),
    ((2, 4), (4, 2)),
    ((2, 2),),
    ((6, 4),),
    (),
    (),
    ((2, 6), (4, 4)),
    ((4, 6),),
)
#: per sample, the number of text tokens before each image block (and after the last one).
_TEXT_RUNS: tuple[tuple[int, ...], ...] = (
    (3, 4),
    (2, 1, 3),
    (5, 6),
    (2, 3),
    (11,),
    (17,),
    (1, 1, 2),
    (2, 5),
)


def build_config() -> Any:
    """The tiny ``Kimi_K25Config``: MoonViT hidden 32 (patch 4, merge 2x2), DeepSeek-V3 text hidden 64.

    The text model has two layers: layer 0 dense, layer 1 a tiny MoE (4 routed experts, top 2, one
    shared expert) with multi-head latent attention, so the Kimi-K2 text stack is exercised as is.
    """
    from transformers import Kimi_K25Config

    vision = tower_fields(
        patch_size=PATCH_SIZE, pos_emb_height=8, pos_emb_width=8, pos_emb_time=4, hidden_act="gelu_pytorch_tanh",
        merge_kernel_size=list(MERGE), rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
    )
    text = text_fields(
        _VOCAB, PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID, model_type="deepseek_v3", moe_intermediate_size=32,
        num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16, max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return Kimi_K25Config(
        vision_config=vision,
        text_config=text,
        # the projector's pre-norm runs over single vision tokens before the 2x2 concatenation
        projection_hidden_size=vision["hidden_size"],
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_TOKEN_ID,
        vision_end_token_id=VISION_END_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
    )


def build_model(seed: int = 0) -> torch.nn.Module:
    """The tiny ``Kimi_K25ForConditionalGeneration``, float32, eval mode, weights drawn after ``seed``."""
    from transformers import Kimi_K25ForConditionalGeneration

    config = build_config()
    config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    return seeded(Kimi_K25ForConditionalGeneration, config, seed)


def build_checkpoint_model(seed: int = 0) -> torch.nn.Module:
    """:func:`build_model` with ``q_lora_rank`` 16 (the query through ``q_a_proj`` / ``q_b_proj``, as in
    real Kimi-K2.5 configs), for checkpoint round trips.

    transformers 5.23 cannot read back a ``kimi_k25`` checkpoint whose text config has ``q_lora_rank``
    ``None`` (:func:`build_model`'s): its conversion mapping for the vision tower's fused ``wqkv``
    (pattern ``attn.q_proj``) also catches the text attention's ``self_attn.q_proj``, so
    ``save_pretrained`` writes it as a ``wqkv`` and ``from_pretrained`` fails on it (``PermuteForRope``).
    """
    from transformers import Kimi_K25ForConditionalGeneration

    config = build_config()
    config.text_config.q_lora_rank = 16
    config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    return seeded(Kimi_K25ForConditionalGeneration, config, seed)


def build_batch(seed: int = 0) -> dict[str, Tensor]:
    """The 8-sample batch described in the module docstring.

    Returns:
        ``input_ids`` and ``attention_mask`` ``[8, SEQ_LEN]``, ``pixel_values`` ``[patches, 3, 4, 4]``
        (112 patches, image order), ``image_grid_hws`` ``[8, 2]`` int64 (h, w) per image.
    """
    gen = torch.Generator().manual_seed(seed)
    rows: list[list[int]] = []
    for grids, runs in zip(IMAGE_GRIDS, _TEXT_RUNS, strict=True):
        assert len(runs) == len(grids) + 1
        ids = [BOS_TOKEN_ID]
        for i, run in enumerate(runs):
            ids += torch.randint(_FIRST_TEXT_ID, _VOCAB, (run,), generator=gen).tolist()
            if i < len(grids):
                h, w = grids[i]
                ids += [VISION_START_TOKEN_ID] + [IMAGE_TOKEN_ID] * (h * w // (MERGE[0] * MERGE[1]))
                ids += [VISION_END_TOKEN_ID]
        assert len(ids) <= SEQ_LEN, (len(ids), SEQ_LEN)
        rows.append(ids)
    input_ids = torch.full((len(rows), SEQ_LEN), PAD_TOKEN_ID, dtype=torch.int64)
    attention_mask = torch.zeros((len(rows), SEQ_LEN), dtype=torch.int64)
    for b, ids in enumerate(rows):
        input_ids[b, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        attention_mask[b, : len(ids)] = 1

    image_grid_hws = torch.tensor([g for sample in IMAGE_GRIDS for g in sample], dtype=torch.int64)
    patches = int(image_grid_hws.prod(-1).sum())
    pixel_values = torch.randn((patches, CHANNELS, PATCH_SIZE, PATCH_SIZE), generator=gen)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "pixel_values": pixel_values,
        "image_grid_hws": image_grid_hws,
    }


def reference_inputs(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """``Kimi_K25ForConditionalGeneration.forward`` keywords: the grid as ``image_grid_thw`` with t = 1."""
    hws = batch["image_grid_hws"]
    return {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "pixel_values": batch["pixel_values"],
        "image_grid_thw": torch.cat([hws.new_ones((hws.shape[0], 1)), hws], dim=1),
    }


def build_processor(image_backend: str = "torchvision") -> Any:
    """A real ``Kimi_K25Processor``: ``Kimi_K25ImageProcessor`` (torchvision only) and
    ``Kimi_K25VideoProcessor`` at patch 4, merge 2, at most 32 x 32 pixels (64 patches) an image or frame,
    videos in chunks of 2 frames (frames as given); a word-level tokenizer with the tiny ids
    (``<|media_begin|>`` ``VISION_START_TOKEN_ID``, ``<|media_content|>`` 7, ``<|media_end|>``
    ``VISION_END_TOKEN_ID``; ``<|im_start|>`` / ``<|im_end|>`` the turns), a chatml chat template writing
    an image as Kimi's ``<|media_begin|>image<|media_content|><|media_pad|><|media_end|>`` (the kind
    words and the processor's chunk timestamps are unknown words). Kimi-K2.5's model itself: see the ``kimi_k25_video`` family."""
    import transformers

    from ._processors import image_processor_class, qwen_processor, qwen_tokenizer

    common = {"patch_size": PATCH_SIZE, "merge_size": MERGE[0], "size": {"max_height": 32, "max_width": 32}, "max_patches": 64}
    images = image_processor_class("Kimi_K25ImageProcessor", image_backend)(**common)
    videos = transformers.Kimi_K25VideoProcessor(**common, temporal_patch_size=2, do_sample_frames=False)
    video = "<|kimi_k25_video_placeholder|>"
    ids = {"<|endoftext|>": PAD_TOKEN_ID, "<|im_start|>": BOS_TOKEN_ID, "<|im_end|>": EOS_TOKEN_ID,
           "<|media_begin|>": VISION_START_TOKEN_ID, "<|media_content|>": 7, "<|media_pad|>": IMAGE_TOKEN_ID,
           "<|media_end|>": VISION_END_TOKEN_ID, video: VIDEO_TOKEN_ID}
    tokenizer = qwen_tokenizer(_VOCAB, ids, image="<|media_pad|>", video=video)
    return qwen_processor("Kimi_K25Processor", tokenizer=tokenizer, images=images, videos=videos,
                          media={"image": "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>", "video": video})
