"""Tiny seeded Inkling (``inkling_mm_model``): image patches channels-last, discrete audio codes.

The model (``InklingForConditionalGeneration``):

* vision tower: patches ``pixel_values`` ``[patches, 2, 4, 4, 3]`` (temporal patch 2, patch 4,
  channels LAST, as the Inkling image processor writes them), one token per patch (4 layers: fewer
  need scipy);
* audio tower: discrete log-mel codes ``audio_input_ids`` ``[audios, frames, 80]`` (integers below
  ``mel_vocab_size``) with ``audio_input_ids_mask`` ``[audios, frames]``; one token per valid frame;
* language model: 2 layers (a sliding-window hybrid layer, then a full-attention hybrid layer), MoE
  with 4 experts; the head divides the hidden states by ``logits_mup_width_multiplier`` and keeps the
  first ``unpadded_vocab_size`` logits (the pipeline's last stage does the same).

The tiny processor (:func:`build_processor`) is transformers' own ``InklingProcessor``; its image
processor cuts an image into 4 x 4 tiles, one more column than ``width // 4`` (padded with -1), and its
feature extractor gives one audio token per 50 ms.

Tokens: an image ``<image_bos> <image> * patches``, an audio clip ``<audio_bos> <audio> * frames``. The
processor drops the patches per image, so the rows of a sample are counted from its tokens: one
``pixel_values`` row per image token (:meth:`ppmedia.adapters.inkling.InklingAdapter.media_per_sample`).

The batch (8 samples; split in 4 microbatches, microbatch 2 = samples 4 and 5 is text-only)::

    sample  media
    0       image of 3 patches, audio of 4 frames
    1       audio of 6 frames, image of 2 patches
    2       image of 4 patches
    3       audio of 2 frames, image of 1 patch, audio of 5 frames
    4, 5    text only
    6       audio of 3 frames, image of 1 patch
    7       image of 2 patches, image of 3 patches
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import seeded_distinct
from ._batch import right_padded
from ._configs import text_fields

__all__ = ["AUDIO_TOKEN_ID", "IMAGE_TOKEN_ID", "MODEL_TYPE", "PAD_TOKEN_ID", "SAMPLES", "build_batch",
           "build_config", "build_model", "build_processor", "reference_inputs"]

MODEL_TYPE = "inkling_mm_model"

PAD_TOKEN_ID = 0
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
IMAGE_BOS_TOKEN_ID = 3
AUDIO_BOS_TOKEN_ID = 4
IMAGE_TOKEN_ID = 5
AUDIO_TOKEN_ID = 6
_FIRST_TEXT_ID = 10
_VOCAB = 128
_UNPADDED_VOCAB = 120
PATCH = 4
TEMPORAL = 2
MEL_BINS = 80
MEL_VOCAB = 16
AUDIO_FRAMES = 6

SAMPLES: tuple[tuple[Any, ...], ...] = (
    (2, ("image", 3), 1, ("audio", 4), 2),
    (1, ("audio", 6), 2, ("image", 2), 1),
    (3, ("image", 4), 2),
    (1, ("audio", 2), 1, ("image", 1), 1, ("audio", 5), 1),
    (9,),
    (12,),
    (2, ("audio", 3), 1, ("image", 1), 1),
    (1, ("image", 2), 1, ("image", 3), 1),
)


def build_config() -> Any:
    """The tiny :class:`~transformers.InklingConfig`."""
    from transformers import InklingConfig

    text = text_fields(
        _VOCAB, PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID, width=32, unpadded_vocab_size=_UNPADDED_VOCAB, head_dim=8,
        swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=4, d_rel=4,
        rel_extent=16, local_layer_ids=[0], max_position_embeddings=256, moe_intermediate_size=16, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, mlp_layer_types=["dense", "sparse"], logits_mup_width_multiplier=2.0,
    )
    vision = {"text_hidden_size": 32, "patch_size": PATCH, "temporal_patch_size": TEMPORAL, "hidden_size": 16,
              "num_hidden_layers": 4, "num_attention_heads": 2}
    audio = {"n_mel_bins": MEL_BINS, "mel_vocab_size": MEL_VOCAB, "text_hidden_size": 32}
    return InklingConfig(text_config=text, vision_config=vision, audio_config=audio, image_token_id=IMAGE_TOKEN_ID,
                         audio_token_id=AUDIO_TOKEN_ID, image_bos_token_id=IMAGE_BOS_TOKEN_ID,
                         audio_bos_token_id=AUDIO_BOS_TOKEN_ID)


def build_model(seed: int = 0) -> torch.nn.Module:
    """A :class:`~transformers.InklingForConditionalGeneration`, float32, eval mode, seeded, every
    constant parameter redrawn from the seed."""
    from transformers import InklingForConditionalGeneration

    return seeded_distinct(InklingForConditionalGeneration, build_config(), seed)


def build_batch(seed: int = 0, *, text_only_first: bool = False) -> dict[str, Tensor]:
    """The processor-style batch of the module docstring, drawn from ``seed``.

    Keys: ``input_ids``, ``attention_mask`` ``[8, S]``; ``pixel_values`` ``[16, 2, 4, 4, 3]``;
    ``audio_input_ids`` ``[5, 6, 80]`` int64 with ``audio_input_ids_mask`` ``[5, 6]`` (int64).
    """
    gen = torch.Generator().manual_seed(seed)
    samples = SAMPLES[4:6] + SAMPLES[:4] + SAMPLES[6:] if text_only_first else SAMPLES
    rows, patches, clips = [], 0, []
    for sample in samples:
        ids = [BOS_TOKEN_ID]
        for part in sample:
            if isinstance(part, int):
                ids += torch.randint(_FIRST_TEXT_ID, _UNPADDED_VOCAB, (part,), generator=gen).tolist()
            elif part[0] == "image":
                ids += [IMAGE_BOS_TOKEN_ID] + [IMAGE_TOKEN_ID] * part[1]
                patches += part[1]
            else:
                ids += [AUDIO_BOS_TOKEN_ID] + [AUDIO_TOKEN_ID] * part[1]
                clips.append(part[1])
        rows.append(ids + [EOS_TOKEN_ID])
    input_ids, attention_mask = right_padded(rows, PAD_TOKEN_ID)
    mask = (torch.arange(AUDIO_FRAMES)[None, :] < torch.tensor(clips)[:, None]).long()
    codes = torch.randint(0, MEL_VOCAB, (len(clips), AUDIO_FRAMES, MEL_BINS), generator=gen) * mask[..., None]
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "pixel_values": torch.rand(patches, TEMPORAL, PATCH, PATCH, 3, generator=gen),
        "audio_input_ids": codes,
        "audio_input_ids_mask": mask,
    }


def reference_inputs(batch: dict[str, Tensor]) -> dict[str, Any]:
    """Keyword arguments of the model's own full-batch forward."""
    keys = ("input_ids", "attention_mask", "pixel_values", "audio_input_ids", "audio_input_ids_mask")
    return {k: batch[k] for k in keys if k in batch} | {"use_cache": False}


