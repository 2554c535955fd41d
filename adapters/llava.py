"""LLaVA (``llava``): LLaVA-1.5 (CLIP or SigLIP tower, fixed-size images) and Pixtral-backbone LLaVA
(Pixtral-12B: images of different sizes), one model class, ``LlavaForConditionalGeneration``.

Which layout a model uses follows its ``vision_config.model_type``:

* **LLaVA-1.5** (any tower but Pixtral): ``chunk.pixel_values`` ``[images, C, S, S]``, complete images
  of the tower's ``image_size`` (``LlavaProcessor`` / ``CLIPImageProcessor`` resize and crop them to
  it); each image fills one run of ``(S // p) ** 2`` placeholder tokens (``p`` the patch size), plus
  one with ``vision_feature_select_strategy == "full"`` on a tower with a CLS token (CLIP), minus one
  with ``"default"`` on a tower without (SigLIP: the model drops its first position anyway). Images
  written back to back form one run, so a sample's images are its placeholders divided by that count.
* **Pixtral-backbone** (``vision_config.model_type == "pixtral"``): Mistral 3's layout
  (:mod:`ppmedia.adapters.mistral3`) without the patch merger: ``[images, C, Hmax, Wmax]`` padded to
  the batch's largest with the true sizes ``image_sizes`` ``[images, 2]``, ``(H // p) * (W // p)``
  ``[IMG]`` tokens, ``[IMG_BREAK]`` / ``[IMG_END]`` as Mistral's tokenizer writes them (ids from the
  config if set, else the adapter's, 12 and 13 by default).

Both run the model's own ``get_image_features`` (tower, ``vision_feature_layer``, the select strategy,
projector). Videos are refused.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch
from torch import Tensor

from ..chunk import VlmMediaChunk
from ._helpers import as_tower_dtype, refuse_videos, shape
from .base import HostValues, config_get, config_value, inner_model
from .mistral3 import Mistral3Adapter

__all__ = ["LlavaAdapter", "is_pixtral", "tokens_per_image"]

#: vision towers with a CLS position in front of the patches.
_CLS_TOWERS = frozenset({"clip_vision_model"})


def is_pixtral(config: Any) -> bool:
    """Whether a LLaVA config's vision tower is Pixtral's (images of different sizes)."""
    return config_get(config_get(config, "vision_config"), "model_type") == "pixtral"


def tokens_per_image(config: Any) -> int:
    """Placeholder tokens of one LLaVA-1.5 image: the tower's positions kept by the select strategy."""
    vision = config_value(config, "vision_config")
    side = int(config_value(vision, "image_size")) // int(config_value(vision, "patch_size"))
    positions = side * side + (1 if config_get(vision, "model_type") in _CLS_TOWERS else 0)
    strategy = config_get(config, "vision_feature_select_strategy") or "default"
    return positions - 1 if strategy == "default" else positions


class LlavaAdapter(Mistral3Adapter):
    """LLaVA adapter (``LlavaForConditionalGeneration``): LLaVA-1.5 and Pixtral-backbone LLaVA.

    Module path: ``model.model.get_image_features(pixel_values, [image_sizes])`` (``model.get_image_features``
    on the inner ``LlavaModel``); config fields ``image_token_id``, ``vision_config.image_size`` /
    ``patch_size`` / ``model_type``, ``vision_feature_select_strategy``.

    Args:
        image_break_token_id, image_end_token_id: Pixtral-backbone only, as for
            :class:`~ppmedia.adapters.mistral3.Mistral3Adapter`.
    """

    name: ClassVar[str] = "llava"
    model_types: ClassVar[tuple[str, ...]] = ("llava",)
    layout: ClassVar[str] = (
        "complete images [images, C, S, S] (LLaVA-1.5), or with a Pixtral tower images padded to the "
        "batch's largest [images, C, Hmax, Wmax] with image_sizes [images, 2]"
    )

    def downsample(self, config: Any) -> int:
        """Pixtral-backbone: the patch size (no merger)."""
        return int(config_value(config, "vision_config.patch_size"))

    # -- token side -------------------------------------------------------------------------
    def media_per_sample(
        self, input_ids: Tensor, config: Any, *, media: Mapping[str, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Images per sample: Pixtral-backbone its ``[IMG_END]`` tokens; LLaVA-1.5 its placeholder
        tokens divided by :func:`tokens_per_image` (one host read checks they divide). No videos.

        Raises:
            ValueError: LLaVA-1.5 samples whose placeholders are not whole images (named, with counts).
        """
        if is_pixtral(config):
            return super().media_per_sample(input_ids, config, media=media)
        per = tokens_per_image(config)
        placeholders = self.placeholder_masks(input_ids, config)["image"].sum(dim=-1, dtype=torch.int64)
        counts = placeholders.tolist()  # one host read
        bad = [i for i, n in enumerate(counts) if n % per]
        if bad:
            raise ValueError(
                f"llava input_ids: samples {bad} hold {[counts[i] for i in bad]} image placeholder tokens, "
                f"not a multiple of {per} per image; pass n_images_per_sample [B] in the batch"
            )
        images = placeholders // per
        return images, torch.zeros_like(images)

    # -- media side -------------------------------------------------------------------------
    def host_inputs(self, chunk: VlmMediaChunk, config: Any) -> dict[str, Tensor]:
        """Pixtral-backbone: the ``image_sizes`` (Mistral 3's checks). LLaVA-1.5: nothing, after
        checking the images are ``[images, C, S, S]`` at the tower's size.

        Raises:
            ValueError: videos; LLaVA-1.5 pixels not ``[images, C, S, S]``, or sizes in the chunk.
            TypeError: pixels not floating point.
        """
        if is_pixtral(config):
            return super().host_inputs(chunk, config)
        refuse_videos(chunk, self.name)
        pixels = chunk.pixel_values
        if pixels is None:
            if chunk.image_grid is not None:
                raise ValueError(f"llava chunk has image metadata {shape(chunk.image_grid)} but no pixel_values")
            return {}
        size = int(config_value(config, "vision_config.image_size"))
        if pixels.dim() != 4 or tuple(pixels.shape[2:]) != (size, size):
            raise ValueError(
                f"llava pixel_values: shape {shape(pixels)}; expected [images, C, {size}, {size}] (complete "
                f"images at the vision tower's image_size)"
            )
        if not pixels.is_floating_point():
            raise TypeError(f"llava pixel_values: dtype {pixels.dtype}; expected a floating dtype")
        return {}

    def feature_counts(self, chunk: VlmMediaChunk, config: Any, host: HostValues) -> dict[str, int]:
        """Pixtral-backbone: from the sizes; LLaVA-1.5: images x :func:`tokens_per_image`."""
        if is_pixtral(config):
            return super().feature_counts(chunk, config, host)
        images = 0 if chunk.pixel_values is None else int(chunk.pixel_values.shape[0])
        return {"image": images * tokens_per_image(config)}

    def encode(self, model: torch.nn.Module, chunk: VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        """The model's own ``get_image_features``: ``{"image": [tokens, text_hidden]}`` in image order."""
        if chunk.pixel_values is None:
            return {}
        if is_pixtral(model.config):
            return super().encode(model, chunk, host)
        inner = inner_model(model, "get_image_features", "a LlavaForConditionalGeneration or LlavaModel")
        pixels = as_tower_dtype(chunk.pixel_values, inner.vision_tower)
        out = inner.get_image_features(pixel_values=pixels, return_dict=True)
        return {"image": torch.cat([f.reshape(-1, f.shape[-1]) for f in out.pooler_output], dim=0)}
