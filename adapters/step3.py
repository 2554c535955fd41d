"""Step3 family adapter (``step3_vl`` remote-code checkpoints, transformers' ``step3p7``).

Media layout of a chunk:

* ``pixel_values`` ``[images, C, H, W]``: one global view per image, in sample order; a sample holds
  at most one image;
* ``patch_pixel_values`` ``[patches, C, h, w]``: the local crops of those images, concatenated in
  image order (``None`` when no image of the microbatch has crops);
* ``num_patches`` ``[b]``: crops per SAMPLE. 0 both for a text-only sample and for an image without
  crops, so the per-image counts the model wants cannot be told from this tensor alone;
* ``patch_newline_mask`` ``[patches]``: the crops that end a row of the crop grid. The model never
  reads it: the processor writes a ``<patch_newline>`` text token after each such crop, an ordinary
  token that gets its text embedding. It changes the token layout, not the feature count, so this
  adapter ignores it.

Features of one image are its crops (``tokens_per_crop`` rows each, crop order) followed by its
global view (``tokens_per_global`` rows); each scatters into that image's ``image_token_id``
placeholders in order.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch
from torch import Tensor

from ..chunk import VlmMediaChunk
from ._helpers import refuse_videos, shape, tower_dtype
from .base import HostValues, VlmAdapter, config_get, config_value, inner_model

__all__ = ["Step3Adapter", "tokens_per_view"]

#: stride-2 (kernel 3, padding 1) convolutions after the ViT: Step3's ``downsampler1``/``downsampler2``.
_DOWNSAMPLE_STEPS = 2


def tokens_per_view(height: int, width: int, vision_patch: int) -> int:
    """Feature rows one view of ``height`` x ``width`` pixels gives (ViT patch grid, halved twice, rounding up)."""
    rows, cols = height // vision_patch, width // vision_patch
    for _ in range(_DOWNSAMPLE_STEPS):
        rows, cols = (rows + 1) // 2, (cols + 1) // 2
    return rows * cols


def _image_token_id(config: Any) -> int:
    return int(config_value(config, "image_token_id", "image_token_index"))


def _vision_patch(config: Any) -> int:
    patch = config_get(config_get(config, "vision_config"), "patch_size")
    if patch is None:
        raise AttributeError(f"{type(config).__name__} has no vision_config.patch_size")
    return int(patch)


def _view_tokens(pixels: Tensor | None, patch: int) -> int:
    return 0 if pixels is None else tokens_per_view(pixels.shape[-2], pixels.shape[-1], patch)


def _views(pixels: Tensor | None) -> int:
    return 0 if pixels is None else int(pixels.shape[0])


class Step3Adapter(VlmAdapter):
    """Step3: one global view per image-bearing sample plus its local crops, crops counted per sample.

    Module paths expected on ``model`` (transformers' ``Step3p7ForConditionalGeneration`` has them; a
    remote-code ``step3_vl`` model must be wrapped to expose the same):

    * ``model.config.image_token_id`` (or ``image_token_index``): the ``<im_patch>`` placeholder id;
    * ``model.config.vision_config.patch_size``: the ViT patch size; the tower then halves the patch
      grid twice (two stride-2 convolutions), so a view gives ``ceil(ceil(H/p)/2)/2`` rows times the
      same for the width (169 for Step3's 728 px global view, 81 for a 504 px crop);
    * ``model.model.get_image_features(pixel_values=, pixel_values_local=, num_local_patches=)`` with
      ``num_local_patches`` per IMAGE, returning an output whose ``pooler_output`` holds one
      ``[crops_i * tokens_per_crop + tokens_per_global, text_hidden]`` tensor per image, crops first.

    The per-image crop counts come from ``input_ids``: the samples with placeholder tokens are the
    image-bearing ones, and their ``num_patches`` entries, in order, are the per-image counts.
    :meth:`host_inputs` asks for ``num_patches``, so merge reads it in its one host read together with
    the per-sample placeholder counts; :meth:`feature_counts` checks every sample.
    """

    name: ClassVar[str] = "step3"
    model_types: ClassVar[tuple[str, ...]] = ("step3_vl", "step3p7")
    layout: ClassVar[str] = (
        "one global image per sample [images, C, H, W] plus crop patches [patches, C, h, w] counted "
        "per sample (num_patches [batch]), newline mask [patches]"
    )
    packing_refusal: ClassVar[str | None] = (
        "its crops are counted per sample (num_patches [samples]) and a sample holds at most one image: a "
        "packed row of several image-bearing samples has neither one count nor one image"
    )

    # -- token side -------------------------------------------------------------------------
    def media_per_sample(
        self, input_ids: Tensor, config: Any, *, media: Mapping[str, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """1 for a sample with any ``<im_patch>`` token, else 0 (a Step3 sample holds at most one
        image); no videos. Device ops only; ``media`` is not needed."""
        images = (input_ids == _image_token_id(config)).any(dim=-1).to(torch.int64)
        return images, torch.zeros_like(images)

    def placeholder_masks(self, input_ids: Tensor, config: Any) -> dict[str, Tensor]:
        return {"image": input_ids == _image_token_id(config)}

    # -- media side -------------------------------------------------------------------------
    def host_inputs(self, chunk: VlmMediaChunk, config: Any) -> dict[str, Tensor]:
        """``{"num_patches": [b]}`` when staged (crops per sample).

        Raises:
            ValueError: the chunk carries videos, crops without global views, or ``num_patches`` that
                is not 1-D.
        """
        refuse_videos(chunk, "step3")
        if chunk.pixel_values is None and chunk.patch_pixel_values is not None:
            raise ValueError(
                f"the chunk has crop patches {shape(chunk.patch_pixel_values)} but no global views (pixel_values)"
            )
        if chunk.num_patches is None:
            return {}
        if chunk.num_patches.dim() != 1:
            raise ValueError(f"num_patches: shape {shape(chunk.num_patches)}; expected [b], crops per sample")
        return {"num_patches": chunk.num_patches}

    def feature_counts(self, chunk: VlmMediaChunk, config: Any, host: HostValues) -> dict[str, int]:
        """``crops * tokens_per_crop + images * tokens_per_global`` (shapes), after checking every
        sample: its placeholders must be ``num_patches[s] * tokens_per_crop + tokens_per_global``, or 0
        for a text-only sample. The ``<patch_newline>`` tokens are text, not placeholders.

        Raises:
            ValueError: ``num_patches`` of another length than the microbatch, crops that do not add
                up, a number of image-bearing samples other than the global views, or a sample whose
                placeholders its crops and view do not fill (sample named).
        """
        patch = _vision_patch(config)
        per_crop = _view_tokens(chunk.patch_pixel_values, patch)
        per_global = _view_tokens(chunk.pixel_values, patch)
        images, patches = _views(chunk.pixel_values), _views(chunk.patch_pixel_values)
        total = images * per_global + patches * per_crop
        if total != host.total("image"):
            return {"image": total}  # check_counts reports the totals
        placeholders = host.placeholders["image"]
        crops = _crops_per_sample(chunk, host, len(placeholders))
        has_image = [n > 0 for n in placeholders]
        if sum(has_image) != images:
            raise ValueError(
                f"image: {sum(has_image)} samples have placeholder tokens (per sample: {placeholders}) but "
                f"the chunk has {images} global views (one image per sample)"
            )
        if sum(crops) != patches:
            raise ValueError(f"num_patches: {crops} sums to {sum(crops)} but the chunk has {patches} crop patches")
        for s, (n_placeholders, n_crops, holds) in enumerate(zip(placeholders, crops, has_image)):
            want = n_crops * per_crop + (per_global if holds else 0)
            if n_placeholders != want:
                raise ValueError(
                    f"image: sample {s} of the microbatch has {n_placeholders} placeholder tokens but "
                    f"its {n_crops} crops and {int(holds)} global view give {want} feature rows"
                )
        return {"image": total}

    def encode(self, model: torch.nn.Module, chunk: VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        """``model.model.get_image_features`` on the chunk, with ``num_local_patches`` per IMAGE: the
        ``num_patches`` entries of the samples that hold placeholders (from ``host``).

        Returns:
            ``{"image": [tokens, text_hidden]}``, or ``{}`` when the chunk has no image.
        """
        views = chunk.pixel_values
        if views is None:
            return {}
        placeholders = host.placeholders["image"]
        crops = _crops_per_sample(chunk, host, len(placeholders))
        per_image = [c for c, n in zip(crops, placeholders) if n > 0]
        inner = inner_model(model, "get_image_features", "a Step3p7ForConditionalGeneration or its inner model")
        crops_pixels = chunk.patch_pixel_values
        dtype = tower_dtype(getattr(inner, "vision_model", None))
        if dtype is not None:
            views = views.to(dtype)
            crops_pixels = None if crops_pixels is None else crops_pixels.to(dtype)
        output = inner.get_image_features(
            pixel_values=views,
            pixel_values_local=crops_pixels,
            num_local_patches=per_image,
            return_dict=True,
        )
        return {"image": torch.cat(output.pooler_output, dim=0)}


def _crops_per_sample(chunk: VlmMediaChunk, host: HostValues, batch: int) -> list[int]:
    """``num_patches`` as read by merge (zeros when not staged), checked against the microbatch size."""
    values = host.values.get("num_patches")
    if values is None:
        return [0] * batch
    if len(values) != batch:
        raise ValueError(
            f"num_patches: shape {shape(chunk.num_patches)} but the microbatch has {batch} samples; "
            f"expected [{batch}]"
        )
    return values
