"""MiniMax-M3-VL (``minimax_m3_vl``): Qwen-style flat patch rows with grids, videos in chunks, 1-D positions.

Media layout of a chunk (as the MiniMax-M3 image and video processors give them):

* ``pixel_values`` ``[patches, D]`` (``D = C * temporal_patch * patch * patch``) with ``image_grid``
  ``[images, 3]`` ``(t, h, w)`` (or ``[images, 2]``, ``t = 1``): ``t * h * w / merge**2`` features each;
* ``pixel_values_videos`` ``[patches, D]`` with ``video_grid`` ``[rows, 3]``: one row per **video chunk**
  (the video processor cuts a video into chunks of at most ``vision_segment_max_frames`` temporal
  steps and reports ``num_chunks_per_video``); a chunk gives ``t * h * w / merge**2`` features and the
  text holds one ``vision_start, video * (h * w / merge**2), vision_end`` block per temporal step.

ppmedia stages one grid row (chunk) as one "video": :meth:`MiniMaxM3VLAdapter.media_counts` assigns the
chunks to samples by their blocks (as Qwen3-VL's per-step blocks) and, when the batch has
``num_chunks_per_video``, checks that no video's chunks are split between samples. Images are counted
by their blocks too (two images back to back are two blocks).

Positions: the language model's default 1-D positions (``arange(S)``, the model's own forward passes
none), which every sparse layer's lightning indexer reads to place its key blocks; each stage's
language model computes the same ones itself, so nothing but the hidden states crosses a boundary.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch
from torch import Tensor

from ..chunk import VlmMediaChunk
from ._helpers import check_video_chunks, encode_grid_modalities
from .base import HostValues, VlmAdapter, inner_model
from .qwen3_vl import Qwen3VLAdapter

__all__ = ["MiniMaxM3VLAdapter"]

_MINIMAX = "a MiniMax-M3-VL model (MiniMaxM3SparseForConditionalGeneration or MiniMaxM3VLModel)"


class MiniMaxM3VLAdapter(Qwen3VLAdapter):
    """MiniMax-M3-VL adapter (``MiniMaxM3SparseForConditionalGeneration``).

    Module paths: ``model.model.get_image_features(pixel_values, image_grid_thw)`` and
    ``get_video_features(pixel_values_videos, video_grid_thw)`` (vision tower, projector with its patch
    merger); config fields ``image_token_id``, ``video_token_id``, ``vision_config.spatial_merge_size``
    and, when set, ``vision_start_token_id`` (else blocks are runs of placeholder tokens, which the
    processor's end/start tokens separate).

    The token side (blocks, chunks from the grid) is Qwen3-VL's, the grid checks Qwen2.5-VL's; no
    mrope positions, no deepstack.
    """

    name: ClassVar[str] = "minimax_m3_vl"
    model_types: ClassVar[tuple[str, ...]] = ("minimax_m3_vl",)
    layout: ClassVar[str] = (
        "flat patch rows [patches, D] with grid [images, 3]; videos likewise, one grid row per chunk "
        "(num_chunks_per_video), one token block per temporal step; 1-D positions on every stage"
    )

    # the language model's own 1-D positions, no wire tensors: the base protocol's defaults (whose
    # position_ids returns None, "the language model's default", where Qwen3-VL's always returns mrope)
    position_ids = VlmAdapter.position_ids  # type: ignore[assignment]
    wire_tensors = VlmAdapter.wire_tensors
    first_stage = VlmAdapter.first_stage
    decoder_kwargs = VlmAdapter.decoder_kwargs
    # what the encoder spread sends stage 0: this family's encode, no deepstack sets
    encoder_outputs = VlmAdapter.encoder_outputs
    encoder_output_names = VlmAdapter.encoder_output_names

    def media_counts(self, batch: Mapping[str, Any], config: Any) -> dict[str, Any]:
        """Images and video chunks per sample (see :meth:`Qwen3VLAdapter.media_counts`), after checking
        the batch's ``num_chunks_per_video`` (when present) against them.

        Raises:
            ValueError: ``num_chunks_per_video`` does not add up to the grid's rows, or a video's
                chunks would be split between samples.
        """
        counts = super().media_counts(batch, config)
        check_video_chunks(batch, counts)
        return counts

    # -- media side -------------------------------------------------------------------------
    def encode(self, model: torch.nn.Module, chunk: VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        """The model's own ``get_image_features`` / ``get_video_features`` per present modality:
        ``{modality: [tokens, text_hidden]}`` in placeholder order."""
        inner = inner_model(model, "get_image_features", _MINIMAX)
        missing_grid = "minimax_m3_vl {modality}: the chunk has {shape} patch rows but no grid"
        return encode_grid_modalities(inner, chunk, "vision_tower", missing_grid)
