"""The plugin's tiny family: ppmedia's tiny LLaVA-OneVision with per-frame video sizes.

Model, config and media are :mod:`ppmedia.testing.tiny_models.llava_onevision`'s (8 samples; images
tiled or base-only by ``batch_num_images``, which holds one entry per sample that holds images; 3
videos of 2 frames in samples 2, 6 and 7; microbatch 2 of 4 text-only). The batch adds
``image_sizes_videos`` ``[videos, frames, 2]``, which only the plugin's layout splits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ppmedia.testing.tiny_models import llava_onevision as base

MODEL_TYPE = base.MODEL_TYPE
build_config = base.build_config
build_model = base.build_model
SAMPLES = base.SAMPLES


def build_batch(seed: int = 0) -> dict[str, Tensor]:
    """ppmedia's tiny OneVision batch plus ``image_sizes_videos`` ``[3, 2, 2]`` (every frame 16 x 16)."""
    batch = base.build_batch(seed)
    videos = batch["pixel_values_videos"]
    batch["image_sizes_videos"] = torch.tensor([videos.shape[-2], videos.shape[-1]]).repeat(videos.shape[0], videos.shape[1], 1)
    return batch


def reference_inputs(batch: dict[str, Tensor]) -> dict[str, Any]:
    """Keyword arguments of the model's own full-batch forward (it accepts ``image_sizes_videos``)."""
    return {**base.reference_inputs(batch), "image_sizes_videos": batch["image_sizes_videos"]}
