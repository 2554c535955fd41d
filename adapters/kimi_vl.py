"""Kimi-VL family adapter: MoonViT patch-major images (Kimi-VL, Kimi-K2.5).

Media layout read from a :class:`~ppmedia.VlmMediaChunk`:

* ``pixel_values`` ``[patches, C, P, P]``: each image cut into ``P x P`` patches (``P`` the vision
  ``patch_size``) in row-major grid order, all images of the microbatch concatenated on axis 0;
* ``image_grid`` ``[images, 2]`` (h, w), as Kimi-VL checkpoints stage ``image_grid_hws``, or
  ``[images, 3]`` (t, h, w) with ``t = 1``, as transformers' ``image_grid_thw``.

MoonViT averages every ``kh x kw`` block of patches (``vision_config.merge_kernel_size``, 2 x 2 in
every released checkpoint) into one token, so an image with grid ``(h, w)`` fills ``h * w / (kh * kw)``
placeholder tokens, and a microbatch's feature count is its patch rows divided by the kernel area.

Videos are not handled: Kimi-K2.5 video chunks (``t > 1``) do not run in transformers 5.23's own
``get_video_features``. A chunk carrying video media is refused before anything runs, and video
placeholder tokens without features fail the count check.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor

from ..chunk import VlmMediaChunk
from ._helpers import as_tower_dtype, count_runs, grid_products, grid_thw, images_from_runs, refuse_videos, shape
from .base import HostValues, VlmAdapter, config_get, config_value

__all__ = ["KimiVLAdapter"]

_GRID_KEYS = ("image_grid_hws", "image_grid_thw")


class KimiVLAdapter(VlmAdapter):
    """Runs the model's own MoonViT tower and projector on one microbatch's images.

    Module paths, tried in this order by :meth:`encode`:

    1. transformers' ``Kimi_K25ForConditionalGeneration``: ``model.model.vision_tower`` (MoonViT),
       ``model.model.mm_projector``, called through ``model.model.get_image_features(pixel_values,
       image_grid_thw)`` with an ``[images, 3]`` grid (an ``[images, 2]`` chunk grid gets a ``t = 1``
       column prepended on its own device);
    2. remote-code Kimi-VL (``KimiVLForConditionalGeneration``): ``model.vision_tower``,
       ``model.multi_modal_projector``, called through ``model._extract_image_features(pixel_values,
       image_grid_hws)`` with an ``[images, 2]`` grid (the ``t`` column of an ``[images, 3]`` chunk
       grid is dropped).

    Config fields read: ``image_token_id`` (transformers) or ``media_placeholder_token_id``
    (remote Kimi-VL); ``video_token_id`` when set; ``vision_config.merge_kernel_size`` (default 2 x 2).
    """

    name = "kimi_vl"
    model_types = ("kimi_vl", "kimi_k25")
    layout = "patch-major patches [patches, C, ph, pw] with grid [images, 2] (h, w) or [images, 3] (t, h, w)"

    # -- config ----------------------------------------------------------------------------
    @staticmethod
    def _image_token_id(config: Any) -> int:
        return int(config_value(config, "image_token_id", "media_placeholder_token_id"))

    @staticmethod
    def _video_token_id(config: Any) -> int | None:
        value = config_get(config, "video_token_id")
        return None if value is None else int(value)

    @staticmethod
    def _merge_area(config: Any) -> int:
        kernel = config_get(config_get(config, "vision_config"), "merge_kernel_size")
        if kernel is None:
            return 4
        if isinstance(kernel, int):
            return kernel * kernel
        kh, kw = kernel
        return int(kh) * int(kw)

    # -- token side ------------------------------------------------------------------------
    def media_per_sample(
        self, input_ids: Tensor, config: Any, *, media: Mapping[str, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Images per sample: the runs of image placeholder tokens (the processor frames each image
        with media start/end tokens, so each image is one run). Videos are always zero.

        Without ``media`` (or without a grid in it): device ops only, no host read. With the batch's
        grid (``media=batch`` holding ``image_grid_hws`` ``[images, 2]`` or ``image_grid_thw``
        ``[images, 3]``), runs are split by the images' token counts (``h * w / merge area``), so
        images written back to back are told apart too; one host read.

        Raises:
            ValueError: (with a grid) runs and images that do not pair up; the message names the
                sample and the way out (``n_images_per_sample`` in the batch).
        """
        is_image = input_ids == self._image_token_id(config)
        grid, key = None, ""
        for key in _GRID_KEYS:
            grid = None if media is None else media.get(key)
            if grid is not None:
                break
        if grid is None:
            images = count_runs(is_image)
        else:
            if grid.dim() != 2 or grid.shape[1] not in (2, 3):
                raise ValueError(f"{key}: shape {shape(grid)}; expected [images, 2] (h, w) or [images, 3] (t, h, w)")
            area, columns = self._merge_area(config), grid.shape[1]

            def tokens(flat: list[int]) -> list[int]:
                return [n // area for n in grid_products(flat, columns)]

            images = images_from_runs(is_image, grid, tokens, token="input_ids", metadata=key)
        return images, torch.zeros_like(images)

    def placeholder_masks(self, input_ids: Tensor, config: Any) -> dict[str, Tensor]:
        image_id = self._image_token_id(config)
        masks = {"image": input_ids == image_id}
        video_id = self._video_token_id(config)
        if video_id is not None and video_id != image_id:
            masks["video"] = input_ids == video_id
        return masks

    # -- media side ------------------------------------------------------------------------
    def host_inputs(self, chunk: VlmMediaChunk, config: Any) -> dict[str, Tensor]:
        """``{"image_grid": [images, 2 or 3]}`` when the chunk has images.

        Raises:
            ValueError: the chunk carries video media; it has pixels but no grid (or a grid but no
                pixels, or a grid that is not ``[images, 2]`` / ``[images, 3]``).
        """
        refuse_videos(chunk, "the Kimi-VL adapter")
        pixels, grid = chunk.pixel_values, chunk.image_grid
        if pixels is None and grid is None:
            return {}
        if pixels is None or grid is None:
            raise ValueError(
                f"Kimi-VL chunk has pixel_values {shape(pixels)} and image grid {shape(grid)}; expected "
                "both: patches [patches, C, P, P] with image_grid_hws [images, 2] or image_grid_thw [images, 3]"
            )
        if grid.dim() != 2 or grid.shape[-1] not in (2, 3):
            raise ValueError(f"image grid must be [images, 2] or [images, 3], got {shape(grid)}")
        return {"image_grid": grid}

    def feature_counts(self, chunk: VlmMediaChunk, config: Any, host: HostValues) -> dict[str, int]:
        """Image tokens = patches // merge-kernel area, after checking the grid covers exactly the
        patches and each image is a whole number of merge blocks. No video features (a video
        placeholder then fails the count check).

        Raises:
            ValueError: the grid covers another number of patches than ``pixel_values`` has rows, or an
                image whose patches are not a multiple of the merge-kernel area (row named).
        """
        pixels, grid = chunk.pixel_values, chunk.image_grid
        if pixels is None or grid is None:
            return {"image": 0}
        area = self._merge_area(config)
        patches = grid_products(host.values["image_grid"], grid.shape[1])
        if sum(patches) != pixels.shape[0]:
            raise ValueError(
                f"image grid {shape(grid)} covers {sum(patches)} patches but pixel_values {shape(pixels)} "
                f"has {pixels.shape[0]} patch rows"
            )
        for row, n in enumerate(patches):
            if n % area:
                raise ValueError(
                    f"image grid: row {row} gives {n} patches, not a multiple of the merge-kernel area {area}"
                )
        return {"image": pixels.shape[0] // area}

    def encode(self, model: torch.nn.Module, chunk: VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        """MoonViT + projector on the chunk's images: ``{"image": [tokens, text_hidden]}``."""
        pixels, grid = chunk.pixel_values, chunk.image_grid
        if pixels is None or grid is None:
            return {}
        inner = getattr(model, "model", None)
        if inner is not None and hasattr(inner, "get_image_features") and hasattr(inner, "vision_tower"):
            pixels = as_tower_dtype(pixels, inner.vision_tower)
            out = inner.get_image_features(pixels, image_grid_thw=grid_thw(grid, "image grid"), return_dict=True)
            features = out.pooler_output
        elif hasattr(model, "_extract_image_features") and hasattr(model, "vision_tower"):
            remote: Any = model  # remote-code members nn.Module does not declare
            hws = grid[:, 1:] if grid.shape[-1] == 3 else grid
            features = remote._extract_image_features(as_tower_dtype(pixels, remote.vision_tower), hws)
        else:
            raise TypeError(
                f"{type(model).__name__} has neither model.model.get_image_features with "
                "model.model.vision_tower (transformers Kimi-K2.5) nor model._extract_image_features "
                "with model.vision_tower (remote-code Kimi-VL)"
            )
        if isinstance(features, Tensor):
            return {"image": features.reshape(-1, features.shape[-1])}
        if any(f.dim() != 2 for f in features):  # remote code may keep a kernel axis: [n_i, k, H]
            features = [f.reshape(-1, f.shape[-1]) for f in features]
        return {"image": torch.cat(features, dim=0)}
