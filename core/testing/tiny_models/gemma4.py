"""Tiny seeded Gemma 4 (``gemma4``): images, video frames and audio, per-layer embeddings, shared KV.

The model (``Gemma4ForConditionalGeneration``):

* vision tower: patch 2 (``D = 3 * 2 * 2 = 12``), 2 x 2 pooling, so an image of ``h x w`` patches
  (``h``, ``w`` even) gives ``h * w / 4`` tokens; images are padded to :data:`IMAGE_MAX_PATCHES` = 16
  patches (``pixel_values`` ``[images, 16, 12]``, ``image_position_ids`` ``[images, 16, 2]``, ``-1`` =
  padding). Video frames are images of their own, padded to :data:`FRAME_MAX_PATCHES` = 8 patches
  (``pixel_values_videos`` ``[frames, 8, 12]``, ``video_position_ids``, ``num_frames_per_video``).
* audio tower (conformer, one layer): ``input_features`` ``[audios, 16, 128]`` log-mel frames with
  ``input_features_mask`` ``[audios, 16]``; two stride-2 convolutions make a clip of ``n`` valid
  frames ``ceil(n / 4)`` tokens (the mask's ``[::2][::2]`` entries).
* language model: 4 layers (sliding, full, sliding, full; window 8), hidden 32, per-layer embeddings
  (PLE) of 4 per layer, ``num_kv_shared_layers = 2``: layers 2 and 3 reuse the keys and values of
  layers 0 (sliding) and 1 (full). The default 2-stage split (2 + 2) therefore cuts through both
  cross-layer dependencies: stage 1 needs layers 2-3's PLE inputs and both layer types' KV from stage 0.
  ``use_bidirectional_attention = "vision"``: image and video tokens attend within their block on the
  sliding layers (``mm_token_type_ids``, 1 image, 2 video, 3 audio). The logits are soft-capped at 5
  (``final_logit_softcapping``; 30 in the released models), which the pipeline's last stage applies too.

transformers initialises several parameters to constants (the vision position table to ones, norm
weights to ones, the audio attention's ``per_dim_scale`` and biases to zeros): every constant
parameter is redrawn from the seed, so every parameter is distinct and a golden test can tell a
mistake in any of them.

Token layout (as ``Gemma4Processor`` writes it): an image ``<boi> <image> * n <eoi>``; a video one
block per frame after its timestamp (two text tokens standing for ``mm:ss``): ``ts ts <boi> <video> * n
<eoi>``; an audio clip ``<boa> <audio> * n <eoa>``.

The batch (8 samples; split in 4 microbatches, microbatch 2 = samples 4 and 5 is text-only)::

    sample  media
    0       image 4x4 (4 tokens), audio 16 frames (4)
    1       audio 12 frames (3), image 2x4 (2)
    2       video of 2 frames 2x4 (2 + 2)
    3       image 2x2 (1), video of 1 frame 4x2 (2), audio 8 frames (2)
    4, 5    text only
    6       audio 5 frames (2), image 4x4 (4), audio 16 frames (4)
    7       video of 3 frames 2x2 (1 + 1 + 1), image 2x4 (2)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import seeded_distinct
from ._batch import right_padded

__all__ = [
    "AUDIO_FRAMES",
    "AUDIO_TOKEN_ID",
    "FRAME_MAX_PATCHES",
    "IMAGE_MAX_PATCHES",
    "IMAGE_TOKEN_ID",
    "MAX_PARITY_LR",
    "MEL_BINS",
    "MODEL_TYPE",
    "PAD_TOKEN_ID",
    "PATCH_DIM",
    "PROCESSOR_MAX_FRAME_TOKENS",
    "PROCESSOR_MAX_IMAGE_TOKENS",
    "PROCESSOR_VISION_OVERRIDES",
    "SAMPLES",
    "VIDEO_TOKEN_ID",
    "build_batch",
    "build_config",
    "build_model",
    "build_processor",
    "build_processor_model",
    "reference_inputs",
    "text_config",
]

MODEL_TYPE = "gemma4"

#: the largest SGD step the parity harness takes on this model (``ppmedia.testing.parity``). The tiny
#: Gemma 4 is strongly curved (RMSNorm of queries, keys, values, layer outputs and 4-wide per-layer
#: inputs): in float64, a random 1e-8 change of every parameter moves its gradients by 8.5e-5. After
#: one step of 1e-2, the model's OWN forward run microbatch by microbatch (no ppmedia involved) has
#: gradients 2e-5 away from its full-batch forward's, past the 1e-5 tolerance. The two sides of a
#: parity run take their first steps with gradients 1.3e-6 apart (float32 rounding), so their second
#: step starts from weights ``lr * 1.3e-6`` apart: at 1e-3 the second step's gradients were measured
#: 7.9e-6 (2 processes) and 1.9e-5 (in process) apart, too close to or past the tolerance for rounding
#: that differs between machines; at 1e-4, 4.1e-6 at most.
MAX_PARITY_LR = 1e-4

PAD_TOKEN_ID = 0
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
BOI_TOKEN_ID = 120
EOI_TOKEN_ID = 121
IMAGE_TOKEN_ID = 122
VIDEO_TOKEN_ID = 123
BOA_TOKEN_ID = 124
EOA_TOKEN_ID = 125
AUDIO_TOKEN_ID = 126
_FIRST_TEXT_ID = 3
_VOCAB = 128

PATCH = 2
POOL = 2
PATCH_DIM = 3 * PATCH * PATCH
IMAGE_MAX_PATCHES = 16
FRAME_MAX_PATCHES = 8
MEL_BINS = 128
AUDIO_FRAMES = 16
_TIMESTAMP_TOKENS = 2

#: per sample: text lengths (ints) and media ``("image", (h, w))``, ``("video", [(h, w), ...])``
#: (one entry per frame), ``("audio", valid_frames)``.
SAMPLES: tuple[tuple[Any, ...], ...] = (
    (2, ("image", (4, 4)), 1, ("audio", 16), 2),
    (1, ("audio", 12), 2, ("image", (2, 4)), 1),
    (3, ("video", [(2, 4), (2, 4)]), 2),
    (1, ("image", (2, 2)), 1, ("video", [(4, 2)]), 1, ("audio", 8), 1),
    (9,),
    (12,),
    (2, ("audio", 5), 1, ("image", (4, 4)), 1, ("audio", 16), 1),
    (1, ("video", [(2, 2), (2, 2), (2, 2)]), 1, ("image", (2, 4)), 1),
)


def text_config(num_layers: int = 4, num_kv_shared_layers: int = 2) -> dict[str, Any]:
    """The tiny text config: ``num_layers`` layers alternating sliding / full attention (the last is
    full), the last ``num_kv_shared_layers`` reusing the KV of the last non-shared layer of their type."""
    return {
        "vocab_size": _VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "global_head_dim": 16,
        "sliding_window": 8,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
        "max_position_embeddings": 256,
        "vocab_size_per_layer_input": _VOCAB,
        "hidden_size_per_layer_input": 4,
        "num_kv_shared_layers": num_kv_shared_layers,
        "use_bidirectional_attention": "vision",
        "final_logit_softcapping": 5.0,
        "pad_token_id": PAD_TOKEN_ID,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
    }


def build_config(vision_overrides: dict[str, Any] | None = None, **text_overrides: Any) -> Any:
    """The tiny :class:`~transformers.Gemma4Config` (``text_overrides`` change :func:`text_config`,
    ``vision_overrides`` the vision config, e.g. a larger ``position_embedding_size`` for real
    processor output)."""
    from transformers import Gemma4AudioConfig, Gemma4Config, Gemma4TextConfig, Gemma4VisionConfig

    text = text_config()
    text.update(text_overrides)
    vision_kwargs: dict[str, Any] = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        head_dim=8, patch_size=PATCH, pooling_kernel_size=POOL, position_embedding_size=16,
    )
    vision = Gemma4VisionConfig(**{**vision_kwargs, **(vision_overrides or {})})
    audio = Gemma4AudioConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[MEL_BINS, 4],
        output_proj_dims=16, attention_chunk_size=4, attention_context_left=5, conv_kernel_size=3,
    )
    return Gemma4Config(
        text_config=Gemma4TextConfig(**text), vision_config=vision, audio_config=audio,
        boi_token_id=BOI_TOKEN_ID, eoi_token_id=EOI_TOKEN_ID, image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID, boa_token_id=BOA_TOKEN_ID, eoa_token_index=EOA_TOKEN_ID,
        audio_token_id=AUDIO_TOKEN_ID,
    )


def build_model(seed: int = 0, vision_overrides: dict[str, Any] | None = None, **text_overrides: Any) -> torch.nn.Module:
    """A :class:`~transformers.Gemma4ForConditionalGeneration`, float32, eval mode, seeded, with
    every constant parameter redrawn (:func:`~ppmedia.testing.tiny_models.seeded_distinct`)."""
    from transformers import Gemma4ForConditionalGeneration

    return seeded_distinct(Gemma4ForConditionalGeneration, build_config(vision_overrides, **text_overrides), seed)



def _padded_patches(gen: torch.Generator, sizes: list[tuple[int, int]], max_patches: int) -> tuple[Tensor, Tensor]:
    """Per image (or frame) of ``h x w`` patches: its patch rows padded to ``max_patches`` (zeros) and
    their ``(x, y)`` positions (``-1`` for padding), as the Gemma 4 image processor lays them out."""
    pixels = torch.zeros(len(sizes), max_patches, PATCH_DIM)
    positions = torch.full((len(sizes), max_patches, 2), -1, dtype=torch.long)
    for i, (h, w) in enumerate(sizes):
        n = h * w
        pixels[i, :n] = torch.rand(n, PATCH_DIM, generator=gen)
        ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        positions[i, :n, 0] = xs.reshape(-1)
        positions[i, :n, 1] = ys.reshape(-1)
    return pixels, positions


def _audio_tokens(valid_frames: int) -> int:
    return len(range(0, len(range(0, valid_frames, 2)), 2))  # the mask's [::2][::2] entries


def _tokens(samples: tuple[tuple[Any, ...], ...], gen: torch.Generator) -> tuple[list[list[int]], dict[str, list[Any]]]:
    def text(n: int) -> list[int]:
        return torch.randint(_FIRST_TEXT_ID, BOI_TOKEN_ID, (n,), generator=gen).tolist()

    rows: list[list[int]] = []
    media: dict[str, list[Any]] = {"image": [], "video": [], "audio": []}
    for sample in samples:
        ids = [BOS_TOKEN_ID]
        for part in sample:
            if isinstance(part, int):
                ids += text(part)
                continue
            kind, spec = part
            media[kind].append(spec)
            if kind == "image":
                ids += [BOI_TOKEN_ID] + [IMAGE_TOKEN_ID] * (spec[0] * spec[1] // POOL**2) + [EOI_TOKEN_ID]
            elif kind == "video":
                for h, w in spec:  # one timestamped block per frame
                    ids += text(_TIMESTAMP_TOKENS) + [BOI_TOKEN_ID] + [VIDEO_TOKEN_ID] * (h * w // POOL**2) + [EOI_TOKEN_ID]
            else:
                ids += [BOA_TOKEN_ID] + [AUDIO_TOKEN_ID] * _audio_tokens(spec) + [EOA_TOKEN_ID]
        rows.append(ids + [EOS_TOKEN_ID])
    return rows, media


def build_batch(seed: int = 0, *, text_only_first: bool = False) -> dict[str, Tensor]:
    """The processor-style batch of the module docstring, drawn from ``seed``.

    ``text_only_first``: samples 4 and 5 first (order 4, 5, 0, 1, 2, 3, 6, 7).

    Keys: ``input_ids``, ``attention_mask``, ``mm_token_type_ids`` ``[8, S]``; ``pixel_values``
    ``[5, 16, 12]`` with ``image_position_ids`` ``[5, 16, 2]``; ``pixel_values_videos`` ``[6, 8, 12]`` with
    ``video_position_ids`` ``[6, 8, 2]`` and ``num_frames_per_video`` ``[3]``; ``input_features``
    ``[5, 16, 128]`` with ``input_features_mask`` ``[5, 16]`` (bool).
    """
    gen = torch.Generator().manual_seed(seed)
    samples = SAMPLES[4:6] + SAMPLES[:4] + SAMPLES[6:] if text_only_first else SAMPLES
    rows, media = _tokens(samples, gen)
    input_ids, attention_mask = right_padded(rows, PAD_TOKEN_ID)
    pixel_values, image_position_ids = _padded_patches(gen, media["image"], IMAGE_MAX_PATCHES)
    frames = [frame for video in media["video"] for frame in video]
    pixel_values_videos, video_position_ids = _padded_patches(gen, frames, FRAME_MAX_PATCHES)
    lengths = torch.tensor(media["audio"])
    mask = torch.arange(AUDIO_FRAMES)[None, :] < lengths[:, None]
    features = torch.randn(len(media["audio"]), AUDIO_FRAMES, MEL_BINS, generator=gen) * mask[..., None]
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "mm_token_type_ids": mm_token_type_ids(input_ids),
        "pixel_values": pixel_values,
        "image_position_ids": image_position_ids,
        "pixel_values_videos": pixel_values_videos,
        "video_position_ids": video_position_ids,
        "num_frames_per_video": torch.tensor([len(v) for v in media["video"]], dtype=torch.long),
        "input_features": features,
        "input_features_mask": mask,
    }


def mm_token_type_ids(input_ids: Tensor) -> Tensor:
    """``[B, S]``: 1 at image tokens, 2 at video tokens, 3 at audio tokens (what the processor returns)."""
    return ((input_ids == IMAGE_TOKEN_ID).long() + 2 * (input_ids == VIDEO_TOKEN_ID).long()
            + 3 * (input_ids == AUDIO_TOKEN_ID).long())


def reference_inputs(batch: dict[str, Tensor]) -> dict[str, Any]:
    """Keyword arguments of the model's own full-batch forward (every media key, ``mm_token_type_ids``)."""
    keys = ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_position_ids",
            "pixel_values_videos", "video_position_ids", "num_frames_per_video", "input_features", "input_features_mask")
    return {k: batch[k] for k in keys if k in batch} | {"use_cache": False}


