"""An example third-party ppmedia plugin that brings what ppmedia lacked: LLaVA-OneVision (``llava_onevision``).

It adds, without touching ppmedia:

* a MEDIA LAYOUT (hook ``ppmedia_media_layouts``): OneVision videos ``pixel_values_videos``
  ``[videos, frames, C, H, W]`` with no grid, one item per row of axis 0. ppmedia's own video layout
  needs ``video_grid_thw``; with this plugin registered, every ``split_media`` of a batch holding
  ``pixel_values_videos`` alone stages them per microbatch (as views, checked all or nothing);
* a PER-SAMPLE INPUT (``LlavaOnevisionAdapter.sample_inputs``): ``batch_num_images``. The processor
  writes one entry per sample that HOLDS images; :meth:`LlavaOnevisionAdapter.media_counts` turns it
  into ``[B]`` (zeros for samples without images), which counts each sample's images exactly (images
  written back to back form one run of placeholder tokens) and is staged per microbatch in
  ``chunk.extras["batch_num_images"]``, where ``encode`` reads it (one-image samples are tiled, the
  images of a several-image sample keep their base crop).

Images themselves use ppmedia's LLaVA-NeXT layout (crops ``[images, max_crops, C, H, W]`` with
``image_sizes``). Installed, it would announce itself like the LLaVA-1.5 example (entry point
``ppmedia.adapters``); its tests name it in ``plugins=[...]``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import Tensor

import ppmedia
from ppmedia.adapters._helpers import count_runs
from ppmedia.adapters.base import HostValues, SampleInput, VlmAdapter, inner_model
from ppmedia.adapters.llava_next import image_tokens
from ppmedia.layouts import item_layout

#: the videos: items on axis 0, nothing else; counted by the batch's n_videos_per_sample or the
#: adapter's videos_per_sample, like any video layout.
ONEVISION_VIDEOS = item_layout("onevision_videos", "video", "pixel_values_videos")


class LlavaOnevisionAdapter(VlmAdapter):
    """LLaVA-OneVision through the model's own ``get_image_features`` / ``get_video_features``."""

    name = "llava_onevision_example"
    model_types = ("llava_onevision",)
    layout = "crops [images, max_crops, C, H, W] + image_sizes; videos [videos, frames, C, H, W]"
    sample_inputs = (SampleInput("batch_num_images"),)
    override = True  # should ppmedia ever serve llava_onevision itself, this example still runs

    # -- token side ---------------------------------------------------------------------------
    def _ids(self, config: Any) -> tuple[int, int]:
        return int(config.image_token_index), int(config.video_token_index)

    def media_per_sample(
        self, input_ids: Tensor, config: Any, *, media: Mapping[str, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Images from ``batch_num_images`` (scattered to the samples holding image tokens), else one
        per run of image tokens; videos one per run of video tokens."""
        image, video = self._ids(config)
        counts = None if media is None else media.get("batch_num_images")
        images = count_runs(input_ids == image) if counts is None else self.per_sample_images(input_ids, config, counts)
        return images, count_runs(input_ids == video)

    def per_sample_images(self, input_ids: Tensor, config: Any, batch_num_images: Tensor) -> Tensor:
        """``[B]`` images per sample from the processor's ``[samples with images]`` counts."""
        holders = (input_ids == self._ids(config)[0]).any(dim=-1)
        if int(holders.sum()) != batch_num_images.shape[0]:  # the one host read of the counting
            raise ValueError(
                f"batch_num_images: shape {list(batch_num_images.shape)}; expected [{int(holders.sum())}] (one "
                f"entry per sample holding image tokens)"
            )
        per_sample = torch.zeros(input_ids.shape[0], dtype=torch.int64, device=input_ids.device)
        return per_sample.masked_scatter(holders, batch_num_images.to(per_sample))

    def media_counts(self, batch: Mapping[str, Any], config: Any) -> dict[str, Any]:
        """Counts, and ``batch_num_images`` as ``[B]`` to stage (counted once)."""
        counts = super().media_counts(batch, config)
        if batch.get("batch_num_images") is not None:
            counts["sample_inputs"] = {"batch_num_images": counts["images_per_sample"]}
        return counts

    def placeholder_masks(self, input_ids: Tensor, config: Any) -> dict[str, Tensor]:
        image, video = self._ids(config)
        return {"image": input_ids == image, "video": input_ids == video}

    # -- media side ---------------------------------------------------------------------------
    def host_inputs(self, chunk: ppmedia.VlmMediaChunk, config: Any) -> dict[str, Tensor]:
        inputs = {}
        if chunk.pixel_values is not None:
            if chunk.image_grid is None or chunk.pixel_values.dim() != 5:
                raise ValueError(f"llava_onevision: pixel_values {list(chunk.pixel_values.shape)} needs image_sizes and 5 dims")
            inputs["image_sizes"] = chunk.image_grid
        extras = chunk.extras or {}
        if "batch_num_images" in extras:
            inputs["batch_num_images"] = extras["batch_num_images"]
        return inputs

    def _tiled(self, host: HostValues) -> list[bool] | None:
        """Per image of the chunk: tiled (its sample has one image) or base crop only; ``None``: all tiled."""
        counts = host.values.get("batch_num_images")
        return None if counts is None else [n == 1 for n in counts if n for _ in range(n)]

    def feature_counts(self, chunk: ppmedia.VlmMediaChunk, config: Any, host: HostValues) -> dict[str, int]:
        side = config.vision_config.image_size // config.vision_config.patch_size
        images = 0
        if chunk.pixel_values is not None:
            sizes = host.rows("image_sizes", 2)
            tiled = self._tiled(host) or [True] * len(sizes)
            if len(tiled) != len(sizes):
                raise ValueError(f"llava_onevision: batch_num_images counts {len(tiled)} images; image_sizes {len(sizes)}")
            for (h, w), tile in zip(sizes, tiled):
                if tile and math.sqrt((image_tokens(h, w, config) - side * side) / (9 * side * side)) > 1.1:
                    raise ValueError(f"llava_onevision example: image ({h}, {w}) would be downsampled (anyres_max_9)")
                images += image_tokens(h, w, config) if tile else side * side + 1
        videos = chunk.pixel_values_videos
        per_video = videos.shape[1] * math.ceil(side / 2) ** 2 + 1 if videos is not None else 0
        return {"image": images, "video": 0 if videos is None else videos.shape[0] * per_video}

    def encode(self, model: torch.nn.Module, chunk: ppmedia.VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        inner = inner_model(model, "get_image_features", "a LlavaOnevisionForConditionalGeneration")
        config, out = model.config, {}
        kwargs = dict(vision_feature_layer=config.vision_feature_layer,
                      vision_feature_select_strategy=config.vision_feature_select_strategy)
        if chunk.pixel_values is not None:
            counts = host.values.get("batch_num_images")
            features = inner.get_image_features(
                pixel_values=chunk.pixel_values, image_sizes=host.rows("image_sizes", 2),
                vision_aspect_ratio=config.vision_aspect_ratio,
                batch_num_images=None if counts is None else [n for n in counts if n], **kwargs,
            ).pooler_output
            out["image"] = torch.cat(list(features), dim=0)
        if chunk.pixel_values_videos is not None:
            videos = inner.get_video_features(pixel_values_videos=chunk.pixel_values_videos, **kwargs).pooler_output
            out["video"] = videos.reshape(-1, videos.shape[-1])
        return out


@ppmedia.hookimpl
def ppmedia_adapters() -> list[type[VlmAdapter]]:
    return [LlavaOnevisionAdapter]


@ppmedia.hookimpl
def ppmedia_media_layouts() -> list[Any]:
    return [ONEVISION_VIDEOS]
