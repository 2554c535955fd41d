"""Gemma 3 (``gemma3``): complete images, a fixed number of tokens per image, bidirectional image blocks.

Media layout of a chunk:

* ``chunk.pixel_values``: ``[rows, C, H, W]`` complete images at the vision tower's size
  (``vision_config.image_size``, 896 in the released models); one row per image block of the text.
  With pan-and-scan (``Gemma3ImageProcessor(do_pan_and_scan=True, pan_and_scan_min_crop_size=...,
  pan_and_scan_max_num_crops=..., pan_and_scan_min_ratio_to_activate=...)``) the crops of an image
  are further rows right after it, and the processor writes one ``<boi> <image> * n <eoi>`` block per
  crop after the image's own block: a crop is an image to the model and to this adapter.
* ``chunk.image_grid``: unused (``None``); Gemma 3 has no per-image metadata.

Every row gives ``config.mm_tokens_per_image`` feature rows (SigLIP, average pooling, RMSNorm and the
projection ``mm_input_projection_weight``, all through ``model.model.get_image_features``).

Rows per sample for :func:`ppmedia.split_media`: the processor computes ``num_crops`` per image but
drops it from its output (``Gemma3Processor.unused_input_names``), so :meth:`media_per_sample`
counts a sample's rows from its tokens: image tokens / ``mm_tokens_per_image`` (original images and
crops together, which is what ``pixel_values`` holds per sample). Passing ``n_images_per_sample``
(images + crops per sample, e.g. from the image processor's own ``num_crops``) works as well.

Attention: image tokens attend to all tokens of their own block, in both directions
(``token_type_ids`` = 1 at image tokens, as the processor returns them); everything else is causal,
and the sliding-window layers keep their window. The pipeline's stages build that mask with
:meth:`Gemma3Adapter.attention_masks`, from token types the first stage derives from ``input_ids``
(:meth:`Gemma3Adapter.token_type_ids`) and sends on with the hidden states.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch
from torch import Tensor

from ..chunk import VlmMediaChunk
from ._helpers import ImageRowsAdapter, refuse_videos
from .base import HostValues, WireTensor, config_get, config_value

__all__ = ["Gemma3Adapter"]


class Gemma3Adapter(ImageRowsAdapter):
    """Gemma 3 adapter (``Gemma3ForConditionalGeneration``).

    Module paths used: ``model.model.get_image_features(pixel_values)`` (``vision_tower`` and
    ``multi_modal_projector``; ``model.get_image_features`` when ``model`` is the inner
    ``Gemma3Model``); ``model.config`` fields ``image_token_id``, ``mm_tokens_per_image``,
    ``vision_config.image_size`` and ``vision_config.num_channels``; for the attention masks,
    transformers' ``gemma3`` mask helpers and the language model's config (``sliding_window``).
    """

    name: ClassVar[str] = "gemma3"
    model_types: ClassVar[tuple[str, ...]] = ("gemma3",)
    layout: ClassVar[str] = (
        "complete images [rows, C, H, W], one row per image or pan-and-scan crop, "
        "mm_tokens_per_image tokens each; no grid"
    )
    image_token_fields: ClassVar[tuple[str, ...]] = ("image_token_id", "image_token_index")
    expected_model: ClassVar[str] = "a Gemma3ForConditionalGeneration or Gemma3Model"

    def tokens_per_row(self, config: Any) -> int:
        """``mm_tokens_per_image``: every row (an image or a pan-and-scan crop) is pooled to as many."""
        return int(config_value(config, "mm_tokens_per_image"))

    # -- token side -------------------------------------------------------------------------
    def token_type_ids(self, input_ids: Tensor, config: Any) -> Tensor:
        """``[b, S]`` int64: 1 at image tokens, 0 elsewhere (what ``Gemma3Processor`` returns)."""
        return (input_ids == self.image_token_id(config)).to(torch.int64)

    # -- media side -------------------------------------------------------------------------
    def feature_counts(self, chunk: VlmMediaChunk, config: Any, host: HostValues) -> dict[str, int]:
        """``{"image": rows * mm_tokens_per_image}``, from shapes only.

        Raises:
            ValueError: the chunk carries videos or a per-image grid, or ``pixel_values`` is not
                ``[rows, C, H, W]`` at the vision tower's channels and size.
            TypeError: ``pixel_values`` is not floating point.
        """
        refuse_videos(chunk, "gemma3")
        if chunk.image_grid is not None:
            raise ValueError(
                f"gemma3 takes no per-image grid, but the chunk carries image_grid of shape "
                f"{tuple(chunk.image_grid.shape)}"
            )
        pixels = chunk.pixel_values
        if pixels is None:
            return {"image": 0}
        size = int(config_value(config, "vision_config.image_size"))
        vision = config_get(config, "vision_config")
        found = config_get(vision, "num_channels")
        channels = int(found) if found is not None else int(getattr(vision, "num_channels", 3))
        if pixels.dim() != 4 or tuple(pixels.shape[1:]) != (channels, size, size):
            raise ValueError(
                f"gemma3 pixel_values: shape {tuple(pixels.shape)}; expected [rows, {channels}, {size}, {size}] "
                f"(complete images at vision_config.image_size)"
            )
        if not pixels.is_floating_point():
            raise TypeError(f"gemma3 pixel_values: dtype {pixels.dtype}; expected a floating dtype")
        return {"image": pixels.shape[0] * self.tokens_per_row(config)}

    # -- every stage ------------------------------------------------------------------------
    def wire_tensors(self, config: Any, first_layer: int) -> tuple[WireTensor, ...]:
        """Every later stage gets the token types ``[b, S]`` (int64) to build its masks from."""
        return (WireTensor("token_type_ids", ("b", "S")),)

    def first_stage(
        self,
        model: torch.nn.Module,
        input_ids: Tensor,
        attention_mask: Tensor,
        inputs_embeds: Tensor,
        chunk: VlmMediaChunk | None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """:meth:`merge`, plus the token types derived from ``input_ids`` for every stage."""
        hidden = self.merge(model, input_ids, inputs_embeds, chunk)
        return hidden, {"token_type_ids": self.token_type_ids(input_ids, model.config)}

    def decoder_kwargs(
        self,
        stage: torch.nn.Module,
        layers: range,
        hidden: Tensor,
        attention_mask: Tensor,
        wire: Mapping[str, Tensor],
    ) -> dict[str, Any]:
        """The model's own masks (causal OR same image block; sliding layers within the window)."""
        lm: torch.nn.Module = getattr(stage, "stage_language_model")
        return {"attention_mask": self.attention_masks(lm, hidden, attention_mask, wire["token_type_ids"])}

    def attention_blocks(self, config: Any, wire: Mapping[str, Tensor]) -> Tensor | None:
        """Each image's tokens one bidirectional block (the model's own ``get_block_sequence_ids_for_mask``)."""
        from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

        blocks: Tensor = get_block_sequence_ids_for_mask(wire["token_type_ids"])
        return blocks.long()

    def attention_masks(
        self,
        language_model: torch.nn.Module,
        inputs_embeds: Tensor,
        attention_mask: Tensor | None,
        token_type_ids: Tensor,
        position_ids: Tensor | None = None,
    ) -> dict[str, Any]:
        """The masks ``Gemma3Model.forward`` builds for its language model, for one microbatch.

        Args:
            language_model: the (stage's) ``Gemma3TextModel``; its config gives the sliding window.
            inputs_embeds: ``[b, S, H]`` the hidden states entering the stage (shape, dtype, device).
            attention_mask: ``[b, S]`` the batch's padding mask (or ``None``).
            token_type_ids: ``[b, S]``, 1 at image tokens.
            position_ids: ``[b, S]`` or ``None`` (the model's own forward passes ``None``).

        Returns:
            ``{"full_attention": mask, "sliding_attention": mask}``: causal OR same-image-block, the
            sliding one also limited to the window; pass it as the language model's
            ``attention_mask``.
        """
        from transformers.models.gemma3.modeling_gemma3 import (
            create_masks_for_vision_model,
            get_block_sequence_ids_for_mask,
        )

        blocks = get_block_sequence_ids_for_mask(token_type_ids, device=inputs_embeds.device)
        return create_masks_for_vision_model(
            config=language_model.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            past_key_values=None,
            position_ids=position_ids,
            block_sequence_ids=blocks,
        )
