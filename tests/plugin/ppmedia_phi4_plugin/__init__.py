"""An example plugin for a family that merges INSIDE its decoder stack: Phi-4-multimodal's images.

``Phi4MultimodalForCausalLM`` keeps its vision (and audio) encoders and the merge in the decoder
stack itself, at ``model.embed_tokens_extend``: the stack's ``forward`` gets token ids, never the
merged ``inputs_embeds``. One declaration says so, ``merge_path = "model.embed_tokens_extend"`` (the
module whose output is the merged embeddings), and the testing kit takes its reference there, the
stage cutter keeps that module (encoders included) on the first stage only, and the encoder spread's
vision replica keeps it. Images only here (padded crops, global view first, plus ``image_sizes``:
the core ``images`` layout with LLaVA-NeXT's padded crops); the tiny batch's crops are never partly
padded, so the patch mask is all ones and ``encode`` passes one.

Phi-4-multimodal is built in (``ppmedia.adapters.phi4_multimodal``, images and audio, the processor's
keys, the same ``merge_path``); this example replaces it (``override = True``) to show the kit path a
plugin author takes with the one declaration.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor

import ppmedia
from ppmedia.adapters._helpers import count_runs
from ppmedia.adapters.base import HostValues, VlmAdapter

#: the module whose output is the merged embeddings, inside the decoder stack ``model``
MERGE_PATH = "model.embed_tokens_extend"


def image_tokens(height: int, width: int, config: Any) -> int:
    """Placeholders of one image: its sub-crops' features (one extra column per row), one separator,
    the global view's (again one extra column per row)."""
    vision = config.vision_config
    base = vision.image_size // vision.patch_size // 2  # features per side of a crop, after 2x2 pooling
    rows, cols = height // vision.crop_size * base, width // vision.crop_size * base
    return rows * (cols + 1) + 1 + base * (base + 1)


class Phi4ImagesAdapter(VlmAdapter):
    """Phi-4-multimodal, images only; the merge is ``model.embed_tokens_extend`` inside the decoder."""

    name = "phi4_multimodal_images"
    model_types = ("phi4_multimodal",)
    layout = "padded crops [images, max_crops, C, crop, crop], global view first; image_sizes [images, 2]"
    language_model_path = "model"
    merge_path = MERGE_PATH
    override = True  # replaces the built-in phi4_multimodal adapter where this plugin is registered

    def media_per_sample(
        self, input_ids: Tensor, config: Any, *, media: Mapping[str, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        images = count_runs(self.placeholder_masks(input_ids, config)["image"])  # text between images
        return images, torch.zeros_like(images)

    def placeholder_masks(self, input_ids: Tensor, config: Any) -> dict[str, Tensor]:
        return {"image": input_ids == config.vision_config.image_token_id}

    def host_inputs(self, chunk: Any, config: Any) -> dict[str, Tensor]:
        return {} if chunk.image_grid is None else {"image_sizes": chunk.image_grid}

    def feature_counts(self, chunk: Any, config: Any, host: HostValues) -> dict[str, int]:
        if chunk.pixel_values is None:
            return {"image": 0}
        return {"image": sum(image_tokens(h, w, config) for h, w in host.rows("image_sizes", 2))}

    def encode(self, model: torch.nn.Module, chunk: Any, host: HostValues) -> dict[str, Tensor]:
        """The model's own image embedding on the chunk's crops; it scatters into the embeddings it is
        given, so it gets one row of placeholders only and hands back exactly the features."""
        embed: Any = model.get_submodule(MERGE_PATH).image_embed
        pixels = chunk.pixel_values
        config = model.config
        n = self.feature_counts(chunk, config, host)["image"]
        patches = config.vision_config.image_size // config.vision_config.patch_size
        ids = torch.full((1, n), config.vision_config.image_token_id, dtype=torch.long, device=pixels.device)
        zeros = pixels.new_zeros(1, n, config.hidden_size)
        mask = torch.ones(*pixels.shape[:2], patches, patches, dtype=torch.bool, device=pixels.device)
        out = embed(ids, zeros, image_pixel_values=pixels, image_sizes=chunk.image_grid, image_attention_mask=mask)
        return {"image": out[0]}


@ppmedia.hookimpl
def ppmedia_adapters() -> list[type[VlmAdapter]]:
    return [Phi4ImagesAdapter]
