"""Llama 4 (``llama4``): tiles of one size, ``<|patch|>`` tokens per tile, the projector outside the encoder.

Media layout of a chunk (as ``Llama4ImageProcessor`` gives them; that processor needs torchvision):

* ``chunk.pixel_values`` ``[tiles, C, S, S]``: tiles at the vision tower's ``image_size`` (336 in the
  released models), each image's local tiles first (none when the image is not cut) and then its
  global tile, image after image in prompt order; no per-image metadata (the processor drops its
  ``aspect_ratios``).
* ``chunk.image_grid``: unused (``None``).

Every tile gives ``(S / patch)^2 * pixel_shuffle_ratio^2`` features (144 at 336 px, patch 14, ratio
0.5), one per ``<|patch|>`` token (the config's ``image_token_id``); ``Llama4Processor`` writes a
tile's tokens as one run, with tile separators and the ``<|image|>`` marker between runs. So a sample's
tiles are its patch tokens divided by the tokens per tile (:meth:`Llama4Adapter.media_per_sample`), and
the batch splits with ppmedia's plain ``images`` layout (one row per tile).

Encoding follows ``Llama4ForConditionalGeneration.forward``: the vision model (``get_image_features``)
gives ``[tiles, tokens, vision_output_dim]``, which the model flattens and sends through its
``multi_modal_projector`` (outside ``get_image_features``) to the text width.

The decoder stack sits at ``language_model.model`` (a ``Llama4ForCausalLM`` at the top level) and the
output head at ``language_model.lm_head``: :attr:`Llama4Adapter.language_model_path` says so. Every
stage computes the language model's own 1-D positions, chunked-attention masks and NoPE temperature
scales itself; nothing but hidden states and mask crosses a boundary.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from ..chunk import VlmMediaChunk
from ._helpers import ImageRowsAdapter, as_tower_dtype
from .base import HostValues, config_value

__all__ = ["Llama4Adapter", "tokens_per_tile"]


def tokens_per_tile(config: Any) -> int:
    """Features (``<|patch|>`` tokens) of one tile: ``(image_size // patch_size)^2 * pixel_shuffle_ratio^2``.

    Raises:
        ValueError: the shuffled grid is not a whole number of tokens (a config the model cannot run).
    """
    vision = config_value(config, "vision_config")
    side = int(config_value(vision, "image_size")) // int(config_value(vision, "patch_size"))
    ratio = float(config_value(vision, "pixel_shuffle_ratio"))
    tokens = side * side * ratio * ratio
    if tokens != int(tokens) or tokens < 1:
        raise ValueError(
            f"llama4 vision_config: {side} x {side} patches with pixel_shuffle_ratio {ratio} give {tokens} tokens "
            f"per tile; expected a whole number"
        )
    return int(tokens)


class Llama4Adapter(ImageRowsAdapter):
    """Llama 4 adapter (``Llama4ForConditionalGeneration``).

    Module paths: ``model.vision_model(pixel_values)`` (what ``get_image_features`` runs; its
    ``last_hidden_state`` is ``[tiles, tokens, vision_output_dim]``), ``model.multi_modal_projector``;
    config fields ``image_token_id`` (``<|patch|>``), ``vision_config.image_size`` / ``patch_size`` /
    ``pixel_shuffle_ratio`` / ``num_channels``. Images only: videos are refused.
    """

    name: ClassVar[str] = "llama4"
    model_types: ClassVar[tuple[str, ...]] = ("llama4",)
    layout: ClassVar[str] = (
        "tiles [tiles, C, S, S] at the tower's image_size, each image's local tiles then its global tile; "
        "(S/patch)^2 * pixel_shuffle_ratio^2 <|patch|> tokens per tile; no grid"
    )
    language_model_path: ClassVar[str | None] = "language_model.model"
    # the image placeholder is <|patch|> (config.image_token_id), one per feature row of a tile
    image_token_fields: ClassVar[tuple[str, ...]] = ("image_token_id", "image_token_index")
    row_name: ClassVar[str] = "tiles"
    row_note: ClassVar[str] = "tiles at vision_config.image_size"
    grid_name: ClassVar[str] = "per-image metadata"
    grid_note: ClassVar[str] = " (the processor's aspect_ratios are not model inputs)"

    def tokens_per_row(self, config: Any) -> int:
        """:func:`tokens_per_tile`: a row is a tile (its ``<|patch|>`` tokens)."""
        return tokens_per_tile(config)

    # -- media side -------------------------------------------------------------------------
    def encode(self, model: torch.nn.Module, chunk: VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        """The vision model, then the projector on the flattened tile features, as the model's forward:
        ``{"image": [tiles * tokens, text_hidden]}`` in tile order."""
        if chunk.pixel_values is None:
            return {}
        vision: Any = getattr(model, "vision_model", None)
        projector: Any = getattr(model, "multi_modal_projector", None)
        if vision is None or projector is None:
            raise TypeError(
                f"{type(model).__name__} has no vision_model / multi_modal_projector; expected a "
                f"Llama4ForConditionalGeneration (or its first pipeline stage)"
            )
        features = vision(as_tower_dtype(chunk.pixel_values, vision), return_dict=True).last_hidden_state
        return {"image": projector(features.reshape(-1, features.shape[-1]))}
