"""ERNIE 4.5 VL MoE (``ernie4_5_vl_moe``): Qwen-style patch rows with grids, mrope, and modality-routed MoE
layers that need the token types on every stage.

Media layout of a chunk (as ``Ernie4_5_VLMoeImageProcessor`` / its video processor give them):

* ``pixel_values`` ``[patches, D]`` (``D = C * patch * patch``: 588 in the released models, no temporal
  packing) with ``image_grid`` ``[images, 3]`` ``(1, h, w)`` (``[images, 2]``: ``t = 1``): ``h * w /
  merge**2`` features each;
* ``pixel_values_videos`` ``[patches, D]`` with ``video_grid`` ``[videos, 3]`` ``(t, h, w)``, ``t``
  frames, a multiple of ``vision_config.temporal_merge_size`` (2): ``t * h * w / merge**2 /
  temporal_merge`` features each (the resampler merges frame pairs).

The text holds ``<|IMAGE_START|> <|image|> * n <|IMAGE_END|>`` per image and ``<|VIDEO_START|>
<|video|> * n <|VIDEO_END|>`` per video (distinct image and video tokens); images and videos per
sample are their start tokens.

Positions: mrope ``[3, b, S]`` from the model's own ``get_rope_index`` with ``mm_token_type_ids`` (image
1, video 2 at the placeholders, derived from the ids as the processor does), sent to every stage.

Token types for the MoE: every decoder layer takes ``moe_mm_token_type_ids`` ``[b, S]`` (the placeholders
plus the start/end tokens; nonzero tokens go to the vision experts). It is a
:class:`~ppmedia.adapters.base.SampleInput` with ``every_stage=True`` and ``kwarg``: the processor's
``[B, S]`` value in the batch is split with the samples and reaches every stage's language model as
``moe_mm_token_type_ids=``; a batch without it gets the processor's definition derived from the ids on
the first stage, which then travels the same way.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch
from torch import Tensor

from ..chunk import VlmMediaChunk
from ._helpers import as_tower_dtype, count_runs, grid_products, grid_thw, shape
from .base import HostValues, SampleInput, config_get, config_value, inner_model
from .qwen2_5_vl import Qwen2_5_VLAdapter

__all__ = ["Ernie4_5_VLAdapter"]

_ERNIE = "an ERNIE 4.5 VL model (Ernie4_5_VLMoeForConditionalGeneration or Ernie4_5_VLMoeModel)"
_MOE_TYPES = "moe_mm_token_type_ids"


class Ernie4_5_VLAdapter(Qwen2_5_VLAdapter):
    """ERNIE 4.5 VL MoE adapter (``Ernie4_5_VLMoeForConditionalGeneration``).

    Module paths: ``model.model.get_image_features(pixel_values, image_grid_thw)`` and
    ``get_video_features(pixel_values_videos, video_grid_thw)`` (vision tower and resampler),
    ``model.model.get_rope_index``; config fields ``image_token_id``, ``video_token_id``, the
    image/video start and end token ids, ``vision_config.spatial_merge_size`` and
    ``temporal_merge_size``.
    """

    name: ClassVar[str] = "ernie4_5_vl_moe"
    model_types: ClassVar[tuple[str, ...]] = ("ernie4_5_vl_moe",)
    layout: ClassVar[str] = (
        "flat patch rows [patches, C*p*p] with grid [images, 3] (t = 1); videos likewise, t frames "
        "(a multiple of temporal_merge_size); moe_mm_token_type_ids [B, S] on every stage"
    )
    sample_inputs: ClassVar[tuple[SampleInput, ...]] = (
        SampleInput(_MOE_TYPES, ("b", "S"), every_stage=True, kwarg=_MOE_TYPES),
    )

    @staticmethod
    def _temporal_merge(config: Any) -> int:
        return int(config_value(config, "vision_config.temporal_merge_size"))

    # -- token side -------------------------------------------------------------------------
    def media_per_sample(
        self, input_ids: Tensor, config: Any, *, media: Mapping[str, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Images (videos) per sample: their start tokens; without ``image_start_token_id``
        (``video_start_token_id``) in the config, the runs of image (video) tokens. Device ops only."""
        out = []
        for token, start_key in zip(self._token_ids(config), ("image_start_token_id", "video_start_token_id")):
            start = config_get(config, start_key)
            if start is None:
                out.append(count_runs(input_ids == token))
            else:
                out.append((input_ids == int(start)).sum(dim=1, dtype=torch.int64))
        return out[0], out[1]

    def token_types(self, input_ids: Tensor, config: Any) -> Tensor:
        """``mm_token_type_ids`` ``[b, S]`` int32 (image 1, video 2 at the placeholders), from the ids."""
        image, video = self._token_ids(config)
        return (input_ids == image).to(torch.int32) + 2 * (input_ids == video).to(torch.int32)

    def moe_token_types(self, input_ids: Tensor, config: Any) -> Tensor:
        """``moe_mm_token_type_ids`` ``[b, S]`` int64 as the processor makes them: :meth:`token_types`
        plus 1 at image start/end and 2 at video start/end tokens (the ones the config names)."""
        types = self.token_types(input_ids, config).to(torch.int64)
        for value, keys in ((1, ("image_start_token_id", "image_end_token_id")), (2, ("video_start_token_id", "video_end_token_id"))):
            for key in keys:
                token = config_get(config, key)
                if token is not None:
                    types = types + value * (input_ids == int(token)).to(torch.int64)
        return types

    # -- media side -------------------------------------------------------------------------
    def feature_counts(self, chunk: VlmMediaChunk, config: Any, host: HostValues) -> dict[str, int]:
        """Qwen2.5-VL's grid checks, then ``h * w / merge**2`` per image and ``t * h * w / merge**2 /
        temporal_merge`` per video.

        Raises:
            ValueError: an image grid row with ``t != 1``, or a video whose ``t`` is not a multiple of
                ``temporal_merge_size`` (row named), besides Qwen2.5-VL's checks.
        """
        counts = super().feature_counts(chunk, config, host)
        temporal = self._temporal_merge(config)
        for modality, grid in (("image", chunk.image_grid), ("video", chunk.video_grid)):
            if grid is None:
                continue
            frames = host.values[f"{modality}_grid"][0::3] if grid.shape[1] == 3 else [1] * grid.shape[0]  # [n, 2]: t = 1
            for row, t in enumerate(frames):
                if modality == "image" and t != 1:
                    raise ValueError(f"image grid: row {row} has t = {t}; expected 1 (ERNIE 4.5 VL images are single frames)")
                if modality == "video" and t % temporal:
                    raise ValueError(
                        f"video grid: row {row} has t = {t} frames, not a multiple of temporal_merge_size = {temporal}"
                    )
        if chunk.video_grid is not None:
            counts["video"] = sum(grid_products(host.values["video_grid"], chunk.video_grid.shape[1])) // (
                self._merge(config) ** 2 * temporal
            )
        return counts

    def encode(self, model: torch.nn.Module, chunk: VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        """The model's own ``get_image_features`` / ``get_video_features`` per present modality:
        ``{modality: [tokens, text_hidden]}`` in placeholder order."""
        inner = inner_model(model, "get_image_features", _ERNIE)
        out: dict[str, Tensor] = {}
        for modality, pixels, grid, encoder in (
            ("image", chunk.pixel_values, chunk.image_grid, inner.get_image_features),
            ("video", chunk.pixel_values_videos, chunk.video_grid, inner.get_video_features),
        ):
            if pixels is None:
                continue
            if grid is None:
                raise ValueError(f"ernie4_5_vl_moe {modality}: the chunk has patch rows {shape(pixels)} but no grid")
            rows = as_tower_dtype(pixels, inner.vision_tower)
            features = encoder(rows, grid_thw(grid, f"{modality} grid"), return_dict=True).pooler_output
            out[modality] = torch.cat(list(features), dim=0)
        return out

    # -- positions and token types on every stage -------------------------------------------
    def position_ids(
        self,
        model: torch.nn.Module,
        input_ids: Tensor,
        chunk: VlmMediaChunk | None,
        attention_mask: Tensor | None = None,
    ) -> Tensor:
        """mrope positions ``[3, b, S]`` from the model's own ``get_rope_index`` (also text-only)."""
        inner = inner_model(model, "get_rope_index", _ERNIE)
        kwargs: dict[str, Any] = {"attention_mask": attention_mask}
        if chunk is not None and chunk.image_grid is not None:
            kwargs["image_grid_thw"] = grid_thw(chunk.image_grid, "image grid")
        if chunk is not None and chunk.video_grid is not None:
            kwargs["video_grid_thw"] = grid_thw(chunk.video_grid, "video grid")
        types = self.token_types(input_ids, model.config)
        positions: Tensor = inner.get_rope_index(input_ids, mm_token_type_ids=types, **kwargs)[0]
        return positions

    def first_stage(
        self,
        model: torch.nn.Module,
        input_ids: Tensor,
        attention_mask: Tensor,
        inputs_embeds: Tensor,
        chunk: VlmMediaChunk | None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """:meth:`merge` and the positions, plus ``moe_mm_token_type_ids`` derived from the ids when the
        batch did not carry them (the staged ones are added by the stage otherwise)."""
        hidden, wire = super().first_stage(model, input_ids, attention_mask, inputs_embeds, chunk)
        extras = None if chunk is None else chunk.extras
        if extras is None or extras.get(_MOE_TYPES) is None:
            wire[_MOE_TYPES] = self.moe_token_types(input_ids, model.config)
        return hidden, wire
