"""Tiny seeded VideoLLaMA3 (``video_llama_3``): ``VideoLlama3ForConditionalGeneration``, patch rows with a
merge size per image and per video, and a compression mask over the video features.

Decoder: Qwen2, 64 wide, 2 layers, 1-D positions. Vision tower: 2 layers, 32 wide, patch 4, temporal
patch 1 (rows of ``3 * 4 * 4 = 48``), axial rotary positions (no position table: any grid fits).

The batch uses the processor's keys. An item is ``(t, h, w)`` in patches with its merge size ``m``:
``t * h * w / m**2`` features; a video also names the features its compression mask drops (never one
of the first frame, and every frame keeps one, as the processor's mask does). The text writes a video
frame by frame, a text token (the processor's ``Time 0.0s:``) before each frame's kept tokens.
Images and videos with merge sizes 1 AND 2 are in the batch, so an adapter that takes one merge size
for every item (or hard-codes the processor's default, 2 for videos) gets the wrong feature counts:

======  ====================================================  ======  ======
sample  media: (t, h, w) merge -> features (kept)             images  videos
======  ====================================================  ======  ======
0       image (1, 4, 4) m2 -> 4; video (2, 4, 4) m2 -> 8 (7)  1       1
1       video (3, 2, 2) m1 -> 12 (10); image (1, 2, 4) m1 -> 8  1     1
2       images (1, 2, 2) m1 -> 4 and (1, 4, 2) m2 -> 2,       2       0
        back to back
3       video (2, 4, 2) m2 -> 4 (4)                           0       1
4, 5    text only                                             0       0
6       videos (1, 2, 4) m1 -> 8 and (2, 4, 4) m2 -> 8 (7)    0       2
7       image (1, 4, 6) m2 -> 6                               1       0
======  ====================================================  ======  ======

:func:`build_batches` adds a batch of 4 without a compression mask (every feature kept), with the
processor's own merge sizes (images 1, videos 2).
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
    "PATCH_DIM",
    "VIDEO_TOKEN_ID",
    "build_batch",
    "build_batches",
    "build_config",
    "build_model",
    "build_processor",
    "reference_inputs",
]

MODEL_TYPE = "video_llama_3"
VOCAB_SIZE = 128
PAD_TOKEN_ID, IM_START_TOKEN_ID, IM_END_TOKEN_ID = 0, 1, 2
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = 7, 8
_FIRST_TEXT_ID = 10
PATCH = 4
PATCH_DIM = 3 * PATCH * PATCH

#: per sample its parts in prompt order: ``int`` text tokens, ``("image", (t, h, w), merge)``,
#: ``("video", (t, h, w), merge, dropped feature indices)``
SAMPLES: tuple[tuple[Any, ...], ...] = (
    (2, ("image", (1, 4, 4), 2), 1, ("video", (2, 4, 4), 2, (5,)), 1),
    (("video", (3, 2, 2), 1, (5, 10)), 2, ("image", (1, 2, 4), 1)),
    (1, ("image", (1, 2, 2), 1), ("image", (1, 4, 2), 2), 2),
    (3, ("video", (2, 4, 2), 2, ()), 1),
    (9,),
    (6,),
    (("video", (1, 2, 4), 1, ()), ("video", (2, 4, 4), 2, (4,)), 1),
    (1, ("image", (1, 4, 6), 2), 2),
)
#: :func:`build_batches`: no compression mask, the processor's merge sizes (images 1, videos 2)
UNCOMPRESSED: tuple[tuple[Any, ...], ...] = (
    (("video", (2, 2, 4), 2, None), 2),
    (5,),
    (1, ("image", (1, 2, 2), 1), ("video", (3, 4, 2), 2, None)),
    (("image", (1, 4, 2), 1), 3),
)


def build_config() -> Any:
    """The tiny ``VideoLlama3Config``."""
    from transformers import VideoLlama3Config

    text = text_fields(VOCAB_SIZE, PAD_TOKEN_ID, IM_START_TOKEN_ID, IM_END_TOKEN_ID, model_type="qwen2",
                       max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    vision = tower_fields(patch_size=PATCH)
    return VideoLlama3Config(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN_ID,
                             video_token_id=VIDEO_TOKEN_ID)


def build_model(seed: int = 0) -> torch.nn.Module:
    """The tiny ``VideoLlama3ForConditionalGeneration``, float32, eval mode, seeded (constants drawn)."""
    from transformers import VideoLlama3ForConditionalGeneration

    return seeded_distinct(VideoLlama3ForConditionalGeneration, build_config(), seed)


def _video_tokens(grid: tuple[int, int, int], merge: int, dropped: Any, text: Any) -> tuple[list[int], Tensor]:
    """A video's token ids (per frame a text token, then its kept tokens) and its compression mask."""
    t, h, w = grid
    per_frame = h * w // merge**2
    mask = torch.ones(t * per_frame, dtype=torch.bool)
    for i in dropped or ():
        mask[i] = False
    ids: list[int] = []
    for frame in mask.split(per_frame):
        if frame.sum() < 1:
            raise ValueError(f"tiny video_llama_3 video {grid}: a frame drops every feature; expected one kept a frame")
        ids += text(1) + [VIDEO_TOKEN_ID] * int(frame.sum())
    return ids, mask


