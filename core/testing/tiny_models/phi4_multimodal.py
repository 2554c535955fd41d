"""Tiny seeded Phi-4-multimodal (``phi4_multimodal``): ``Phi4MultimodalForCausalLM``, both encoders and the
merge inside the decoder stack (``model.model.embed_tokens_extend``).

Decoder 64 wide, 2 layers; vision tower 2 layers, 32 wide, 16 x 16 crops of 4 x 4 patches (2 x 2
features a crop after pooling), run with eager attention (transformers 5.23's tower is marked causal:
under SDPA an unpadded crop would be encoded causally, docs/families-more.md); conformer audio encoder
1 block, 32 wide, 16 mel bins, time reduction 8.

The batch uses the processor's keys. Images are ``(crop rows, crop columns, padded patch rows at the
bottom, padded patch columns at the right)``; an image's tokens follow from its real features
(:func:`tokens_of`). Audio clips are frame counts (``ceil(frames / 8)`` tokens each), padded to 40.

======  ==============================================  ===========
sample  images                                          audio
======  ==============================================  ===========
0       1x1                                             23 frames
1       1x2 (3 columns padded), 1x1                     -
2       -                                               40, 9
3       2x1 (2 rows padded)                             -
4       -                                               -
5       -                                               -
6       2x2 and 1x1 back to back                        17
7       1x3 (5 columns padded)                          -
======  ==============================================  ===========

The batch holds images, so the model projects every clip with its "vision" projections;
:func:`build_batches` adds a batch with audio alone ("speech" projections) and one of tall images.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import seeded_distinct
from ._batch import right_padded
from ._configs import text_fields, tower_fields

__all__ = [
    "AUDIO_TOKEN_ID",
    "IMAGE_TOKEN_ID",
    "MODEL_TYPE",
    "build_batch",
    "build_batches",
    "build_config",
    "build_model",
    "build_processor",
    "build_processor_model",
    "reference_inputs",
    "tokens_of",
]

MODEL_TYPE = "phi4_multimodal"
VOCAB_SIZE = 256
PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID = 0, 1, 2
IMAGE_TOKEN_ID, AUDIO_TOKEN_ID = 200, 201
USER_TOKEN_ID, END_TOKEN_ID = 202, 203
CROP, PATCH, MEL, FRAMES = 16, 4, 16, 40

Image = tuple[int, int, int, int]
#: per sample: its parts in prompt order, ``("image", (rows, cols, pad_rows, pad_cols))``,
#: ``("audio", frames)`` or ``int`` text tokens
SAMPLES: tuple[tuple[Any, ...], ...] = (
    (3, ("image", (1, 1, 0, 0)), 2, ("audio", 23), 1),
    (("image", (1, 2, 0, 3)), 2, ("image", (1, 1, 0, 0)), 1),
    (2, ("audio", 40), 3, ("audio", 9)),
    (1, ("image", (2, 1, 2, 0)), 4),
    (9,),
    (6,),
    (2, ("image", (2, 2, 0, 0)), ("image", (1, 1, 0, 0)), 1, ("audio", 17)),
    (("image", (1, 3, 0, 5)), 3),
)
#: :func:`build_batches`: audio alone (the "speech" projections), then tall images alone
AUDIO_ONLY: tuple[tuple[Any, ...], ...] = ((2, ("audio", 12), 1), (5,), (("audio", 30), 2, ("audio", 5)), (1, ("audio", 40)))
TALL: tuple[tuple[Any, ...], ...] = ((("image", (3, 1, 0, 0)), 2), (4,), (1, ("image", (2, 1, 3, 0)), ("image", (1, 1, 0, 2))), (3, ("image", (1, 1, 1, 0))))


def _vision(image_size: int, patch_size: int, layers: int) -> dict[str, Any]:
    return tower_fields(num_hidden_layers=layers, num_attention_heads=2 if layers > 1 else 1, image_size=image_size,
                        patch_size=patch_size, crop_size=image_size, feature_layer=-2 if layers > 1 else -1,
                        image_token_id=IMAGE_TOKEN_ID)


def build_config(image_size: int = CROP, patch_size: int = PATCH, vision_layers: int = 2) -> Any:
    """The tiny ``Phi4MultimodalConfig`` (``vision_layers`` 1: one single-head layer whose output is the
    features, else features from the next-to-last layer, as Phi-4's); its vision tower set to eager
    attention."""
    from transformers import Phi4MultimodalConfig

    config = Phi4MultimodalConfig(
        **text_fields(VOCAB_SIZE, PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID, max_position_embeddings=1024,
                      original_max_position_embeddings=1024, embd_pdrop=0.0, tie_word_embeddings=False),
        vision_config=_vision(image_size, patch_size, vision_layers),
        audio_config=dict(hidden_size=32, intermediate_size=64, num_blocks=1, num_attention_heads=2,
                          audio_token_id=AUDIO_TOKEN_ID, input_size=MEL, nemo_conv_channels=16, time_reduction=8,
                          ext_pw_out_channel=32, depthwise_separable_out_channel=32),
    )
    config.vision_config._attn_implementation = "eager"
    return config


def build_model(seed: int = 0) -> torch.nn.Module:
    """The tiny ``Phi4MultimodalForCausalLM``, float32, eval mode, seeded (constants drawn: transformers
    starts the crop separators at zero)."""
    from transformers import Phi4MultimodalForCausalLM

    return seeded_distinct(Phi4MultimodalForCausalLM, build_config(), seed)


def build_processor_model(seed: int = 0) -> torch.nn.Module:
    """The model the real processor's batches fit: crops of 32 x 32 one-pixel patches (the processor
    counts 16 x 16 features a crop, as for 448-pixel crops of 14-pixel patches); its tower one
    single-head layer, to keep 1024 patches a crop cheap."""
    from transformers import Phi4MultimodalForCausalLM

    return seeded_distinct(Phi4MultimodalForCausalLM, build_config(32, 1, vision_layers=1), seed)


def tokens_of(image: Image) -> int:
    """Placeholders of one tiny image: its real sub-crop features (pooled 2 x 2, sampled at even patches
    as the model does) with a separator per row, one separator, the global view's 2 x 2 plus 2."""
    rows, cols, pad_rows, pad_cols = image
    per_crop = CROP // PATCH
    mask = torch.ones(rows * per_crop, cols * per_crop, dtype=torch.bool)
    if pad_rows:
        mask[-pad_rows:] = False
    if pad_cols:
        mask[:, -pad_cols:] = False
    sampled = mask[0::2, 0::2]
    useful_rows, useful_cols = int(sampled[:, 0].sum()), int(sampled[0].sum())
    base = per_crop // 2
    return useful_rows * (useful_cols + 1) + 1 + base * (base + 1)


