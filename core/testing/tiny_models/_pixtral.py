"""Processor-style batches of complete images for the Pixtral-tower tiny families (Mistral 3, Mistral
Small 4, Mistral Large 4, Pixtral-backbone LLaVA): images padded to the largest with their true sizes,
and the text ``PixtralProcessor`` writes for them.

Private to ``ppmedia.testing.tiny_models``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from ._batch import right_padded

__all__ = ["PixtralLayout", "image_ids", "pixtral_batch", "pixtral_processor"]


@dataclass(frozen=True)
class PixtralLayout:
    """The token ids and geometry of one tiny Pixtral family.

    Attributes:
        step: pixels per image token along each side (vision patch size x spatial merge).
        max_size: the padded height and width of ``pixel_values``.
        vocab, first_text_id: text tokens are drawn from ``[first_text_id, vocab)``.
        image, image_break, image_end, pad: the special token ids.
        sizes: per sample, the true (height, width) of each of its images, in token order.
        prefix, suffix: per sample, the text tokens before its first image and after its last.
    """

    step: int
    max_size: int
    vocab: int
    first_text_id: int
    image: int
    image_break: int
    image_end: int
    pad: int
    sizes: tuple[tuple[tuple[int, int], ...], ...]
    prefix: Sequence[int]
    suffix: Sequence[int]


def image_ids(layout: PixtralLayout, size: tuple[int, int]) -> list[int]:
    """One image's tokens: per row of tokens ``[IMG] * cols`` then ``[IMG_BREAK]``, ``[IMG_END]``
    instead of the last break."""
    rows, cols = size[0] // layout.step, size[1] // layout.step
    ids = ([layout.image] * cols + [layout.image_break]) * rows
    ids[-1] = layout.image_end
    return ids


def pixtral_batch(layout: PixtralLayout, seed: int) -> dict[str, Tensor]:
    """``input_ids`` / ``attention_mask`` ``[B, S]`` (right-padded), ``pixel_values`` ``[images, 3,
    max_size, max_size]`` float32 (zero past each image's true size), ``image_sizes`` ``[images, 2]``."""
    gen = torch.Generator().manual_seed(seed)

    def text(n: int) -> list[int]:
        return torch.randint(layout.first_text_id, layout.vocab, (n,), generator=gen).tolist()

    rows: list[list[int]] = []
    for i, sizes in enumerate(layout.sizes):
        ids = text(layout.prefix[i])
        for j, size in enumerate(sizes):
            ids += (text(1) if j else []) + image_ids(layout, size)
        ids += text(layout.suffix[i])
        rows.append(ids)
    input_ids, attention_mask = right_padded(rows, layout.pad)
    all_sizes = [size for sizes in layout.sizes for size in sizes]
    pixel_values = torch.zeros(len(all_sizes), 3, layout.max_size, layout.max_size)
    for k, (h, w) in enumerate(all_sizes):
        pixel_values[k, :, :h, :w] = torch.randn(3, h, w, generator=gen)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "pixel_values": pixel_values,
        "image_sizes": torch.tensor(all_sizes, dtype=torch.int64),
    }


def pixtral_processor(layout: PixtralLayout, patch_size: int, merge: int, image_backend: str) -> Any:
    """A real ``PixtralProcessor`` for ``layout``: ``PixtralImageProcessor`` (``...Pil`` with
    ``image_backend="pil"``) at patch ``layout.step`` (vision patch x merge, as the processor passes
    it), longest edge ``layout.max_size``; a word-level tokenizer with the layout's ids (``<s>`` 1,
    ``</s>`` 2, ``[INST]`` 3, ``[/INST]`` 4, ``<pad>`` the pad id), Mistral's ``[INST]`` chat template."""
    import transformers

    from ..word_tokenizer import TokenizerSpec, chat_template, word_tokenizer
    from ._processors import image_processor_class

    images = image_processor_class("PixtralImageProcessor", image_backend)(
        patch_size={"height": layout.step, "width": layout.step}, size={"longest_edge": layout.max_size})
    ids = {"<pad>": layout.pad, "<s>": 1, "</s>": 2, "[INST]": 3, "[/INST]": 4, "[IMG]": layout.image,
           "[IMG_BREAK]": layout.image_break, "[IMG_END]": layout.image_end}
    tokenizer = word_tokenizer(TokenizerSpec(layout.vocab, ids, pad="<pad>", eos="</s>", bos="<s>"))
    return transformers.PixtralProcessor(image_processor=images, tokenizer=tokenizer, patch_size=patch_size,
                                         spatial_merge_size=merge, chat_template=chat_template("inst", {"image": "[IMG]"}, bos="<s>"))
