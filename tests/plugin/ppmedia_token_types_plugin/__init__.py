"""An example plugin with a per-token input every stage needs: token types taken from the batch.

PaliGemma's prefix-LM mask (and ERNIE 4.5 VL's MoE routing) read token types that the token ids do not
determine; the processor writes them. This plugin replaces ppmedia's Gemma 3 adapter (``override``) with
one that declares the batch's ``token_type_ids`` ``[B, S]`` as a :class:`~ppmedia.adapters.base.SampleInput`
with ``every_stage=True`` instead of deriving them from ``input_ids``: ``split_media`` splits them with
the samples, the first stage finds them in ``chunk.extras``, and ppmedia's stages send them on with the
hidden states, where the adapter's ``decoder_kwargs`` builds each stage's attention masks from
``wire["token_type_ids"]``. Its tiny batch (``tiny.py``) marks text tokens as part of the bidirectional
image blocks too, so a pipeline that derived the types from the ids would not match the model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import ppmedia
from ppmedia.adapters.base import SampleInput, VlmAdapter
from ppmedia.adapters.gemma3 import Gemma3Adapter


class BatchTokenTypesGemma3Adapter(Gemma3Adapter):
    """Gemma 3 with the processor's token types carried to every stage (not derived from the ids)."""

    name = "gemma3_batch_token_types"
    override = True
    sample_inputs = (SampleInput("token_type_ids", ("b", "S"), every_stage=True),)

    def wire_tensors(self, config: Any, first_layer: int) -> tuple:
        return ()  # token_type_ids travel as a sample input (ppmedia adds it to every stage's wire)

    def first_stage(
        self, model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, inputs_embeds: Tensor, chunk: Any
    ) -> tuple[Tensor, dict[str, Tensor]]:
        return self.merge(model, input_ids, inputs_embeds, chunk), {}


@ppmedia.hookimpl
def ppmedia_adapters() -> list[type[VlmAdapter]]:
    return [BatchTokenTypesGemma3Adapter]
