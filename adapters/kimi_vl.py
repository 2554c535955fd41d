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

from typing import Any

import torch
from torch import Tensor

from ..chunk import VlmMediaChunk
from .base import VlmAdapter, config_value

__all__ = ["KimiVLAdapter"]


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
        value = getattr(config, "video_token_id", None)
        return None if value is None else int(value)

    @staticmethod
    def _merge_area(config: Any) -> int:
        try:
            kernel = config_value(config, "vision_config.merge_kernel_size")
        except AttributeError:
            return 4
        if isinstance(kernel, int):
            return kernel * kernel
        kh, kw = kernel
        return int(kh) * int(kw)

    # -- token side ------------------------------------------------------------------------
    def media_per_sample(self, input_ids: Tensor, config: Any) -> tuple[Tensor, Tensor]:
        """Images per sample: the runs of image placeholder tokens (each image is one run, framed by
        its media start/end tokens). Videos are always zero. Computed on ``input_ids.device``."""
        is_image = input_ids == self._image_token_id(config)
        before = torch.zeros_like(is_image[..., :1])
        previous = torch.cat([before, is_image[..., :-1]], dim=-1)
        images = (is_image & ~previous).sum(dim=-1, dtype=torch.int64)
        return images, torch.zeros_like(images)

    def placeholder_masks(self, input_ids: Tensor, config: Any) -> dict[str, Tensor]:
        image_id = self._image_token_id(config)
        masks = {"image": input_ids == image_id}
        video_id = self._video_token_id(config)
        if video_id is not None and video_id != image_id:
            masks["video"] = input_ids == video_id
        return masks

    # -- media side ------------------------------------------------------------------------
    def feature_counts(self, chunk: VlmMediaChunk, config: Any) -> dict[str, Tensor | int]:
        """Image tokens = patch rows // merge-kernel area (shapes only). Video is always 0.

        Raises:
            ValueError: the chunk carries video media; it has pixels but no grid (or a grid that is
                not ``[images, 2]`` / ``[images, 3]``); or its patch rows are not a whole number of
                merge blocks.
        """
        if chunk.pixel_values_videos is not None or chunk.video_grid is not None:
            raise ValueError(
                "the Kimi-VL adapter handles images only; the chunk carries video media "
                f"(pixel_values_videos {_shape(chunk.pixel_values_videos)}, video_grid "
                f"{_shape(chunk.video_grid)})"
            )
        counts: dict[str, Tensor | int] = {"image": 0}
        if self._video_token_id(config) is not None:
            counts["video"] = 0
        pixels = chunk.pixel_values
        if pixels is None:
            return counts
        grid = chunk.image_grid
        if grid is None:
            raise ValueError(
                f"pixel_values {_shape(pixels)} came without an image grid; Kimi-VL needs image_grid_hws "
                "[images, 2] or image_grid_thw [images, 3]"
            )
        if grid.dim() != 2 or grid.shape[-1] not in (2, 3):
            raise ValueError(f"image grid must be [images, 2] or [images, 3], got {_shape(grid)}")
        area = self._merge_area(config)
        rows = pixels.shape[0]
        if rows % area:
            raise ValueError(
                f"pixel_values has {rows} patch rows, not a multiple of the merge-kernel area {area}"
            )
        counts["image"] = rows // area
        return counts

    def encode(self, model: torch.nn.Module, chunk: VlmMediaChunk) -> dict[str, Tensor]:
        """MoonViT + projector on the chunk's images: ``{"image": [tokens, text_hidden]}``."""
        pixels, grid = chunk.pixel_values, chunk.image_grid
        if pixels is None:
            return {}
        if grid is None:
            raise ValueError(f"pixel_values {_shape(pixels)} came without an image grid")
        inner = getattr(model, "model", None)
        if inner is not None and hasattr(inner, "get_image_features") and hasattr(inner, "vision_tower"):
            tower = inner.vision_tower
            if grid.shape[-1] == 2:
                grid = torch.nn.functional.pad(grid, (1, 0), value=1)  # t = 1 column
            pixels = _as_tower_dtype(pixels, tower)
            out = inner.get_image_features(pixels, image_grid_thw=grid, return_dict=True)
            features = out.pooler_output
        elif hasattr(model, "_extract_image_features") and hasattr(model, "vision_tower"):
            if grid.shape[-1] == 3:
                grid = grid[:, 1:]
            features = model._extract_image_features(_as_tower_dtype(pixels, model.vision_tower), grid)  # type: ignore[operator,arg-type]
        else:
            raise TypeError(
                f"{type(model).__name__} has neither model.model.get_image_features with "
                "model.model.vision_tower (transformers Kimi-K2.5) nor model._extract_image_features "
                "with model.vision_tower (remote-code Kimi-VL)"
            )
        if isinstance(features, (list, tuple)):
            features = torch.cat([f.reshape(-1, f.shape[-1]) for f in features], dim=0)
        else:
            features = features.reshape(-1, features.shape[-1])
        return {"image": features}


def _as_tower_dtype(pixels: Tensor, tower: torch.nn.Module) -> Tensor:
    # The patch-embedding convolution needs pixels in the tower's dtype; a no-op when they match.
    param = next(tower.parameters(), None)
    if param is None or not param.dtype.is_floating_point:
        return pixels
    return pixels.to(param.dtype)


def _shape(tensor: Tensor | None) -> str:
    return "None" if tensor is None else str(list(tensor.shape))
