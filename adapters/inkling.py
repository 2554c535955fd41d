"""Inkling (``inkling_mm_model``): image patches channels-last, one token per patch; discrete audio codes.

Media layout of a chunk (what ``InklingProcessor`` returns, split per microbatch):

* ``pixel_values`` ``[patches, temporal_patch, patch, patch, channels]`` (channels LAST), the patches
  of the microbatch's images in token order; each patch is one ``<image>`` token. The processor drops
  the patches per image, so :meth:`InklingAdapter.media_per_sample` counts a sample's ROWS (patches)
  from its image tokens, and ``split_media`` stages one row per token.
* ``input_features`` = ``audio_input_ids`` ``[audios, frames, n_mel_bins]`` integer dMel codes with
  ``input_features_mask`` = ``audio_input_ids_mask`` ``[audios, frames]``; a clip gives one token per
  valid frame. Clips per sample: its ``<audio_bos>`` tokens.

The head: the model divides the last hidden states by ``logits_mup_width_multiplier`` before
``lm_head`` and keeps the first ``unpadded_vocab_size`` logits; the pipeline's last stage does the same
(:meth:`InklingAdapter.logits`, :meth:`InklingAdapter.logits_width`). Nothing but the hidden states
and the mask crosses a stage boundary (positions are the default 1-D ones; every stage builds the
model's own masks).
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch
from torch import Tensor

from ..chunk import VlmMediaChunk
from ._helpers import check_audio_mask, pooled_image_features, refuse_videos, rows_from_tokens, shape
from ._helpers import text_config, token_ids, unpadded_logits, unpadded_width
from .base import HostValues, VlmAdapter, config_get, config_value, inner_model

__all__ = ["InklingAdapter"]

_INKLING = "an InklingForConditionalGeneration or InklingModel"


_TOKENS = {"image": "image_token_id", "audio": "audio_token_id", "audio_bos": "audio_bos_token_id"}


def _ids(config: Any) -> dict[str, int]:
    return token_ids(config, _TOKENS)


class InklingAdapter(VlmAdapter):
    """Inkling adapter (``InklingForConditionalGeneration``; layout in the module docstring).

    Module paths used: ``model.model.get_image_features(pixel_values)`` (``vision_tower``, its
    ``pooler_output``), ``model.model.get_audio_features(audio_input_ids, audio_input_ids_mask)``
    (``audio_tower``); config fields ``image_token_id``, ``audio_token_id``, ``audio_bos_token_id``,
    ``vision_config.patch_size`` / ``temporal_patch_size`` / ``num_channels``, the text config's
    ``logits_mup_width_multiplier`` and ``unpadded_vocab_size``.
    """

    name: ClassVar[str] = "inkling"
    model_types: ClassVar[tuple[str, ...]] = ("inkling_mm_model",)
    layout: ClassVar[str] = (
        "image patches [patches, T, P, P, C] channels-last, one token per patch (rows counted from tokens); "
        "discrete audio codes audio_input_ids [audios, frames, bins] + audio_input_ids_mask"
    )

    def media_per_sample(
        self, input_ids: Tensor, config: Any, *, media: Mapping[str, Any] | None = None
    ) -> tuple[Tensor, Tensor]:
        """``([B], [B])``: each sample's ``pixel_values`` ROWS (its image tokens: one per patch) and no videos."""
        return rows_from_tokens(input_ids, _ids(config)["image"], 1)

    def audios_per_sample(
        self, input_ids: Tensor, config: Any, *, media: Mapping[str, Any] | None = None
    ) -> Tensor:
        """``[B]`` audio clips per sample: its ``<audio_bos>`` tokens."""
        return (input_ids == _ids(config)["audio_bos"]).sum(dim=1, dtype=torch.int64)

    def placeholder_masks(self, input_ids: Tensor, config: Any) -> dict[str, Tensor]:
        ids = _ids(config)
        return {"image": input_ids == ids["image"], "audio": input_ids == ids["audio"]}

    def host_inputs(self, chunk: VlmMediaChunk, config: Any) -> dict[str, Tensor]:
        """``{"audio_frames": [audios]}`` (valid frames per clip); every shape checked first."""
        refuse_videos(chunk, "inkling")
        pixels = chunk.pixel_values
        if pixels is not None:
            vision = config_get(config, "vision_config")
            p, t = int(config_value(vision, "patch_size")), int(config_value(vision, "temporal_patch_size"))
            c = int(config_get(vision, "num_channels") or 3)
            if pixels.dim() != 5 or list(pixels.shape[1:]) != [t, p, p, c]:
                raise ValueError(
                    f"inkling pixel_values: shape {shape(pixels)}; expected [patches, {t}, {p}, {p}, {c}] "
                    f"(channels last, one row per image token)"
                )
        codes, mask = chunk.input_features, chunk.input_features_mask
        if codes is None:
            return {}
        mask = check_audio_mask(
            codes, mask, time_dim=1,
            message="inkling audio: audio_input_ids {features} with audio_input_ids_mask {mask}; "
            "expected [audios, frames, bins] with [audios, frames]",
        )
        return {"audio_frames": mask.to(torch.int64).sum(dim=-1)}

    def feature_counts(self, chunk: VlmMediaChunk, config: Any, host: HostValues) -> dict[str, int]:
        """``{"image": patches, "audio": valid frames}``."""
        counts = {"image": 0 if chunk.pixel_values is None else int(chunk.pixel_values.shape[0])}
        if "audio_frames" in host.values:
            counts["audio"] = sum(host.values["audio_frames"])
        return counts

    def encode(self, model: torch.nn.Module, chunk: VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        """The model's own towers: ``{"image": [patches, H], "audio": [frames, H]}``."""
        inner = inner_model(model, "get_audio_features", _INKLING)
        out: dict[str, Tensor] = {}
        if chunk.pixel_values is not None:  # [patches, H]: one row per patch, as the model's masked_scatter reads it
            out["image"] = pooled_image_features(model, chunk.pixel_values, _INKLING)
        if chunk.input_features is not None:
            out["audio"] = inner.get_audio_features(chunk.input_features, chunk.input_features_mask).last_hidden_state
        return out

    def logits(self, stage: torch.nn.Module, hidden: Tensor) -> Tensor:
        """As the model's head: the hidden states divided by ``logits_mup_width_multiplier``, ``lm_head``,
        then the first ``unpadded_vocab_size`` logits."""
        text = text_config(getattr(stage, "config"))
        multiplier = float(config_get(text, "logits_mup_width_multiplier") or 1.0)
        return unpadded_logits(super().logits(stage, hidden / multiplier), getattr(stage, "config"))

    def logits_width(self, config: Any, head_width: int) -> int:
        return unpadded_width(config, head_width)
