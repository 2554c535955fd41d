"""Inkling 2 (``inkling2``): one pixel row per image token, and attention-residual block states that
grow across decoder layers, carried across pipeline stages.

Media layout of a chunk (as ``Inkling2ImageProcessor`` gives it):

* ``pixel_values`` ``[tokens, T, T, C]`` channels-last: each image padded to whole ``T x T`` tiles
  (``T = patch_size * spatial_merge_size``, 40 in the released model), one row per tile, raster
  order, images one after the other;
* ``image_grid`` ``image_grid_thw`` ``[images, 3]`` ``(t, rows, columns)`` counted in language-model
  tokens: an image fills ``t * rows * columns`` placeholder tokens and has as many pixel rows.

The processor writes only the placeholders, so two images back to back form one run of them:
:meth:`Inkling2Adapter.media_per_sample` splits runs with the batch's grid (without it, one image per run).

**Block states.** ``Inkling2TextModel`` keeps ``block_states`` ``[b, S, blocks, H]``: every layer whose
index is a multiple of ``n_layers_per_attn_res_block`` appends its input hidden states, and every
layer (and ``final_input`` before the norm) attends over them. Before layer ``k`` they hold
``ceil(k / n)`` blocks; they cross the boundary as the wire tensor ``block_states`` ``[b, S, ceil(k / n),
H]`` (floating: the gradient reaches the layers, and the vision tower, that made each block). The
language model's ``forward`` starts its own ``block_states`` empty on every stage; the hooks of
:meth:`Inkling2Adapter.stage_hooks` hand each layer (and ``final_input``) the full ones instead and
append the stage's block-opening inputs. ``final_input`` runs on the last stage only
(:meth:`Inkling2Adapter.prune_stage`), and the last stage applies the model's logit soft-cap and
drops the padded vocabulary rows (``unpadded_vocab_size``).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Mapping, MutableMapping, Sequence

import torch
from torch import Tensor, nn

from ..chunk import VlmMediaChunk
from ._helpers import as_tower_dtype, count_runs, grid_products, grid_thw, images_from_runs, refuse_videos
from ._helpers import shape, softcapped, text_config, unpadded_logits, unpadded_width
from .base import HostValues, LayerHook, VlmAdapter, WireTensor, config_value, inner_model

__all__ = ["Inkling2Adapter", "blocks_before"]

_INKLING2 = "an Inkling 2 model (Inkling2ForConditionalGeneration or Inkling2Model)"




def blocks_before(config: Any, layer: int) -> int:
    """Block states the language model holds before decoder layer ``layer``: ``ceil(layer / n)``
    (``n = n_layers_per_attn_res_block``; layers ``0, n, 2n, ...`` open a block)."""
    return math.ceil(layer / int(config_value(text_config(config), "n_layers_per_attn_res_block")))


class _PassPartial(nn.Module):
    """Stand-in for ``final_input`` on the stages before the last: returns the hidden states as they are
    (``final_input(block_states, hidden)[0]`` is what the language model reads)."""

    def forward(self, block_states: Tensor, hidden_states: Tensor) -> tuple[Tensor]:
        return (hidden_states,)


class Inkling2Adapter(VlmAdapter):
    """Inkling 2 adapter (``Inkling2ForConditionalGeneration``).

    Module paths: ``model.model.get_image_features(pixel_values, image_grid_thw)`` (vision tower and
    merger); the language model at ``model.model.language_model`` with ``layers`` (each with
    ``is_block_boundary``) and ``final_input``; ``model.lm_head``. Config fields: ``image_token_id``,
    ``text_config.n_layers_per_attn_res_block``, ``final_logit_softcapping``, ``unpadded_vocab_size``.
    """

    name: ClassVar[str] = "inkling2"
    context_refusal: ClassVar[str | None] = (
        "its block-attention residual states grow along the whole row across layers (block_states), not a per-token tensor that can be cut"
    )
    model_types: ClassVar[tuple[str, ...]] = ("inkling2",)
    layout: ClassVar[str] = (
        "one row per image token [tokens, T, T, C] channels-last with image_grid_thw [images, 3] in tokens; "
        "attention-residual block states cross stage boundaries"
    )

    # -- token side -------------------------------------------------------------------------
    def media_per_sample(
        self, input_ids: Tensor, config: Any, *, media: Mapping[str, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Images per sample: runs of placeholder tokens, split by ``media["image_grid_thw"]`` when given
        (one host read; images back to back), else one image per run (no host read)."""
        mask = self.placeholder_masks(input_ids, config)["image"]
        grid = None if media is None else media.get("image_grid_thw")
        if grid is None:
            images = count_runs(mask)
        else:
            if grid.dim() != 2 or grid.shape[1] != 3:
                raise ValueError(f"image_grid_thw: shape {shape(grid)}; expected [images, 3] (t, rows, columns)")
            images = images_from_runs(
                mask, grid, lambda flat: grid_products(flat, 3), token="input_ids", metadata="image_grid_thw"
            )
        return images, torch.zeros_like(images)

    def placeholder_masks(self, input_ids: Tensor, config: Any) -> dict[str, Tensor]:
        return {"image": input_ids == int(config_value(config, "image_token_id"))}

    # -- media side -------------------------------------------------------------------------
    def host_inputs(self, chunk: VlmMediaChunk, config: Any) -> dict[str, Tensor]:
        """``{"image_grid": [images, 3]}``, shapes checked.

        Raises:
            ValueError: videos; pixels without a grid or the reverse; pixels not ``[tokens, T, T, C]``
                with ``T = patch_size * spatial_merge_size``; a grid not ``[images, 3]``.
        """
        refuse_videos(chunk, self.name)
        pixels, grid = chunk.pixel_values, chunk.image_grid
        if pixels is None and grid is None:
            return {}
        if pixels is None or grid is None:
            raise ValueError(f"inkling2 chunk has pixel_values {shape(pixels)} and image_grid_thw {shape(grid)}; expected both")
        tile = int(config_value(config, "vision_config.patch_size")) * int(config_value(config, "vision_config.spatial_merge_size"))
        if pixels.dim() != 4 or tuple(pixels.shape[1:3]) != (tile, tile):
            raise ValueError(
                f"inkling2 pixel_values: shape {shape(pixels)}; expected [tokens, {tile}, {tile}, C] (one "
                f"channels-last tile per image token)"
            )
        if grid.dim() != 2 or grid.shape[1] != 3:
            raise ValueError(f"inkling2 image_grid_thw: shape {shape(grid)}; expected [images, 3] (t, rows, columns)")
        return {"image_grid": grid}

    def feature_counts(self, chunk: VlmMediaChunk, config: Any, host: HostValues) -> dict[str, int]:
        """Image tokens = the grid's products, which must equal the pixel rows.

        Raises:
            ValueError: the grid covers another number of tiles than ``pixel_values`` has rows.
        """
        pixels = chunk.pixel_values
        if pixels is None:
            return {"image": 0}
        tokens = sum(grid_products(host.values["image_grid"], 3))
        if tokens != pixels.shape[0]:
            raise ValueError(
                f"inkling2 image_grid_thw {shape(chunk.image_grid)} covers {tokens} tiles but pixel_values "
                f"{shape(pixels)} has {pixels.shape[0]} rows"
            )
        return {"image": tokens}

    def encode(self, model: torch.nn.Module, chunk: VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        """The model's own ``get_image_features``: ``{"image": [tokens, text_hidden]}``."""
        if chunk.pixel_values is None or chunk.image_grid is None:
            return {}
        inner = inner_model(model, "get_image_features", _INKLING2)
        pixels = as_tower_dtype(chunk.pixel_values, inner.vision_tower)
        out = inner.get_image_features(pixels, grid_thw(chunk.image_grid, "image_grid_thw"), return_dict=True)
        return {"image": torch.cat(list(out.pooler_output), dim=0)}

    # -- pipeline ---------------------------------------------------------------------------
    def wire_tensors(self, config: Any, first_layer: int) -> tuple[WireTensor, ...]:
        """``block_states`` ``[b, S, ceil(first_layer / n), H]`` once there are any."""
        blocks = blocks_before(config, first_layer)
        return (WireTensor("block_states", ("b", "S", blocks, "H"), floating=True),) if blocks else ()

    def prune_stage(self, language_model: torch.nn.Module, *, layers: range, first: bool, last: bool) -> None:
        """``final_input`` (the last block-state residual, before the norm) on the last stage only."""
        if not last and "final_input" in language_model._modules:
            language_model._modules["final_input"] = _PassPartial()

    def stage_hooks(
        self, stage: torch.nn.Module, layers: range, state: MutableMapping[str, Tensor]
    ) -> Sequence[LayerHook]:
        """Before each layer: its block-state argument becomes the full ``state["block_states"]``, and a
        block-opening layer's input is appended to it; on the last stage ``final_input`` reads them too."""

        def blocks_for(hidden: Tensor) -> Tensor:
            held = state.get("block_states")
            return hidden.new_zeros(*hidden.shape[:-1], 0, hidden.shape[-1]) if held is None else held

        def before_layer(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            hidden = args[0]
            blocks = blocks_for(hidden)
            if getattr(module, "is_block_boundary"):
                state["block_states"] = torch.cat([blocks, hidden.unsqueeze(-2)], dim=-2)
            return (hidden, blocks, *args[2:]), kwargs

        def before_final(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            return (blocks_for(args[1]), *args[1:]), kwargs

        lm = getattr(stage, "stage_language_model")
        hooks = [LayerHook(layer, before=before_layer) for layer in lm.layers]
        if getattr(stage, "is_last"):
            hooks.append(LayerHook(lm.final_input, before=before_final))
        return hooks

    def logits(self, stage: torch.nn.Module, hidden: Tensor) -> Tensor:
        """``lm_head`` in float32, soft-capped ``tanh(x / c) * c``, cut to ``unpadded_vocab_size``."""
        config = getattr(stage, "config")
        return unpadded_logits(softcapped(super().logits(stage, hidden).float(), config), config)

    def logits_width(self, config: Any, head_width: int) -> int:
        return unpadded_width(config, head_width)
