"""Tiny seeded ERNIE 4.5 VL MoE (``ernie4_5_vl_moe``): Qwen-style patch rows of 588 features with grids,
mrope, and a text model whose MoE layers route text and vision tokens to separate experts.

Media as ``Ernie4_5_VLMoeImageProcessor`` gives them: ``pixel_values`` ``[patches, 588]`` (``3 * 14 *
14``, no temporal packing) with ``image_grid_thw`` ``[images, 3]``, ``t = 1``: ``h * w / 4`` features;
videos ``pixel_values_videos`` ``[patches, 588]`` with ``video_grid_thw`` ``[videos, 3]``, ``t`` frames
(even): ``t * h * w / 8`` features (the resampler merges 2 x 2 patches and 2 frames). The text:
``<|IMAGE_START|> <|image|> * n <|IMAGE_END|>`` and ``<|VIDEO_START|> <|video|> * n <|VIDEO_END|>``.

Besides ``input_ids`` the processor returns ``mm_token_type_ids`` (image 1 / video 2 at placeholders:
the mrope groups) and ``moe_mm_token_type_ids`` (the same, plus the start/end tokens: which tokens the
MoE layers send to the vision experts); the batch holds both, as the processor gives them.

======  ==================================================  ======  ======
sample  media (t, h, w) -> tokens                           images  videos
======  ==================================================  ======  ======
0       image (1, 4, 4) -> 4                                1       0
1       image (1, 4, 6) -> 6, video (2, 4, 4) -> 4          1       1
2       video (4, 2, 4) -> 4                                0       1
3       image (1, 2, 2) -> 1, image (1, 6, 4) -> 6          2       0
4, 5    text only                                           0       0
6       video (2, 4, 2) -> 2, image (1, 4, 4) -> 4          1       1
7       image (1, 8, 4) -> 8                                1       0
======  ==================================================  ======  ======

Text model (hidden 64, 2 layers): layer 0 dense, layer 1 MoE with 4 text and 4 vision experts (2 per
token) and a shared expert; mrope section ``[3, 3, 2]``; tied embeddings (the default). Vision: depth 2,
hidden 32, patch 14. The router weights and correction biases (zeros in transformers) are drawn.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import seeded_distinct
from ._batch import right_padded
from ._configs import grid_tower_fields, text_fields

__all__ = [
    "IMAGE_END_TOKEN_ID",
    "IMAGE_START_TOKEN_ID",
    "IMAGE_TOKEN_ID",
    "MODEL_TYPE",
    "PATCH_DIM",
    "VIDEO_END_TOKEN_ID",
    "VIDEO_START_TOKEN_ID",
    "VIDEO_TOKEN_ID",
    "build_batch",
    "build_config",
    "build_model",
    "build_processor",
    "moe_token_types",
    "reference_inputs",
    "token_types",
]

MODEL_TYPE = "ernie4_5_vl_moe"

PAD_TOKEN_ID = 0
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
IMAGE_START_TOKEN_ID = 3
IMAGE_END_TOKEN_ID = 4
VIDEO_START_TOKEN_ID = 5
VIDEO_END_TOKEN_ID = 6
IMAGE_TOKEN_ID = 7
VIDEO_TOKEN_ID = 8
_FIRST_TEXT_ID = 10
_VOCAB = 128
PATCH_SIZE = 14
MERGE = 2
TEMPORAL_MERGE = 2
PATCH_DIM = 3 * PATCH_SIZE * PATCH_SIZE

_SAMPLES: tuple[tuple[Any, ...], ...] = (
    (3, ("image", (1, 4, 4)), 4),
    (2, ("image", (1, 4, 6)), 1, ("video", (2, 4, 4)), 2),
    (1, ("video", (4, 2, 4)), 3),
    (2, ("image", (1, 2, 2)), 1, ("image", (1, 6, 4)), 1),
    (9,),
    (14,),
    (1, ("video", (2, 4, 2)), 2, ("image", (1, 4, 4)), 1),
    (2, ("image", (1, 8, 4)), 2),
)


def build_config() -> Any:
    """The tiny ``Ernie4_5_VLMoeConfig``."""
    from transformers import Ernie4_5_VLMoeConfig

    text = text_fields(
        _VOCAB, PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID, head_dim=16, max_position_embeddings=512,
        moe_intermediate_size=[32, 16], moe_k=2, moe_num_experts=4, moe_num_shared_experts=1,
        mlp_layer_types=["dense", "sparse"],
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [3, 3, 2]},
    )
    vision = grid_tower_fields(patch_size=PATCH_SIZE, spatial_merge_size=MERGE, temporal_merge_size=TEMPORAL_MERGE)
    return Ernie4_5_VLMoeConfig(
        text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID,
        image_start_token_id=IMAGE_START_TOKEN_ID, image_end_token_id=IMAGE_END_TOKEN_ID,
        video_start_token_id=VIDEO_START_TOKEN_ID, video_end_token_id=VIDEO_END_TOKEN_ID,
    )


def build_model(seed: int = 0) -> torch.nn.Module:
    """The tiny ``Ernie4_5_VLMoeForConditionalGeneration``, float32, eval mode, seeded (constants drawn)."""
    from transformers import Ernie4_5_VLMoeForConditionalGeneration

    return seeded_distinct(Ernie4_5_VLMoeForConditionalGeneration, build_config(), seed)


def token_types(input_ids: Tensor) -> Tensor:
    """``mm_token_type_ids`` as the processor makes them: 1 at image tokens, 2 at video tokens."""
    return (input_ids == IMAGE_TOKEN_ID).to(torch.int64) + 2 * (input_ids == VIDEO_TOKEN_ID).to(torch.int64)


def moe_token_types(input_ids: Tensor) -> Tensor:
    """``moe_mm_token_type_ids`` as ``Ernie4_5_VLMoeProcessor.create_moe_mm_token_type_ids`` makes them:
    :func:`token_types` plus 1 at image start/end and 2 at video start/end tokens."""
    image = (input_ids == IMAGE_START_TOKEN_ID) | (input_ids == IMAGE_END_TOKEN_ID)
    video = (input_ids == VIDEO_START_TOKEN_ID) | (input_ids == VIDEO_END_TOKEN_ID)
    return token_types(input_ids) + image.to(torch.int64) + 2 * video.to(torch.int64)


def build_batch(seed: int = 0) -> dict[str, Tensor]:
    """The batch of the module docstring: ``input_ids`` / ``attention_mask`` / ``mm_token_type_ids`` /
    ``moe_mm_token_type_ids`` ``[8, S]``, ``pixel_values`` ``[patches, 588]`` with ``image_grid_thw``
    ``[7, 3]``, ``pixel_values_videos`` ``[patches, 588]`` with ``video_grid_thw`` ``[3, 3]``."""
    gen = torch.Generator().manual_seed(seed)
    rows: list[list[int]] = []
    grids: dict[str, list[tuple[int, int, int]]] = {"image": [], "video": []}
    for sample in _SAMPLES:
        ids = [BOS_TOKEN_ID]
        for part in sample:
            if isinstance(part, int):
                ids += torch.randint(_FIRST_TEXT_ID, _VOCAB, (part,), generator=gen).tolist()
                continue
            kind, (t, h, w) = part
            grids[kind].append((t, h, w))
            if kind == "image":
                ids += [IMAGE_START_TOKEN_ID] + [IMAGE_TOKEN_ID] * (h * w // MERGE**2) + [IMAGE_END_TOKEN_ID]
            else:
                tokens = t * h * w // MERGE**2 // TEMPORAL_MERGE
                ids += [VIDEO_START_TOKEN_ID] + [VIDEO_TOKEN_ID] * tokens + [VIDEO_END_TOKEN_ID]
        rows.append(ids + [EOS_TOKEN_ID])
    input_ids, attention_mask = right_padded(rows, PAD_TOKEN_ID)

    def pixels(kind: str) -> Tensor:
        return torch.randn((sum(t * h * w for t, h, w in grids[kind]), PATCH_DIM), generator=gen)

    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "mm_token_type_ids": token_types(input_ids),
        "moe_mm_token_type_ids": moe_token_types(input_ids),
        "pixel_values": pixels("image"),
        "image_grid_thw": torch.tensor(grids["image"], dtype=torch.int64),
        "pixel_values_videos": pixels("video"),
        "video_grid_thw": torch.tensor(grids["video"], dtype=torch.int64),
    }


def reference_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of the model's own full-batch forward (both token types included: without
    ``moe_mm_token_type_ids`` its MoE layers would send every token to the text experts)."""
    keys = ("input_ids", "attention_mask", "mm_token_type_ids", "moe_mm_token_type_ids", "pixel_values",
            "image_grid_thw", "pixel_values_videos", "video_grid_thw")
    return {k: batch[k] for k in keys if batch.get(k) is not None}