def _crops(image: Image, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """``([1 + rows * cols, 3, CROP, CROP], [.., P, P])``: the global view, then the sub-crops row by
    row, and their patch masks (the padding at the image's bottom and right)."""
    rows, cols, pad_rows, pad_cols = image
    p = CROP // PATCH
    full = torch.ones(rows * p, cols * p)
    if pad_rows:
        full[-pad_rows:] = 0
    if pad_cols:
        full[:, -pad_cols:] = 0
    masks = full.reshape(rows, p, cols, p).transpose(1, 2).reshape(-1, p, p)
    pixels = torch.randn(1 + rows * cols, 3, CROP, CROP, generator=gen)
    return pixels, torch.cat([torch.ones(1, p, p), masks])


def _batch(samples: tuple[tuple[Any, ...], ...], seed: int) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rows, images, clips = [], [], []
    for parts in samples:
        ids = [BOS_TOKEN_ID, USER_TOKEN_ID]
        for part in parts:
            if isinstance(part, int):
                ids += torch.randint(3, IMAGE_TOKEN_ID, (part,), generator=gen).tolist()
            elif part[0] == "image":
                ids += [IMAGE_TOKEN_ID] * tokens_of(part[1])
                images.append((part[1], *_crops(part[1], gen)))
            else:
                ids += [AUDIO_TOKEN_ID] * -(-part[1] // 8)
                clips.append(part[1])
        rows.append(ids + [END_TOKEN_ID, EOS_TOKEN_ID])
    input_ids, attention_mask = right_padded(rows, PAD_TOKEN_ID)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    if images:
        most = max(p.shape[0] for _, p, _ in images)
        pixels = torch.zeros(len(images), most, 3, CROP, CROP)
        masks = torch.ones(len(images), most, CROP // PATCH, CROP // PATCH)  # padding crops: ones, as the processor pads
        for i, (_, p, m) in enumerate(images):
            pixels[i, : p.shape[0]], masks[i, : m.shape[0]] = p, m
        sizes = [[r * CROP, c * CROP] for (r, c, _, _), _, _ in images]
        batch.update(image_pixel_values=pixels, image_sizes=torch.tensor(sizes, dtype=torch.long), image_attention_mask=masks)
    if clips:
        features = torch.zeros(len(clips), FRAMES, MEL)
        mask = torch.zeros(len(clips), FRAMES, dtype=torch.bool)
        for i, n in enumerate(clips):
            features[i, :n] = torch.randn(n, MEL, generator=gen)
            mask[i, :n] = True
        batch.update(audio_input_features=features, audio_embed_sizes=torch.tensor([-(-n // 8) for n in clips]),
                     audio_attention_mask=mask)
    return batch


def build_batch(seed: int = 0) -> dict[str, Tensor]:
    """``input_ids`` / ``attention_mask`` ``[8, S]``; ``image_pixel_values`` ``[8, 5, 3, 16, 16]``,
    ``image_sizes`` ``[8, 2]``, ``image_attention_mask`` ``[8, 5, 4, 4]``; ``audio_input_features``
    ``[4, 40, 16]``, ``audio_embed_sizes`` ``[4]``, ``audio_attention_mask`` ``[4, 40]`` (the table above)."""
    return _batch(SAMPLES, seed)


def build_batches(seed: int = 0) -> list[dict[str, Tensor]]:
    """Two batches of other structures, 4 samples each: audio alone (:data:`AUDIO_ONLY`: the model
    projects it with its "speech" projections), tall images alone (:data:`TALL`)."""
    return [_batch(AUDIO_ONLY, seed + 1), _batch(TALL, seed + 2)]


def reference_inputs(batch: dict[str, Tensor]) -> dict[str, Any]:
    """Keyword arguments of the model's own full-batch forward (the processor's keys are its own)."""
    keys = ("input_ids", "attention_mask", "image_pixel_values", "image_sizes", "image_attention_mask",
            "audio_input_features", "audio_embed_sizes", "audio_attention_mask")
    return {k: batch[k] for k in keys if batch.get(k) is not None}


def build_processor(image_backend: str = "torchvision") -> Any:
    """A real ``Phi4MultimodalProcessor``: ``Phi4MultimodalImageProcessor`` (torchvision only: no
    ``...Pil`` class) at 32-pixel crops of 1-pixel mask patches, at most 2 sub-crops an image;
    ``Phi4MultimodalFeatureExtractor`` with 16 mel bins; a word-level tokenizer with the tiny ids
    (``<|image|>``, ``<|audio|>``), and a plain chat template. Its batches fit
    :func:`build_processor_model`."""
    import transformers

    from ..word_tokenizer import TokenizerSpec, chat_template, word_tokenizer
    from ._processors import image_processor_class

    images = image_processor_class("Phi4MultimodalImageProcessor", image_backend)(
        size={"height": 32, "width": 32}, patch_size=1, dynamic_hd=2)
    audio = transformers.Phi4MultimodalFeatureExtractor(feature_size=MEL)
    ids = {"<pad>": PAD_TOKEN_ID, "<s>": BOS_TOKEN_ID, "<|endoftext|>": EOS_TOKEN_ID, "<|image|>": IMAGE_TOKEN_ID,
           "<|audio|>": AUDIO_TOKEN_ID, "<|user|>": USER_TOKEN_ID, "<|end|>": END_TOKEN_ID}
    tokenizer = word_tokenizer(TokenizerSpec(VOCAB_SIZE, ids, pad="<pad>", eos="<|endoftext|>", bos="<s>",
                                             attributes={"image_token": "<|image|>", "audio_token": "<|audio|>"}))
    return transformers.Phi4MultimodalProcessor(
        image_processor=images, audio_processor=audio, tokenizer=tokenizer,
        chat_template=chat_template("plain", {"image": "<|image|>", "audio": "<|audio|>"}))
