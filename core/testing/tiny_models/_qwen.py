"""The Qwen-style tiny families' token ids and batches of flat patch rows (private to
``ppmedia.testing.tiny_models``): Qwen2.5-VL, Qwen3-VL, Qwen2.5-Omni / Qwen3-Omni and MiniMax-M3-VL
write their media in Qwen's layout, with these ids.

A batch's media are flat patch rows: every image or video is cut into ``temporal_patch x patch x
patch`` pixel cubes, one row of ``patch_dim`` values each, the rows of all images concatenated on axis
0 (``pixel_values`` ``[patches, patch_dim]``) with each image's ``(t, h, w)`` patch grid a row of
``image_grid_thw``; videos likewise in ``pixel_values_videos`` / ``video_grid_thw``. A grid ``(t, h,
w)`` gives ``t * h * w / merge**2`` placeholder tokens, written ``VISION_START, IMAGE * n, VISION_END``
(``VIDEO`` for a video): one block for the whole video (Qwen2.5-VL), or one block per temporal step
after a timestamp of :data:`TIMESTAMP_TOKENS` text tokens (Qwen3-VL, MiniMax-M3-VL).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from ._batch import right_padded

__all__ = [
    "BOS_TOKEN_ID",
    "EOS_TOKEN_ID",
    "FIRST_TEXT_ID",
    "IMAGE_TOKEN_ID",
    "PAD_TOKEN_ID",
    "PROCESSOR_TOKEN_IDS",
    "TIMESTAMP_TOKENS",
    "VIDEO_TOKEN_ID",
    "VISION_END_TOKEN_ID",
    "VISION_START_TOKEN_ID",
    "VOCAB",
    "grid_batch",
    "grid_reference_inputs",
]

PAD_TOKEN_ID = 0
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
VISION_START_TOKEN_ID = 3
VISION_END_TOKEN_ID = 4
IMAGE_TOKEN_ID = 5
VIDEO_TOKEN_ID = 6
#: text tokens are drawn from ``[FIRST_TEXT_ID, VOCAB)``.
FIRST_TEXT_ID = 10
VOCAB = 128
#: text tokens of a video step's timestamp (standing for ``<0.5 seconds>``).
TIMESTAMP_TOKENS = 2

#: the ids of the processors' Qwen tokens (:data:`~ppmedia.testing.tiny_models._processors.QWEN_TOKENS`).
PROCESSOR_TOKEN_IDS = (PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID, VISION_START_TOKEN_ID, VISION_END_TOKEN_ID, IMAGE_TOKEN_ID,
                       VIDEO_TOKEN_ID)


def _block(token: int, tokens: int) -> list[int]:
    return [VISION_START_TOKEN_ID] + [token] * tokens + [VISION_END_TOKEN_ID]


def grid_batch(samples: Sequence[Sequence[Any]], seed: int, *, family: str, patch_dim: int, merge: int,
               video_steps: bool, seq_len: int | None = None, chunk_counts: bool = False) -> dict[str, Tensor]:
    """The processor-style batch of ``samples``, drawn from ``seed`` (text tokens in token order, then
    the image rows, then the video rows).

    Each sample is text runs (ints) and media ``("image", (t, h, w))`` and ``("video", (t, h, w))``, or
    a video cut in chunks ``("video", ((t, h, w), ...))`` (one grid row a chunk), written between
    ``BOS`` and ``EOS``; ``video_steps``: a video is a block per temporal step (see the module docstring).

    Returns:
        ``input_ids`` / ``attention_mask`` ``[B, S]`` right-padded (``S`` the longest row; with
        ``seq_len``, which it must equal), ``pixel_values`` ``[patches, patch_dim]`` float32 with
        ``image_grid_thw`` ``[images, 3]``, ``pixel_values_videos`` with ``video_grid_thw`` ``[chunks,
        3]`` (int64), and with ``chunk_counts`` ``num_chunks_per_video`` ``[videos]``.

    Raises:
        AssertionError: the longest row is not ``seq_len`` tokens (a family's documented layout).
    """
    gen = torch.Generator().manual_seed(seed)

    def text(n: int) -> list[int]:
        return torch.randint(FIRST_TEXT_ID, VOCAB, (n,), generator=gen).tolist()

    rows: list[list[int]] = []
    grids: dict[str, list[tuple[int, int, int]]] = {"image": [], "video": []}
    chunks_per_video: list[int] = []
    for sample in samples:
        ids = [BOS_TOKEN_ID]
        for part in sample:
            if isinstance(part, int):
                ids += text(part)
            elif part[0] == "image":
                t, h, w = part[1]
                grids["image"].append((t, h, w))
                ids += _block(IMAGE_TOKEN_ID, t * h * w // merge**2)
            else:
                chunks = part[1] if isinstance(part[1][0], tuple) else (part[1],)
                chunks_per_video.append(len(chunks))
                for t, h, w in chunks:
                    grids["video"].append((t, h, w))
                    if not video_steps:
                        ids += _block(VIDEO_TOKEN_ID, t * h * w // merge**2)
                        continue
                    for _step in range(t):  # one timestamped block per temporal step
                        ids += text(TIMESTAMP_TOKENS) + _block(VIDEO_TOKEN_ID, h * w // merge**2)
        rows.append(ids + [EOS_TOKEN_ID])
    longest = max(len(ids) for ids in rows)
    if seq_len is not None and longest != seq_len:  # keeps the documented layout honest
        raise AssertionError(f"tiny {family} batch is {longest} tokens long, documented {seq_len}")
    input_ids, attention_mask = right_padded(rows, PAD_TOKEN_ID, seq_len)

    def pixels(kind: str) -> Tensor:
        n = sum(t * h * w for t, h, w in grids[kind])
        return torch.randn((n, patch_dim), generator=gen, dtype=torch.float32)

    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "pixel_values": pixels("image"),
        "image_grid_thw": torch.tensor(grids["image"], dtype=torch.int64),
        "pixel_values_videos": pixels("video"),
        "video_grid_thw": torch.tensor(grids["video"], dtype=torch.int64),
    }
    if chunk_counts:
        batch["num_chunks_per_video"] = torch.tensor(chunks_per_video, dtype=torch.int64)
    return batch


def grid_reference_inputs(batch: dict[str, Tensor]) -> dict[str, Any]:
    """Keyword arguments of a Qwen-VL model's own full-batch forward on ``batch``, adding
    ``mm_token_type_ids`` (text 0, image 1, video 2): without it the model silently falls back to 1-D
    positions instead of mrope."""
    ids = batch["input_ids"]
    mm_token_type_ids = (ids == IMAGE_TOKEN_ID).long() + 2 * (ids == VIDEO_TOKEN_ID).long()
    keys = ("attention_mask", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
    return {"input_ids": ids, **{k: batch[k] for k in keys}, "mm_token_type_ids": mm_token_type_ids, "use_cache": False}
