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

import functools
import inspect
from typing import Any, Callable, ClassVar, Mapping

import torch
from torch import Tensor

from ..chunk import VlmMediaChunk
from ._helpers import as_tower_dtype, count_runs, grid_products, grid_thw, shape
from .base import HostValues, VlmAdapter, config_value, inner_model

__all__ = ["Qwen2_5_VLAdapter"]

_QWEN = "a Qwen2-VL-style model (Qwen2_5_VLForConditionalGeneration or its inner model)"


def _modalities(chunk: VlmMediaChunk) -> tuple[tuple[str, Tensor | None, Tensor | None], ...]:
    return (
        ("image", chunk.pixel_values, chunk.image_grid),
        ("video", chunk.pixel_values_videos, chunk.video_grid),
    )


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

    Video timing: :meth:`position_ids` passes the chunk's ``second_per_grid_ts`` ``[videos]`` to
    ``get_rope_index`` when it was staged; without it, video frames are spaced with
    ``get_rope_index``'s default (one second per temporal grid step), as the model itself does.
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
    def media_per_sample(
        self, input_ids: Tensor, config: Any, *, media: Mapping[str, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Count each sample's images and videos: a ``vision_start`` token followed by the image (video)
        token opens one image (video), so images written back to back are still told apart. Without
        ``vision_start_token_id`` in the config, every run of consecutive image (video) tokens counts
        as one. Device ops only, no host read; ``media`` is not needed."""
        image_id, video_id = self._token_ids(config)
        try:
            start_id: int | None = int(config_value(config, "vision_start_token_id"))
        except AttributeError:
            start_id = None
        if start_id is None:
            return count_runs(input_ids == image_id), count_runs(input_ids == video_id)
        opens = input_ids[:, :-1] == start_id
        following = input_ids[:, 1:]
        images = (opens & (following == image_id)).sum(dim=1, dtype=torch.int64)
        videos = (opens & (following == video_id)).sum(dim=1, dtype=torch.int64)
        return images, videos

    def placeholder_masks(self, input_ids: Tensor, config: Any) -> dict[str, Tensor]:
        image_id, video_id = self._token_ids(config)
        return {"image": input_ids == image_id, "video": input_ids == video_id}

    # -- media side ------------------------------------------------------------------------------
    def host_inputs(self, chunk: VlmMediaChunk, config: Any) -> dict[str, Tensor]:
        """``{"image_grid": [images, 3 or 2], "video_grid": [videos, 3 or 2]}`` (those present).

        Raises:
            ValueError: patch rows without a grid (or a grid without rows), rows that are not
                ``[patches, D]``, or a grid that is not ``[n, 3]`` / ``[n, 2]``.
        """
        inputs = {}
        for modality, pixels, grid in _modalities(chunk):
            if pixels is None and grid is None:
                continue
            if pixels is None or grid is None:
                raise ValueError(
                    f"{modality}: the chunk has patch rows {shape(pixels)} and grid {shape(grid)}; expected both"
                )
            if pixels.dim() != 2:
                raise ValueError(f"{modality}: patch rows of shape {shape(pixels)}; expected [patches, D]")
            if grid.dim() != 2 or grid.shape[1] not in (2, 3):
                raise ValueError(f"{modality} grid: shape {shape(grid)}; expected [n, 3] (t, h, w) or [n, 2] (h, w)")
            inputs[f"{modality}_grid"] = grid
        return inputs

    def feature_counts(self, chunk: VlmMediaChunk, config: Any, host: HostValues) -> dict[str, int]:
        """``t * h * w / merge**2`` per image (video), summed, after checking that the grids cover
        exactly the patch rows and every grid row is a whole number of ``merge x merge`` blocks.

        Raises:
            ValueError: the grid covers another number of patches than the chunk's rows, or a grid row
                whose patches are not a multiple of ``spatial_merge_size**2`` (row named).
        """
        unit = self._merge(config) ** 2
        counts = {"image": 0, "video": 0}
        for modality, pixels, grid in _modalities(chunk):
            if pixels is None or grid is None:
                continue
            patches = grid_products(host.values[f"{modality}_grid"], grid.shape[1])
            if sum(patches) != pixels.shape[0]:
                raise ValueError(
                    f"{modality}: the grid {shape(grid)} covers {sum(patches)} patches but the chunk has "
                    f"{pixels.shape[0]} patch rows"
                )
            for row, n in enumerate(patches):
                if n % unit:
                    raise ValueError(
                        f"{modality} grid: row {row} gives {n} patches, not a multiple of "
                        f"spatial_merge_size**2 = {unit}"
                    )
            counts[modality] = pixels.shape[0] // unit
        return counts

    def encode(self, model: torch.nn.Module, chunk: VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        """Run ``visual`` once per present modality on exactly the chunk's rows and grids (pixels cast
        to the tower's dtype; no copy when it matches)."""
        visual = inner_model(model, "visual", _QWEN).visual
        features: dict[str, Tensor] = {}
        for modality, pixels, grid in _modalities(chunk):
            if pixels is None or grid is None:
                continue
            out = visual(as_tower_dtype(pixels, visual), grid_thw=grid_thw(grid, f"{modality} grid"))
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
        kwargs: dict[str, Any] = {"attention_mask": attention_mask}
        if chunk is not None:
            if chunk.image_grid is not None:
                kwargs["image_grid_thw"] = grid_thw(chunk.image_grid, "image grid")
            if chunk.video_grid is not None:
                kwargs["video_grid_thw"] = grid_thw(chunk.video_grid, "video grid")
            if chunk.second_per_grid_ts is not None and _takes(type(inner).get_rope_index, "second_per_grid_ts"):
                kwargs["second_per_grid_ts"] = chunk.second_per_grid_ts
        if _takes(type(inner).get_rope_index, "mm_token_type_ids"):
            # transformers 5.x groups tokens by this type (text 0, image 1, video 2); without it the
            # model's own forward would silently use 1-D positions.
            kwargs["mm_token_type_ids"] = (input_ids == image_id).to(torch.int32) + 2 * (
                input_ids == video_id
            ).to(torch.int32)
        positions: Tensor = inner.get_rope_index(input_ids, **kwargs)[0]
        return positions


@functools.lru_cache(maxsize=64)
def _takes(get_rope_index: Callable[..., Any], parameter: str) -> bool:
    """Whether the class's ``get_rope_index`` takes ``parameter`` (cached: ``inspect`` is slow)."""
    try:
        return parameter in inspect.signature(get_rope_index).parameters
    except (TypeError, ValueError):
        return True
