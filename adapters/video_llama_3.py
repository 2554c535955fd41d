"""VideoLLaMA3 (``video_llama_3``): Qwen-style patch rows with a merge size PER image and PER video, and
a compression mask over the video features.

Media layout of a chunk (what ``VideoLlama3Processor`` returns, split per microbatch by
:data:`ppmedia.adapters.media_layouts.VIDEOLLAMA3_IMAGES` / ``VIDEOLLAMA3_VIDEOS``):

* ``pixel_values`` ``[sum of h*w, D]`` with ``image_grid`` ``[images, 3]`` ``(1, h, w)`` in patches
  and ``chunk.extras["image_merge_sizes"]`` ``[images]``: image ``i`` gives
  ``h * w / m_i**2`` features (its ``m_i x m_i`` patch blocks pooled bilinearly);
* ``pixel_values_videos`` ``[sum of t*h*w, D]`` with ``video_grid`` ``[videos, 3]``,
  ``chunk.extras["video_merge_sizes"]`` ``[videos]`` and ``chunk.extras["video_compression_mask"]``
  ``[sum of t*h*w / m_i**2]`` bool: video ``i`` gives ``t * h * w / m_i**2`` features, of which the
  mask keeps those it marks (the processor drops tokens that barely change from the previous frame;
  every frame keeps at least one). Without a mask every feature is kept.

The processor writes an image as ``<|image_pad|> * n`` and a video as ``Time 0.0s:`` + the first frame's
kept ``<|video_pad|>`` tokens, ``,Time 1.0s:`` + the second's, and so on: neither the runs of image
tokens (images back to back form one) nor those of video tokens (one run per frame) count the items.
:meth:`VideoLlama3Adapter.media_per_sample` therefore maps items to samples by their token counts,
from the batch's grids, merge sizes and mask (one host read).

The language model is Qwen2 with 1-D positions: nothing travels between stages but the hidden states.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch
from torch import Tensor

from ..chunk import VlmMediaChunk
from ..producer.hostreads import HostReader
from ._helpers import as_tower_dtype, count_runs, grid_products, shape
from .base import HostValues, VlmAdapter, config_value, inner_model

__all__ = ["VideoLlama3Adapter", "item_tokens"]

_MODEL = "a VideoLLaMA3 model (VideoLlama3ForConditionalGeneration or its inner model)"
#: per modality: (chunk pixels, chunk grid, extras key of the merge sizes)
_FIELDS = {"image": ("pixel_values", "image_grid", "image_merge_sizes"),
           "video": ("pixel_values_videos", "video_grid", "video_merge_sizes")}


def item_tokens(grid: list[int], merges: list[int], what: str) -> list[int]:
    """Features per item, ``t * h * w / m**2``, from a flattened ``[items, 3]`` grid and ``[items]``
    merge sizes (host ints).

    Raises:
        ValueError: a merge size below 1, or ``h`` or ``w`` not a multiple of it (the model's pooling
            views each ``m x m`` block), naming the item and ``what`` (``"image"``, ``"video"``).
    """
    out = []
    for i, ((t, h, w), m) in enumerate(zip(zip(grid[0::3], grid[1::3], grid[2::3]), merges)):
        if m < 1 or h % m or w % m:
            raise ValueError(
                f"video_llama_3 {what} {i}: grid (t, h, w) = ({t}, {h}, {w}) with merge size {m}; expected a merge "
                f"size >= 1 dividing h and w (each m x m block of patches pools into one feature)"
            )
        out.append(t * h * w // (m * m))
    return out


def _assign(per_sample: list[int], per_item: list[int], what: str) -> list[int]:
    """Items per sample: consecutive items whose tokens add up to each sample's placeholder tokens.

    Raises:
        ValueError: an item of no tokens (a video whose mask keeps nothing: no sample can be told its
            owner), a sample's tokens ending inside an item, or items left over.
    """
    if 0 in per_item:
        raise ValueError(f"video_llama_3: {what} {per_item.index(0)} gives no placeholder tokens ({what} token counts "
                         f"{per_item}); expected at least one a {what} (the processor keeps one feature a frame)")
    counts, i = [], 0
    for s, tokens in enumerate(per_sample):
        n = 0
        while tokens > 0 and i < len(per_item):
            tokens -= per_item[i]
            i, n = i + 1, n + 1
        if tokens != 0:
            raise ValueError(
                f"video_llama_3: sample {s} has {per_sample[s]} {what} placeholder tokens, which the {what}s' token counts "
                f"{per_item} (in batch order) do not add up to at a {what} boundary; expected each sample's tokens to be "
                f"whole {what}s (pass n_{what}s_per_sample [B] in the batch otherwise)"
            )
        counts.append(n)
    if i != len(per_item):
        raise ValueError(f"video_llama_3: {len(per_item) - i} {what}s ({per_item[i:]} tokens) left over after every "
                         f"sample's placeholder tokens; expected the {what}s to fill the placeholders exactly")
    return counts


class VideoLlama3Adapter(VlmAdapter):
    """VideoLLaMA3 adapter (``VideoLlama3ForConditionalGeneration``; the layout is in the module docstring).

    Module paths used: ``model.model.vision_model`` (called as ``vision_model(pixel_values=, grid_thw=,
    merge_sizes=)``), ``model.model.projector``; config fields ``image_token_id`` and
    ``video_token_id``.
    """

    name: ClassVar[str] = "video_llama_3"
    model_types: ClassVar[tuple[str, ...]] = ("video_llama_3",)
    layout: ClassVar[str] = (
        "flat patch rows [patches, D] with image_grid_thw [images, 3] + image_merge_sizes [images]; videos likewise "
        "with video_merge_sizes [videos] and video_compression_mask [video features] (bool)"
    )

    @staticmethod
    def _token_ids(config: Any) -> tuple[int, int]:
        return int(config_value(config, "image_token_id")), int(config_value(config, "video_token_id"))

    # -- token side -------------------------------------------------------------------------
    def placeholder_masks(self, input_ids: Tensor, config: Any) -> dict[str, Tensor]:
        image, video = self._token_ids(config)
        return {"image": input_ids == image, "video": input_ids == video}

    def media_per_sample(
        self, input_ids: Tensor, config: Any, *, media: Mapping[str, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Images and videos per sample, ``[B]`` int64 each. With the batch's grids and merge sizes (and
        compression mask) in ``media``: items are given to samples in batch order by their token
        counts (one host read). Without them: images as runs of image tokens (two back to back count
        as one) and no videos; a batch with video tokens is then refused.

        Raises:
            ValueError: a sample's tokens end inside an item, items are left over, or video tokens
                without ``video_grid_thw`` and ``video_merge_sizes`` in ``media``.
        """
        masks = self.placeholder_masks(input_ids, config)
        media = media or {}
        have = {m: media.get(f"{m}_grid_thw") is not None and media.get(f"{m}_merge_sizes") is not None for m in _FIELDS}
        reader, slots = HostReader(), {}
        for modality, mask in masks.items():
            if have[modality]:
                slots[modality] = (reader.add(mask.sum(dim=1)), reader.add(media[f"{modality}_grid_thw"]),
                                   reader.add(media[f"{modality}_merge_sizes"]))
        squeeze = media.get("video_compression_mask") if have["video"] else None
        if squeeze is not None:
            kept_at = reader.add(squeeze.to(torch.int8))
        if not have["video"] and bool(masks["video"].any()):
            raise ValueError("video_llama_3: the batch has video placeholder tokens but media holds no video_grid_thw and "
                             "video_merge_sizes; expected them (the tokens alone do not tell one video's frames from videos)")
        runs = count_runs(masks["image"])
        out = {"image": runs, "video": torch.zeros_like(runs)}
        if not slots:
            return out["image"], out["video"]
        values = reader.read_lists()
        for modality, (tokens, grid, merges) in slots.items():
            per_item = item_tokens(values[grid], values[merges], modality)
            if modality == "video" and squeeze is not None:
                flags, at, kept = values[kept_at], 0, []
                for n in per_item:
                    kept.append(sum(flags[at : at + n]))
                    at += n
                per_item = kept
            counts = _assign(values[tokens], per_item, modality)
            out[modality] = torch.tensor(counts, dtype=torch.int64, device=input_ids.device)
        return out["image"], out["video"]

    # -- media side -------------------------------------------------------------------------
    def host_inputs(self, chunk: VlmMediaChunk, config: Any) -> dict[str, Tensor]:
        """Per present modality its grid and merge sizes; for videos the kept features (the mask's sum).

        Raises:
            ValueError: pixels without a grid or merge sizes (or the reverse), pixels that are not
                ``[patches, D]``, a grid that is not ``[n, 3]``, merge sizes that are not ``[n]``, a
                compression mask that is not 1-D.
        """
        extras = chunk.extras or {}
        inputs: dict[str, Tensor] = {}
        for modality, (pixels_field, grid_field, merge_key) in _FIELDS.items():
            pixels, grid, merges = getattr(chunk, pixels_field), getattr(chunk, grid_field), extras.get(merge_key)
            if pixels is None and grid is None:
                continue
            if pixels is None or grid is None or merges is None:
                raise ValueError(f"video_llama_3 {modality}s: the chunk has patch rows {shape(pixels)}, grid {shape(grid)} and "
                                 f"{merge_key} {shape(merges)}; expected all three")
            if pixels.dim() != 2 or grid.dim() != 2 or grid.shape[1] != 3 or tuple(merges.shape) != (grid.shape[0],):
                raise ValueError(f"video_llama_3 {modality}s: patch rows {shape(pixels)}, grid {shape(grid)}, {merge_key} "
                                 f"{shape(merges)}; expected [patches, D], [n, 3] (t, h, w) and [n]")
            inputs[f"{modality}_grid"], inputs[merge_key] = grid, merges
        mask = extras.get("video_compression_mask")
        if mask is not None and "video_grid" in inputs:
            if mask.dim() != 1 or mask.dtype != torch.bool:
                raise ValueError(f"video_llama_3 video_compression_mask: shape {shape(mask)}, dtype {mask.dtype}; expected "
                                 f"[video features] bool (the model indexes its features with it)")
            inputs["video_kept"] = mask.sum(dtype=torch.int64).reshape(1)
        return inputs

    def feature_counts(self, chunk: VlmMediaChunk, config: Any, host: HostValues) -> dict[str, int]:
        """Per modality ``sum(t * h * w / m**2)`` (videos: the kept ones), after checking the grids cover
        the patch rows exactly and the mask has one entry per video feature.

        Raises:
            ValueError: a grid covering another number of rows than the chunk's, a merge size not
                dividing its item's ``h`` and ``w``, a mask of another length than the features.
        """
        counts = {"image": 0, "video": 0}
        extras = chunk.extras or {}
        for modality, (pixels_field, _, merge_key) in _FIELDS.items():
            grid = host.values.get(f"{modality}_grid")
            if grid is None:
                continue
            rows = getattr(chunk, pixels_field).shape[0]
            if sum(grid_products(grid, 3)) != rows:
                raise ValueError(f"video_llama_3 {modality}s: the grid covers {sum(grid_products(grid, 3))} patches but the "
                                 f"chunk has {rows} patch rows")
            features = sum(item_tokens(grid, host.values[merge_key], modality))
            mask = extras.get("video_compression_mask") if modality == "video" else None
            if mask is not None:
                if mask.shape[0] != features:
                    raise ValueError(f"video_llama_3 video_compression_mask: {mask.shape[0]} entries; expected {features}, "
                                     f"one per video feature (t * h * w / merge**2 each video)")
                features = host.values["video_kept"][0]
            counts[modality] = features
        return counts

    def encode(self, model: torch.nn.Module, chunk: VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        """The model's own tower and projector on each present modality's rows, grids and merge sizes;
        video features then filtered by the compression mask (its kept count is known on the host:
        ``nonzero_static``, no device sync)."""
        inner = inner_model(model, "vision_model", _MODEL)
        tower, extras = inner.vision_model, chunk.extras or {}
        features: dict[str, Tensor] = {}
        for modality, (pixels_field, grid_field, merge_key) in _FIELDS.items():
            pixels = getattr(chunk, pixels_field)
            if pixels is None:
                continue
            out = tower(pixel_values=as_tower_dtype(pixels, tower), grid_thw=getattr(chunk, grid_field),
                        merge_sizes=extras[merge_key], return_dict=True)
            feats = inner.projector(out.last_hidden_state)
            mask = extras.get("video_compression_mask") if modality == "video" else None
            if mask is not None:
                keep = torch.nonzero_static(mask, size=host.values["video_kept"][0]).reshape(-1)
                feats = feats.index_select(0, keep)
            features[modality] = feats
        return features
