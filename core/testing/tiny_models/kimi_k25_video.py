"""Tiny seeded Kimi-K2.5 (``kimi_k25``) with videos of several frames per chunk, next to images.

The model is the Kimi-VL family's tiny Kimi-K2.5 (:mod:`ppmedia.testing.tiny_models.kimi_vl`: MoonViT
patch 4, 2 x 2 merge, DeepSeek-V3 text), served by the ``kimi_vl`` adapter. Images: patch-major
``pixel_values`` ``[patches, 3, 4, 4]`` with ``image_grid_thw`` ``[images, 3]`` (``t = 1``). Videos, as
the Kimi-K2.5 video processor cuts them: chunks of ``t`` frames, ``pixel_values_videos`` ``[t * h * w
patches, 3, 4, 4]`` per chunk with one ``video_grid_thw`` row ``(t, h, w)`` each, ``num_chunks_per_video``
per video; MoonViT pools a chunk's frames, so a chunk fills ``h * w / 4`` video tokens, written as one
block ``ts ts VISION_START, VIDEO * (h * w / 4), VISION_END``.

**The reference.** transformers 5.23's ``get_video_features`` splits the pooled features of a chunk by
``t * h * w / 4`` and fails for ``t > 1`` (and the tower's pooling index fails on chunks of different
``t`` in one call). The model's own forward therefore cannot run these videos; :func:`build_model`
returns the model with that one method replaced (:class:`VideoSplitFixed`, a stand-in for a fixed
upstream method: the model's own tower and projector, one chunk per call; scatter and language model
are the model's own). The adapter does not use it: it feeds ``vision_tower`` and ``mm_projector``
itself, all chunks of one ``t`` per call.

======  =================================================  ===========
sample  media                                              tokens
======  =================================================  ===========
0       image 4x4, video chunk (2, 4, 4)                   4, 4
1       one video of 2 chunks (2, 2, 4), (2, 2, 4)         2, 2
2       image 2x2                                          1
3       video chunk (3, 4, 2), image 4x2                   2, 2
4, 5    text only                                          0
6       image 2x6, video chunk (2, 2, 2)                   3, 1
7       video chunk (4, 4, 4)                              4
======  =================================================  ===========
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import seeded_distinct
from ._batch import right_padded
from .kimi_vl import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    IMAGE_TOKEN_ID,
    MERGE,
    PAD_TOKEN_ID,
    PATCH_SIZE,
    VIDEO_TOKEN_ID,
    VISION_END_TOKEN_ID,
    VISION_START_TOKEN_ID,
    build_config,
)

__all__ = [
    "ADAPTER",
    "MODEL_TYPE",
    "SAMPLES",
    "VideoSplitFixed",
    "build_batch",
    "build_config",
    "build_model",
    "build_processor",
    "reference_inputs",
]

#: the built-in adapter serving this tiny model (model type ``kimi_k25``)
ADAPTER = "kimi_vl"
MODEL_TYPE = "kimi_k25"
_FIRST_TEXT_ID = 10
_VOCAB = 128
_AREA = MERGE[0] * MERGE[1]

#: per sample: text runs (ints), images ``("image", (h, w))``, videos ``("video", [(t, h, w), ...])``.
SAMPLES: tuple[tuple[Any, ...], ...] = (
    (2, ("image", (4, 4)), 1, ("video", ((2, 4, 4),)), 1),
    (1, ("video", ((2, 2, 4), (2, 2, 4))), 3),
    (5, ("image", (2, 2)), 6),
    (1, ("video", ((3, 4, 2),)), 1, ("image", (4, 2)), 2),
    (11,),
    (17,),
    (1, ("image", (2, 6)), 1, ("video", ((2, 2, 2),)), 2),
    (2, ("video", ((4, 4, 4),)), 3),
)


class VideoSplitFixed:
    """Mixin for ``Kimi_K25Model``: ``get_video_features`` that runs on chunks of several frames.

    transformers 5.23's method calls ``get_image_features`` on all chunks at once, which splits the
    pooled features by ``t * h * w / area`` (the tower gives ``h * w / area`` per chunk) and, with
    chunks of different ``t``, fails inside the tower's pooling index. This one runs the model's own
    ``get_image_features`` body (tower, projector) on one chunk at a time and keeps each whole.
    """

    def get_video_features(self, pixel_values_videos: Tensor, video_grid_thw: Tensor, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        inner: Any = self
        features, start = [], 0
        for row in video_grid_thw:
            n = int(row.prod())
            pooled = inner.vision_tower(pixel_values_videos[start : start + n], grid_thw=row[None], **kwargs).pooler_output
            features.append(inner.mm_projector(pooled).squeeze(1))
            start += n
        return BaseModelOutputWithPooling(pooler_output=features)


def build_model(seed: int = 0) -> torch.nn.Module:
    """The tiny ``Kimi_K25ForConditionalGeneration`` (float32, eval, seeded, eager attention, constants
    drawn), its inner
    model's ``get_video_features`` corrected (:class:`VideoSplitFixed`) for the reference."""
    from transformers import Kimi_K25ForConditionalGeneration

    config = build_config()
    for c in (config, config.vision_config, config.text_config):
        c._attn_implementation = "eager"
    model = seeded_distinct(Kimi_K25ForConditionalGeneration, config, seed)
    inner = model.model
    inner.__class__ = type("Kimi_K25ModelVideoSplitFixed", (VideoSplitFixed, type(inner)), {})
    return model


