"""Media layouts of built-in families that ppmedia's core layouts (:data:`ppmedia.layouts.BUILTIN_LAYOUTS`)
do not cover, declared as a plugin declares its own (:func:`ppmedia.layouts.item_layout`,
:func:`ppmedia.layouts.sample_layout`) and registered through the same hook
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
"""

from __future__ import annotations

from ..layouts import MediaLayout, item_layout, sample_layout

__all__ = ["FAMILY_LAYOUTS", "IDEFICS3_IMAGES", "ONEVISION_VIDEOS"]

#: LLaVA-OneVision videos ``[videos, frames, C, H, W]``, no grid.
ONEVISION_VIDEOS: MediaLayout = item_layout("onevision_videos", "video", "pixel_values_videos")

#: Idefics3 / SmolVLM images padded per sample: ``[B, max_crops, 3, H, W]`` + ``[B, max_crops, H, W]``.
IDEFICS3_IMAGES: MediaLayout = sample_layout(
    "idefics3_images", "image", {"pixel_values": "pixel_values", "pixel_attention_mask": "pixel_attention_mask"}
)

#: what the built-in plugin registers after the core layouts, in this order.
FAMILY_LAYOUTS: tuple[MediaLayout, ...] = (ONEVISION_VIDEOS, IDEFICS3_IMAGES)
