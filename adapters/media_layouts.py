"""Media layouts of built-in families that ppmedia's core layouts (:data:`ppmedia.producer.layouts.BUILTIN_LAYOUTS`)
do not cover, declared as a plugin declares its own (:func:`ppmedia.producer.layouts.item_layout`,
:func:`ppmedia.producer.layouts.sample_layout`) and registered through the same hook
(``ppmedia_media_layouts`` of :mod:`ppmedia.adapters.builtin`).

Kept apart from the adapter modules so that registering them imports no family's adapter or model
code (a registry lookup of one model type imports that family only).

* :data:`ONEVISION_VIDEOS` (LLaVA-OneVision): ``pixel_values_videos`` ``[videos, frames, C, H, W]``
  with no grid, one video per row of axis 0, mapped to samples by ``n_videos_per_sample`` or the
  adapter's ``videos_per_sample``. A batch that also holds ``video_grid_thw`` selects the core
  ``video_patch_rows`` layout instead (it requires strictly more).
* :data:`IDEFICS3_IMAGES` (Idefics3, SmolVLM): the processor pads images per sample,
  ``pixel_values`` ``[B, max_crops, 3, H, W]`` with ``pixel_attention_mask`` ``[B, max_crops, H, W]``:
  samples on axis 0, so microbatch ``k`` gets its samples' rows (all-zero crops are the processor's
  padding, which the model itself drops).
* :data:`PHI4_IMAGES` (Phi-4-multimodal): ``image_pixel_values`` ``[images, max_crops, 3, S, S]``
  padded crops with ``image_sizes`` ``[images, 2]`` and ``image_attention_mask``
  ``[images, max_crops, S/p, S/p]``, one image per row (staged as ``pixel_values``, ``image_grid``
  and ``chunk.extras["image_attention_mask"]``).
* :data:`PHI4_AUDIO` (Phi-4-multimodal): ``audio_input_features`` ``[audios, T, mel]`` with
  ``audio_embed_sizes`` ``[audios]`` and, when the processor gives it (more than one clip a call),
  ``audio_attention_mask`` ``[audios, T]`` (staged as ``input_features``,
  ``chunk.extras["audio_embed_sizes"]`` and ``input_features_mask``).
* :data:`VIDEOLLAMA3_IMAGES` (VideoLLaMA3): ``pixel_values`` ``[sum of h*w, D]`` patch rows with
  ``image_grid_thw`` ``[images, 3]`` and ``image_merge_sizes`` ``[images]`` (staged as
  ``pixel_values``, ``image_grid`` and ``chunk.extras["image_merge_sizes"]``). It requires strictly
  more than the core ``image_patch_rows_thw``, so a batch with merge sizes selects it.
* :data:`VIDEOLLAMA3_VIDEOS` (VideoLLaMA3): ``pixel_values_videos`` ``[sum of t*h*w, D]`` with
  ``video_grid_thw`` ``[videos, 3]``, ``video_merge_sizes`` ``[videos]`` and, optional,
  ``video_compression_mask`` ``[sum of t*h*w / merge**2]`` (bool): a third axis, one entry per video
  FEATURE before compression, so video ``i`` owns ``prod(grid[i]) / merge[i]**2`` entries of it, not
  ``prod(grid[i])`` rows. Microbatch ``k`` gets its videos' patch rows, grids, merge sizes and that
  many mask entries (staged as ``pixel_values_videos``, ``video_grid``,
  ``chunk.extras["video_merge_sizes"]``, ``chunk.extras["video_compression_mask"]``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Mapping

from ..producer.assemble import Part
from ..producer.declared import GridRows
from ..producer.layouts import MediaLayout, Planner, item_layout, sample_layout
from ..producer.planners import Context, Counts

__all__ = [
    "FAMILY_LAYOUTS",
    "IDEFICS3_IMAGES",
    "ONEVISION_VIDEOS",
    "PHI4_AUDIO",
    "PHI4_IMAGES",
    "VIDEOLLAMA3_IMAGES",
    "VIDEOLLAMA3_VIDEOS",
]

#: LLaVA-OneVision videos ``[videos, frames, C, H, W]``, no grid.
ONEVISION_VIDEOS: MediaLayout = item_layout("onevision_videos", "video", "pixel_values_videos")

#: Idefics3 / SmolVLM images padded per sample: ``[B, max_crops, 3, H, W]`` + ``[B, max_crops, H, W]``.
IDEFICS3_IMAGES: MediaLayout = sample_layout(
    "idefics3_images", "image", {"pixel_values": "pixel_values", "pixel_attention_mask": "pixel_attention_mask"}
)

#: Phi-4-multimodal's padded crops with their sizes and patch masks, one image a row.
PHI4_IMAGES: MediaLayout = item_layout(
    "phi4_images", "image", "image_pixel_values", field="pixel_values",
    per_item={"image_sizes": "image_grid", "image_attention_mask": "image_attention_mask"},
)

#: Phi-4-multimodal's audio features, one clip a row, with their token counts (and frame mask).
PHI4_AUDIO: MediaLayout = item_layout(
    "phi4_audio", "audio", "audio_input_features", field="input_features",
    per_item={"audio_embed_sizes": "audio_embed_sizes", "audio_attention_mask": "input_features_mask"},
    optional=("audio_attention_mask",),
)

#: VideoLLaMA3's image patch rows with per-image merge sizes.
VIDEOLLAMA3_IMAGES: MediaLayout = item_layout(
    "videollama3_images", "image", "pixel_values", rows_per_item=GridRows("image_grid_thw"),
    per_item={"image_grid_thw": "image_grid", "image_merge_sizes": "image_merge_sizes"},
)

_VIDEO_ROWS = item_layout(
    "videollama3_videos", "video", "pixel_values_videos", rows_per_item=GridRows("video_grid_thw"),
    per_item={"video_grid_thw": "video_grid", "video_merge_sizes": "video_merge_sizes"},
)
#: the compression mask cut by features: ``prod(grid) / merge**2`` entries a video (checked to add up)
_VIDEO_FEATURES = item_layout(
    "videollama3_video_features", "video", "video_compression_mask",
    rows_per_item=GridRows("video_grid_thw", merge="video_merge_sizes"),
)


def _with_compression_mask(rows: Planner, features: Planner) -> Planner:
    """``rows`` (patch rows, grids, merge sizes), plus the compression mask cut by ``features`` when the
    batch holds one: the same videos to each microbatch, one ``Part``."""

    def plan(ctx: Context, media: Mapping[str, Any], counts: Counts | None) -> Callable[[], Part]:
        finish = rows(ctx, media, counts)
        if media.get("video_compression_mask") is None:
            return finish
        keys = ("video_compression_mask", "video_grid_thw", "video_merge_sizes")
        finish_mask = features(ctx, {k: media[k] for k in keys}, counts)

        def both() -> Part:
            part, mask = finish(), finish_mask()
            return part._replace(fields=[*part.fields, *mask.fields])

        return both

    return plan


#: VideoLLaMA3's video patch rows with per-video merge sizes and the feature-level compression mask.
VIDEOLLAMA3_VIDEOS: MediaLayout = replace(
    _VIDEO_ROWS,
    plan=_with_compression_mask(_VIDEO_ROWS.plan, _VIDEO_FEATURES.plan),
    fields=(*_VIDEO_ROWS.fields, "video_compression_mask"),
    optional=("video_compression_mask",),
    axis0={**dict(_VIDEO_ROWS.axis0 or {}), "video_compression_mask": "video features before compression "
           "(prod(video_grid_thw) / video_merge_sizes**2 each video)"},
)

#: what the built-in plugin registers after the core layouts, in this order.
FAMILY_LAYOUTS: tuple[MediaLayout, ...] = (
    ONEVISION_VIDEOS, IDEFICS3_IMAGES, PHI4_IMAGES, PHI4_AUDIO, VIDEOLLAMA3_IMAGES, VIDEOLLAMA3_VIDEOS,
)
