"""Tiny seeded Qwen2.5-Omni thinker (``qwen2_5_omni_thinker``): images, videos with audio tracks, audio.

The model (``Qwen2_5OmniThinkerForConditionalGeneration``):

* vision tower as Qwen2.5-VL's tiny one: patch 4, temporal patch 2, merge 2, so ``pixel_values`` rows
  are ``3 * 2 * 4 * 4 = 96`` wide and an image or video of grid ``(t, h, w)`` gives ``t * h * w / 4``
  tokens;
* Whisper-style audio tower: ``input_features`` ``[audios, 128, T]`` (mel bins first, as
  ``WhisperFeatureExtractor`` writes them) with ``feature_attention_mask`` ``[audios, T]``; a clip of
  ``L`` valid frames gives ``((L - 1) // 2 + 1 - 2) // 2 + 1`` tokens;
* language model: 2 layers, hidden 32, mrope sections ``[2, 1, 1]``; 3-D positions from the model's
  own ``get_rope_index`` (audio tokens included; a video's audio track interleaved with its frames).

Token layout (the processor's): an image ``<vision_bos> <image> * n <vision_eos>``; an audio clip
``<audio_bos> <audio> * n <audio_eos>``; a video WITH its audio track (``use_audio_in_video``)
``<vision_bos> <audio_bos> [<video> * .. <audio> * ..] per 2-second chunk <audio_eos> <vision_eos>``.
Every video of the batch has its audio track (the model's forward takes one ``use_audio_in_video``
for the whole batch). The track is an audio clip like the others: ``input_features`` holds the clips
in token order.

The batch (8 samples; split in 4 microbatches, microbatch 2 = samples 4 and 5 is text-only)::

    sample  media
    0       image (1, 4, 4) -> 4, audio 30 frames -> 7
    1       audio 48 frames -> 12, image (1, 4, 6) -> 6
    2       video (2, 4, 4) -> 8 with its audio track of 17 frames -> 4
    3       image (1, 2, 2) -> 1, audio 9 frames -> 2
    4, 5    text only
    6       audio 30 -> 7, audio 9 -> 2
    7       video (2, 2, 4) -> 4 with its audio track of 9 frames -> 2, image (1, 4, 4) -> 4
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import seeded_distinct
from ._batch import right_padded
from ._configs import grid_tower_fields, text_fields
from ._qwen import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    FIRST_TEXT_ID,
    IMAGE_TOKEN_ID,
    PAD_TOKEN_ID,
    VIDEO_TOKEN_ID,
    VISION_END_TOKEN_ID,
    VISION_START_TOKEN_ID,
    VOCAB,
)

__all__ = [
    "AUDIO_END_TOKEN_ID",
    "AUDIO_START_TOKEN_ID",
    "AUDIO_TOKEN_ID",
    "IMAGE_TOKEN_ID",
    "MEL_BINS",
    "MODEL_TYPE",
    "PAD_TOKEN_ID",
    "PATCH_DIM",
    "PROCESSOR_CALL_KWARGS",
    "SAMPLES",
    "VIDEO_TOKEN_ID",
    "VISION_END_TOKEN_ID",
    "VISION_START_TOKEN_ID",
    "audio_tokens",
    "build_batch",
    "build_config",
    "build_model",
    "build_processor",
    "omni_tokenizer",
    "interleave",
    "reference_inputs",
]

MODEL_TYPE = "qwen2_5_omni_thinker"

AUDIO_TOKEN_ID = 7
AUDIO_START_TOKEN_ID = 8
AUDIO_END_TOKEN_ID = 9

PATCH = 4
TEMPORAL = 2
MERGE = 2
PATCH_DIM = 3 * TEMPORAL * PATCH * PATCH
MEL_BINS = 128
AUDIO_FRAMES = 48
POSITION_ID_PER_SECONDS = 25
SECONDS_PER_CHUNK = 2
#: seconds per temporal patch of each video (the processor's ``video_second_per_grid``)
VIDEO_SECONDS = (1.0, 0.5)

SAMPLES: tuple[tuple[Any, ...], ...] = (
    (2, ("image", (1, 4, 4)), 1, ("audio", 30), 2),
    (1, ("audio", 48), 2, ("image", (1, 4, 6)), 1),
    (3, ("video", (2, 4, 4), 17), 2),
    (1, ("image", (1, 2, 2)), 1, ("audio", 9), 1),
    (9,),
    (12,),
    (2, ("audio", 30), 1, ("audio", 9), 1),
    (1, ("video", (2, 2, 4), 9), 1, ("image", (1, 4, 4)), 1),
)


def audio_tokens(frames: int) -> int:
    """Tokens of a clip of ``frames`` valid mel frames (two stride-2 steps of the audio tower)."""
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


def token_ids() -> dict[str, int]:
    return {
        "image_token_index": IMAGE_TOKEN_ID, "video_token_index": VIDEO_TOKEN_ID, "audio_token_index": AUDIO_TOKEN_ID,
        "vision_start_token_id": VISION_START_TOKEN_ID, "vision_end_token_id": VISION_END_TOKEN_ID,
        "audio_start_token_id": AUDIO_START_TOKEN_ID, "audio_end_token_id": AUDIO_END_TOKEN_ID,
        "position_id_per_seconds": POSITION_ID_PER_SECONDS, "seconds_per_chunk": SECONDS_PER_CHUNK,
    }


def build_config() -> Any:
    """The tiny :class:`~transformers.Qwen2_5OmniThinkerConfig`."""
    from transformers import Qwen2_5OmniThinkerConfig

    text = text_fields(
        VOCAB, PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID, width=32, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 1, 1]},
    )
    vision = grid_tower_fields(
        in_channels=3, patch_size=PATCH, temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE, window_size=16,
        out_hidden_size=32, fullatt_block_indexes=[1],
    )
    audio = {
        "num_mel_bins": MEL_BINS, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 32,
        "d_model": 16, "output_dim": 32, "n_window": 100, "max_source_positions": 1500,
    }
    return Qwen2_5OmniThinkerConfig(audio_config=audio, vision_config=vision, text_config=text, **token_ids())


def build_model(seed: int = 0) -> torch.nn.Module:
    """A :class:`~transformers.Qwen2_5OmniThinkerForConditionalGeneration`, float32, eval mode, seeded,
    every constant parameter (biases, norm scales) redrawn from the seed."""
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    return seeded_distinct(Qwen2_5OmniThinkerForConditionalGeneration, build_config(), seed)


def interleave(grid: tuple[int, int, int], seconds: float, clip_tokens: int) -> list[int]:
    """A video's placeholder tokens with its audio track, as the processor interleaves them: per
    ``SECONDS_PER_CHUNK`` chunk of positions, that chunk's video tokens, then its audio tokens."""
    t, h, w = grid
    per_step = (h // MERGE) * (w // MERGE)
    video_pos = [int(step * seconds * POSITION_ID_PER_SECONDS) for step in range(t) for _ in range(per_step)]
    per_chunk = POSITION_ID_PER_SECONDS * SECONDS_PER_CHUNK
    chunks = max(max(video_pos, default=0), clip_tokens - 1) // per_chunk + 1
    ids: list[int] = []
    for j in range(chunks):
        ids += [VIDEO_TOKEN_ID] * sum(1 for p in video_pos if p // per_chunk == j)
        ids += [AUDIO_TOKEN_ID] * sum(1 for p in range(clip_tokens) if p // per_chunk == j)
    return ids


def _tokens(samples: tuple[tuple[Any, ...], ...], gen: torch.Generator, *, interleaved: Any = None,
            clip_tokens: Any = None, extra_frames: int = 0) -> tuple[list[list[int]], dict[str, list[Any]]]:
    """Token rows and media of ``samples`` (``interleaved(grid, seconds, tokens)``: a video's body with
    its audio track; ``clip_tokens(frames)``: tokens of a clip; this family's by default)."""
    interleaved = interleaved or interleave
    clip_tokens = clip_tokens or audio_tokens

    def text(n: int) -> list[int]:
        return torch.randint(FIRST_TEXT_ID, VOCAB, (n,), generator=gen).tolist()

    rows, media = [], {"image": [], "video": [], "audio": []}  # type: ignore[var-annotated]
    for sample in samples:
        ids = [BOS_TOKEN_ID]
        for part in sample:
            if isinstance(part, int):
                ids += text(part)
            elif part[0] == "image":
                media["image"].append(part[1])
                t, h, w = part[1]
                ids += [VISION_START_TOKEN_ID] + [IMAGE_TOKEN_ID] * (t * h * w // MERGE**2) + [VISION_END_TOKEN_ID]
            elif part[0] == "audio":
                frames = part[1] + extra_frames
                media["audio"].append(frames)
                ids += [AUDIO_START_TOKEN_ID] + [AUDIO_TOKEN_ID] * clip_tokens(frames) + [AUDIO_END_TOKEN_ID]
            else:  # a video with its audio track
                seconds = VIDEO_SECONDS[len(media["video"])]
                media["video"].append(part[1])
                media["audio"].append(part[2] + extra_frames)
                body = interleaved(part[1], seconds, clip_tokens(part[2] + extra_frames))
                ids += [VISION_START_TOKEN_ID, AUDIO_START_TOKEN_ID] + body + [AUDIO_END_TOKEN_ID, VISION_END_TOKEN_ID]
        rows.append(ids + [EOS_TOKEN_ID])
    return rows, media


def build_batch(seed: int = 0, *, text_only_first: bool = False, interleaved: Any = None, clip_tokens: Any = None,
                extra_frames: int = 0) -> dict[str, Any]:
    """The processor-style batch of the module docstring, drawn from ``seed``.

    ``text_only_first``: samples 4 and 5 first (order 4, 5, 0, 1, 2, 3, 6, 7). ``interleaved`` and
    ``clip_tokens``: another thinker's token arithmetic (Qwen3-Omni's); ``extra_frames``: added to every
    clip and to ``T`` (Qwen3-Omni's batch has clips of more than one 100-frame window).

    Keys: ``input_ids``, ``attention_mask`` ``[8, S]``; ``pixel_values`` ``[60, 96]`` with
    ``image_grid_thw`` ``[4, 3]``; ``pixel_values_videos`` ``[48, 96]`` with ``video_grid_thw`` ``[2, 3]``
    and ``video_second_per_grid`` ``[2]``; ``input_features`` ``[7, 128, 48]`` with
    ``feature_attention_mask`` ``[7, 48]`` (int64, as Whisper's feature extractor returns it).
    """
    gen = torch.Generator().manual_seed(seed)
    samples = SAMPLES[4:6] + SAMPLES[:4] + SAMPLES[6:] if text_only_first else SAMPLES
    rows, media = _tokens(samples, gen, interleaved=interleaved, clip_tokens=clip_tokens, extra_frames=extra_frames)
    input_ids, attention_mask = right_padded(rows, PAD_TOKEN_ID)

    def patches(grids: list[tuple[int, int, int]]) -> Tensor:
        return torch.randn(sum(t * h * w for t, h, w in grids), PATCH_DIM, generator=gen)

    lengths = torch.tensor(media["audio"])
    T = AUDIO_FRAMES + extra_frames
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    features = torch.randn(len(media["audio"]), MEL_BINS, T, generator=gen) * mask[:, None, :]
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "pixel_values": patches(media["image"]),
        "image_grid_thw": torch.tensor(media["image"], dtype=torch.long),
        "pixel_values_videos": patches(media["video"]),
        "video_grid_thw": torch.tensor(media["video"], dtype=torch.long),
        "video_second_per_grid": torch.tensor(VIDEO_SECONDS[: len(media["video"])]),
        "input_features": features,
        "feature_attention_mask": mask,
    }


def reference_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of the model's own full-batch forward (``use_audio_in_video=True``: every
    video carries its audio track)."""
    keys = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
            "video_second_per_grid", "input_features", "feature_attention_mask")
    return {k: batch[k] for k in keys if k in batch} | {"use_audio_in_video": True, "use_cache": False}


#: the tiny processor's image and video frame sizes: 8 to 32 pixels a side (multiples of patch x merge = 8).
MIN_PIXELS = 8 * 8
MAX_PIXELS = 32 * 32
#: what a call of a LOADED tiny processor needs (``AutoProcessor.from_pretrained``): the Omni processor
#: classes hold video sizes of their own (``videos_kwargs``, 100352..602112 pixels a frame) that win over
#: the video processor's, and are not saved; :func:`build_processor` sets them on its instance.
PROCESSOR_CALL_KWARGS: dict[str, Any] = {"videos_kwargs": {"size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}}}
#: the token strings of the Omni processors, with the tiny ids.
TOKENS: dict[str, int] = {
    "<|endoftext|>": PAD_TOKEN_ID, "<|im_start|>": BOS_TOKEN_ID, "<|im_end|>": EOS_TOKEN_ID,
    "<|vision_bos|>": VISION_START_TOKEN_ID, "<|vision_eos|>": VISION_END_TOKEN_ID, "<|IMAGE|>": IMAGE_TOKEN_ID,
    "<|VIDEO|>": VIDEO_TOKEN_ID, "<|AUDIO|>": AUDIO_TOKEN_ID, "<|audio_bos|>": AUDIO_START_TOKEN_ID,
    "<|audio_eos|>": AUDIO_END_TOKEN_ID,
}
#: the chat-template markup per media kind (a video's audio track has none: the processor adds it).
OMNI_MEDIA: dict[str, str] = {
    "image": "<|vision_bos|><|IMAGE|><|vision_eos|>",
    "video": "<|vision_bos|><|VIDEO|><|vision_eos|>",
    "audio": "<|audio_bos|><|AUDIO|><|audio_eos|>",
}


def omni_tokenizer(vocab_size: int = VOCAB, ids: dict[str, int] | None = None) -> Any:
    """The Omni processors' tokenizer: :data:`TOKENS` at the tiny ids, and the token attributes their
    processors read (``image_token``, ``audio_bos_token``, ...)."""
    from ._processors import qwen_tokenizer

    return qwen_tokenizer(
        vocab_size, TOKENS if ids is None else ids, image="<|IMAGE|>", video="<|VIDEO|>", audio_token="<|AUDIO|>",
        vision_bos_token="<|vision_bos|>", vision_eos_token="<|vision_eos|>", audio_bos_token="<|audio_bos|>",
        audio_eos_token="<|audio_eos|>",
    )


def build_processor(image_backend: str = "torchvision") -> Any:
    """A real ``Qwen2_5OmniProcessor``: ``Qwen2VLImageProcessor`` (``...Pil`` with ``image_backend="pil"``)
    and ``Qwen2VLVideoProcessor`` at patch 4, temporal patch 2, merge 2, 64..1024 pixels a frame (frames
    as given); ``WhisperFeatureExtractor`` (16 kHz, 128 mel bins, every clip padded to 30 s as the
    processor does); the Omni token names at the tiny ids, a chatml chat template. A video's audio
    track: :func:`ppmedia.testing.processors.chat_batch`'s ``("video", frames, track)``."""
    import transformers

    from ._processors import qwen_media_processors, qwen_processor

    images, videos = qwen_media_processors("Qwen2VLVideoProcessor", image_backend, patch_size=PATCH, temporal_patch_size=TEMPORAL,
                                           merge_size=MERGE, pixels=(MIN_PIXELS, MAX_PIXELS))
    audio = transformers.WhisperFeatureExtractor(feature_size=MEL_BINS)
    processor = qwen_processor("Qwen2_5OmniProcessor", tokenizer=omni_tokenizer(), images=images, videos=videos,
                               media=OMNI_MEDIA, feature_extractor=audio)
    processor.videos_kwargs = dict(PROCESSOR_CALL_KWARGS["videos_kwargs"])  # over the class's own sizes
    return processor
