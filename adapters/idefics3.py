"""Idefics3 (``idefics3``): images padded per sample, pixel-shuffle connector, language model at ``model.text_model``.

Media layout of a chunk (layout ``idefics3_images`` of :mod:`ppmedia.adapters.media_layouts`: samples
on axis 0, so microbatch ``k`` gets exactly its samples' rows):

* ``chunk.pixel_values``: ``[b, max_crops, C, H, W]``, each sample's crops in prompt order (per image
  its ``rows x cols`` split crops, then its global view), zero-padded to the batch's most crops. A crop
  whose pixels are all 0 is padding: the model drops it, and so does the count here.
* ``chunk.extras["pixel_attention_mask"]``: ``[b, max_crops, H, W]``, 1 on real pixels (the processor
  pads images to the batch's largest inside their crops), or absent (then the core ``images`` layout
  stages ``pixel_values`` alone, one row per sample, and the model attends to every patch).

Every real crop gives ``image_seq_len = (image_size // patch_size) ** 2 // scale_factor ** 2`` feature
rows (169 in the released models, at 364 px with patch 14 and scale 3). Which crops are real is read
from the pixels themselves (a device op on the chunk, read with the placeholder counts in merge's one
host read), and every sample's placeholder tokens must be its real crops times ``image_seq_len``
(checked per sample, before the encoder). A microbatch without a real crop (text only, its rows all
padding) does not run the encoder.

The image processors ``Idefics3ImageProcessorPil`` / ``SmolVLMImageProcessorPil`` run without
torchvision; SmolVLM's video processor needs it.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch
from torch import Tensor

from ..chunk import VlmMediaChunk
from ._helpers import as_tower_dtype, refuse_grid, refuse_videos, rows_from_tokens, shape
from .base import HostValues, VlmAdapter, config_value, inner_model

__all__ = ["Idefics3Adapter", "tokens_per_crop"]

_MASK = "pixel_attention_mask"
_CROPS = "crops"  # host input: per crop, 1 = real pixels, + 2 = pixel_attention_mask not empty


def tokens_per_crop(config: Any) -> int:
    """Image tokens of one real crop: ``(image_size // patch_size) ** 2 // scale_factor ** 2``."""
    vision = config_value(config, "vision_config")
    side = int(config_value(vision, "image_size")) // int(config_value(vision, "patch_size"))
    return side * side // int(config_value(config, "scale_factor")) ** 2


def _image_token_id(config: Any) -> int:
    return int(config_value(config, "image_token_id", "image_token_index"))


class Idefics3Adapter(VlmAdapter):
    """Idefics3 adapter (``Idefics3ForConditionalGeneration``).

    Module paths used: ``model.model.get_image_features(pixel_values, pixel_attention_mask)``
    (``vision_model`` + ``connector``; ``model.get_image_features`` on the inner model); the decoder
    stack ``model.text_model`` (:attr:`language_model_path`); config fields ``image_token_id``,
    ``scale_factor``, ``vision_config.image_size`` / ``patch_size``.
    """

    name: ClassVar[str] = "idefics3"
    model_types: ClassVar[tuple[str, ...]] = ("idefics3",)
    layout: ClassVar[str] = (
        "samples on axis 0: crops [B, max_crops, C, H, W] (all-zero crops are padding) + pixel_attention_mask "
        "[B, max_crops, H, W]; image_seq_len tokens a real crop"
    )
    language_model_path: ClassVar[str | None] = "model.text_model"
    packing_refusal: ClassVar[str | None] = (
        "its media hold one entry per sample on axis 0 (pixel_values [samples, max_crops, C, H, W] and "
        "pixel_attention_mask, layout idefics3_images), and a packed row holds several samples: the rows "
        "would need their samples' crops joined along the crops axis, which pack_samples does not do"
    )
    family: ClassVar[str] = "Idefics3"
    sample_axis_keys: ClassVar[tuple[str, ...]] = ("pixel_values", _MASK)

    # -- token side -------------------------------------------------------------------------
    def media_per_sample(
        self, input_ids: Tensor, config: Any, *, media: Mapping[str, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Real crops per sample from the tokens: image tokens / ``image_seq_len`` (rounded up, so a
        sample with a partial crop is refused by the merge's count check); no videos (zeros).

        The split itself needs no counts (samples are on axis 0): :meth:`media_counts` passes none."""
        return rows_from_tokens(input_ids, _image_token_id(config), tokens_per_crop(config))

    def media_counts(self, batch: Mapping[str, Any], config: Any) -> dict[str, Any]:
        """No counts: the layout has the samples on axis 0 (``pixel_values`` ``[B, ...]``).

        Raises:
            ValueError: the batch holds videos (``pixel_values_videos``): images only in this family.
        """
        if batch.get("pixel_values_videos") is not None:
            raise ValueError(
                f"{self.name}: pixel_values_videos {shape(batch['pixel_values_videos'])} in the batch; {self.family} "
                f"takes images only (SmolVLM's videos come as image crops from its processor)"
            )
        return {}

    def placeholder_masks(self, input_ids: Tensor, config: Any) -> dict[str, Tensor]:
        return {"image": input_ids == _image_token_id(config)}

    # -- media side -------------------------------------------------------------------------
    def host_inputs(self, chunk: VlmMediaChunk, config: Any) -> dict[str, Tensor]:
        """``{"crops": [b, max_crops]}``: per crop 1 if any pixel is not 0 (the model's own test for
        padding) plus 2 if its ``pixel_attention_mask`` is not empty; device ops, read with the counts.

        Raises:
            ValueError: pixels not ``[b, max_crops, C, H, W]``, a mask not ``[b, max_crops, H, W]``,
                a grid or videos in the chunk.
            TypeError: pixels not floating point.
        """
        refuse_videos(chunk, self.name)
        pixels, mask = chunk.pixel_values, (chunk.extras or {}).get(_MASK)
        refuse_grid(chunk, self.name)
        if pixels is None:
            if mask is not None:
                raise ValueError(f"{self.name} chunk has {_MASK} {shape(mask)} but no pixel_values")
            return {}
        if pixels.dim() != 5:
            raise ValueError(f"{self.name} pixel_values: shape {shape(pixels)}; expected [samples, max_crops, C, H, W]")
        if not pixels.is_floating_point():
            raise TypeError(f"{self.name} pixel_values: dtype {pixels.dtype}; expected a floating dtype")
        real = (pixels != 0).flatten(2).any(dim=-1).to(torch.int64)
        if mask is None:
            return {_CROPS: real + 2}
        expected = [pixels.shape[0], pixels.shape[1], pixels.shape[3], pixels.shape[4]]
        if list(mask.shape) != expected:
            raise ValueError(f"{self.name} {_MASK}: shape {shape(mask)}; expected {expected} (pixel_values {shape(pixels)} without channels)")
        return {_CROPS: real + 2 * (mask != 0).flatten(2).any(dim=-1).to(torch.int64)}

    def feature_counts(self, chunk: VlmMediaChunk, config: Any, host: HostValues) -> dict[str, int]:
        """``image_seq_len`` rows per real crop, checked sample by sample against the placeholders.

        Raises:
            ValueError: a sample whose placeholder tokens are not its real crops x ``image_seq_len``,
                or a real crop whose ``pixel_attention_mask`` is all 0 (the tower would see no patch).
        """
        if chunk.pixel_values is None:
            return {"image": 0}
        per, width = tokens_per_crop(config), int(chunk.pixel_values.shape[1])
        flags = host.rows(_CROPS, width)
        placeholders = host.placeholders["image"]
        for sample, (row, tokens) in enumerate(zip(flags, placeholders)):
            bad = [c for c, f in enumerate(row) if f == 1]
            if bad:
                raise ValueError(
                    f"{self.name} {_MASK}: sample {sample} of the microbatch has real crops {bad} whose mask is all 0; "
                    f"expected 1 on each crop's real pixels (as the image processor writes it)"
                )
            real = sum(f & 1 for f in row)
            if real * per != tokens:
                raise ValueError(
                    f"{self.name}: sample {sample} of the microbatch has {tokens} image tokens but {real} real crops "
                    f"(crops not all 0) in pixel_values, giving {real * per} ({per} a crop)"
                )
        return {"image": sum(placeholders)}

    def encode(self, model: torch.nn.Module, chunk: VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        """The model's own ``get_image_features`` (drops the padding crops, tower, pixel shuffle,
        projection); not called for a microbatch without a real crop."""
        if chunk.pixel_values is None or host.total("image") == 0:
            return {}
        inner = inner_model(model, "get_image_features", f"a {self.family}ForConditionalGeneration or {self.family}Model")
        pixels = as_tower_dtype(chunk.pixel_values, getattr(inner, "vision_model", None))
        mask = (chunk.extras or {}).get(_MASK)
        features = inner.get_image_features(pixels, mask, return_dict=True).pooler_output
        return {"image": torch.cat(list(features), dim=0)}
