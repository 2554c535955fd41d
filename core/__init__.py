"""ppmedia: pipeline-parallel media staging for vision-language models."""

from .chunk import CURSOR_ATTRIBUTE, STAGED_ATTRIBUTES, VlmMediaChunk, next_vlm_media_chunk

__all__ = [
    "CURSOR_ATTRIBUTE",
    "STAGED_ATTRIBUTES",
    "VlmMediaChunk",
    "next_vlm_media_chunk",
]
