"""ppmedia's tiny Gemma 3, with token types that the ids do not determine.

The batch is ``ppmedia.testing.tiny_models.gemma3``'s, except that ``token_type_ids`` also marks every
``<boi>`` and the text token before it as 1: they join the image block's bidirectional attention (a
block is a run of 1s). The model's own forward follows the given types; the ids alone would not.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ppmedia.testing.tiny_models import gemma3

MODEL_TYPE = gemma3.MODEL_TYPE
build_config = gemma3.build_config
build_model = gemma3.build_model
reference_inputs = gemma3.reference_inputs


def build_batch(seed: int = 0) -> dict[str, Tensor]:
    batch = gemma3.build_batch(seed)
    ids = batch["input_ids"]
    types = batch["token_type_ids"].clone()
    boi = ids == gemma3.BOI_TOKEN_ID
    before = torch.zeros_like(boi)
    before[:, :-1] = boi[:, 1:]
    types[boi | before] = 1
    batch["token_type_ids"] = types
    return batch


def derived_token_types(batch: dict[str, Any]) -> Tensor:
    """What the ids alone give (ppmedia's own Gemma 3 adapter): differs from the batch's."""
    return (batch["input_ids"] == gemma3.IMAGE_TOKEN_ID).to(torch.int64)
