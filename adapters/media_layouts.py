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
* :data:`PHI4_IMAGES` (Phi-4-multimodal): ``image_pixel_values`` ``[images, max_crops, 3, S, S]``
  padded crops with ``image_sizes`` ``[images, 2]`` and ``image_attention_mask``
  ``[images, max_crops, S/p, S/p]``, one image per row (staged as ``pixel_values``, ``image_grid``
  and ``chunk.extras["image_attention_mask"]``).
* :data:`PHI4_AUDIO` (Phi-4-multimodal): ``audio_input_features`` ``[audios, T, mel]`` with
  ``audio_embed_sizes`` ``[audios]`` and, when the processor gives it (more than one clip a call),
  ``audio_attention_mask`` ``[audios, T]`` (staged as ``input_features``,
  ``chunk.extras["audio_embed_sizes"]`` and ``input_features_mask``).
"""

from __future__ import annotations

from ..layouts import MediaLayout, item_layout, sample_layout

__all__ = ["FAMILY_LAYOUTS", "IDEFICS3_IMAGES", "ONEVISION_VIDEOS", "PHI4_AUDIO", "PHI4_IMAGES"]

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

#: what the built-in plugin registers after the core layouts, in this order.
FAMILY_LAYOUTS: tuple[MediaLayout, ...] = (ONEVISION_VIDEOS, IDEFICS3_IMAGES, PHI4_IMAGES, PHI4_AUDIO)
