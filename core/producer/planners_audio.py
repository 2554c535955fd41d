"""The audio planners: audio clips, one clip per row of axis 0 (layouts ``audio_features`` and
``audio_codes`` in :data:`ppmedia.producer.layouts.BUILTIN_LAYOUTS`).

Audio clips are media like images: a sample may hold none, one or several, so they cannot be split
along dim 0 with the samples. Every family in transformers stages them clip-major:

=========================  ===========================================  ===================================
family                     clips (chunk field ``input_features``)       valid frames (``input_features_mask``)
=========================  ===========================================  ===================================
Gemma 4                    ``input_features`` ``[audios, T, mel]``      ``input_features_mask`` ``[audios, T]``
Qwen2.5-Omni, Qwen3-Omni   ``input_features`` ``[audios, mel, T]``      ``feature_attention_mask`` ``[audios, T]``
Inkling                    ``audio_input_ids`` ``[audios, frames, 80]`` ``audio_input_ids_mask`` ``[audios, frames]``
=========================  ===========================================  ===================================

Microbatch ``k`` gets the clips of its samples: the split hands the planner the modality ``"audio"``'s
counts (``n_audios_per_sample`` ``[B]`` in the batch, or the ``audios_per_sample=`` argument, e.g. an
adapter's ``media_counts``, counted from the placeholder blocks), else one clip per sample when there
are exactly ``B``. Both tensors are cut into views along axis 0.

Checks (shapes and dtypes only, before the one host read; counts after it): at most one mask key;
the mask ``[audios, T]`` with the features' clips and the features' time axis (axis 1, or the last
axis for Whisper's ``feature_attention_mask``); float features (``input_features``) or integer codes
(``audio_input_ids``); a bool or integer mask; counts that sum to the clips. Which keys go together
(a mask only with its features, one features key per batch) is the layouts' selection. Every failure
is a ``ValueError``/``TypeError`` naming the key and the shapes.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from .planners import (
    Context,
    Counts,
    Part,
    check_counts,
    default_counts,
    media_part,
    require_integer,
    shape_of,
)

__all__ = ["AUDIO_FEATURE_KEYS", "AUDIO_MASK_AXES", "AUDIO_MASKS", "audio_planner"]

#: batch keys holding the clips (staged as the chunk's ``input_features``); one layout each.
AUDIO_FEATURE_KEYS: tuple[str, ...] = ("input_features", "audio_input_ids")
#: features key -> the mask keys that may come with it (staged as the chunk's ``input_features_mask``).
AUDIO_MASKS: dict[str, tuple[str, ...]] = {
    "input_features": ("input_features_mask", "feature_attention_mask"),
    "audio_input_ids": ("audio_input_ids_mask",),
}
#: mask key -> the axis of the clips tensor that the mask's frames index (Whisper's features are
#: ``[audios, mel, T]``).
AUDIO_MASK_AXES: dict[str, int] = {"input_features_mask": 1, "feature_attention_mask": -1, "audio_input_ids_mask": 1}


def _check_features(key: str, features: torch.Tensor) -> None:
    if features.dim() < 2:
        raise ValueError(f"{key}: shape {shape_of(features)}; expected at least 2 dims, clips first ([audios, ...])")
    if key == "audio_input_ids":
        require_integer(key, features)
    elif not features.is_floating_point():
        raise TypeError(f"{key}: dtype {features.dtype}; expected a floating dtype (audio features)")


def _check_mask(mask_key: str, mask: torch.Tensor, key: str, features: torch.Tensor) -> None:
    """The mask is ``[audios, T]``, bool or integer, with the features' clips and frames."""
    if mask.dtype != torch.bool:
        if mask.is_floating_point() or mask.is_complex():
            raise TypeError(f"{mask_key}: dtype {mask.dtype}; expected bool or an integer dtype (valid frames)")
        require_integer(mask_key, mask)
    axis = AUDIO_MASK_AXES[mask_key]
    frames = features.shape[axis]
    axis_name = "last" if axis < 0 else str(axis)
    if mask.dim() != 2 or mask.shape[0] != features.shape[0] or mask.shape[1] != frames:
        raise ValueError(
            f"{mask_key}: shape {shape_of(mask)}; expected [{features.shape[0]}, {frames}] (one row per clip of "
            f"{key} {shape_of(features)}, one entry per frame of its axis {axis_name}): the mask and the "
            f"features disagree"
        )


def audio_planner(key: str) -> Callable[[Context, Mapping[str, Any], "Counts | None"], Callable[[], Part]]:
    """The planner of the clips ``key`` (one of :data:`AUDIO_FEATURE_KEYS`) and their mask, one clip per row.

    Its ``finish()`` gives a :class:`~ppmedia.producer.planners.Part` holding ``input_features`` and
    ``input_features_mask`` cut by clips, and the clips per microbatch as both ``items`` and ``rows``.
    """
    mask_keys = AUDIO_MASKS[key]

    def plan(ctx: Context, media: Mapping[str, Any], counts: Counts | None) -> Callable[[], Part]:
        features = media[key]
        _check_features(key, features)
        present = [k for k in mask_keys if media.get(k) is not None]
        if len(present) > 1:
            raise ValueError(f"audio mask: got {' and '.join(present)}; expected at most one of them")
        meta = []
        if present:
            mask = media[present[0]]
            _check_mask(present[0], mask, key, features)
            meta.append(("input_features_mask", present[0], mask))
        n_audios = features.shape[0]
        pending = counts if counts is not None else default_counts(
            ctx, key, n_audios, "audios", "n_audios_per_sample", "audios_per_sample")

        def finish() -> Part:
            per_sample = pending.values(ctx.reader)
            item_at = check_counts(ctx, pending, per_sample, n_audios, "audios")[ctx.at]
            return media_part(("input_features", key, features), meta, item_at, item_at)

        return finish

    return plan
