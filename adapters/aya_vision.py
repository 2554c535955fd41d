"""Aya Vision (``aya_vision``): image tiles, pixel-shuffle projector, ``<|IMG_PATCH|>`` tokens a tile.

Media layout of a chunk: ``chunk.pixel_values`` ``[tiles, C, S, S]``, every tile of every image in
prompt order (core layout ``images``: one row a tile). ``GotOcr2ImageProcessor(crop_to_patches=True)``
cuts an image into up to ``max_patches`` tiles at the tower's ``image_size`` and, when it made more than
one, adds a thumbnail of the whole image after them; ``AyaVisionProcessor`` writes
``<|START_OF_IMG|>``, for each tile but the thumbnail ``TILE_i`` and its patch tokens, then
``TILE_GLOBAL`` and the thumbnail's patch tokens, then ``<|END_OF_IMG|>``. Every tile fills
``((image_size // patch_size) // downsample_factor) ** 2`` ``<|IMG_PATCH|>`` tokens (169 at 364 px
with patch 14 and downsample 2: the ``image_token_index``); a sample's tiles are its patch tokens
divided by that.

The image processor's ``num_patches`` (tiles per IMAGE) is dropped by ``AyaVisionProcessor``; in a
batch it would be read as Step3's per-SAMPLE ``num_patches``, so it is refused here with what to do.
``vision_feature_select_strategy`` must be ``"full"`` (the released value): with ``"default"`` the
model's pixel shuffle cannot reshape the tower's output. ``GotOcr2ImageProcessorPil`` runs without
torchvision. The Cohere 2 text model builds its own masks (sliding and global layers) on every stage.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch
from torch import Tensor

from ..chunk import VlmMediaChunk
from ._helpers import as_tower_dtype, refuse_videos, shape
from .base import HostValues, VlmAdapter, config_get, config_value, inner_model

__all__ = ["AyaVisionAdapter", "tokens_per_tile"]


def tokens_per_tile(config: Any) -> int:
    """``<|IMG_PATCH|>`` tokens of one tile: ``((image_size // patch_size) // downsample_factor) ** 2``.

    Raises:
        ValueError: ``vision_feature_select_strategy`` is not ``"full"``, or the patch grid does not divide.
    """
    strategy = config_get(config, "vision_feature_select_strategy") or "full"
    if strategy != "full":
        raise ValueError(
            f"aya_vision: vision_feature_select_strategy {strategy!r}; expected 'full' (with the CLS-less SigLIP tower, "
            f"'default' drops a patch and the model's pixel shuffle cannot reshape the rest)"
        )
    vision = config_value(config, "vision_config")
    side = int(config_value(vision, "image_size")) // int(config_value(vision, "patch_size"))
    factor = int(config_value(config, "downsample_factor"))
    if side % factor:
        raise ValueError(f"aya_vision: {side} x {side} patches a tile do not divide by downsample_factor {factor}")
    return (side // factor) ** 2


def _image_token_id(config: Any) -> int:
    return int(config_value(config, "image_token_index", "image_token_id"))


class AyaVisionAdapter(VlmAdapter):
    """Aya Vision adapter (``AyaVisionForConditionalGeneration``).

    Module paths used: ``model.model.get_image_features(pixel_values)`` (SigLIP tower, feature layer,
    pixel shuffle, SwiGLU projector; ``model.get_image_features`` on the inner ``AyaVisionModel``);
    config fields ``image_token_index``, ``downsample_factor``, ``vision_feature_select_strategy``,
    ``vision_config.image_size`` / ``patch_size`` / ``num_channels``.
    """

    name: ClassVar[str] = "aya_vision"
    model_types: ClassVar[tuple[str, ...]] = ("aya_vision",)
    layout: ClassVar[str] = "tiles [tiles, C, S, S] (each image's tiles, then its thumbnail), <|IMG_PATCH|> tokens per tile fixed"

    # -- token side -------------------------------------------------------------------------
    def media_per_sample(
        self, input_ids: Tensor, config: Any, *, media: Mapping[str, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Tiles per sample = patch tokens / tokens per tile (rounded up: a partial tile counts one
        more, which the split or the merge's count check refuses); device ops only. No videos."""
        tokens = (input_ids == _image_token_id(config)).sum(dim=-1, dtype=torch.int64)
        per = tokens_per_tile(config)
        tiles = torch.div(tokens + per - 1, per, rounding_mode="floor")
        return tiles, torch.zeros_like(tiles)

    def media_counts(self, batch: Mapping[str, Any], config: Any) -> dict[str, Any]:
        """Tiles per sample for :func:`ppmedia.split_media`.

        Raises:
            ValueError: the batch holds the image processor's ``num_patches`` (tiles per image), which
                the split would take for Step3's per-sample crops.
        """
        if batch.get("num_patches") is not None:
            raise ValueError(
                f"aya_vision: num_patches {shape(batch['num_patches']) if isinstance(batch['num_patches'], Tensor) else ''} "
                f"in the batch: GotOcr2ImageProcessor's tiles per image, which AyaVisionProcessor drops and "
                f"split_media would read as Step3's crops per sample; drop it (pass its sums per sample as "
                f"n_images_per_sample [B] to count tiles explicitly)"
            )
        return super().media_counts(batch, config)

    def placeholder_masks(self, input_ids: Tensor, config: Any) -> dict[str, Tensor]:
        return {"image": input_ids == _image_token_id(config)}

    # -- media side -------------------------------------------------------------------------
    def feature_counts(self, chunk: VlmMediaChunk, config: Any, host: HostValues) -> dict[str, int]:
        """``tiles * tokens_per_tile``, from shapes only.

        Raises:
            ValueError: videos or a grid in the chunk, tiles not ``[tiles, C, S, S]`` at the tower's size.
            TypeError: pixels not floating point.
        """
        refuse_videos(chunk, self.name)
        if chunk.image_grid is not None:
            raise ValueError(f"{self.name} takes no image grid, but the chunk carries image_grid {shape(chunk.image_grid)}")
        pixels = chunk.pixel_values
        if pixels is None:
            return {"image": 0}
        vision = config_get(config, "vision_config")
        size, channels = int(config_value(vision, "image_size")), int(config_get(vision, "num_channels") or 3)
        if pixels.dim() != 4 or tuple(pixels.shape[1:]) != (channels, size, size):
            raise ValueError(
                f"{self.name} pixel_values: shape {shape(pixels)}; expected [tiles, {channels}, {size}, {size}] (tiles at "
                f"vision_config.image_size)"
            )
        if not pixels.is_floating_point():
            raise TypeError(f"{self.name} pixel_values: dtype {pixels.dtype}; expected a floating dtype")
        return {"image": pixels.shape[0] * tokens_per_tile(config)}

    def encode(self, model: torch.nn.Module, chunk: VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        """The model's own ``get_image_features``: ``{"image": [tiles * tokens_per_tile, text_hidden]}``."""
        if chunk.pixel_values is None:
            return {}
        inner = inner_model(model, "get_image_features", "an AyaVisionForConditionalGeneration or AyaVisionModel")
        pixels = as_tower_dtype(chunk.pixel_values, getattr(inner, "vision_tower", None))
        features = inner.get_image_features(pixel_values=pixels, return_dict=True).pooler_output
        return {"image": features.reshape(-1, features.shape[-1])}
