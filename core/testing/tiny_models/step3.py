"""Tiny seeded Step3 family model (transformers' ``Step3p7ForConditionalGeneration``) and batch.

Media layout, as the Step3 processor stages it:

* each image-bearing sample holds exactly ONE image;
* ``pixel_values`` ``[images, 3, 48, 48]``: one global view per image, in sample order;
* ``patch_pixel_values`` ``[patches, 3, 32, 32]``: the local crops, concatenated in image order;
* ``num_patches`` ``[8]``: crops per SAMPLE (0 for a text-only sample and for an image without crops);
* ``patch_newline_mask`` ``[patches]`` bool: the crops that end a row of the crop grid (all rows but
  the last), after which the processor writes a ``<patch_newline>`` text token.

Vision tower: patch 4 and two stride-2 downsampling convolutions, so a global view (48 px, a 12 x 12
patch grid) yields 3 x 3 = :data:`TOKENS_PER_GLOBAL` features and a crop (32 px, 8 x 8) yields
2 x 2 = :data:`TOKENS_PER_CROP`.

Token layout of one image, as the processor writes it (features per image: its crops, then its
global view)::

    for each crop c:  <patch_start> <im_patch> * 4 <patch_end> [<patch_newline> if mask[c]]
    then:             <im_start>    <im_patch> * 9 <im_end>

Only ``<im_patch>`` (:data:`IMAGE_TOKEN_ID`) receives features; the framing and newline tokens are
ordinary text tokens embedded by the language model. The samples:

=======  ==========  ===========  =====  ========  ============  ===========
sample   images      crop grid    crops  newlines  image tokens  real length
=======  ==========  ===========  =====  ========  ============  ===========
0        1           2 wide x 1   2      0         17            28
1        1           none         0      0         9             16
2        1           2 x 2        4      1         25            40
3        1           1 x 2 tall   2      1         17            32
4        0 (text)    -            0      -         0             7
5        0 (text)    -            0      -         0             12
6        1           3 x 1        3      0         21            36
7        1           2 x 3 tall   6      2         33            51
=======  ==========  ===========  =====  ========  ============  ===========

6 images, 17 crops, ``S`` = 51, right-padded with :data:`PAD_TOKEN_ID`. Split in 4 microbatches
(``torch.tensor_split``), microbatch 2 (samples 4 and 5) is text-only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import seeded
from ._batch import right_padded
from ._configs import text_fields

__all__ = [
    "CROP_GRIDS",
    "CROP_SIZE",
    "GLOBAL_SIZE",
    "IMAGE_TOKEN_ID",
    "MODEL_TYPE",
    "PAD_TOKEN_ID",
    "TOKENS_PER_CROP",
    "TOKENS_PER_GLOBAL",
    "build_batch",
    "build_config",
    "build_model",
    "build_processor",
    "reference_inputs",
]

MODEL_TYPE = "step3p7"

PAD_TOKEN_ID = 0
IMAGE_TOKEN_ID = 5  # <im_patch>: the only token that receives image features
PATCH_START_ID = 6
PATCH_END_ID = 7
PATCH_NEWLINE_ID = 8
IM_START_ID = 9
IM_END_ID = 10
_FIRST_TEXT_ID = 11
_VOCAB = 128

VISION_PATCH = 4
GLOBAL_SIZE = 48  # = vision_config.image_size, as in the real model (728)
CROP_SIZE = 32  # the image processor's crop size (504 in the real model); not in the model config
TOKENS_PER_GLOBAL = 9  # 48 / 4 = 12 -> 6 -> 3, squared
TOKENS_PER_CROP = 4  # 32 / 4 = 8 -> 4 -> 2, squared

#: per sample: ``None`` for a text-only sample, ``()`` for an image without crops, else the crop
#: grid ``(columns, rows)``.
CROP_GRIDS: tuple[tuple[int, int] | tuple[()] | None, ...] = (
    (2, 1),
    (),
    (2, 2),
    (1, 2),
    None,
    None,
    (3, 1),
    (2, 3),
)
_PREFIX = (3, 4, 2, 5, 7, 12, 3, 2)  # text tokens before the image (the whole text when text-only)
_SUFFIX = (2, 1, 2, 3, 0, 0, 4, 0)  # text tokens after the image


def build_config() -> Any:
    """The tiny ``Step3p7Config``: vision 2 layers x 32 wide, text 2 dense layers x 64 wide."""
    from transformers import Step3p7Config

    return Step3p7Config(
        vision_config={
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,  # head_dim 16: the axial rope needs a multiple of 4
            "image_size": GLOBAL_SIZE,
            "patch_size": VISION_PATCH,
            "mlp_ratio": 2.0,
            "max_position_embeddings": (GLOBAL_SIZE // VISION_PATCH) ** 2,
            "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
        },
        text_config=text_fields(
            _VOCAB, PAD_TOKEN_ID, None, None, head_dim=16, max_position_embeddings=256,
            sliding_window=64,  # required by the mask code even without sliding layers
            layer_types=["full_attention", "full_attention"], mlp_layer_types=["dense", "dense"],
        ),
        image_token_id=IMAGE_TOKEN_ID,
    )


def build_model(seed: int = 0) -> torch.nn.Module:
    """``Step3p7ForConditionalGeneration`` from :func:`build_config`, float32, eval mode."""
    from transformers import Step3p7ForConditionalGeneration

    return seeded(Step3p7ForConditionalGeneration, build_config(), seed)


def _newline_mask(columns: int, rows: int) -> list[bool]:
    # The processor's rule: a newline after the last crop of every row except the final row.
    return [col == columns - 1 and row < rows - 1 for row in range(rows) for col in range(columns)]


def _image_tokens(columns: int, rows: int) -> list[int]:
    ids: list[int] = []
    for ends_row in _newline_mask(columns, rows):
        ids += [PATCH_START_ID] + [IMAGE_TOKEN_ID] * TOKENS_PER_CROP + [PATCH_END_ID]
        if ends_row:
            ids.append(PATCH_NEWLINE_ID)
    return ids + [IM_START_ID] + [IMAGE_TOKEN_ID] * TOKENS_PER_GLOBAL + [IM_END_ID]


def build_batch(seed: int = 0) -> dict[str, Tensor]:
    """The 8-sample batch described in the module docstring (deterministic for a given ``seed``)."""
    gen = torch.Generator().manual_seed(seed)

    def text(n: int) -> list[int]:
        return torch.randint(_FIRST_TEXT_ID, _VOCAB, (n,), generator=gen).tolist()

    rows: list[list[int]] = []
    crops_per_sample: list[int] = []
    newline: list[bool] = []
    for grid, prefix, suffix in zip(CROP_GRIDS, _PREFIX, _SUFFIX):
        if grid is None:
            rows.append(text(prefix))
            crops_per_sample.append(0)
            continue
        columns, nrows = grid if grid else (0, 0)
        rows.append(text(prefix) + _image_tokens(columns, nrows) + text(suffix))
        crops_per_sample.append(columns * nrows)
        newline += _newline_mask(columns, nrows)

    input_ids, attention_mask = right_padded(rows, PAD_TOKEN_ID)

    images = sum(grid is not None for grid in CROP_GRIDS)
    patches = sum(crops_per_sample)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "pixel_values": torch.randn(images, 3, GLOBAL_SIZE, GLOBAL_SIZE, generator=gen),
        "patch_pixel_values": torch.randn(patches, 3, CROP_SIZE, CROP_SIZE, generator=gen),
        "num_patches": torch.tensor(crops_per_sample, dtype=torch.int64),
        "patch_newline_mask": torch.tensor(newline, dtype=torch.bool),
    }


def reference_inputs(batch: dict[str, Tensor]) -> dict[str, Any]:
    """The model's own forward arguments for ``batch``.

    ``num_patches`` is per sample; the model wants ``num_local_patches`` per image, i.e. the entries of
    the samples that hold an image (any ``<im_patch>`` token). ``patch_newline_mask`` is not a model
    input: its only effect is the ``<patch_newline>`` tokens already in ``input_ids``.
    """
    has_image = (batch["input_ids"] == IMAGE_TOKEN_ID).any(dim=-1)
    return {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "pixel_values": batch["pixel_values"],
        "pixel_values_local": batch["patch_pixel_values"],
        "num_local_patches": batch["num_patches"][has_image].tolist(),
    }


def build_processor(image_backend: str = "torchvision") -> Any:
    """A real ``Step3p7Processor``: ``Step3p7ImageProcessor`` (torchvision only) with the tiny global
    view (48 x 48), crops of 32 x 32, images scaled to at most 96 pixels, vision patch 4 and
    downsampler stride 4 (class attributes of the image processor, set on the instance: 9 tokens a
    global view, 4 a crop); a word-level tokenizer with the tiny ids (``<im_patch>``,
    ``<patch_start>``, ``<patch_end>``, ``<patch_newline>``, ``<im_start>``, ``<im_end>``; ``<s>`` 1,
    ``</s>`` 2), a plain chat template."""
    from transformers import Step3p7Processor

    from ..word_tokenizer import TokenizerSpec, chat_template, word_tokenizer
    from ._processors import image_processor_class

    images = image_processor_class("Step3p7ImageProcessor", image_backend)(
        size={"height": GLOBAL_SIZE, "width": GLOBAL_SIZE}, patch_size=CROP_SIZE, max_image_size=2 * GLOBAL_SIZE)
    images.vision_patch_size, images.downsampler_stride = VISION_PATCH, 4
    ids = {"<pad>": PAD_TOKEN_ID, "<s>": 1, "</s>": 2, "<im_patch>": IMAGE_TOKEN_ID, "<patch_start>": PATCH_START_ID,
           "<patch_end>": PATCH_END_ID, "<patch_newline>": PATCH_NEWLINE_ID, "<im_start>": IM_START_ID, "<im_end>": IM_END_ID}
    tokenizer = word_tokenizer(TokenizerSpec(_VOCAB, ids, pad="<pad>", eos="</s>", bos="<s>"))
    return Step3p7Processor(image_processor=images, tokenizer=tokenizer,
                            chat_template=chat_template("plain", {"image": "<im_patch>"}, bos="<s>"))
