"""ppmedia: pipeline-parallel media staging for vision-language models.

``torch.distributed.pipelining`` splits every tensor handed to ``schedule.step()`` along dim 0; VLM
media do not have samples there. ppmedia splits the media per microbatch exactly as the schedule
splits the rows (:func:`split_media`), stages them on the first stage for one step
(:func:`stage_media`), and hands each forward its own microbatch's media
(:func:`next_vlm_media_chunk`). Adapters (:func:`get_adapter`) run each family's vision encoder on a
chunk and merge the features into the text embeddings.
"""

from .balance import balance_microbatches, restore_order
from .chunk import CURSOR_ATTRIBUTE, STAGED_ATTRIBUTES, VlmMediaChunk, next_vlm_media_chunk
from .hostreads import HostReadCounter
from .collate import PipelineBatch, collate_for_pipeline
from .split import IMAGE_GRID_KEYS, MEDIA_KEYS, StagedMedia, microbatch_bounds, split_media
from .stage import stage_media
from .registry import get_adapter, hookimpl, list_adapters, register_adapter

__version__ = "0.1.0"

__all__ = [
    "CURSOR_ATTRIBUTE",
    "HostReadCounter",
    "IMAGE_GRID_KEYS",
    "MEDIA_KEYS",
    "PipelineBatch",
    "STAGED_ATTRIBUTES",
    "StagedMedia",
    "VlmMediaChunk",
    "balance_microbatches",
    "collate_for_pipeline",
    "get_adapter",
    "hookimpl",
    "list_adapters",
    "microbatch_bounds",
    "next_vlm_media_chunk",
    "register_adapter",
    "restore_order",
    "split_media",
    "stage_media",
]