def _block(token: int, n: int) -> list[int]:
    return [VISION_START_TOKEN_ID] + [token] * n + [VISION_END_TOKEN_ID]


def build_batch(seed: int = 0) -> dict[str, Tensor]:
    """``input_ids`` / ``attention_mask`` ``[8, S]``, ``pixel_values`` ``[patches, 3, 4, 4]``,
    ``image_grid_thw`` ``[5, 3]``, ``pixel_values_videos`` ``[patches, 3, 4, 4]``, ``video_grid_thw``
    ``[6, 3]`` (chunks), ``num_chunks_per_video`` ``[5]``."""
    gen = torch.Generator().manual_seed(seed)

    def text(n: int) -> list[int]:
        return torch.randint(_FIRST_TEXT_ID, _VOCAB, (n,), generator=gen).tolist()

    rows: list[list[int]] = []
    images: list[tuple[int, int, int]] = []
    chunks: list[tuple[int, int, int]] = []
    per_video: list[int] = []
    for sample in SAMPLES:
        ids = [BOS_TOKEN_ID]
        for part in sample:
            if isinstance(part, int):
                ids += text(part)
            elif part[0] == "image":
                h, w = part[1]
                images.append((1, h, w))
                ids += _block(IMAGE_TOKEN_ID, h * w // _AREA)
            else:
                per_video.append(len(part[1]))
                for t, h, w in part[1]:
                    chunks.append((t, h, w))
                    ids += text(2) + _block(VIDEO_TOKEN_ID, h * w // _AREA)
        rows.append(ids + [EOS_TOKEN_ID])
    input_ids, attention_mask = right_padded(rows, PAD_TOKEN_ID)

    def patches(grid: list[tuple[int, int, int]]) -> Tensor:
        n = sum(t * h * w for t, h, w in grid)
        return torch.randn((n, 3, PATCH_SIZE, PATCH_SIZE), generator=gen)

    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "pixel_values": patches(images),
        "image_grid_thw": torch.tensor(images, dtype=torch.int64),
        "pixel_values_videos": patches(chunks),
        "video_grid_thw": torch.tensor(chunks, dtype=torch.int64),
        "num_chunks_per_video": torch.tensor(per_video, dtype=torch.int64),
    }


def reference_inputs(batch: dict[str, Tensor]) -> dict[str, Any]:
    """Keyword arguments of the model's own full-batch forward."""
    keys = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
    return {k: batch[k] for k in keys}


def build_processor(image_backend: str = "torchvision") -> Any:
    """The Kimi-VL family's tiny ``Kimi_K25Processor`` (:func:`ppmedia.testing.tiny_models.kimi_vl.build_processor`):
    videos in chunks of 2 frames, one ``video_grid_thw`` row a chunk."""
    from .kimi_vl import build_processor as kimi_processor

    return kimi_processor(image_backend)
