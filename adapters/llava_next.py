"""LLaVA-NeXT (``llava_next``): anyres crops, original image sizes, ``image_newline`` packing.

Media layout of a chunk:

* ``chunk.pixel_values``: the processor's padded crops ``[images, max_crops, C, H, W]`` (crops past an
  image's own count are padding and ignored), or the same crops flattened ``[crops, C, H, W]``,
  concatenated in image order with no padding.
* ``chunk.image_grid``: ``image_sizes`` ``[images, 2]``, each image's original (height, width).

Everything follows from ``image_sizes`` and the config, exactly as in the model: the best resolution is
the pinpoint of ``config.image_grid_pinpoints`` that keeps the most pixels (ties: least waste, first
listed); an image has ``1 + grid_h * grid_w`` crops (``grid = best_resolution // crop side``), and
``P * P + rows * (cols + 1)`` tokens, with ``P = image_size // patch_size`` feature rows per crop side,
``P * P`` rows of the base crop first, then the ``grid_h * P x grid_w * P`` feature map of the grid
crops with the letterbox padding of the original aspect ratio removed (``rows x cols`` left), each row
ending in one ``image_newline`` row.

Crops per image in the flat layout: nothing in the chunk says where one image's crops end; they are
derived from ``image_sizes`` (``1 + grid_h * grid_w``), which is what the model's own
``get_image_features`` does with 4-D ``pixel_values``. :meth:`LlavaNextAdapter.encode` checks that they
add up to the number of crop rows before running the vision tower.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor
from transformers.image_processing_utils import select_best_resolution
from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape

from ..chunk import VlmMediaChunk
from .base import Count, HostCount, VlmAdapter, config_value, inner_model

__all__ = ["LlavaNextAdapter", "image_tokens"]


def _geometry(config: Any) -> tuple[int, int, list[tuple[int, int]], bool]:
    crop = int(config_value(config, "vision_config.image_size"))
    patch = int(config_value(config, "vision_config.patch_size"))
    pinpoints = [(int(h), int(w)) for h, w in config_value(config, "image_grid_pinpoints")]
    strategy = getattr(config, "vision_feature_select_strategy", "default")
    return crop, crop // patch, pinpoints, strategy == "full"


def image_tokens(height: int, width: int, config: Any) -> int:
    """Placeholder tokens of one image of original size ``(height, width)``, on the host.

    The crop grid comes from the model's own ``get_anyres_image_grid_shape`` (best resolution); the
    unpadding is ``unpad_image``'s arithmetic on Python floats, as the model does it (a test checks
    it against ``unpad_image`` itself): base crop + unpadded grid rows of ``cols + 1`` (one newline
    each).
    """
    return _image_tokens(height, width, *_host_geometry(config))


def _host_geometry(config: Any) -> tuple[int, int, list[list[int]], int]:
    crop, side, pinpoints, full = _geometry(config)
    return crop, side, [list(p) for p in pinpoints], side * side + (1 if full else 0)


def _image_tokens(height: int, width: int, crop: int, side: int, pinpoints: list[list[int]], base: int) -> int:
    grid_h, grid_w = get_anyres_image_grid_shape((height, width), pinpoints, crop)
    rows, cols = grid_h * side, grid_w * side
    if width / height > cols / rows:
        rows -= 2 * ((rows - int(round(height * (cols / width), 7))) // 2)
    else:
        cols -= 2 * ((cols - int(round(width * (rows / height), 7))) // 2)
    return base + rows * (cols + 1)


def _tokens_of_sizes(flat_sizes: list[int], config: Any) -> int:
    # HostCount callback: image_sizes read as [h0, w0, h1, w1, ...]
    geometry = _host_geometry(config)
    return sum(_image_tokens(h, w, *geometry) for h, w in zip(flat_sizes[0::2], flat_sizes[1::2]))


def _crops_per_image(sizes: list[list[int]], config: Any) -> list[int]:
    # host side, from sizes already read: the model's own select_best_resolution
    crop, _, pinpoints, _ = _geometry(config)
    counts = []
    for size in sizes:
        best_h, best_w = select_best_resolution(size, [list(p) for p in pinpoints])
        counts.append(1 + (best_h // crop) * (best_w // crop))
    return counts


class LlavaNextAdapter(VlmAdapter):
    """LLaVA-NeXT adapter (``LlavaNextForConditionalGeneration``).

    Module paths used: ``model.model.get_image_features`` (``model.get_image_features`` when ``model``
    is the inner ``LlavaNextModel``), which runs ``vision_tower``, ``multi_modal_projector`` and packs with
    ``image_newline``; ``model.config`` fields ``image_token_id``, ``image_grid_pinpoints``,
    ``vision_feature_select_strategy``, ``vision_config.image_size`` and ``vision_config.patch_size``.
    """

    name = "llava_next"
    model_types = ("llava_next",)
    layout = (
        "padded crops [images, max_crops, C, H, W] (or flat crops [crops, C, H, W]) "
        "with original sizes [images, 2]"
    )

    # -- token side -------------------------------------------------------------------------
    def media_per_sample(self, input_ids: Tensor, config: Any) -> tuple[Tensor, Tensor]:
        """Images per sample = runs of consecutive image tokens (an image is one contiguous run).

        Two images with no token between them would count as one; the processor always separates
        them. No videos in this family: the second tensor is zeros.
        """
        is_image = input_ids == config_value(config, "image_token_id", "image_token_index")
        starts = is_image.clone()
        starts[:, 1:] &= ~is_image[:, :-1]
        images = starts.sum(dim=1, dtype=torch.int64)
        return images, torch.zeros_like(images)

    def placeholder_masks(self, input_ids: Tensor, config: Any) -> dict[str, Tensor]:
        return {"image": input_ids == config_value(config, "image_token_id", "image_token_index")}

    # -- media side -------------------------------------------------------------------------
    def feature_counts(self, chunk: VlmMediaChunk, config: Any) -> dict[str, Count]:
        """``{"image": HostCount(image_sizes, ...)}``: the tokens depend on ``image_sizes`` only; merge
        reads them with the placeholder counts and counts on the host (:func:`image_tokens`).

        Raises:
            ValueError: the chunk carries videos, pixels without ``image_sizes``, or a padded-crops
                ``pixel_values`` whose image count differs from ``image_sizes`` (shapes only).
        """
        if chunk.pixel_values_videos is not None or chunk.video_grid is not None:
            raise ValueError("llava_next takes no video input, but the chunk carries videos")
        pixels, sizes = chunk.pixel_values, chunk.image_grid
        if pixels is None and sizes is None:
            return {"image": 0}
        if pixels is None or sizes is None:
            missing = "pixel_values" if pixels is None else "image sizes (image_grid)"
            raise ValueError(f"llava_next chunk has images but no {missing}")
        if sizes.dim() != 2 or sizes.shape[-1] != 2:
            raise ValueError(f"llava_next image sizes must be [images, 2], got {tuple(sizes.shape)}")
        if pixels.dim() == 5 and pixels.shape[0] != sizes.shape[0]:
            raise ValueError(
                f"llava_next padded crops hold {pixels.shape[0]} images but image sizes describe "
                f"{sizes.shape[0]}"
            )
        if pixels.dim() not in (4, 5):
            raise ValueError(
                f"llava_next pixel_values must be [images, max_crops, C, H, W] or [crops, C, H, W], "
                f"got {tuple(pixels.shape)}"
            )
        return {"image": HostCount(sizes, functools.partial(_tokens_of_sizes, config=config))}

    def encode(self, model: torch.nn.Module, chunk: VlmMediaChunk) -> dict[str, Tensor]:
        """The model's own ``get_image_features``: vision tower, projector, unpad and newline packing.

        Reads ``image_sizes`` to the host once (the model needs them there to cut crops into grids) and
        checks the crop layout against them before the vision tower runs.

        Raises:
            ValueError: fewer padded crops than an image needs, or flat crops that do not add up to
                the crops the sizes imply.
        """
        pixels, image_sizes = chunk.pixel_values, chunk.image_grid
        if pixels is None:
            return {}
        if image_sizes is None:
            raise ValueError("llava_next chunk has pixel_values but no image sizes (image_grid)")
        inner = inner_model(model, "get_image_features", "a LlavaNextForConditionalGeneration or LlavaNextModel")
        sizes = image_sizes.tolist()  # one host read for the whole chunk
        crops = _crops_per_image(sizes, model.config)
        if pixels.dim() == 5:
            if pixels.shape[0] != len(sizes) or pixels.shape[1] < max(crops, default=0):
                raise ValueError(
                    f"llava_next padded crops {tuple(pixels.shape[:2])} cannot hold {len(sizes)} images "
                    f"of {crops} crops"
                )
        elif pixels.dim() == 4:
            if pixels.shape[0] != sum(crops):
                raise ValueError(
                    f"llava_next flat crops: pixel_values has {pixels.shape[0]} crops but the image "
                    f"sizes imply {sum(crops)} ({crops} per image)"
                )
        else:
            raise ValueError(f"llava_next pixel_values must be 4-D or 5-D, got {tuple(pixels.shape)}")
        # A list of [h, w] is accepted everywhere the model uses image_sizes and spares it a host
        # read per image.
        out = inner.get_image_features(pixels, sizes, return_dict=True)
        return {"image": torch.cat(list(out.pooler_output), dim=0)}
