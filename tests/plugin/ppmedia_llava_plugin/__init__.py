"""An example third-party ppmedia plugin: LLaVA-1.5 (``model_type == "llava"``).

LLaVA-1.5 sends complete images ``[images, C, H, W]`` (one size), each filling a fixed number of
placeholder tokens: ``(image_size // patch_size) ** 2`` (plus one with the ``"full"`` feature strategy,
which keeps the CLS token). Installed, the package announces itself in ``pyproject.toml``::

    [project.entry-points."ppmedia.adapters"]
    llava = "ppmedia_llava_plugin"

and ``ppmedia.get_adapter(model)`` finds :class:`LlavaAdapter` for any LLaVA model.

ppmedia also ships a LLaVA adapter of its own (``ppmedia.adapters.llava``: LLaVA-1.5 and
Pixtral-backbone LLaVA). Two adapters claiming one model type are an error unless the one that should
win says so: :attr:`LlavaAdapter.override` is ``True``, so this plugin, installed, takes ``llava`` over
from the built-in, which is how a plugin replaces a built-in family with its own adapter.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor

import ppmedia
from ppmedia.adapters.base import HostValues, VlmAdapter


class LlavaAdapter(VlmAdapter):
    """Complete images through ``model.model.get_image_features`` (CLIP tower + projector)."""

    name = "llava"
    model_types = ("llava",)
    layout = "complete images [images, C, H, W]"
    #: take ``llava`` over from ppmedia's built-in LLaVA adapter
    override = True

    def media_per_sample(
        self, input_ids: Tensor, config: Any, *, media: Mapping[str, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        image = input_ids == config.image_token_id
        starts = image.clone()
        starts[:, 1:] &= ~image[:, :-1]  # an image is a run of placeholder tokens
        return starts.sum(-1), torch.zeros(input_ids.shape[0], dtype=torch.int64, device=input_ids.device)

    def placeholder_masks(self, input_ids: Tensor, config: Any) -> dict[str, Tensor]:
        return {"image": input_ids == config.image_token_id}

    def _tokens_per_image(self, config: Any) -> int:
        vision = config.vision_config
        side = vision.image_size // vision.patch_size
        return side * side + (1 if config.vision_feature_select_strategy == "full" else 0)

    def feature_counts(self, chunk: ppmedia.VlmMediaChunk, config: Any, host: HostValues) -> dict[str, int]:
        images = 0 if chunk.pixel_values is None else chunk.pixel_values.shape[0]
        return {"image": images * self._tokens_per_image(config)}

    def encode(self, model: torch.nn.Module, chunk: ppmedia.VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        config = model.config
        out = model.model.get_image_features(
            pixel_values=chunk.pixel_values,
            vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
        )
        features = out.pooler_output
        return {"image": torch.cat(list(features)).reshape(-1, features[0].shape[-1])}


@ppmedia.hookimpl
def ppmedia_adapters() -> list[type[VlmAdapter]]:
    return [LlavaAdapter]


@ppmedia.hookimpl
def ppmedia_model_type_aliases() -> dict[str, str]:
    return {"llava_1_5": "llava"}
