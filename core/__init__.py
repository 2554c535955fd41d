"""ppmedia: pipeline-parallel media staging for vision-language models.

``torch.distributed.pipelining`` splits every tensor handed to ``schedule.step()`` along dim 0; VLM
media do not have samples there. ppmedia splits the media per microbatch exactly as the schedule
splits the rows (:func:`split_media`), stages them on the first stage for one step
(:func:`stage_media`), and hands each forward its own microbatch's media
(:func:`next_vlm_media_chunk`). Adapters (:func:`get_adapter`) run each family's vision encoder on a
chunk and merge the features into the text embeddings.
"""

import typing as _typing

from ._lazy import lazy_attributes as _lazy_attributes
from ._lazy import moved_modules as _moved_modules

#: public name -> the module that defines it (imported on first use: ``import ppmedia`` imports no torch)
_EXPORTS = {
    "CURSOR_ATTRIBUTE": "chunk",
    "HostReadCounter": "producer.hostreads",
    "IMAGE_GRID_KEYS": "producer.split",
    "MEDIA_KEYS": "producer.split",
    "MEDIA_KWARG": "producer.presplit",
    "MicrobatchInputs": "producer.presplit",
    "MicrobatchMedia": "producer.presplit",
    "PipelineBatch": "producer.collate",
    "STAGED_ATTRIBUTES": "chunk",
    "StagedMedia": "producer.split",
    "VlmMediaChunk": "chunk",
    "balance_microbatches": "balance",
    "collate_for_pipeline": "producer.collate",
    "get_adapter": "registry",
    "hookimpl": "registry",
    "list_adapters": "registry",
    "microbatch_bounds": "producer.split",
    "microbatch_inputs": "producer.presplit",
    "next_vlm_media_chunk": "chunk",
    "register_adapter": "registry",
    "restore_order": "balance",
    "split_media": "producer.split",
    "stage_media": "producer.staging",
}
__getattr__, __dir__ = _lazy_attributes(__name__, _EXPORTS)

#: modules that moved into the concern folders (docs/architecture.md): their old import paths keep working
_MOVED = {
    "assemble": "producer.assemble",
    "balancing": "producer.balancing",
    "cli_base": "cli.base",
    "cli_inspect": "cli.inspect_batch",
    "collate": "producer.collate",
    "costs": "planning.costs",
    "demo": "cli.demo",
    "hostreads": "producer.hostreads",
    "layout_planners": "producer.declared",
    "loads": "planning.loads",
    "plan": "cli.plan",
    "planners": "producer.planners",
    "planners_audio": "producer.planners_audio",
    "planners_frames": "producer.planners_frames",
    "presplit": "producer.presplit",
    "replay": "planning.replay",
    "simulate": "planning.simulate",
    "split": "producer.split",
    "splitter": "producer.plan",
    "stage": "producer.staging",
    "staged": "producer.staged",
    "stepmodel": "planning.stepmodel",
    "tables": "cli.tables",
    "timeline": "planning.timeline",
}
_moved_modules(__name__, _MOVED)

if _typing.TYPE_CHECKING:  # what type checkers and IDEs see
    from .balance import balance_microbatches, restore_order
    from .chunk import CURSOR_ATTRIBUTE, STAGED_ATTRIBUTES, VlmMediaChunk, next_vlm_media_chunk
    from .producer.collate import PipelineBatch, collate_for_pipeline
    from .producer.hostreads import HostReadCounter
    from .producer.presplit import MEDIA_KWARG, MicrobatchInputs, MicrobatchMedia, microbatch_inputs
    from .registry import get_adapter, hookimpl, list_adapters, register_adapter
    from .producer.split import IMAGE_GRID_KEYS, MEDIA_KEYS, StagedMedia, microbatch_bounds, split_media
    from .producer.staging import stage_media

__version__ = "0.1.0"

__all__ = [
    "CURSOR_ATTRIBUTE",
    "HostReadCounter",
    "IMAGE_GRID_KEYS",
    "MEDIA_KEYS",
    "MEDIA_KWARG",
    "MicrobatchInputs",
    "MicrobatchMedia",
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
    "microbatch_inputs",
    "next_vlm_media_chunk",
    "register_adapter",
    "restore_order",
    "split_media",
    "stage_media",
]
