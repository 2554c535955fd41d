"""Kimi-VL family adapter: MoonViT patch-major images (Kimi-VL, Kimi-K2.5).

Media layout read from a :class:`~ppmedia.VlmMediaChunk`:

* ``pixel_values`` ``[patches, C, P, P]``: each image cut into ``P x P`` patches (``P`` the vision
  ``patch_size``) in row-major grid order, all images of the microbatch concatenated on axis 0;
* ``image_grid`` ``[images, 2]`` (h, w), as Kimi-VL checkpoints stage ``image_grid_hws``, or
  ``[images, 3]`` (t, h, w) with ``t = 1``, as transformers' ``image_grid_thw``.

MoonViT averages every ``kh x kw`` block of patches (``vision_config.merge_kernel_size``, 2 x 2 in
every released checkpoint) into one token, so an image with grid ``(h, w)`` fills ``h * w / (kh * kw)``
placeholder tokens, and a microbatch's feature count is its patch rows divided by the kernel area.

Videos (Kimi-K2.5): ``pixel_values_videos`` ``[patches, C, P, P]``, patch-major like images, with
``video_grid`` ``video_grid_thw`` ``[chunks, 3]`` ``(t, h, w)``: the Kimi-K2.5 video processor cuts a video
into chunks of ``t`` frames (``num_chunks_per_video`` per video) and writes one block of ``h * w / (kh *
kw)`` video tokens per chunk (MoonViT pools a chunk's frames into one frame's worth of tokens).
ppmedia stages one chunk (grid row) as one video, counted by its block. transformers 5.23's own
``get_video_features`` fails on ``t > 1`` (it splits the pooled features by ``t * h * w / 4``); the
adapter feeds the model's own ``vision_tower`` and ``mm_projector`` itself and splits nothing.
Remote-code Kimi-VL has no videos: a video chunk for it is refused before anything runs.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor

from ..chunk import VlmMediaChunk
from ._helpers import (
    as_tower_dtype,
    check_video_chunks,
    count_runs,
    grid_products,
    grid_thw,
    images_from_runs,
    refuse_videos,
    shape,
)
from .base import HostValues, VlmAdapter, config_get, config_value

__all__ = ["KimiVLAdapter"]

_GRID_KEYS = ("image_grid_hws", "image_grid_thw")


class KimiVLAdapter(VlmAdapter):
    """Runs the model's own MoonViT tower and projector on one microbatch's images.

    Module paths, tried in this order by :meth:`encode`:

    1. transformers' ``Kimi_K25ForConditionalGeneration``: ``model.model.vision_tower`` (MoonViT),
       ``model.model.mm_projector``, called through ``model.model.get_image_features(pixel_values,
       image_grid_thw)`` with an ``[images, 3]`` grid (an ``[images, 2]`` chunk grid gets a ``t = 1``
       column prepended on its own device);
    2. remote-code Kimi-VL (``KimiVLForConditionalGeneration``): ``model.vision_tower``,
       ``model.multi_modal_projector``, called through ``model._extract_image_features(pixel_values,
       image_grid_hws)`` with an ``[images, 2]`` grid (the ``t`` column of an ``[images, 3]`` chunk
       grid is dropped).

    Config fields read: ``image_token_id`` (transformers) or ``media_placeholder_token_id``
    (remote Kimi-VL); ``video_token_id`` when set; ``vision_config.merge_kernel_size`` (default 2 x 2).
    """

    name = "kimi_vl"
    model_types = ("kimi_vl", "kimi_k25")
    layout = (
        "patch-major patches [patches, C, ph, pw] with grid [images, 2] (h, w) or [images, 3] (t, h, w); "
        "Kimi-K2.5 videos likewise, one grid row (t, h, w) per chunk of t frames"
    )

    # -- config ----------------------------------------------------------------------------
    @staticmethod
    def _image_token_id(config: Any) -> int:
        return int(config_value(config, "image_token_id", "media_placeholder_token_id"))

    @staticmethod
    def _video_token_id(config: Any) -> int | None:
        value = config_get(config, "video_token_id")
        return None if value is None else int(value)

    @staticmethod
    def _merge_area(config: Any) -> int:
        kernel = config_get(config_get(config, "vision_config"), "merge_kernel_size")
        if kernel is None:
            return 4
        if isinstance(kernel, int):
            return kernel * kernel
        kh, kw = kernel
        return int(kh) * int(kw)

    # -- token side ------------------------------------------------------------------------
    def media_per_sample(
        self, input_ids: Tensor, config: Any, *, media: Mapping[str, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Images per sample: the runs of image placeholder tokens (the processor frames each image
        with media start/end tokens, so each image is one run). Videos are always zero.

        Without ``media`` (or without a grid in it): device ops only, no host read. With the batch's
        grid (``media=batch`` holding ``image_grid_hws`` ``[images, 2]`` or ``image_grid_thw``
        ``[images, 3]``), runs are split by the images' token counts (``h * w / merge area``), so
        images written back to back are told apart too; one host read.

        Raises:
            ValueError: (with a grid) runs and images that do not pair up; the message names the
                sample and the way out (``n_images_per_sample`` in the batch).
        """
        is_image = input_ids == self._image_token_id(config)
        grid, key = None, ""
        for key in _GRID_KEYS:
            grid = None if media is None else media.get(key)
            if grid is not None:
                break
        if grid is None:
            images = count_runs(is_image)
        else:
            if grid.dim() != 2 or grid.shape[1] not in (2, 3):
                raise ValueError(f"{key}: shape {shape(grid)}; expected [images, 2] (h, w) or [images, 3] (t, h, w)")
            area, columns = self._merge_area(config), grid.shape[1]

            def tokens(flat: list[int]) -> list[int]:
                return [n // area for n in grid_products(flat, columns)]

            images = images_from_runs(is_image, grid, tokens, token="input_ids", metadata=key)
        return images, self._videos_per_sample(input_ids, config, media)

    def _videos_per_sample(self, input_ids: Tensor, config: Any, media: Mapping[str, Tensor] | None) -> Tensor:
        """Video chunks per sample: runs of video tokens, split by ``media["video_grid_thw"]`` (one
        block of ``h * w / merge area`` tokens per chunk) when given; zeros without a video token."""
        video_id = self._video_token_id(config)
        if video_id is None or video_id == self._image_token_id(config):
            return torch.zeros(input_ids.shape[0], dtype=torch.int64, device=input_ids.device)
        is_video = input_ids == video_id
        grid = None if media is None else media.get("video_grid_thw")
        if grid is None:
            return count_runs(is_video)
        if grid.dim() != 2 or grid.shape[1] != 3:
            raise ValueError(f"video_grid_thw: shape {shape(grid)}; expected [chunks, 3] (t, h, w)")
        area = self._merge_area(config)

        def tokens(flat: list[int]) -> list[int]:
            return [h * w // area for h, w in zip(flat[1::3], flat[2::3])]

        return images_from_runs(is_video, grid, tokens, token="input_ids", metadata="video_grid_thw")

    def media_counts(self, batch: Mapping[str, Any], config: Any) -> dict[str, Any]:
        """As the base method (images and video chunks from the tokens and the batch's grids), after
        checking the batch's ``num_chunks_per_video`` (when present): no video split between samples."""
        counts = super().media_counts(batch, config)
        check_video_chunks(batch, counts)
        return counts

    def placeholder_masks(self, input_ids: Tensor, config: Any) -> dict[str, Tensor]:
        image_id = self._image_token_id(config)
        masks = {"image": input_ids == image_id}
        video_id = self._video_token_id(config)
        if video_id is not None and video_id != image_id:
            masks["video"] = input_ids == video_id
        return masks

    # -- media side ------------------------------------------------------------------------
    def host_inputs(self, chunk: VlmMediaChunk, config: Any) -> dict[str, Tensor]:
        """``{"image_grid": [images, 2 or 3]}`` when the chunk has images, ``{"video_grid": [chunks, 3]}``
        when it has videos.

        Raises:
            ValueError: pixels without a grid (or a grid without pixels, or a grid of another shape);
                video media for a model other than transformers' Kimi-K2.5 (remote-code Kimi-VL has
                no videos).
        """
        out: dict[str, Tensor] = {}
        pixels, grid = chunk.pixel_values, chunk.image_grid
        if pixels is not None or grid is not None:
            if pixels is None or grid is None:
                raise ValueError(
                    f"Kimi-VL chunk has pixel_values {shape(pixels)} and image grid {shape(grid)}; expected "
                    "both: patches [patches, C, P, P] with image_grid_hws [images, 2] or image_grid_thw [images, 3]"
                )
            if grid.dim() != 2 or grid.shape[-1] not in (2, 3):
                raise ValueError(f"image grid must be [images, 2] or [images, 3], got {shape(grid)}")
            out["image_grid"] = grid
        videos, video_grid = chunk.pixel_values_videos, chunk.video_grid
        if videos is not None or video_grid is not None:
            if config_get(config, "model_type") != "kimi_k25":
                refuse_videos(chunk, f"the Kimi-VL adapter for model type {config_get(config, 'model_type')!r}")
            if videos is None or video_grid is None or video_grid.dim() != 2 or video_grid.shape[-1] != 3:
                raise ValueError(
                    f"Kimi-K2.5 chunk has pixel_values_videos {shape(videos)} and video_grid_thw "
                    f"{shape(video_grid)}; expected both: patches [patches, C, P, P] with [chunks, 3] (t, h, w)"
                )
            out["video_grid"] = video_grid
        return out

    def feature_counts(self, chunk: VlmMediaChunk, config: Any, host: HostValues) -> dict[str, int]:
        """Image tokens = patches // merge-kernel area; video tokens = per chunk ``h * w // area`` (its
        ``t`` frames pool into one), after checking each grid covers exactly its patch rows and every
        image or frame is a whole number of merge blocks.

        Raises:
            ValueError: a grid covers another number of patches than its pixels have rows, or a row
                whose patches (per frame) are not a multiple of the merge-kernel area (row named).
        """
        area = self._merge_area(config)
        counts = {"image": 0}
        pixels, grid = chunk.pixel_values, chunk.image_grid
        if pixels is not None and grid is not None:
            patches = grid_products(host.values["image_grid"], grid.shape[1])
            _check_rows("image grid", grid, patches, "pixel_values", pixels, patches, area)
            counts["image"] = pixels.shape[0] // area
        videos, video_grid = chunk.pixel_values_videos, chunk.video_grid
        if videos is not None and video_grid is not None:
            flat = host.values["video_grid"]
            frames = [h * w for h, w in zip(flat[1::3], flat[2::3])]
            _check_rows("video_grid_thw", video_grid, grid_products(flat, 3), "pixel_values_videos", videos, frames, area)
            counts["video"] = sum(frames) // area
        return counts

    def encode(self, model: torch.nn.Module, chunk: VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        """MoonViT + projector: ``{"image": [tokens, text_hidden], "video": [tokens, text_hidden]}`` for
        the modalities the chunk has."""
        out = self._encode_images(model, chunk)
        if chunk.pixel_values_videos is not None and chunk.video_grid is not None:
            out["video"] = self._encode_videos(model, chunk.pixel_values_videos, chunk.video_grid, host.values["video_grid"])
        return out

    @staticmethod
    def _encode_videos(model: torch.nn.Module, pixels: Tensor, grid: Tensor, flat: list[int]) -> Tensor:
        """The model's own ``vision_tower`` (pooling each chunk's frames) and ``mm_projector``:
        ``[sum(h * w / area), text_hidden]`` in chunk order, what ``get_image_features`` computes before
        its split (which transformers 5.23 gets wrong for ``t > 1``). The tower pools the chunks of one
        call into one ``[tokens, t, area]`` index, so chunks of different ``t`` (a video's last chunk)
        go in separate calls: one per run of consecutive chunks with the same ``t`` (``flat``: the
        grid read to the host)."""
        inner: Any = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "vision_tower") or not hasattr(inner, "mm_projector"):
            raise TypeError(f"{type(model).__name__} has no model.vision_tower / model.mm_projector (Kimi-K2.5) for videos")
        pixels = as_tower_dtype(pixels, inner.vision_tower)
        rows = [(t, t * h * w) for t, h, w in zip(flat[0::3], flat[1::3], flat[2::3])]
        parts, first, start = [], 0, 0
        for k in range(1, len(rows) + 1):
            if k == len(rows) or rows[k][0] != rows[first][0]:
                stop = start + sum(n for _, n in rows[first:k])
                pooled = inner.vision_tower(pixels[start:stop], grid_thw=grid[first:k]).pooler_output
                projected: Tensor = inner.mm_projector(pooled)
                parts.append(projected.reshape(-1, projected.shape[-1]))
                first, start = k, stop
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def _encode_images(self, model: torch.nn.Module, chunk: VlmMediaChunk) -> dict[str, Tensor]:
        pixels, grid = chunk.pixel_values, chunk.image_grid
        if pixels is None or grid is None:
            return {}
        inner = getattr(model, "model", None)
        if inner is not None and hasattr(inner, "get_image_features") and hasattr(inner, "vision_tower"):
            pixels = as_tower_dtype(pixels, inner.vision_tower)
            out = inner.get_image_features(pixels, image_grid_thw=grid_thw(grid, "image grid"), return_dict=True)
            features = out.pooler_output
        elif hasattr(model, "_extract_image_features") and hasattr(model, "vision_tower"):
            remote: Any = model  # remote-code members nn.Module does not declare
            hws = grid[:, 1:] if grid.shape[-1] == 3 else grid
            features = remote._extract_image_features(as_tower_dtype(pixels, remote.vision_tower), hws)
        else:
            raise TypeError(
                f"{type(model).__name__} has neither model.model.get_image_features with "
                "model.model.vision_tower (transformers Kimi-K2.5) nor model._extract_image_features "
                "with model.vision_tower (remote-code Kimi-VL)"
            )
        if isinstance(features, Tensor):
            return {"image": features.reshape(-1, features.shape[-1])}
        if any(f.dim() != 2 for f in features):  # remote code may keep a kernel axis: [n_i, k, H]
            features = [f.reshape(-1, f.shape[-1]) for f in features]
        return {"image": torch.cat(features, dim=0)}


def _check_rows(
    what: str, grid: Tensor, patches: list[int], pixels_name: str, pixels: Tensor, per_frame: list[int], area: int
) -> None:
    """``patches`` (per grid row) add up to ``pixels``' rows; every ``per_frame`` count is whole merge blocks."""
    if sum(patches) != pixels.shape[0]:
        raise ValueError(
            f"{what} {shape(grid)} covers {sum(patches)} patches but {pixels_name} {shape(pixels)} has "
            f"{pixels.shape[0]} patch rows"
        )
    for row, n in enumerate(per_frame):
        if n % area:
            raise ValueError(f"{what}: row {row} gives {n} patches, not a multiple of the merge-kernel area {area}")
