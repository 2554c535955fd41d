"""Tiny seeded Mistral Small 4: a Mistral 3 model (``mistral3``: Pixtral tower, 2 x 2 patch merger)
whose text model is ``mistral4`` (multi-head latent attention with a query LoRA, mixture of experts).

Media and tokens are Mistral 3's (:mod:`ppmedia.testing.tiny_models.mistral3`, the same batch layout and
sizes: 8 x 8 patches, 16 pixels per image token, ``[IMG]`` 10, ``[IMG_BREAK]`` 12, ``[IMG_END]`` 13);
the model type is ``mistral3``, so the :class:`~ppmedia.adapters.mistral3.Mistral3Adapter` serves it.
The text model (hidden 64, 2 layers): layer 0 dense, layer 1 a MoE (4 routed experts, 2 per token, one
shared), MLA with ``q_lora_rank`` 16 and ``kv_lora_rank`` 16, the released model's YaRN rope with its
Llama-4 position scaling of the queries (over a 16-token original window). No state crosses layers besides the hidden states; the 2-stage
split puts one layer on each stage. Constant-initialised parameters are drawn from the seed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import seeded_distinct
from .mistral3 import build_batch as _mistral3_batch

__all__ = ["ADAPTER", "MODEL_TYPE", "build_batch", "build_config", "build_model", "build_processor", "reference_inputs"]

#: the built-in adapter serving this tiny model (its model type is mistral3's)
ADAPTER = "mistral3"
MODEL_TYPE = "mistral3"


def build_config() -> Any:
    """The tiny ``Mistral3Config`` with a ``Mistral4Config`` text model."""
    from transformers import Mistral3Config, Mistral4Config, PixtralVisionConfig

    from ._configs import pixtral_tower_fields, text_fields
    from .mistral3 import IMAGE_TOKEN_ID, MAX_SIZE, MERGE, PAD_TOKEN_ID, PATCH_SIZE, VOCAB_SIZE

    vision = PixtralVisionConfig(**pixtral_tower_fields(MAX_SIZE, PATCH_SIZE))
    text = Mistral4Config(**text_fields(
        VOCAB_SIZE, PAD_TOKEN_ID, moe_intermediate_size=32, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=256,
        # the released model's YaRN + Llama-4 query scaling, over a 16-token original window: the
        # scaling changes at positions 16 and 32 of the tiny batch
        rope_parameters={
            "type": "yarn", "rope_theta": 1e4, "factor": 16.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
            "llama_4_scaling_beta": 0.1, "max_position_embeddings": 256,
        },
    ))
    return Mistral3Config(
        vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID, spatial_merge_size=MERGE,
        vision_feature_layer=-1,
    )


def build_model(seed: int = 0) -> torch.nn.Module:
    """The tiny ``Mistral3ForConditionalGeneration`` (Mistral 4 text), float32, eval mode, seeded."""
    from transformers import Mistral3ForConditionalGeneration

    return seeded_distinct(Mistral3ForConditionalGeneration, build_config(), seed)


def build_batch(seed: int = 0) -> dict[str, Tensor]:
    """The Mistral 3 tiny batch (:func:`ppmedia.testing.tiny_models.mistral3.build_batch`)."""
    return _mistral3_batch(seed)


def reference_inputs(batch: dict[str, Tensor]) -> dict[str, Any]:
    """Keyword arguments of the model's own full-batch forward."""
    return {k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values", "image_sizes")}


def build_processor(image_backend: str = "torchvision") -> Any:
    """Mistral 3's tiny processor (:func:`ppmedia.testing.tiny_models.mistral3.build_processor`): same ids and tower."""
    from .mistral3 import build_processor as mistral3_processor

    return mistral3_processor(image_backend)