#: the tiny processor's image and frame sizes: 28 to 84 pixels a side (multiples of patch x merge = 28).
MIN_PIXELS = 28 * 28
MAX_PIXELS = 84 * 56


def build_processor(image_backend: str = "torchvision") -> Any:
    """A real ``Ernie4_5_VLMoeProcessor``: ``Ernie4_5_VLMoeImageProcessor`` (``...Pil`` with
    ``image_backend="pil"``) and ``Ernie4_5_VLMoeVideoProcessor`` at patch 14, merge 2, 784..4704 pixels
    a frame (frames as given, no timestamps drawn on them: that needs a font file from the hub); a
    word-level tokenizer with the tiny ids (``<|im_start|>`` / ``<|im_end|>`` the turns at
    ``BOS_TOKEN_ID`` / ``EOS_TOKEN_ID``), a chatml chat template. The processor also returns
    ``moe_mm_token_type_ids``."""
    import transformers

    from ._processors import image_processor_class, qwen_processor, qwen_tokenizer

    size = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    images = image_processor_class("Ernie4_5_VLMoeImageProcessor", image_backend)(size=size)
    videos = transformers.Ernie4_5_VLMoeVideoProcessor(size=size, do_sample_frames=False, draw_on_frames=False)
    ids = {"<|endoftext|>": PAD_TOKEN_ID, "<|im_start|>": BOS_TOKEN_ID, "<|im_end|>": EOS_TOKEN_ID,
           "<|IMAGE_START|>": IMAGE_START_TOKEN_ID, "<|IMAGE_END|>": IMAGE_END_TOKEN_ID, "<|VIDEO_START|>": VIDEO_START_TOKEN_ID,
           "<|VIDEO_END|>": VIDEO_END_TOKEN_ID, "<|image|>": IMAGE_TOKEN_ID, "<|video|>": VIDEO_TOKEN_ID}
    tokenizer = qwen_tokenizer(_VOCAB, ids, image="<|image|>", video="<|video|>", image_start_token="<|IMAGE_START|>",
                               image_end_token="<|IMAGE_END|>", video_start_token="<|VIDEO_START|>", video_end_token="<|VIDEO_END|>")
    media = {"image": "<|IMAGE_START|><|image|><|IMAGE_END|>", "video": "<|VIDEO_START|><|video|><|VIDEO_END|>"}
    return qwen_processor("Ernie4_5_VLMoeProcessor", tokenizer=tokenizer, images=images, videos=videos, media=media)
