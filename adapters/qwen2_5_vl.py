"""Qwen2.5-VL / Qwen2-VL: flat patch rows with a ``(t, h, w)`` grid per image or video.

Media layout (what a :class:`~ppmedia.VlmMediaChunk` holds for this family):

* ``pixel_values`` ``[patches, D]``: the patch rows of the microbatch's images, image after image
  (``D = C * temporal_patch * patch * patch``); ``image_grid`` ``[images, 3]`` ``(t, h, w)`` in patches,
  or ``[images, 2]`` ``(h, w)`` meaning ``t = 1``.
* ``pixel_values_videos`` / ``video_grid``: the same for videos.

An image or video yields ``t * h * w / merge**2`` features (``merge = vision_config.spatial_merge_size``),
one per placeholder token; the processor writes each as ``vision_start, pad * n, vision_end`` with
``pad`` the image or the video token.
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..chunk import VlmMediaChunk
from .base import VlmAdapter, config_value, inner_model

__all__ = ["Qwen2_5_VLAdapter"]

_QWEN = "a Qwen2-VL-style model (Qwen2_5_VLForConditionalGeneration or its inner model)"


def _grid_thw(grid: Tensor | None, what: str) -> Tensor | None:
    """``grid`` as ``[n, 3]`` ``(t, h, w)``; an ``[n, 2]`` ``(h, w)`` grid gets ``t = 1`` prepended."""
    if grid is None:
        return None
    if grid.dim() != 2 or grid.shape[1] not in (2, 3):
        raise ValueError(f"{what} must be [n, 3] (t, h, w) or [n, 2] (h, w); got shape {tuple(grid.shape)}")
    if grid.shape[1] == 3:
        return grid
    return torch.nn.functional.pad(grid, (1, 0), value=1)  # t = 1 column


def _rows(pixels: Tensor | None) -> int:
    return 0 if pixels is None else int(pixels.shape[0])


class Qwen2_5_VLAdapter(VlmAdapter):
    """Adapter of the Qwen2.5-VL family (``qwen2_5_vl``) and of Qwen2-VL (``qwen2_vl``).

    Module paths it expects (``transformers``' ``Qwen2_5_VLForConditionalGeneration`` and
    ``Qwen2VLForConditionalGeneration`` have them; a remote-code checkpoint with the same structure
    works too):

    * ``model.model.visual`` (or ``model.visual``): the vision tower, called as
      ``visual(pixel_rows, grid_thw=grid)``; it returns the merged, projected features ``[tokens, hidden]``
      either as a tensor or as the ``pooler_output`` of its output;
    * ``model.model.get_rope_index(input_ids, mm_token_type_ids, image_grid_thw=, video_grid_thw=,
      attention_mask=)`` for the mrope positions (``mm_token_type_ids`` is left out when the method
      does not take it, as in transformers 4.x);
    * config fields ``image_token_id``, ``video_token_id``, ``vision_start_token_id`` and
      ``vision_config.spatial_merge_size``.

    Video timing: :meth:`position_ids` passes the chunk's ``second_per_grid_ts`` (``[videos]``, split
    with its videos by :func:`ppmedia.split_media`) to ``get_rope_index``, so video frames are spaced as
    the model spaces them for any fps; without it, ``get_rope_index``'s default (one second per temporal
    grid step), as the model itself does when that argument is not passed.
    """

    name: ClassVar[str] = "qwen2_5_vl"
    model_types: ClassVar[tuple[str, ...]] = ("qwen2_5_vl", "qwen2_vl")
    layout: ClassVar[str] = (
        "flat patch rows [patches, D] with grid [images, 3] (t, h, w) or [images, 2] (t = 1); "
        "videos likewise"
    )

    # -- config ----------------------------------------------------------------------------------
    @staticmethod
    def _token_ids(config: Any) -> tuple[int, int]:
        image = config_value(config, "image_token_id", "text_config.image_token_id")
        video = config_value(config, "video_token_id", "text_config.video_token_id")
        return int(image), int(video)

    @staticmethod
    def _merge(config: Any) -> int:
        return int(config_value(config, "vision_config.spatial_merge_size", "spatial_merge_size"))

    # -- token side ------------------------------------------------------------------------------
    def media_per_sample(self, input_ids: Tensor, config: Any) -> tuple[Tensor, Tensor]:
        """Count each sample's images and videos: a ``vision_start`` token followed by the image (video)
        token opens one image (video). Without ``vision_start_token_id`` in the config, every run of
        consecutive image (video) tokens counts as one. Device ops only, no host read."""
        image_id, video_id = self._token_ids(config)
        try:
            start_id: int | None = int(config_value(config, "vision_start_token_id"))
        except AttributeError:
            start_id = None
        if start_id is not None:
            opens = input_ids[:, :-1] == start_id
            nxt = input_ids[:, 1:]
            images = (opens & (nxt == image_id)).sum(dim=1)
            videos = (opens & (nxt == video_id)).sum(dim=1)
        else:
            def runs(token: int) -> Tensor:
                hit = input_ids == token
                first = hit.clone()
                first[:, 1:] &= ~hit[:, :-1]
                return first.sum(dim=1)

            images, videos = runs(image_id), runs(video_id)
        return images.to(torch.int64), videos.to(torch.int64)

    def placeholder_masks(self, input_ids: Tensor, config: Any) -> dict[str, Tensor]:
        image_id, video_id = self._token_ids(config)
        return {"image": input_ids == image_id, "video": input_ids == video_id}

    # -- media side ------------------------------------------------------------------------------
    def feature_counts(self, chunk: VlmMediaChunk, config: Any) -> dict[str, Tensor | int]:
        """Features per modality from the patch-row counts (shapes only): ``rows // merge**2``."""
        unit = self._merge(config) ** 2
        counts: dict[str, Tensor | int] = {}
        for modality, pixels in (("image", chunk.pixel_values), ("video", chunk.pixel_values_videos)):
            rows = _rows(pixels)
            if rows % unit:
                raise ValueError(
                    f"{modality}: {rows} patch rows is not a multiple of spatial_merge_size**2 = {unit}"
                )
            counts[modality] = rows // unit
        return counts

    def encode(self, model: torch.nn.Module, chunk: VlmMediaChunk) -> dict[str, Tensor]:
        """Run ``visual`` once per present modality on exactly the chunk's rows and grids."""
        visual = inner_model(model, "visual", _QWEN).visual
        dtype = next(visual.parameters()).dtype
        features: dict[str, Tensor] = {}
        for modality, pixels, grid in (
            ("image", chunk.pixel_values, chunk.image_grid),
            ("video", chunk.pixel_values_videos, chunk.video_grid),
        ):
            if pixels is None:
                continue
            grid = _grid_thw(grid, f"{modality} grid")
            if grid is None:
                raise ValueError(f"{modality}: the chunk has {_rows(pixels)} patch rows but no grid")
            if pixels.dim() != 2:
                raise ValueError(
                    f"{modality}: expected flat patch rows [patches, D]; got shape {tuple(pixels.shape)}"
                )
            # The vision tower reads the grid on the host anyway; check it covers exactly the rows, so
            # a grid/rows mismatch fails here and not as a reshape error deep inside the tower.
            patches = int(grid.prod(dim=-1).sum())
            if patches != pixels.shape[0]:
                raise ValueError(
                    f"{modality}: the grid covers {patches} patches but the chunk has "
                    f"{pixels.shape[0]} patch rows"
                )
            out = visual(pixels.to(dtype), grid_thw=grid)
            features[modality] = out if isinstance(out, Tensor) else out.pooler_output
        return features

    # -- positions -------------------------------------------------------------------------------
    def position_ids(
        self,
        model: torch.nn.Module,
        input_ids: Tensor,
        chunk: VlmMediaChunk | None,
        attention_mask: Tensor | None = None,
    ) -> Tensor:
        """mrope positions ``[3, b, S]`` of the microbatch, from its tokens and the chunk's grids.

        Also for a text-only microbatch (``chunk`` ``None``), so every microbatch gets positions of the
        same form as the full batch (padding positions are 0, as in ``get_rope_index``).
        """
        inner = inner_model(model, "visual", _QWEN)
        image_id, video_id = self._token_ids(model.config)
        image_grid = video_grid = None
        seconds = None
        if chunk is not None:
            image_grid = _grid_thw(chunk.image_grid, "image grid")
            video_grid = _grid_thw(chunk.video_grid, "video grid")
            seconds = getattr(chunk, "second_per_grid_ts", None)
        kwargs: dict[str, Any] = {
            "image_grid_thw": image_grid,
            "video_grid_thw": video_grid,
            "attention_mask": attention_mask,
        }
        if seconds is not None:  # [videos]: seconds per temporal grid step of each video of the chunk
            kwargs["second_per_grid_ts"] = seconds
        if _takes_token_types(inner.get_rope_index):
            # transformers 5.x groups tokens by this type (text 0, image 1, video 2); without it the
            # model's own forward would silently use 1-D positions.
            kwargs["mm_token_type_ids"] = (input_ids == image_id).to(torch.int32) + 2 * (
                input_ids == video_id
            ).to(torch.int32)
        positions, _deltas = inner.get_rope_index(input_ids, **kwargs)
        return positions


def _takes_token_types(fn: Any) -> bool:
    try:
        return "mm_token_type_ids" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
