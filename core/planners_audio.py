"""The audio planner of :func:`ppmedia.split_media`: audio clips, one clip per row of axis 0.

Audio clips are media like images: a sample may hold none, one or several, so they cannot be split
along dim 0 with the samples. Every family in transformers stages them clip-major:

=========================  ===========================================  ===================================
family                     clips (chunk field ``input_features``)       valid frames (``input_features_mask``)
=========================  ===========================================  ===================================
Gemma 4                    ``input_features`` ``[audios, T, mel]``      ``input_features_mask`` ``[audios, T]``
Qwen2.5-Omni, Qwen3-Omni   ``input_features`` ``[audios, mel, T]``      ``feature_attention_mask`` ``[audios, T]``
Inkling                    ``audio_input_ids`` ``[audios, frames, 80]`` ``audio_input_ids_mask`` ``[audios, frames]``
=========================  ===========================================  ===================================

Microbatch ``k`` gets the clips of its samples: ``n_audios_per_sample`` ``[B]`` in the batch, or the
``audios_per_sample`` argument (an adapter's ``media_counts``, counted from the placeholder blocks),
or one clip per sample when there are exactly ``B``. Both tensors are cut into views along axis 0.

Checks (shapes and dtypes only, before the one host read; counts after it): at most one features key
and one mask key; a mask only with features; the mask ``[audios, T]`` with the features' clips and
the features' time axis (axis 1, or the last axis for Whisper's ``feature_attention_mask``); float
features (``input_features``) or integer codes (``audio_input_ids``); a bool or integer mask; counts
that sum to the clips. Every failure is a ``ValueError``/``TypeError`` naming the key and the shapes.
"""

from __future__ import annotations

from typing import Callable

import torch

from .planners import (
    Context,
    CountsArgument,
    Media,
    Part,
    check_counts,
    default_counts,
    media_part,
    no_media,
    pending_counts,
    require_integer,
    shape_of,
)

__all__ = ["AUDIO_FEATURE_KEYS", "AUDIO_KEYS", "AUDIO_MASK_KEYS", "plan_audio"]

#: batch keys holding the clips (staged as the chunk's ``input_features``); at most one per batch.
AUDIO_FEATURE_KEYS: tuple[str, ...] = ("input_features", "audio_input_ids")
#: batch keys holding each clip's valid frames (the chunk's ``input_features_mask``) -> the axis of the
#: clips tensor that the mask's frames index (Whisper's features are ``[audios, mel, T]``).
AUDIO_MASK_KEYS: dict[str, int] = {"input_features_mask": 1, "feature_attention_mask": -1, "audio_input_ids_mask": 1}
#: every audio key :func:`ppmedia.split_media` pops (the counts key included).
AUDIO_KEYS: tuple[str, ...] = (*AUDIO_FEATURE_KEYS, *AUDIO_MASK_KEYS, "n_audios_per_sample")
_AUDIO_KEY_SET = frozenset(AUDIO_KEYS)


def _one_of(media: Media, keys: tuple[str, ...] | dict[str, int], what: str) -> str | None:
    present = [k for k in keys if media.get(k) is not None]
    if len(present) > 1:
        raise ValueError(f"{what}: got {' and '.join(present)}; expected at most one of them")
    return present[0] if present else None


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
    axis = AUDIO_MASK_KEYS[mask_key]
    frames = features.shape[axis]
    axis_name = "last" if axis < 0 else str(axis)
    if mask.dim() != 2 or mask.shape[0] != features.shape[0] or mask.shape[1] != frames:
        raise ValueError(
            f"{mask_key}: shape {shape_of(mask)}; expected [{features.shape[0]}, {frames}] (one row per clip of "
            f"{key} {shape_of(features)}, one entry per frame of its axis {axis_name}): the mask and the "
            f"features disagree"
        )


def plan_audio(ctx: Context, media: Media, audios_per_sample: CountsArgument) -> Callable[[], Part] | None:
    """Plan the audio clips and their mask, one clip per row; ``None`` when the batch has no audio.

    Returns the ``finish`` callable of the two-phase planner protocol (:mod:`ppmedia.planners`): its
    :class:`~ppmedia.planners.Part` holds ``input_features`` and ``input_features_mask`` cut by clips,
    and the clips per microbatch as both ``items`` and ``rows``.
    """
    if audios_per_sample is None and _AUDIO_KEY_SET.isdisjoint(media):  # the usual batch without audio
        return None
    key = _one_of(media, AUDIO_FEATURE_KEYS, "audio features")
    mask_key = _one_of(media, AUDIO_MASK_KEYS, "audio mask")
    counts = pending_counts(ctx, media, "n_audios_per_sample", "audios_per_sample", audios_per_sample)
    if key is None:
        if mask_key is not None:
            raise ValueError(
                f"{mask_key}: shape {shape_of(media[mask_key])} given without audio features; expected it "
                f"with one of {', '.join(AUDIO_FEATURE_KEYS)}"
            )
        return no_media(ctx, counts, "audios")
    features = media[key]
    _check_features(key, features)
    meta = []
    if mask_key is not None:
        mask = media[mask_key]
        _check_mask(mask_key, mask, key, features)
        meta.append(("input_features_mask", mask_key, mask))
    n_audios = features.shape[0]
    if counts is None:
        counts = default_counts(ctx, key, n_audios, "audios", "n_audios_per_sample", "audios_per_sample")
    ready = counts

    def finish() -> Part:
        per_sample = ready.values(ctx.reader)
        item_at = check_counts(ctx, ready, per_sample, n_audios, "audios")[ctx.at]
        return media_part(("input_features", key, features), meta, item_at, item_at)

    return finish
