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

from torch import Tensor

from ._helpers import ImageRowsAdapter, shape
from .base import config_get, config_value

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


class AyaVisionAdapter(ImageRowsAdapter):
    """Aya Vision adapter (``AyaVisionForConditionalGeneration``).

    Module paths used: ``model.model.get_image_features(pixel_values)`` (SigLIP tower, feature layer,
    pixel shuffle, SwiGLU projector; ``model.get_image_features`` on the inner ``AyaVisionModel``);
    config fields ``image_token_index``, ``downsample_factor``, ``vision_feature_select_strategy``,
    ``vision_config.image_size`` / ``patch_size`` / ``num_channels``.
    """

    name: ClassVar[str] = "aya_vision"
    model_types: ClassVar[tuple[str, ...]] = ("aya_vision",)
    layout: ClassVar[str] = "tiles [tiles, C, S, S] (each image's tiles, then its thumbnail), <|IMG_PATCH|> tokens per tile fixed"
    row_name: ClassVar[str] = "tiles"
    row_note: ClassVar[str] = "tiles at vision_config.image_size"
    expected_model: ClassVar[str] = "an AyaVisionForConditionalGeneration or AyaVisionModel"

    def tokens_per_row(self, config: Any) -> int:
        """:func:`tokens_per_tile`: a tile is a row (a sample's tiles are its patch tokens / this)."""
        return tokens_per_tile(config)

    # -- token side -------------------------------------------------------------------------
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