def build_processor(image_backend: str = "torchvision") -> Any:
    """A real ``InklingProcessor``: ``InklingImageProcessor`` (torchvision only) at :data:`PATCH` x
    :data:`PATCH` tiles, ``InklingFeatureExtractor`` (16 kHz, :data:`MEL_BINS` mel bins, one frame per
    50 ms; the processor quantises it into :data:`MEL_VOCAB` dMel codes); a word-level tokenizer with the
    tiny ids (``<|content_image|>`` / ``<|content_audio_input|>`` the media starts, ``<|image|>`` /
    ``<|audio|>`` the placeholders; ``<|im_start|>`` 7, ``<|im_end|>`` 8 the turns), a chatml chat template."""
    import transformers

    from ._processors import image_processor_class, qwen_processor, qwen_tokenizer

    images = image_processor_class("InklingImageProcessor", image_backend)(size={"height": PATCH, "width": PATCH})
    ids = {"<|endoftext|>": PAD_TOKEN_ID, "<|im_start|>": 7, "<|im_end|>": 8, "<|content_image|>": IMAGE_BOS_TOKEN_ID,
           "<|content_audio_input|>": AUDIO_BOS_TOKEN_ID, "<|image|>": IMAGE_TOKEN_ID, "<|audio|>": AUDIO_TOKEN_ID}
    tokenizer = qwen_tokenizer(_VOCAB, ids, image="<|image|>", video=None, audio_token="<|audio|>")
    media = {"image": "<|content_image|><|image|>", "audio": "<|content_audio_input|><|audio|>"}
    return qwen_processor("InklingProcessor", tokenizer=tokenizer, images=images, media=media,
                          feature_extractor=transformers.InklingFeatureExtractor(feature_size=MEL_BINS),
                          num_dmel_bins=MEL_VOCAB)
