"""Tiny seeded Qwen3-Omni (MoE) thinker (``qwen3_omni_moe_thinker``): the Qwen2.5-Omni batch layout
(:mod:`ppmedia.testing.tiny_models.qwen2_5_omni`) on Qwen3-Omni's towers and MoE language model.

Differences from the Qwen2.5-Omni tiny model:

* vision tower as Qwen3-VL's (patch 4, temporal 2, merge 2, a learned 8 x 8 position table) with two
  deepstack levels: the language model (2 layers) adds level ``i`` after layer ``i``, so with the
  default 2-stage split level 1 crosses the stage boundary;
* language model: mixture of experts (4 experts, 2 per token), interleaved mrope ``[2, 1, 1]``;
* audio tower: windows of ``n_window * 2 = 100`` frames, three stride-2 convolutions, 13 tokens per
  full window (the model's own ``_get_feat_extract_output_lengths``); every clip is 100 frames longer
  than in the Qwen2.5-Omni batch (:data:`EXTRA_FRAMES`), ``input_features`` ``[7, 128, 148]``;
* a video's audio track is interleaved token by token by position (the Qwen3-Omni processor's rule),
  not per 2-second chunk.
"""

from __future__ import annotations

from typing import Any

import torch

from . import seeded_distinct
from . import qwen2_5_omni as _omni
from ._configs import grid_tower_fields, text_fields
from ._qwen import BOS_TOKEN_ID, EOS_TOKEN_ID, VOCAB
from .qwen2_5_omni import (  # noqa: F401  (the same token ids and batch layout)
    AUDIO_END_TOKEN_ID,
    AUDIO_START_TOKEN_ID,
    AUDIO_TOKEN_ID,
    IMAGE_TOKEN_ID,
    MEL_BINS,
    PAD_TOKEN_ID,
    SAMPLES,
    VIDEO_TOKEN_ID,
    VISION_END_TOKEN_ID,
    VISION_START_TOKEN_ID,
)

__all__ = [
    "EXTRA_FRAMES",
    "MODEL_TYPE",
    "N_WINDOW",
    "PROCESSOR_CALL_KWARGS",
    "audio_tokens",
    "build_batch",
    "build_config",
    "build_model",
    "build_processor",
    "interleave",
    "reference_inputs",
]

MODEL_TYPE = "qwen3_omni_moe_thinker"
N_WINDOW = 50
#: added to every clip of the Qwen2.5-Omni layout: each clip spans more than one window of
#: ``2 * N_WINDOW`` frames, as any clip of more than a second does. (The audio tower pads every window to
#: the longest window of the clips it is given; a microbatch whose clips are all shorter than one window
#: would be padded otherwise than in the full batch, and its features differ, by the model's own code.)
EXTRA_FRAMES = 100


def audio_tokens(frames: int) -> int:
    """Tokens of a clip of ``frames`` valid frames (Qwen3-Omni's audio arithmetic)."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    return int(_get_feat_extract_output_lengths(torch.tensor(frames), N_WINDOW))


def interleave(grid: tuple[int, int, int], seconds: float, clip_tokens: int) -> list[int]:
    """A video's placeholders with its audio track, merged by position as the Qwen3-Omni processor
    does: a video token at position ``p`` comes before the audio tokens at positions ``> p``."""
    t, h, w = grid
    per_step = (h // _omni.MERGE) * (w // _omni.MERGE)
    video = [step * seconds * _omni.POSITION_ID_PER_SECONDS for step in range(t) for _ in range(per_step)]
    ids, v, a = [], 0, 0
    while v < len(video) and a < clip_tokens:
        if video[v] <= a:
            ids.append(VIDEO_TOKEN_ID)
            v += 1
        else:
            ids.append(AUDIO_TOKEN_ID)
            a += 1
    return ids + [VIDEO_TOKEN_ID] * (len(video) - v) + [AUDIO_TOKEN_ID] * (clip_tokens - a)


def build_config() -> Any:
    """The tiny :class:`~transformers.Qwen3OmniMoeThinkerConfig`."""
    from transformers import Qwen3OmniMoeThinkerConfig

    text = text_fields(
        VOCAB, PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID, width=32, head_dim=8, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 1, 1], "interleaved": True},
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1,
    )
    vision = grid_tower_fields(
        in_channels=3, patch_size=_omni.PATCH, temporal_patch_size=_omni.TEMPORAL, spatial_merge_size=_omni.MERGE,
        out_hidden_size=32, num_position_embeddings=64, deepstack_visual_indexes=[0, 1],
    )
    audio = {
        "num_mel_bins": MEL_BINS, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 32,
        "d_model": 16, "output_dim": 32, "n_window": N_WINDOW, "n_window_infer": 400, "conv_chunksize": 500,
        "downsample_hidden_size": 8, "max_source_positions": 1500,
    }
    ids = _omni.token_ids()
    ids.pop("seconds_per_chunk")
    ids = {k.replace("_index", "_id"): v for k, v in ids.items()}
    return Qwen3OmniMoeThinkerConfig(audio_config=audio, vision_config=vision, text_config=text, **ids)


def build_model(seed: int = 0) -> torch.nn.Module:
    """A :class:`~transformers.Qwen3OmniMoeThinkerForConditionalGeneration`, float32, eval mode, seeded,
    every constant parameter redrawn from the seed."""
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    return seeded_distinct(Qwen3OmniMoeThinkerForConditionalGeneration, build_config(), seed)


def build_batch(seed: int = 0, *, text_only_first: bool = False) -> dict[str, Any]:
    """The Qwen2.5-Omni tiny batch layout with Qwen3-Omni's token arithmetic (see the module docstring)."""
    return _omni.build_batch(seed, text_only_first=text_only_first, interleaved=interleave, clip_tokens=audio_tokens,
                             extra_frames=EXTRA_FRAMES)


def reference_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of the model's own full-batch forward (``use_audio_in_video=True``)."""
    return _omni.reference_inputs(batch)


#: what a call of a LOADED tiny processor needs (see :data:`ppmedia.testing.tiny_models.qwen2_5_omni.PROCESSOR_CALL_KWARGS`),
#: and the tiny config's positions per second (the processor class holds 13 of its own, unsaved).
PROCESSOR_CALL_KWARGS: dict[str, Any] = {**_omni.PROCESSOR_CALL_KWARGS, "position_id_per_seconds": _omni.POSITION_ID_PER_SECONDS}


def build_processor(image_backend: str = "torchvision") -> Any:
    """A real ``Qwen3OmniMoeProcessor``: Qwen2.5-Omni's tiny pieces
    (:func:`ppmedia.testing.tiny_models.qwen2_5_omni.build_processor`: ``Qwen2VLImageProcessor`` or
    ``...Pil``, ``Qwen2VLVideoProcessor``, ``WhisperFeatureExtractor``, the Omni tokenizer) in
    Qwen3-Omni's processor class, with the tiny config's ``position_id_per_seconds``."""
    import transformers

    parts = _omni.build_processor(image_backend)
    processor = transformers.Qwen3OmniMoeProcessor(
        image_processor=parts.image_processor, video_processor=parts.video_processor, feature_extractor=parts.feature_extractor,
        tokenizer=parts.tokenizer, chat_template=parts.chat_template)
    processor.videos_kwargs = dict(PROCESSOR_CALL_KWARGS["videos_kwargs"])
    processor.position_id_per_seconds = PROCESSOR_CALL_KWARGS["position_id_per_seconds"]
    return processor
