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
``get_image_features`` does with 4-D ``pixel_values``. :meth:`LlavaNextAdapter.feature_counts` checks
that they add up to the number of crop rows before the vision tower runs.

Images written back to back (``<image><image>`` in a raw prompt) give one run of placeholder tokens.
:meth:`LlavaNextAdapter.media_per_sample` splits such runs when given the batch's ``image_sizes``
(``media=batch``): an image's token count depends only on its size.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import torch
from torch import Tensor
from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape as _untyped_grid_shape

from ..chunk import VlmMediaChunk
from ._helpers import anyres_geometry, as_tower_dtype, count_runs, images_from_runs, refuse_videos, shape
from .base import HostValues, VlmAdapter, config_get, config_value, inner_model

__all__ = ["LlavaNextAdapter", "image_tokens"]

#: transformers' ``get_anyres_image_grid_shape(image_size, grid_pinpoints, patch_size) -> (grid_h, grid_w)``
_grid_shape: Callable[[tuple[int, int], list[list[int]], int], tuple[int, int]] = _untyped_grid_shape

#: (crop side in pixels, feature rows per crop side, pinpoints, rows of the base crop)
_Geometry = tuple[int, int, tuple[tuple[int, int], ...], int]


def _geometry(config: Any) -> _Geometry:
    crop, side, pinpoints = anyres_geometry(config, "LLaVA-NeXT")
    full = config_get(config, "vision_feature_select_strategy") == "full"
    return crop, side, pinpoints, side * side + (1 if full else 0)


def image_tokens(height: int, width: int, config: Any) -> int:
    """Placeholder tokens of one image of original size ``(height, width)``, on the host.

    The crop grid comes from the model's own ``get_anyres_image_grid_shape`` (best resolution); the
    unpadding is ``unpad_image``'s arithmetic on Python floats, as the model does it (a test checks
    it against ``unpad_image`` itself): base crop + unpadded grid rows of ``cols + 1`` (one newline
    each).
    """
    return _crops_and_tokens(int(height), int(width), _geometry(config))[1]


