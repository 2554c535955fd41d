"""PaliGemma (``paligemma``): complete images, a fixed number of tokens each, a prefix-LM mask on every stage.

Media layout of a chunk: ``chunk.pixel_values`` ``[images, C, S, S]``, complete images at the SigLIP
tower's ``image_size`` (``SiglipImageProcessor`` resizes to it: 224 px in the released models), in
placeholder order (core layout ``images``); each gives ``(S // patch) ** 2`` feature rows (256 at
224 px with patch 14; ``text_config.num_image_tokens``). The processor writes a sample's image tokens
first, then ``<bos>`` and the prompt; several images of a sample form one run, so a sample's images
are its image tokens divided by the tokens of one.

Per-token input ``token_type_ids`` ``[B, S]`` (a :class:`~ppmedia.adapters.base.SampleInput` staged
with the samples and sent to EVERY stage): 0 on the prefix (images and prompt), which attends
bidirectionally, 1 on the suffix (the answer), causal. Nothing in the ids says where the prompt ends,
so it cannot be derived: the processor's value is carried. Each stage builds the model's own masks
from it (transformers' ``create_causal_mask`` with ``block_sequence_ids = where(types == 0, 0, -1)``;
PaliGemma 2's Gemma 2 text model also gets the sliding-window mask) and passes the language model
the model's 1-indexed positions ``1 .. S``. The merged embeddings do not depend on the token types,
only the attention does: a golden of embeddings cannot see wrong token types, the stage-split and
pipeline checks can (``tests/test_paligemma_adapter.py`` plants them).

Logits: the model's final soft-capping (``text_config.final_logit_softcapping``, PaliGemma 2) is
applied by :meth:`PaliGemmaAdapter.logits`. A batch without ``token_type_ids`` is refused before the
split (pass all ones for a purely causal model). An image token id outside the text vocabulary (the
model then embeds it as id 0) is refused by the first stage's embedding; real checkpoints keep it
inside.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch
from torch import Tensor

from ..chunk import VlmMediaChunk
from ._helpers import ImageRowsAdapter, shape
from .base import SampleInput, config_get, config_value

__all__ = ["PaliGemmaAdapter", "tokens_per_image"]

_TYPES = "token_type_ids"


def tokens_per_image(config: Any) -> int:
    """Placeholder tokens of one image: ``(image_size // patch_size) ** 2`` of the vision tower."""
    vision = config_value(config, "vision_config")
    side = int(config_value(vision, "image_size")) // int(config_value(vision, "patch_size"))
    return side * side


class PaliGemmaAdapter(ImageRowsAdapter):
    """PaliGemma / PaliGemma 2 adapter (``PaliGemmaForConditionalGeneration``).

    Module paths used: ``model.model.get_image_features(pixel_values)`` (SigLIP tower + linear
    projector; ``model.get_image_features`` on the inner ``PaliGemmaModel``); config fields
    ``image_token_index``, ``vision_config.image_size`` / ``patch_size`` / ``num_channels``; on every
    stage transformers' ``masking_utils.create_causal_mask`` (and ``create_sliding_window_causal_mask``
    when ``text_config.sliding_window`` is set) on the text config, as ``PaliGemmaModel.forward`` calls them.
    """

    name: ClassVar[str] = "paligemma"
    model_types: ClassVar[tuple[str, ...]] = ("paligemma",)
    layout: ClassVar[str] = (
        "complete images [images, C, S, S], (S // patch) ** 2 tokens each; token_type_ids [B, S] "
        "(0 = bidirectional prefix) on every stage"
    )
    sample_inputs: ClassVar[tuple[SampleInput, ...]] = (SampleInput(_TYPES, ("b", "S"), every_stage=True),)
    prefix_lm_key: ClassVar[str | None] = _TYPES
    expected_model: ClassVar[str] = "a PaliGemmaForConditionalGeneration or PaliGemmaModel"

    def tokens_per_row(self, config: Any) -> int:
        """:func:`tokens_per_image`: an image is a row (a sample's images are its image tokens / this)."""
        return tokens_per_image(config)

    # -- token side -------------------------------------------------------------------------
    def media_counts(self, batch: Mapping[str, Any], config: Any) -> dict[str, Any]:
        """Counts, and the batch's ``token_type_ids`` to stage with the samples.

        Raises:
            ValueError: the batch has no ``token_type_ids``, or one that is not ``[B, S]`` like ``input_ids``.
        """
        ids, types = batch["input_ids"], batch.get(_TYPES)
        if not isinstance(types, Tensor) or list(types.shape) != list(ids.shape):
            seen = shape(types) if isinstance(types, Tensor) else ("missing" if types is None else type(types).__name__)
            raise ValueError(
                f"{self.name}: {_TYPES} is {seen}; expected {list(ids.shape)} like input_ids (the processor's prefix-LM "
                f"token types: 0 on the bidirectional prefix, 1 on the causal suffix; all ones for a causal model)"
            )
        return super().media_counts(batch, config)

    # -- every stage ------------------------------------------------------------------------
    def decoder_kwargs(
        self,
        stage: torch.nn.Module,
        layers: range,
        hidden: Tensor,
        attention_mask: Tensor,
        wire: Mapping[str, Tensor],
    ) -> dict[str, Any]:
        """The model's prefix-LM masks from the token types this stage received, and its 1-indexed positions."""
        config: Any = getattr(stage, "config")
        at = getattr(stage, "token_positions", None)  # global indices under context parallelism
        positions = (at(hidden) if at is not None else torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)) + 1
        return {
            "attention_mask": self.attention_masks(config.get_text_config(), hidden, attention_mask, wire[_TYPES], positions),
            "position_ids": positions,
        }

    #: create_sliding_window_causal_mask ORs the prefix block after the window
    attention_blocks_windowed: ClassVar[bool] = False

    def attention_blocks(self, config: Any, wire: Mapping[str, Tensor]) -> Tensor | None:
        """The prefix (token type 0) one bidirectional block, as the model's own mask makes it."""
        types = wire[_TYPES]
        return torch.where(types == 0, 0, -1).long()

    def packed_position_ids(
        self,
        model: torch.nn.Module,
        segments: Tensor,
        input_ids: Tensor | None = None,
        chunk: VlmMediaChunk | None = None,
    ) -> Tensor | None:
        """Packed rows: the model's 1-indexed positions, restarting at 1 at every sample."""
        from ..packing.positions import sample_positions

        return sample_positions(segments) + 1

    def attention_masks(
        self, text_config: Any, inputs_embeds: Tensor, attention_mask: Tensor | None, token_type_ids: Tensor, position_ids: Tensor
    ) -> Any:
        """The mask ``PaliGemmaModel.forward`` gives its language model for one microbatch.

        Args:
            text_config: the model's text config (``config.get_text_config()``).
            inputs_embeds: ``[b, S, H]`` (shape, dtype, device).
            attention_mask: ``[b, S]`` the padding mask (or ``None``).
            token_type_ids: ``[b, S]``, 0 on the bidirectional prefix.
            position_ids: ``[1, S]``, the model's 1-indexed positions.

        Returns:
            The causal mask with the prefix made bidirectional (whatever ``create_causal_mask`` gives:
            a tensor or ``None``), or ``{"full_attention": ..., "sliding_attention": ...}`` when the
            text config has a sliding window (PaliGemma 2).
        """
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        kwargs = {
            "config": text_config, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask,
            "past_key_values": None, "position_ids": position_ids,
            "block_sequence_ids": torch.where(token_type_ids == 0, 0, -1),
        }
        mask = create_causal_mask(**kwargs)
        if config_get(text_config, "sliding_window") is None:
            return mask
        return {"full_attention": mask, "sliding_attention": create_sliding_window_causal_mask(**kwargs)}

    def logits(self, stage: torch.nn.Module, hidden: Tensor) -> Tensor:
        """The head, then the model's final soft-capping when the text config sets one (PaliGemma 2)."""
        logits = super().logits(stage, hidden)
        cap = config_get(getattr(stage, "config").get_text_config(), "final_logit_softcapping")
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap
