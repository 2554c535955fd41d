"""The padded-frames video planner (Gemma 4 videos; layout ``video_frames`` in
:data:`ppmedia.producer.layouts.BUILTIN_LAYOUTS`).

Gemma 4's video processor writes every sampled frame as one image of padded patches:

* ``pixel_values_videos`` ``[frames, max_patches, D]``, the frames of all videos one after another;
* ``video_position_ids`` ``[frames, max_patches, 2]``, each patch's ``(x, y)``, ``-1`` for padding;
* ``num_frames_per_video`` ``[videos]``, how many of those frames each video has.

The frames have no ``video_grid_thw``, so the Qwen-style video layout cannot cut them. The layout is
an :func:`ppmedia.producer.layouts.item_layout` (rows per item = ``num_frames_per_video``, ``video_position_ids``
per row): microbatch ``k`` gets the frames of its samples' videos (videos per sample: the modality
``"video"``'s counts, e.g. an adapter's ``media_counts``), ``pixel_values_videos`` and
``video_position_ids`` cut by frames, ``num_frames_per_video`` by videos, all views.
:func:`frames_planner` adds the checks only this layout can make to the declared planner: padded
frames ``[frames, max_patches, D]``, integer positions of the pixels' shape, and no video of 0 frames.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from .planners import Context, Counts, Part, require_integer, require_readable, require_shape, shape_of

__all__ = ["frames_planner"]

Planner = Callable[[Context, Mapping[str, Any], "Counts | None"], Callable[[], Part]]


def frames_planner(items: Planner) -> Planner:
    """``items`` (the layout's declared planner) after the padded-frame checks (see the module docstring)."""

    def plan(ctx: Context, media: Mapping[str, Any], counts: Counts | None) -> Callable[[], Part]:
        pixels, positions, frames = media["pixel_values_videos"], media.get("video_position_ids"), media["num_frames_per_video"]
        require_shape("pixel_values_videos", pixels, (None, None, None), "[frames, max_patches, D] (padded frames)")
        if positions is not None:
            require_integer("video_position_ids", positions)
            want = f"[{pixels.shape[0]}, {pixels.shape[1]}, 2] (one (x, y) per patch of pixel_values_videos {shape_of(pixels)})"
            require_shape("video_position_ids", positions, (pixels.shape[0], pixels.shape[1], 2), want)
        require_readable("num_frames_per_video", frames)
        require_shape("num_frames_per_video", frames, (None,), "[videos] (frames of each video)")
        slot = ctx.reader.add(frames)
        finish = items(ctx, media, counts)

        def checked() -> Part:
            per_video = ctx.reader.values[slot]
            if per_video.size and int(per_video.min()) <= 0:
                i = int((per_video <= 0).nonzero()[0][0])
                raise ValueError(
                    f"num_frames_per_video: video {i} has {int(per_video[i])} frames; expected positive counts "
                    f"summing to {pixels.shape[0]}, the frames of pixel_values_videos {shape_of(pixels)}"
                )
            return finish()

        return checked

    return plan
