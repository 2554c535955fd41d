"""The padded-frames video planner of :func:`ppmedia.split_media` (Gemma 4 videos).

Gemma 4's video processor writes every sampled frame as one image of padded patches:

* ``pixel_values_videos`` ``[frames, max_patches, D]``, the frames of all videos one after another;
* ``video_position_ids`` ``[frames, max_patches, 2]``, each patch's ``(x, y)``, ``-1`` for padding;
* ``num_frames_per_video`` ``[videos]``, how many of those frames each video has.

The frames have no ``video_grid_thw``, so the Qwen-style video planner
(:func:`ppmedia.planners.plan_videos`) cannot cut them. Microbatch ``k`` gets the frames of its
samples' videos (videos per sample: ``n_videos_per_sample`` in the batch or ``videos_per_sample``, e.g.
an adapter's ``media_counts``): ``pixel_values_videos`` and ``video_position_ids`` cut by frames,
``num_frames_per_video`` by videos, all views.
"""

from __future__ import annotations

from typing import Callable

from .planners import (
    Context,
    CountsArgument,
    FieldSplit,
    Media,
    Part,
    check_counts,
    check_range,
    default_counts,
    exact_sum,
    media_part,
    offsets,
    pending_counts,
    require_integer,
    require_readable,
    require_shape,
    shape_of,
)

__all__ = ["FRAME_KEYS", "plan_video_frames", "uses_frames"]

#: the batch keys of this layout besides ``pixel_values_videos``.
FRAME_KEYS: tuple[str, ...] = ("video_position_ids", "num_frames_per_video")


def uses_frames(media: Media) -> bool:
    """Whether the batch's videos are padded frames (it has any of :data:`FRAME_KEYS`)."""
    return any(media.get(key) is not None for key in FRAME_KEYS)


def plan_video_frames(ctx: Context, media: Media, videos_per_sample: CountsArgument) -> Callable[[], Part]:
    """Plan padded video frames (see the module docstring); call only when :func:`uses_frames`."""
    pixels, positions, frames = (media.get(k) for k in ("pixel_values_videos", *FRAME_KEYS))
    if media.get("video_grid_thw") is not None:
        raise ValueError(
            f"video_grid_thw: shape {shape_of(media['video_grid_thw'])} given with padded frames "
            f"({', '.join(k for k in FRAME_KEYS if media.get(k) is not None)}); expected one video layout"
        )
    if pixels is None:
        given = next(k for k in FRAME_KEYS if media.get(k) is not None)
        raise ValueError(f"{given}: shape {shape_of(media[given])} given without pixel_values_videos")
    if frames is None:
        raise ValueError(
            f"pixel_values_videos: shape {shape_of(pixels)} with video_position_ids but no num_frames_per_video; "
            f"expected num_frames_per_video [videos] (the video processor returns it)"
        )
    require_shape("pixel_values_videos", pixels, (None, None, None), "[frames, max_patches, D] (padded frames)")
    if positions is not None:
        require_integer("video_position_ids", positions)
        want = f"[{pixels.shape[0]}, {pixels.shape[1]}, 2] (one (x, y) per patch of pixel_values_videos {shape_of(pixels)})"
        require_shape("video_position_ids", positions, (pixels.shape[0], pixels.shape[1], 2), want)
    require_readable("num_frames_per_video", frames)
    require_shape("num_frames_per_video", frames, (None,), "[videos] (frames of each video)")
    n_videos, n_frames = frames.shape[0], pixels.shape[0]
    counts = pending_counts(ctx, media, "n_videos_per_sample", "videos_per_sample", videos_per_sample)
    if counts is None:
        counts = default_counts(ctx, "pixel_values_videos", n_videos, "videos", "n_videos_per_sample", "videos_per_sample")
    ready = counts
    slot = ctx.reader.add(frames)

    def finish() -> Part:
        per_video = ctx.reader.values[slot]
        check_range("num_frames_per_video", per_video, n_frames, "frames", lambda i: f"video {i}")
        if exact_sum(per_video, n_frames) != n_frames or (per_video.size and int(per_video.min()) == 0):
            raise ValueError(
                f"num_frames_per_video: {per_video.tolist()} (sum {exact_sum(per_video)}); expected positive "
                f"counts summing to {n_frames}, the frames of pixel_values_videos {shape_of(pixels)}"
            )
        per_sample = ready.values(ctx.reader)
        item_at = check_counts(ctx, ready, per_sample, n_videos, "videos")[ctx.at]
        row_at = offsets(per_video)[item_at]
        part = media_part(("pixel_values_videos", "pixel_values_videos", pixels),
                          [("num_frames_per_video", "num_frames_per_video", frames)], item_at, row_at)
        if positions is not None:
            pixel_field = part.fields[0]
            part.fields.insert(1, FieldSplit("video_position_ids", "video_position_ids", positions,
                                             pixel_field.ranges, pixel_field.sizes))
        return part

    return finish

