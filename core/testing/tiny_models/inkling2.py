"""Tiny seeded Inkling 2 (``inkling2``): one pixel row per image token, a text model with attention
residuals over block states that grow at every block boundary.

Images: the Inkling 2 image processor pads an image to whole 40 x 40 tiles and gives one row per tile,
``pixel_values`` ``[tiles, 40, 40, 3]`` channels-last, with ``image_grid_thw`` ``[images, 3]`` ``(1, rows,
columns)`` counted in language-model tokens: an image fills ``rows * columns`` placeholder tokens (no
start or end token, so two images back to back form one run that the grid splits). Tiny geometry:
tiles of 8 x 8 pixels (``patch_size`` 4 x ``spatial_merge_size`` 2), so ``pixel_values`` is
``[tokens, 8, 8, 3]``.

Text model (hidden 64, 4 layers, sliding / full attention alternating, a tiny MoE in each):
``n_layers_per_attn_res_block = 2``, so layers 0 and 2 open a block; every layer mixes the block
states so far (the input of each block-opening layer) into its attention and MLP inputs, and the last
one ``final_input`` before the norm. The default 2-stage split (2 + 2) sends the first block (layer
0's input: the merged embeddings) across the boundary. transformers initialises the block-state
queries (``attention_input``, ``mlp_input``, ``final_input``) to zeros; they are drawn from the seed
(:func:`~ppmedia.testing.tiny_models.seeded_distinct`), as are the other constants.

======  ======================================  ============
sample  images (grid rows x columns)            image tokens
======  ======================================  ============
0       2 x 2                                   4
1       2 x 3, 1 x 1 (back to back)             6 + 1
2       3 x 4                                   12
3       2 x 2                                   4
4, 5    text only                               0
6       1 x 4, then text, 2 x 1                 4 + 2
7       4 x 4                                   16
======  ======================================  ============
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import seeded_distinct
from ._batch import right_padded

__all__ = [
    "IMAGE_TOKEN_ID",
    "MODEL_TYPE",
    "PAD_TOKEN_ID",
    "TILE",
    "build_batch",
    "build_config",
    "build_model",
    "build_processor",
    "reference_inputs",
]

MODEL_TYPE = "inkling2"

PAD_TOKEN_ID = 0
IMAGE_TOKEN_ID = 5
_FIRST_TEXT_ID = 10
_VOCAB = 128
PATCH_SIZE = 4
MERGE = 2
TILE = PATCH_SIZE * MERGE

#: per sample: text runs (ints) and images ``(rows, columns)``; consecutive images are back to back.
_SAMPLES: tuple[tuple[Any, ...], ...] = (
    (3, (2, 2), 4),
    (2, (2, 3), (1, 1), 3),
    (4, (3, 4), 5),
    (2, (2, 2), 4),
    (9,),
    (13,),
    (2, (1, 4), 2, (2, 1), 2),
    (3, (4, 4), 2),
)


def build_config() -> Any:
    """The tiny ``Inkling2Config``."""
    from transformers import Inkling2Config

    text = {
        "vocab_size": _VOCAB, "unpadded_vocab_size": _VOCAB, "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 2, "swa_head_dim": 16, "sliding_window_size": 8, "d_rel": 4, "rel_extent": 16,
        "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"], "moe_intermediate_size": 32,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "n_layers_per_attn_res_block": 2,
        "max_position_embeddings": 256, "pad_token_id": PAD_TOKEN_ID, "bos_token_id": 1, "eos_token_id": 2,
    }
    vision = {
        "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE, "posemb_grid_size": 4, "projection_hidden_dim": 64, "text_hidden_size": 64,
    }
    config = Inkling2Config(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN_ID)
    config._attn_implementation = "eager"  # the relative position bias runs on the eager path only
    return config


def build_model(seed: int = 0) -> torch.nn.Module:
    """The tiny ``Inkling2ForConditionalGeneration``, float32, eval mode, seeded (constants drawn)."""
    from transformers import Inkling2ForConditionalGeneration

    return seeded_distinct(Inkling2ForConditionalGeneration, build_config(), seed)


def build_batch(seed: int = 0) -> dict[str, Tensor]:
    """``input_ids`` / ``attention_mask`` ``[8, S]``, ``pixel_values`` ``[tokens, 8, 8, 3]`` in ``[-1, 1]``,
    ``image_grid_thw`` ``[8, 3]``."""
    gen = torch.Generator().manual_seed(seed)
    rows, grids = [], []
    for sample in _SAMPLES:
        ids: list[int] = [1]
        for part in sample:
            if isinstance(part, int):
                ids += torch.randint(_FIRST_TEXT_ID, _VOCAB, (part,), generator=gen).tolist()
            else:
                grids.append((1, *part))
                ids += [IMAGE_TOKEN_ID] * (part[0] * part[1])
        rows.append(ids + [2])
    input_ids, attention_mask = right_padded(rows, PAD_TOKEN_ID)
    grid = torch.tensor(grids, dtype=torch.int64)
    pixel_values = torch.rand((int(grid.prod(-1).sum()), TILE, TILE, 3), generator=gen) * 2 - 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "pixel_values": pixel_values, "image_grid_thw": grid}


def reference_inputs(batch: dict[str, Tensor]) -> dict[str, Any]:
    """Keyword arguments of the model's own full-batch forward."""
    return {k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw")}


def build_processor(image_backend: str = "torchvision") -> Any:
    """A real ``Inkling2Processor``: ``Inkling2ImageProcessor`` (torchvision only) at tiles of
    :data:`TILE` x :data:`TILE` pixels, one token a tile; a word-level tokenizer with the tiny ids
    (``<|image|>`` ``IMAGE_TOKEN_ID``, ``<|im_start|>`` 1, ``<|im_end|>`` 2), a chatml chat template."""
    from ._processors import image_processor_class, qwen_processor, qwen_tokenizer

    images = image_processor_class("Inkling2ImageProcessor", image_backend)(size={"height": TILE, "width": TILE})
    ids = {"<|endoftext|>": PAD_TOKEN_ID, "<|im_start|>": 1, "<|im_end|>": 2, "<|image|>": IMAGE_TOKEN_ID}
    return qwen_processor("Inkling2Processor", tokenizer=qwen_tokenizer(_VOCAB, ids, image="<|image|>", video=None), images=images,
                          media={"image": "<|image|>"})
