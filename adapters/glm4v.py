"""GLM-4.1V / GLM-4.5V / GLM-4.6V (``glm4v``, ``glm4v_moe``, ``glm46v``): Qwen-style patch rows with grids,
mrope, and videos whose frames use the IMAGE token.

Media layout of a chunk (as ``Glm4vImageProcessor`` / ``Glm4vVideoProcessor`` give them), Qwen2.5-VL's:

* ``pixel_values`` ``[patches, D]`` (``D = C * temporal_patch * patch * patch``, 1176 in the released
  models) with ``image_grid`` ``[images, 3]`` ``(t, h, w)`` (``[images, 2]``: ``t = 1``);
* ``pixel_values_videos`` ``[patches, D]`` with ``video_grid`` ``[videos, 3]``: ``t`` temporal patches
  each; the model encodes every temporal step as its own ``(1, h, w)`` image.

A grid row gives ``t * h * w / merge**2`` features. The text, as ``Glm4vProcessor`` writes it: an image
is ``<|begin_of_image|> <|image|> * n <|end_of_image|>``; a video is ``<|begin_of_video|>``, one such
image block per temporal step (``h * w / merge**2`` image tokens) followed by its timestamp, then
``<|end_of_video|>``. Video frames use the IMAGE token, so the two placeholder masks are built here:
an image token inside a video block (``video_start_token_id`` ... ``video_end_token_id``) is a video
placeholder, any other an image placeholder (what the processor's ``mm_token_type_ids`` say). Images
per sample are the image blocks outside videos, videos the video blocks.

transformers' own forward takes both masks as ``input_ids == image_token_id``, so it cannot run a batch
holding images AND videos ("Image features and image tokens do not match"); ppmedia's merge can, and
its result is checked against the model's own forward run once per modality
(:func:`ppmedia.testing.tiny_models.glm4v.mixed_reference`).

Positions: mrope ``[3, b, S]`` from the model's own ``get_rope_index(input_ids, mm_token_type_ids,
image_grid_thw=, video_grid_thw=, attention_mask=)`` with the token types derived from the ids as above;
they travel to every stage as a wire tensor (``position_ids`` ``[b, 3, S]``), as Qwen2.5-VL's.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch
from torch import Tensor

from ..chunk import VlmMediaChunk
from ._helpers import as_tower_dtype, grid_thw, shape
from .base import HostValues, config_value, inner_model
from .qwen2_5_vl import Qwen2_5_VLAdapter

__all__ = ["Glm4vAdapter"]

_GLM = "a GLM-4V model (Glm4vForConditionalGeneration, Glm4vMoeForConditionalGeneration, Glm46VForConditionalGeneration)"


class Glm4vAdapter(Qwen2_5_VLAdapter):
    """Adapter of GLM-4.1V (``glm4v``), GLM-4.5V (``glm4v_moe``) and GLM-4.6V (``glm46v``).

    Module paths: ``model.model.get_image_features(pixel_values, image_grid_thw)`` and
    ``get_video_features(pixel_values_videos, video_grid_thw)`` (vision tower with its merger),
    ``model.model.get_rope_index``; config fields ``image_token_id``, ``image_start_token_id``,
    ``video_start_token_id``, ``video_end_token_id``, ``vision_config.spatial_merge_size``. The grid
    checks (grid products cover the rows, whole ``merge x merge`` blocks) are Qwen2.5-VL's.
    """

    name: ClassVar[str] = "glm4v"
    model_types: ClassVar[tuple[str, ...]] = ("glm4v", "glm4v_moe", "glm46v")
    layout: ClassVar[str] = (
        "flat patch rows [patches, D] with grid [images, 3]; videos likewise, one grid row per video, "
        "its frames image blocks (the IMAGE token) inside video start/end"
    )

    @staticmethod
    def _ids(config: Any) -> tuple[int, int, int, int]:
        """``(image token, image start, video start, video end)`` ids."""
        return (
            int(config_value(config, "image_token_id")), int(config_value(config, "image_start_token_id")),
            int(config_value(config, "video_start_token_id")), int(config_value(config, "video_end_token_id")),
        )

    @classmethod
    def _inside_video(cls, input_ids: Tensor, config: Any) -> Tensor:
        """``[B, S]`` bool: positions after a video start and not after its end (device ops)."""
        _, _, start, end = cls._ids(config)
        return torch.cumsum(input_ids == start, dim=1) > torch.cumsum(input_ids == end, dim=1)

    # -- token side -------------------------------------------------------------------------
    def media_per_sample(
        self, input_ids: Tensor, config: Any, *, media: Mapping[str, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Images per sample: ``<|begin_of_image|>`` tokens outside video blocks; videos: video start
        tokens. Device ops only, no host read; ``media`` is not needed."""
        _, image_start, video_start, _ = self._ids(config)
        outside = ~self._inside_video(input_ids, config)
        images = ((input_ids == image_start) & outside).sum(dim=1, dtype=torch.int64)
        videos = (input_ids == video_start).sum(dim=1, dtype=torch.int64)
        return images, videos

    def placeholder_masks(self, input_ids: Tensor, config: Any) -> dict[str, Tensor]:
        """Image tokens outside video blocks are image placeholders, inside them video placeholders."""
        image = input_ids == self._ids(config)[0]
        inside = self._inside_video(input_ids, config)
        return {"image": image & ~inside, "video": image & inside}

    def mm_token_type_ids(self, input_ids: Tensor, config: Any) -> Tensor:
        """``[b, S]`` int32: 1 at image placeholders, 2 at video placeholders, 0 elsewhere (what
        ``Glm4vProcessor.create_mm_token_type_ids`` gives), from the ids."""
        masks = self.placeholder_masks(input_ids, config)
        return masks["image"].to(torch.int32) + 2 * masks["video"].to(torch.int32)

    # -- media side -------------------------------------------------------------------------
    def encode(self, model: torch.nn.Module, chunk: VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        """The model's own ``get_image_features`` / ``get_video_features`` per present modality:
        ``{modality: [tokens, text_hidden]}`` in placeholder order."""
        inner = inner_model(model, "get_image_features", _GLM)
        out: dict[str, Tensor] = {}
        for modality, pixels, grid, encoder in (
            ("image", chunk.pixel_values, chunk.image_grid, inner.get_image_features),
            ("video", chunk.pixel_values_videos, chunk.video_grid, inner.get_video_features),
        ):
            if pixels is None:
                continue
            if grid is None:
                raise ValueError(f"glm4v {modality}: the chunk has patch rows {shape(pixels)} but no grid")
            rows = as_tower_dtype(pixels, inner.visual)
            features = encoder(rows, grid_thw(grid, f"{modality} grid"), return_dict=True).pooler_output
            out[modality] = torch.cat(list(features), dim=0)
        return out

    # -- positions --------------------------------------------------------------------------
    def position_ids(
        self,
        model: torch.nn.Module,
        input_ids: Tensor,
        chunk: VlmMediaChunk | None,
        attention_mask: Tensor | None = None,
    ) -> Tensor:
        """mrope positions ``[3, b, S]`` from the model's own ``get_rope_index``, with the token types of
        :meth:`mm_token_type_ids`; also for a text-only microbatch (``chunk`` ``None``)."""
        inner = inner_model(model, "get_rope_index", _GLM)
        kwargs: dict[str, Any] = {"attention_mask": attention_mask}
        if chunk is not None and chunk.image_grid is not None:
            kwargs["image_grid_thw"] = grid_thw(chunk.image_grid, "image grid")
        if chunk is not None and chunk.video_grid is not None:
            kwargs["video_grid_thw"] = grid_thw(chunk.video_grid, "video grid")
        types = self.mm_token_type_ids(input_ids, model.config)
        positions: Tensor = inner.get_rope_index(input_ids, mm_token_type_ids=types, **kwargs)[0]
        return positions
