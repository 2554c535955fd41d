"""An example third-party ppmedia plugin that brings a media layout ppmedia lacks, for LLaVA-OneVision
(``llava_onevision``).

ppmedia serves LLaVA-OneVision itself (:mod:`ppmedia.adapters.llava_onevision`: crops with
``image_sizes`` and per-sample ``batch_num_images``, videos ``[videos, frames, C, H, W]`` by the
built-in ``onevision_videos`` layout, which requires ``pixel_values_videos`` alone). This plugin, as a
newcomer would write one, adds without touching ppmedia:

* a MEDIA LAYOUT (hook ``ppmedia_media_layouts``): the videos together with their per-frame sizes
  ``image_sizes_videos`` ``[videos, frames, 2]`` (an argument ``LlavaOnevisionModel.forward`` accepts).
  Its layout requires ``pixel_values_videos`` AND ``image_sizes_videos``, strictly more than the
  built-in one, so it wins for a batch holding both (without the plugin ``split_media`` would not
  know ``image_sizes_videos`` at all); its name and keys clash with nothing registered. Both keys are
  staged per microbatch as views, checked all or nothing, the sizes in
  ``chunk.extras["image_sizes_videos"]``;
* an ADAPTER that takes ``llava_onevision`` over from the built-in (``override = True``) and checks
  the staged sizes against the frames before the vision tower runs. Its per-sample input
  ``batch_num_images`` (one entry per sample HOLDING images, turned into ``[B]``) is the built-in
  adapter's, inherited: :class:`~ppmedia.adapters.base.SampleInput` declarations travel with the class.

Installed, it would announce itself like the LLaVA-1.5 example (entry point ``ppmedia.adapters``);
its tests name it in ``plugins=[...]``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

import ppmedia
from ppmedia.adapters.base import HostValues, VlmAdapter
from ppmedia.adapters.llava_onevision import LlavaOnevisionAdapter as BuiltinOnevision
from ppmedia.layouts import item_layout

SIZES = "image_sizes_videos"

#: the videos with per-frame sizes: items on axis 0 of both keys; counted by the batch's
#: n_videos_per_sample or the adapter's videos_per_sample, like any video layout.
VIDEOS_WITH_SIZES = item_layout("onevision_videos_with_sizes", "video", "pixel_values_videos", per_item={SIZES: SIZES})


class LlavaOnevisionAdapter(BuiltinOnevision):
    """ppmedia's LLaVA-OneVision adapter, checking the staged per-frame video sizes."""

    name = "llava_onevision_example"
    model_types = ("llava_onevision",)
    override = True  # ppmedia serves llava_onevision too: this plugin, loaded, takes it over

    def host_inputs(self, chunk: ppmedia.VlmMediaChunk, config: Any) -> dict[str, Tensor]:
        inputs = super().host_inputs(chunk, config)
        sizes, videos = (chunk.extras or {}).get(SIZES), chunk.pixel_values_videos
        if (sizes is None) != (videos is None):
            raise ValueError(f"llava_onevision_example: pixel_values_videos {videos is not None}, {SIZES} {sizes is not None}; expected both or neither")
        if sizes is not None and videos is not None:
            if tuple(sizes.shape) != (videos.shape[0], videos.shape[1], 2):
                raise ValueError(f"{SIZES}: shape {list(sizes.shape)}; expected [{videos.shape[0]}, {videos.shape[1]}, 2] (videos, frames, (h, w))")
            inputs[SIZES] = sizes
        return inputs

    def feature_counts(self, chunk: ppmedia.VlmMediaChunk, config: Any, host: HostValues) -> dict[str, int]:
        flat = host.values.get(SIZES)
        if flat and min(flat) < 1:
            raise ValueError(f"{SIZES}: a frame of size {min(flat)}; expected heights and widths >= 1")
        return super().feature_counts(chunk, config, host)


@ppmedia.hookimpl
def ppmedia_adapters() -> list[type[VlmAdapter]]:
    return [LlavaOnevisionAdapter]


@ppmedia.hookimpl
def ppmedia_media_layouts() -> list[Any]:
    return [VIDEOS_WITH_SIZES]
