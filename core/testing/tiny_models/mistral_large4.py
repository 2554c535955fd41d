"""Tiny seeded Mistral Large 4 (``mistral_large4``): Pixtral tower, 3 x 3 patch merger, a DSA text model
whose layers hand top-k indices and latent KV to later layers.

Geometry: Pixtral cuts images into 4 x 4 patches (at most 48 x 48 pixels); the patch merger joins
3 x 3 patches (``spatial_merge_size = 3``, as the released model), so an image of true size ``H x W``
(multiples of 12) gives ``(H / 12) x (W / 12)`` ``[IMG]`` tokens, written as Mistral 3's (rows of
``[IMG]``, ``[IMG_BREAK]`` between rows, ``[IMG_END]`` last; ids 10, 12, 13).

The text model has 4 layers, so the default 2-stage split (2 + 2) cuts through every cross-layer
dependency:

=====  ===========  ==========  ========  ===================================================
layer  indexer      RoPE        KV        what it needs from earlier layers
=====  ===========  ==========  ========  ===================================================
0      full         rope        stores    nothing
1      full         nope        stores    nothing
2      **shared**   rope        reads 0   the top-k indices of layer 1, the rope KV of layer 0
3      full         nope        reads 1   the nope KV of layer 1
=====  ===========  ==========  ========  ===================================================

``index_topk = 4`` of up to 30 tokens: the sparse mask matters. Layer 0 is a dense MLP, the others a
tiny MoE (4 experts, 2 per token, one shared). Every parameter transformers initialises to a constant
(the query soft-max scaling ``scale`` 0 / ``bias`` 1, norm weights) is drawn from the seed
(:func:`~ppmedia.testing.tiny_models.seeded_distinct`).

The batch (the same layout for every seed):

======  ==========================  =====  ============
sample  image sizes                 rows   image tokens
======  ==========================  =====  ============
0       (24, 36)                    1      6
1       (12, 12), (36, 24)          2      1 + 6
2       (36, 48)                    1      12
3       (24, 24)                    1      4
4       text only                   0      0
5       text only                   0      0
6       (12, 48), (24, 12)          2      4 + 2
7       (48, 48)                    1      16
======  ==========================  =====  ============
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import seeded_distinct
from ._configs import pixtral_tower_fields, text_fields
from ._pixtral import PixtralLayout, pixtral_batch

__all__ = [
    "IMAGE_BREAK_TOKEN_ID",
    "IMAGE_END_TOKEN_ID",
    "IMAGE_TOKEN_ID",
    "LAYOUT",
    "MODEL_TYPE",
    "PAD_TOKEN_ID",
    "build_batch",
    "build_config",
    "build_model",
    "build_processor",
    "reference_inputs",
    "text_config",
]

MODEL_TYPE = "mistral_large4"

VOCAB_SIZE = 128
PAD_TOKEN_ID = 0
IMAGE_TOKEN_ID = 10
IMAGE_BREAK_TOKEN_ID = 12
IMAGE_END_TOKEN_ID = 13
PATCH_SIZE = 4
MERGE = 3
MAX_SIZE = 48

LAYOUT = PixtralLayout(
    step=PATCH_SIZE * MERGE, max_size=MAX_SIZE, vocab=VOCAB_SIZE, first_text_id=14,
    image=IMAGE_TOKEN_ID, image_break=IMAGE_BREAK_TOKEN_ID, image_end=IMAGE_END_TOKEN_ID, pad=PAD_TOKEN_ID,
    sizes=(((24, 36),), ((12, 12), (36, 24)), ((36, 48),), ((24, 24),), (), (), ((12, 48), (24, 12)), ((48, 48),)),
    prefix=(3, 2, 5, 2, 9, 6, 2, 3),
    suffix=(4, 3, 6, 4, 0, 0, 2, 5),
)


def text_config(**overrides: Any) -> dict[str, Any]:
    """The tiny text config (hidden 64, 4 layers: see the module docstring); ``overrides`` replace keys
    (e.g. ``num_hidden_layers`` with matching ``indexer_types`` / ``kv_source_layers`` /
    ``no_rope_layers``)."""
    config = text_fields(
        VOCAB_SIZE, PAD_TOKEN_ID, moe_intermediate_size=32, num_hidden_layers=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        index_topk=4, index_head_dim=16, index_n_heads=2, first_k_dense_replace=1,
        indexer_types=["full", "full", "shared", "full"], kv_source_layers=[0, 1, 0, 1], no_rope_layers=[1, 0, 1, 0],
        max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    )
    config.update(overrides)
    return config


def build_config(**text_overrides: Any) -> Any:
    """The tiny :class:`~transformers.MistralLarge4Config` (Pixtral 32 wide, 2 layers; text as
    :func:`text_config`)."""
    from transformers import MistralLarge4Config, PixtralVisionConfig

    vision = PixtralVisionConfig(**pixtral_tower_fields(MAX_SIZE, PATCH_SIZE))
    return MistralLarge4Config(
        vision_config=vision, text_config=text_config(**text_overrides), image_token_index=IMAGE_TOKEN_ID,
        spatial_merge_size=MERGE, vision_feature_layer=-1,
    )


def build_model(seed: int = 0, **text_overrides: Any) -> torch.nn.Module:
    """The tiny ``MistralLarge4ForConditionalGeneration``, float32, eval mode, seeded; constant-initialised
    parameters drawn from the seed."""
    from transformers import MistralLarge4ForConditionalGeneration

    return seeded_distinct(MistralLarge4ForConditionalGeneration, build_config(**text_overrides), seed)


def build_batch(seed: int = 0) -> dict[str, Tensor]:
    """``input_ids`` / ``attention_mask`` ``[8, S]``, ``pixel_values`` ``[8, 3, 48, 48]`` (zero past each
    image's true size), ``image_sizes`` ``[8, 2]``."""
    return pixtral_batch(LAYOUT, seed)


def reference_inputs(batch: dict[str, Tensor]) -> dict[str, Any]:
    """Keyword arguments of the model's own full-batch forward."""
    return {k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values", "image_sizes")}


def build_processor(image_backend: str = "torchvision") -> Any:
    """A real ``PixtralProcessor`` (``PixtralImageProcessor`` or ``...Pil``) at vision patch 4, merge 3,
    images of at most 48 pixels a side: :func:`ppmedia.testing.tiny_models._pixtral.pixtral_processor`."""
    from ._pixtral import pixtral_processor

    return pixtral_processor(LAYOUT, PATCH_SIZE, MERGE, image_backend)