#: the tiny processor's soft tokens at most per image and per video frame (patches: 4 times as many;
#: 70 is the smallest the image processor accepts).
PROCESSOR_MAX_IMAGE_TOKENS = 70
PROCESSOR_MAX_FRAME_TOKENS = 70
#: the vision config of the model real processor output fits: 280 patches an image reach patch
#: coordinates past the tiny position table of 16.
PROCESSOR_VISION_OVERRIDES: dict[str, Any] = {"position_embedding_size": 128}


def build_processor_model(seed: int = 0) -> torch.nn.Module:
    """:func:`build_model` with :data:`PROCESSOR_VISION_OVERRIDES`: the model for :func:`build_processor`'s batches."""
    return build_model(seed, vision_overrides=PROCESSOR_VISION_OVERRIDES)


def build_processor(image_backend: str = "torchvision") -> Any:
    """A real ``Gemma4Processor``: ``Gemma4ImageProcessor`` (``...Pil`` with ``image_backend="pil"``)
    and ``Gemma4VideoProcessor`` at patch 2, pooling 2, at most 70 soft tokens an image or frame
    (280 patches: use :func:`build_processor_model`), frames as given; ``Gemma4AudioFeatureExtractor``
    (16 kHz, 128 mel bins); a word-level tokenizer with the tiny ids (``<start_of_turn>`` 3,
    ``<end_of_turn>`` 4), Gemma's chat template."""
    import transformers

    from ..word_tokenizer import TokenizerSpec, chat_template, word_tokenizer
    from ._processors import image_processor_class

    sizes = {"patch_size": PATCH, "pooling_kernel_size": POOL}
    images = image_processor_class("Gemma4ImageProcessor", image_backend)(**sizes, max_soft_tokens=PROCESSOR_MAX_IMAGE_TOKENS)
    videos = transformers.Gemma4VideoProcessor(**sizes, max_soft_tokens=PROCESSOR_MAX_FRAME_TOKENS, do_sample_frames=False)
    ids = {"<pad>": PAD_TOKEN_ID, "<bos>": BOS_TOKEN_ID, "<eos>": EOS_TOKEN_ID, "<start_of_turn>": 3, "<end_of_turn>": 4,
           "<start_of_image>": BOI_TOKEN_ID, "<end_of_image>": EOI_TOKEN_ID, "<|image|>": IMAGE_TOKEN_ID,
           "<|video|>": VIDEO_TOKEN_ID, "<start_of_audio>": BOA_TOKEN_ID, "<end_of_audio>": EOA_TOKEN_ID,
           "<|audio|>": AUDIO_TOKEN_ID}
    attributes = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<|image|>",
                  "boa_token": "<start_of_audio>", "eoa_token": "<end_of_audio>", "audio_token": "<|audio|>"}
    tokenizer = word_tokenizer(TokenizerSpec(_VOCAB, ids, pad="<pad>", eos="<eos>", bos="<bos>", attributes=attributes))
    media = {"image": "<|image|>", "video": "<|video|>", "audio": "<|audio|>"}
    template = chat_template("gemma", media, bos="<bos>", role_map={"assistant": "model"})
    return transformers.Gemma4Processor(feature_extractor=transformers.Gemma4AudioFeatureExtractor(), image_processor=images,
                                        tokenizer=tokenizer, video_processor=videos, chat_template=template)