def _batch(samples: tuple[tuple[Any, ...], ...], seed: int) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def text(n: int) -> list[int]:
        return torch.randint(_FIRST_TEXT_ID, VOCAB_SIZE, (n,), generator=gen).tolist()

    rows: list[list[int]] = []
    items: dict[str, list[tuple[tuple[int, int, int], int]]] = {"image": [], "video": []}
    masks: list[Tensor] = []
    compress = False
    for parts in samples:
        ids = [IM_START_TOKEN_ID]
        for part in parts:
            if isinstance(part, int):
                ids += text(part)
                continue
            kind, grid, merge, *dropped = part
            items[kind].append((grid, merge))
            if kind == "image":
                ids += [IMAGE_TOKEN_ID] * (grid[0] * grid[1] * grid[2] // merge**2)
            else:
                compress = compress or dropped[0] is not None
                video, mask = _video_tokens(grid, merge, dropped[0], text)
                ids += video
                masks.append(mask)
        rows.append(ids + [IM_END_TOKEN_ID])
    input_ids, attention_mask = right_padded(rows, PAD_TOKEN_ID)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    for kind, pixels in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        if items[kind]:
            grids = torch.tensor([g for g, _ in items[kind]], dtype=torch.int64)
            batch[pixels] = torch.randn(int(grids.prod(dim=1).sum()), PATCH_DIM, generator=gen)
            batch[f"{kind}_grid_thw"] = grids
            batch[f"{kind}_merge_sizes"] = torch.tensor([m for _, m in items[kind]], dtype=torch.int64)
    if compress:
        batch["video_compression_mask"] = torch.cat(masks)
    return batch


def build_batch(seed: int = 0) -> dict[str, Tensor]:
    """``input_ids`` / ``attention_mask`` ``[8, 25]``; ``pixel_values`` ``[60, 48]``, ``image_grid_thw``
    ``[5, 3]``, ``image_merge_sizes`` ``[5]``; ``pixel_values_videos`` ``[100, 48]``, ``video_grid_thw``
    ``[5, 3]``, ``video_merge_sizes`` ``[5]``, ``video_compression_mask`` ``[40]``, 36 kept (the table above)."""
    return _batch(SAMPLES, seed)


def build_batches(seed: int = 0) -> list[dict[str, Tensor]]:
    """One batch of another structure, 4 samples (:data:`UNCOMPRESSED`): no compression mask, images of
    merge size 1 and videos of 2, as the processor gives them."""
    return [_batch(UNCOMPRESSED, seed + 1)]


_KEYS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "image_merge_sizes", "pixel_values_videos",
         "video_grid_thw", "video_merge_sizes", "video_compression_mask")


def reference_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of the model's own full-batch forward (the processor's keys are its own)."""
    return {k: batch[k] for k in _KEYS if batch.get(k) is not None}


def build_processor(image_backend: str = "torchvision") -> Any:
    """A real ``VideoLlama3Processor``: ``VideoLlama3ImageProcessor`` (``...Pil`` with
    ``image_backend="pil"``; merge size 1, as the processor's default) and ``VideoLlama3VideoProcessor``
    (merge size 2, token compression on, frames as given) at patch 4, temporal patch 1, 16..3072
    pixels an image (a video: its frames together); a word-level tokenizer with the tiny ids
    (``<|image_pad|>``, ``<|video_pad|>``, chatml turns), a chatml chat template."""
    import transformers

    from ._processors import image_processor_class, qwen_processor, qwen_tokenizer

    size = {"shortest_edge": 4 * 4, "longest_edge": 64 * 48}
    images = image_processor_class("VideoLlama3ImageProcessor", image_backend)(
        patch_size=PATCH, temporal_patch_size=1, merge_size=1, size=size)
    videos = transformers.VideoLlama3VideoProcessor(patch_size=PATCH, temporal_patch_size=1, merge_size=2, size=size,
                                                    do_sample_frames=False, min_frames=1)
    ids = {"<|endoftext|>": PAD_TOKEN_ID, "<|im_start|>": IM_START_TOKEN_ID, "<|im_end|>": IM_END_TOKEN_ID,
           "<|image_pad|>": IMAGE_TOKEN_ID, "<|video_pad|>": VIDEO_TOKEN_ID}
    tokenizer = qwen_tokenizer(VOCAB_SIZE, ids)
    return qwen_processor("VideoLlama3Processor", tokenizer=tokenizer, images=images, videos=videos,
                          media={"image": "<|image_pad|>", "video": "<|video_pad|>"})