@functools.lru_cache(maxsize=1 << 16)
def _crops_and_tokens(height: int, width: int, geometry: _Geometry) -> tuple[int, int]:
    # (crops, tokens) of one image; cached: a dataset has few distinct sizes, merge runs every step
    crop, side, pinpoints, base = geometry
    grid_h, grid_w = _grid_shape((height, width), [list(p) for p in pinpoints], crop)
    rows, cols = grid_h * side, grid_w * side
    if width / height > cols / rows:
        rows -= 2 * ((rows - int(round(height * (cols / width), 7))) // 2)
    else:
        cols -= 2 * ((cols - int(round(width * (rows / height), 7))) // 2)
    return 1 + grid_h * grid_w, base + rows * (cols + 1)


def _per_image(flat: list[int], geometry: _Geometry, key: str) -> tuple[list[int], list[int]]:
    """Crops and tokens of each image of ``image_sizes`` read flat (``[h0, w0, h1, w1, ...]``).

    Raises ``ValueError`` naming ``key`` and the row for a size below 1.
    """
    crops, tokens = [], []
    for row in range(len(flat) // 2):
        height, width = flat[2 * row], flat[2 * row + 1]
        if height < 1 or width < 1:
            raise ValueError(f"{key}: row {row} is [{height}, {width}]; expected a height and width >= 1")
        n_crops, n_tokens = _crops_and_tokens(height, width, geometry)
        crops.append(n_crops)
        tokens.append(n_tokens)
    return crops, tokens


def _sizes(host: HostValues) -> list[list[int]]:
    """``image_sizes`` as read by merge's one host read: ``[[h, w], ...]``."""
    return host.rows("image_sizes", 2)


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
    def media_per_sample(
        self, input_ids: Tensor, config: Any, *, media: Mapping[str, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Images per sample from the runs of image tokens; no videos in this family (zeros).

        Without ``media`` (or without ``image_sizes`` in it) every run is one image: device ops only,
        no host read. Images written back to back (``<image><image>`` in a raw prompt) form one run,
        which then counts as one image. With ``media["image_sizes"]`` ``[images, 2]`` (pass the batch:
        ``media=batch``) the runs are split by the images' token counts, which follow from their sizes
        alone: one host read of the run lengths and the sizes.

        Raises:
            ValueError: (with ``image_sizes``) a run that is no sum of whole images, or runs and
                images that do not pair up; the message names the sample and the way out
                (``n_images_per_sample`` in the batch).
        """
        is_image = input_ids == config_value(config, "image_token_index", "image_token_id")
        sizes = None if media is None else media.get("image_sizes")
        if sizes is None:
            images = count_runs(is_image)
        else:
            if sizes.dim() != 2 or sizes.shape[-1] != 2:
                raise ValueError(f"image_sizes: shape {shape(sizes)}; expected [images, 2]")
            geometry = _geometry(config)

            def tokens(flat: list[int]) -> list[int]:
                return _per_image(flat, geometry, "image_sizes")[1]

            images = images_from_runs(is_image, sizes, tokens, token="input_ids", metadata="image_sizes")
        return images, torch.zeros_like(images)

    def placeholder_masks(self, input_ids: Tensor, config: Any) -> dict[str, Tensor]:
        # image_token_index first: the field LlavaNextConfig stores (image_token_id is its alias)
        return {"image": input_ids == config_value(config, "image_token_index", "image_token_id")}

    # -- media side -------------------------------------------------------------------------
    def host_inputs(self, chunk: VlmMediaChunk, config: Any) -> dict[str, Tensor]:
        """``{"image_sizes": chunk.image_grid}``, after checking the chunk's shapes.

        Raises:
            ValueError: the chunk carries videos, pixels without ``image_sizes`` (or sizes without
                pixels), sizes that are not ``[images, 2]``, or padded crops whose image count differs
                from the sizes'.
        """
        refuse_videos(chunk, "llava_next")
        pixels, sizes = chunk.pixel_values, chunk.image_grid
        if pixels is None and sizes is None:
            return {}
        if pixels is None or sizes is None:
            missing = "pixel_values" if pixels is None else "image sizes (image_grid)"
            raise ValueError(
                f"llava_next chunk has no {missing}: pixel_values {shape(pixels)}, image_grid {shape(sizes)}"
            )
        if sizes.dim() != 2 or sizes.shape[-1] != 2:
            raise ValueError(f"llava_next image sizes (image_grid): shape {shape(sizes)}; expected [images, 2]")
        if pixels.dim() not in (4, 5):
            raise ValueError(
                f"llava_next pixel_values: shape {shape(pixels)}; expected [images, max_crops, C, H, W] "
                f"or [crops, C, H, W]"
            )
        if pixels.dim() == 5 and pixels.shape[0] != sizes.shape[0]:
            raise ValueError(
                f"llava_next padded crops hold {pixels.shape[0]} images but image sizes describe "
                f"{sizes.shape[0]}"
            )
        return {"image_sizes": sizes}

    def feature_counts(self, chunk: VlmMediaChunk, config: Any, host: HostValues) -> dict[str, int]:
        """The images' tokens, from their sizes alone (:func:`image_tokens`), after checking that the
        crops in ``pixel_values`` are the ones the sizes imply (``1 + grid_h * grid_w`` per image).

        Raises:
            ValueError: fewer padded crops than an image needs, or flat crops that do not add up to
                the crops the sizes imply.
        """
        pixels = chunk.pixel_values
        if pixels is None:
            return {"image": 0}
        crops, tokens = _per_image(host.values["image_sizes"], _geometry(config), "image sizes (image_grid)")
        if pixels.dim() == 5 and pixels.shape[1] < max(crops, default=0):
            raise ValueError(
                f"llava_next padded crops {shape(pixels)} cannot hold {len(crops)} images of {crops} crops"
            )
        if pixels.dim() == 4 and pixels.shape[0] != sum(crops):
            raise ValueError(
                f"llava_next flat crops: pixel_values has {pixels.shape[0]} crops but the image "
                f"sizes imply {sum(crops)} ({crops} per image)"
            )
        return {"image": sum(tokens)}

    def encode(self, model: torch.nn.Module, chunk: VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        """The model's own ``get_image_features``: vision tower, projector, unpad and newline packing.

        Pixels are cast to the vision tower's dtype (no copy when they match). The sizes come from
        ``host`` as a list of ``[h, w]``, which the model accepts everywhere it uses ``image_sizes``
        and which spares it a host read per image.
        """
        if chunk.pixel_values is None:
            return {}
        inner = inner_model(model, "get_image_features", "a LlavaNextForConditionalGeneration or LlavaNextModel")
        pixels = as_tower_dtype(chunk.pixel_values, getattr(inner, "vision_tower", None))
        out = inner.get_image_features(pixels, _sizes(host), return_dict=True)
        return {"image": torch.cat(out.pooler_output, dim=0)}
