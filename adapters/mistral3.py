"""Mistral 3 (``mistral3``): Pixtral vision tower on images of different sizes, 2 x 2 patch merger.

Media layout of a chunk:

* ``chunk.pixel_values``: ``[images, C, Hmax, Wmax]``, every image padded (bottom and right) to the
  largest height and width of the processor's batch, as ``PixtralImageProcessor`` returns them;
* ``chunk.image_grid``: ``image_sizes`` ``[images, 2]``, each image's true (height, width) in pixels
  after the processor's resize.

An image of true size ``H x W`` gives ``(H // (p * m)) * (W // (p * m))`` feature rows, ``p`` the
vision patch size and ``m`` the ``spatial_merge_size``: the tower encodes its ``H // p x W // p``
patches (nothing of the padding), the projector's patch merger joins ``m x m`` of them. The processor
writes one ``[IMG]`` per feature row, an ``[IMG_BREAK]`` after each row of them and ``[IMG_END]``
instead of the last break; only ``[IMG]`` (``config.image_token_id``) receives features.

``[IMG_BREAK]`` and ``[IMG_END]`` are not in ``Mistral3Config``: the adapter takes them from the
config if it has ``image_break_token_id`` / ``image_end_token_id`` (set them from the processor:
``processor.image_break_token_id``, ``processor.image_end_token_id``), else from the adapter instance
(``Mistral3Adapter(image_break_token_id=..., image_end_token_id=...)``), whose defaults 12 and 13 are
the ids in Mistral's tokenizer. Only :meth:`Mistral3Adapter.media_per_sample` uses them (one
``[IMG_END]`` per image).
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch
from torch import Tensor

from ..chunk import VlmMediaChunk
from ._helpers import as_tower_dtype, refuse_videos, shape
from .base import HostValues, VlmAdapter, config_get, config_value, inner_model

__all__ = ["Mistral3Adapter", "image_tokens"]

#: ``[IMG_BREAK]`` and ``[IMG_END]`` in Mistral's tokenizer (Mistral-Small-3.1, Pixtral).
DEFAULT_IMAGE_BREAK_TOKEN_ID = 12
DEFAULT_IMAGE_END_TOKEN_ID = 13


def _downsample(config: Any) -> int:
    return int(config_value(config, "vision_config.patch_size")) * int(config_value(config, "spatial_merge_size"))


def image_tokens(height: int, width: int, config: Any) -> int:
    """``[IMG]`` tokens of one image of true size ``(height, width)``: ``(H // (p*m)) * (W // (p*m))``."""
    step = _downsample(config)
    return (height // step) * (width // step)


def _tokens_of_sizes(flat: list[int], step: int, max_hw: tuple[int, int], family: str = "mistral3") -> int:
    # image_sizes read to the host as [h0, w0, h1, w1, ...]; checked before any encoder runs
    total = 0
    for k, (h, w) in enumerate(zip(flat[0::2], flat[1::2])):
        if not (step <= h <= max_hw[0] and step <= w <= max_hw[1]):
            raise ValueError(
                f"{family} image_sizes: row {k} of the microbatch is [{h}, {w}]; expected each side between "
                f"{step} (patch x spatial_merge_size) and {list(max_hw)} (the padded pixel_values, at most "
                f"vision_config.image_size)"
            )
        total += (h // step) * (w // step)
    return total


class Mistral3Adapter(VlmAdapter):
    """Mistral 3 adapter (``Mistral3ForConditionalGeneration``).

    Module paths used: ``model.model.get_image_features(pixel_values, image_sizes)`` (``vision_tower``,
    ``multi_modal_projector`` with its patch merger; ``model.get_image_features`` when ``model`` is the
    inner ``Mistral3Model``); ``model.config`` fields ``image_token_id``, ``spatial_merge_size`` and
    ``vision_config.patch_size``.

    Args:
        image_break_token_id: ``[IMG_BREAK]`` when the config has no ``image_break_token_id``.
        image_end_token_id: ``[IMG_END]`` when the config has no ``image_end_token_id``.
    """

    name: ClassVar[str] = "mistral3"
    model_types: ClassVar[tuple[str, ...]] = ("mistral3",)
    layout: ClassVar[str] = (
        "complete images padded to the batch's largest [images, C, Hmax, Wmax] with true sizes "
        "image_sizes [images, 2]"
    )

    def __init__(
        self,
        image_break_token_id: int = DEFAULT_IMAGE_BREAK_TOKEN_ID,
        image_end_token_id: int = DEFAULT_IMAGE_END_TOKEN_ID,
    ) -> None:
        self.image_break_token_id = int(image_break_token_id)
        self.image_end_token_id = int(image_end_token_id)

    def special_token_ids(self, config: Any) -> tuple[int, int, int]:
        """``([IMG], [IMG_BREAK], [IMG_END])`` ids: the config's where it has them, else this adapter's."""
        image = int(config_value(config, "image_token_id", "image_token_index"))
        brk = config_get(config, "image_break_token_id")
        end = config_get(config, "image_end_token_id")
        return (
            image,
            self.image_break_token_id if brk is None else int(brk),
            self.image_end_token_id if end is None else int(end),
        )

    def downsample(self, config: Any) -> int:
        """Pixels per image token along each side: the vision patch size times ``spatial_merge_size``."""
        return _downsample(config)

    # -- token side -------------------------------------------------------------------------
    def media_per_sample(
        self, input_ids: Tensor, config: Any, *, media: Mapping[str, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Images per sample = its ``[IMG_END]`` tokens (one per image, so images back to back are told
        apart without ``media``). No videos: zeros."""
        _, _, end = self.special_token_ids(config)
        images = (input_ids == end).sum(dim=-1, dtype=torch.int64)
        return images, torch.zeros_like(images)

    def placeholder_masks(self, input_ids: Tensor, config: Any) -> dict[str, Tensor]:
        return {"image": input_ids == self.special_token_ids(config)[0]}

    # -- media side -------------------------------------------------------------------------
    def host_inputs(self, chunk: VlmMediaChunk, config: Any) -> dict[str, Tensor]:
        """``{"image_sizes": [images, 2]}`` (staged as ``chunk.image_grid``), shapes checked.

        Raises:
            ValueError: videos; pixels without sizes or the reverse; ``pixel_values`` not 4-D;
                ``image_sizes`` not ``[images, 2]`` for the same number of images.
            TypeError: ``pixel_values`` not floating point, or ``image_sizes`` not integers.
        """
        family = self.name
        refuse_videos(chunk, family)
        pixels, sizes = chunk.pixel_values, chunk.image_grid
        if pixels is None and sizes is None:
            return {}
        if pixels is None or sizes is None:
            raise ValueError(
                f"{family} chunk has pixel_values {shape(pixels)} and image_sizes {shape(sizes)}; expected both"
            )
        if pixels.dim() != 4:
            raise ValueError(f"{family} pixel_values: shape {shape(pixels)}; expected [images, C, Hmax, Wmax]")
        if not pixels.is_floating_point():
            raise TypeError(f"{family} pixel_values: dtype {pixels.dtype}; expected a floating dtype")
        if sizes.is_floating_point() or sizes.is_complex() or sizes.dtype == torch.bool:
            raise TypeError(f"{family} image_sizes: dtype {sizes.dtype}; expected an integer dtype")
        if sizes.dim() != 2 or sizes.shape[1] != 2 or sizes.shape[0] != pixels.shape[0]:
            raise ValueError(
                f"{family} image_sizes: shape {shape(sizes)}; expected [{pixels.shape[0]}, 2] "
                f"(one (height, width) per pixel_values row)"
            )
        return {"image_sizes": sizes}

    def feature_counts(self, chunk: VlmMediaChunk, config: Any, host: HostValues) -> dict[str, int]:
        """``{"image": tokens}`` from the true sizes read to the host, each checked against the padded
        pixels and the tower's largest size.

        Raises:
            ValueError: a size outside ``[patch * spatial_merge_size, min(padded side, image_size)]``.
        """
        pixels = chunk.pixel_values
        if pixels is None:
            return {"image": 0}
        largest = int(config_value(config, "vision_config.image_size"))  # the tower's rope covers no more
        max_hw = (min(int(pixels.shape[2]), largest), min(int(pixels.shape[3]), largest))
        return {"image": _tokens_of_sizes(host.values["image_sizes"], self.downsample(config), max_hw, self.name)}

    def encode(self, model: torch.nn.Module, chunk: VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        """The model's own ``get_image_features``: ``{"image": [tokens, text_hidden]}`` in image order,
        with the sizes read in :meth:`check_counts` (no second host read).

        transformers 5.23's ``get_image_features`` (Mistral 3, Mistral Large 4, LLaVA) squeezes its
        ``[1, tokens, H]`` features before splitting them per image, which fails when a call has ONE
        feature row (a microbatch whose only image is one token): then the image goes in twice and
        the first copy's row is kept (the second copy gets no gradient)."""
        if chunk.pixel_values is None:
            return {}
        inner = inner_model(model, "get_image_features", f"a {self.name} model (...ForConditionalGeneration or its inner model)")
        # a list of [h, w]: the tower and the patch merger index it per image without a host read each
        sizes = host.rows("image_sizes", 2)
        pixels = as_tower_dtype(chunk.pixel_values, inner.vision_tower)
        single = host.total("image") == 1
        if single:
            pixels, sizes = torch.cat([pixels, pixels]), sizes + sizes
        out = inner.get_image_features(pixel_values=pixels, image_sizes=sizes, return_dict=True)
        features = torch.cat(list(out.pooler_output), dim=0)
        return {"image": features[:1] if single else features}
