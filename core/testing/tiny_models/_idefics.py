"""What the tiny Idefics3 and SmolVLM families share: the processor's per-sample crop layout and its prompt.

The vision tower sees 16 x 16 crops cut in 4 x 4 patches (16 patches); the connector's pixel shuffle
(``scale_factor`` 2) makes :data:`TOKENS_PER_CROP` = 4 image tokens of a crop. Like
``Idefics3ImageProcessor`` (``do_image_splitting``), an image is either one crop (its global view) or
``rows x cols`` split crops followed by its global view; the prompt ``Idefics3Processor`` writes for
it is, per split crop, ``<fake_token_around_image> <row_r_col_c> <image> * 4``, a newline after each
row, then ``\\n <fake_token_around_image> <global-img> <image> * 4 <fake_token_around_image>``
(a single crop: the last part without the newline).

``pixel_values`` ``[8, 5, 3, 16, 16]`` holds each sample's crops in prompt order, zero past its own
(the processor's padding, which the model drops: a crop is padding when all its pixels are 0);
``pixel_attention_mask`` ``[8, 5, 16, 16]`` is 1 on real pixels. Two small images are padded inside
their crop too (pixels and mask 0 on the padded rows/columns), as the processor pads images to the
batch's largest.

======  =============================================  =====
sample  images (rows x cols split, or single)          crops
======  =============================================  =====
0       2 x 1                                          3
1       single (12 x 16 real pixels), 1 x 2            1 + 3
2       single                                         1
3       2 x 2                                          5
4       text only                                      0
5       text only                                      0
6       single (16 x 10 real pixels)                   1
7       1 x 2                                          3
======  =============================================  =====
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from ._batch import right_padded
from ._configs import text_fields, tower_fields

VOCAB_SIZE = 128
PAD_TOKEN_ID = 0
IMAGE_TOKEN_ID = VOCAB_SIZE - 1
FAKE_TOKEN_ID = VOCAB_SIZE - 2
GLOBAL_TOKEN_ID = VOCAB_SIZE - 3
NEWLINE_TOKEN_ID = VOCAB_SIZE - 4
ROW_COL_TOKEN_ID = VOCAB_SIZE - 20  # <row_r_col_c>: 16 ids from here
CROP = 16
PATCH = 4
SCALE = 2
TOKENS_PER_CROP = (CROP // PATCH) ** 2 // SCALE**2
MAX_CROPS = 5

#: per sample: its images as (rows, cols) of split crops ((0, 0): a single crop), and the real
#: (height, width) inside the crop of a small single image (None: the whole crop).
SAMPLES: tuple[tuple[tuple[tuple[int, int], tuple[int, int] | None], ...], ...] = (
    (((2, 1), None),),
    (((0, 0), (12, 16)), ((1, 2), None)),
    (((0, 0), None),),
    (((2, 2), None),),
    (),
    (),
    (((0, 0), (16, 10)),),
    (((1, 2), None),),
)
_PREFIX = (3, 2, 4, 6, 9, 5, 2, 3)
_SUFFIX = (5, 3, 6, 4, 2, 7, 2, 4)


def vision_kwargs() -> dict[str, Any]:
    return tower_fields(image_size=CROP, patch_size=PATCH)


def text_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**text_fields(VOCAB_SIZE, PAD_TOKEN_ID, max_position_embeddings=512))


def image_prompt(rows: int, cols: int) -> list[int]:
    """The ids ``Idefics3Processor`` writes for one image of ``rows x cols`` split crops (0 x 0: single)."""
    image = [IMAGE_TOKEN_ID] * TOKENS_PER_CROP
    if rows == cols == 0:
        return [FAKE_TOKEN_ID, GLOBAL_TOKEN_ID, *image, FAKE_TOKEN_ID]
    ids: list[int] = []
    for r in range(rows):
        for c in range(cols):
            ids += [FAKE_TOKEN_ID, ROW_COL_TOKEN_ID + 4 * r + c, *image]
        ids.append(NEWLINE_TOKEN_ID)
    return ids + [NEWLINE_TOKEN_ID, FAKE_TOKEN_ID, GLOBAL_TOKEN_ID, *image, FAKE_TOKEN_ID]


def crops_of(sample: Sequence[tuple[tuple[int, int], Any]]) -> int:
    return sum(rows * cols + 1 for (rows, cols), _ in sample)


def order(text_only_first: bool) -> list[int]:
    samples = list(range(len(SAMPLES)))
    return [4, 5] + [i for i in samples if i not in (4, 5)] if text_only_first else samples


def build_batch(seed: int = 0, *, text_only_first: bool = False) -> dict[str, Tensor]:
    """``input_ids`` / ``attention_mask`` ``[8, S]``, ``pixel_values`` ``[8, 5, 3, 16, 16]``,
    ``pixel_attention_mask`` ``[8, 5, 16, 16]`` (int64, as the processor returns it)."""
    gen = torch.Generator().manual_seed(seed)
    samples = order(text_only_first)
    rows, pixels = [], torch.zeros(len(samples), MAX_CROPS, 3, CROP, CROP)
    mask = torch.zeros(len(samples), MAX_CROPS, CROP, CROP, dtype=torch.int64)
    for s, i in enumerate(samples):
        ids = torch.randint(3, ROW_COL_TOKEN_ID, (_PREFIX[i],), generator=gen).tolist()
        crop = 0
        for (r, c), real in SAMPLES[i]:
            ids += image_prompt(r, c) + torch.randint(3, ROW_COL_TOKEN_ID, (1,), generator=gen).tolist()
            h, w = real or (CROP, CROP)
            for k in range(r * c + 1):
                pixels[s, crop + k, :, :h, :w] = torch.randn(3, h, w, generator=gen)
                mask[s, crop + k, :h, :w] = 1
            crop += r * c + 1
        rows.append(ids + torch.randint(3, ROW_COL_TOKEN_ID, (_SUFFIX[i],), generator=gen).tolist())
    input_ids, attention_mask = right_padded(rows, PAD_TOKEN_ID)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "pixel_values": pixels, "pixel_attention_mask": mask}


def reference_inputs(batch: dict[str, Tensor]) -> dict[str, Any]:
    """Keyword arguments of the model's own full-batch forward."""
    return {k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask") if k in batch}


def build_processor(processor_name: str, image_processor_name: str, image_backend: str, **more: Any) -> Any:
    """A real ``Idefics3Processor`` / ``SmolVLMProcessor`` around ``<image_processor_name>`` (``...Pil``
    with ``image_backend="pil"``) at the tiny crop: images at most 32 pixels a side, split in 16-pixel
    crops (at most 2 x 2 and the global view), :data:`TOKENS_PER_CROP` tokens a crop; a word-level
    tokenizer with the tiny ids (``<row_r_col_c>`` for r, c in 1..4, ``<end_of_utterance>`` 3); the
    Idefics chat style (role word, content, ``<end_of_utterance>``). The processor's newlines between
    crop rows are whitespace to this tokenizer (no token)."""
    import transformers

    from ..word_tokenizer import TokenizerSpec, chat_template, word_tokenizer
    from ._processors import image_processor_class

    images = image_processor_class(image_processor_name, image_backend)(size={"longest_edge": 2 * CROP},
                                                                          max_image_size={"longest_edge": CROP})
    ids = {"<pad>": PAD_TOKEN_ID, "<s>": 1, "</s>": 2, "<end_of_utterance>": 3, "<image>": IMAGE_TOKEN_ID,
           "<fake_token_around_image>": FAKE_TOKEN_ID, "<global-img>": GLOBAL_TOKEN_ID}
    ids.update({f"<row_{r + 1}_col_{c + 1}>": ROW_COL_TOKEN_ID + 4 * r + c for r in range(4) for c in range(4)})
    tokenizer = word_tokenizer(TokenizerSpec(VOCAB_SIZE, ids, pad="<pad>", eos="<end_of_utterance>", bos="<s>"))
    template = chat_template("idefics", {"image": "<image>"}, bos="<s>")
    return getattr(transformers, processor_name)(image_processor=images, tokenizer=tokenizer, image_seq_len=TOKENS_PER_CROP,
                                                 chat_template=template, **more)
