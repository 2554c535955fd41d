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

from typing import Any, ClassVar, Sequence

import torch
from torch import Tensor

from ..chunk import VlmMediaChunk
from .base import VlmAdapter, config_value

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
    return config_value(config, "image_token_id", "image_token_index")


def _vision_patch(config: Any) -> int:
    return config_value(config, "vision_config.patch_size")


def _view_tokens(pixels: Tensor | None, patch: int) -> int:
    return 0 if pixels is None else tokens_per_view(pixels.shape[-2], pixels.shape[-1], patch)


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

    :meth:`merge` derives the per-image crop counts from ``input_ids``: the samples with placeholder
    tokens are the image-bearing ones, and their ``num_patches`` entries, in order, are the per-image
    counts. It reads them in the same single host read as the count check.
    """

    name: ClassVar[str] = "step3"
    model_types: ClassVar[tuple[str, ...]] = ("step3_vl", "step3p7")
    layout: ClassVar[str] = (
        "one global image per sample [images, C, H, W] plus crop patches [patches, C, h, w] counted "
        "per sample (num_patches [batch]), newline mask [patches]"
    )

    # -- token side -------------------------------------------------------------------------
    def media_per_sample(self, input_ids: Tensor, config: Any) -> tuple[Tensor, Tensor]:
        """1 for a sample with any ``<im_patch>`` token, else 0 (a Step3 sample holds at most one image)."""
        images = (input_ids == _image_token_id(config)).any(dim=-1).to(torch.int64)
        return images, torch.zeros_like(images)

    def placeholder_masks(self, input_ids: Tensor, config: Any) -> dict[str, Tensor]:
        return {"image": input_ids == _image_token_id(config)}

    # -- media side -------------------------------------------------------------------------
    def feature_counts(self, chunk: VlmMediaChunk, config: Any) -> dict[str, int]:
        """``crops * tokens_per_crop + images * tokens_per_global``, from shapes only.

        The ``<patch_newline>`` tokens are text, not placeholders, so they are not counted.
        """
        patch = _vision_patch(config)
        count = 0
        if chunk.pixel_values is not None:
            count += chunk.pixel_values.shape[0] * _view_tokens(chunk.pixel_values, patch)
        if chunk.patch_pixel_values is not None:
            count += chunk.patch_pixel_values.shape[0] * _view_tokens(chunk.patch_pixel_values, patch)
        return {"image": count}

    def encode(
        self,
        model: torch.nn.Module,
        chunk: VlmMediaChunk,
        num_local_patches: Sequence[int] | None = None,
    ) -> dict[str, Tensor]:
        """Run ``model.model.get_image_features`` on the chunk.

        Args:
            model: the ``...ForConditionalGeneration`` model.
            chunk: the microbatch's media.
            num_local_patches: crops per IMAGE. When omitted it is taken from ``chunk.num_patches``,
                which only works when it needs no ``input_ids``: no crops at all, or every sample of the
                microbatch holds an image. :meth:`merge` always passes it.

        Returns:
            ``{"image": [tokens, text_hidden]}``, or ``{}`` when the chunk has no image.

        Raises:
            ValueError: crops without global views; per-image counts that do not match the chunk's
                shapes; or per-image counts that cannot be derived without ``input_ids``.
        """
        globals_ = chunk.pixel_values
        crops = chunk.patch_pixel_values
        if globals_ is None:
            if crops is not None:
                raise ValueError(
                    f"the chunk has {crops.shape[0]} crop patches but no global views (pixel_values)"
                )
            return {}
        images = globals_.shape[0]
        patches = 0 if crops is None else crops.shape[0]
        if num_local_patches is None:
            num_local_patches = self._crops_per_image_from_chunk(chunk, images, patches)
        num_local_patches = [int(n) for n in num_local_patches]
        if len(num_local_patches) != images or sum(num_local_patches) != patches:
            raise ValueError(
                f"num_local_patches {num_local_patches} (per image) does not fit the chunk's {images} "
                f"global views and {patches} crop patches"
            )
        output = model.model.get_image_features(  # type: ignore[union-attr,operator]
            pixel_values=globals_,
            pixel_values_local=crops,
            num_local_patches=num_local_patches,
            return_dict=True,
        )
        return {"image": torch.cat(list(output.pooler_output), dim=0)}

    @staticmethod
    def _crops_per_image_from_chunk(chunk: VlmMediaChunk, images: int, patches: int) -> list[int]:
        if patches == 0:
            return [0] * images
        per_sample = chunk.num_patches
        if per_sample is not None and per_sample.shape[0] == images:
            return per_sample.tolist()  # every sample holds an image: per sample == per image
        raise ValueError(
            f"cannot map num_patches (per sample, {None if per_sample is None else per_sample.shape[0]} "
            f"samples) to the chunk's {images} images without input_ids: pass num_local_patches per "
            f"image, or call merge()"
        )

    # -- first stage ------------------------------------------------------------------------
    def merge(
        self,
        model: torch.nn.Module,
        input_ids: Tensor,
        inputs_embeds: Tensor,
        chunk: VlmMediaChunk | None,
    ) -> Tensor:
        """Scatter the chunk's image features into the ``<im_patch>`` positions (see the base class).

        Besides the base class's total check, every sample's placeholder count must equal
        ``num_patches[s] * tokens_per_crop + tokens_per_global`` (or 0 for a text-only sample). All
        counts come from one host read, done before the encoder runs.
        """
        if chunk is None:
            return super().merge(model, input_ids, inputs_embeds, None)
        config = model.config
        mask = self.placeholder_masks(input_ids, config)["image"]
        expected = self.feature_counts(chunk, config)["image"]
        per_image = self._check_and_split(chunk, mask, expected, _vision_patch(config))
        if not per_image:
            return inputs_embeds  # no image in this microbatch (e.g. only num_patches zeros staged)
        return self.scatter(inputs_embeds, {"image": mask}, self.encode(model, chunk, num_local_patches=per_image))

    @staticmethod
    def _check_and_split(chunk: VlmMediaChunk, mask: Tensor, expected: int, patch: int) -> list[int]:
        """Check the chunk against the placeholders; return the crops per image, in image order."""
        batch = mask.shape[0]
        crops = chunk.num_patches
        if crops is None:
            crops = torch.zeros(batch, dtype=torch.int64, device=mask.device)
        elif tuple(crops.shape) != (batch,):
            raise ValueError(
                f"num_patches has shape {tuple(crops.shape)} but the microbatch has {batch} samples"
            )
        # The one host read of the microbatch: placeholders and crops of every sample.
        placeholders, crops_list = torch.stack(
            [mask.sum(dim=-1).to(torch.int64), crops.to(device=mask.device, dtype=torch.int64)]
        ).tolist()
        total = sum(placeholders)
        if total != expected:
            raise ValueError(
                f"image: the microbatch has {total} placeholder tokens but its media give {expected} "
                f"feature rows"
            )
        images = 0 if chunk.pixel_values is None else chunk.pixel_values.shape[0]
        patches = 0 if chunk.patch_pixel_values is None else chunk.patch_pixel_values.shape[0]
        has_image = [n > 0 for n in placeholders]
        if sum(has_image) != images:
            raise ValueError(
                f"image: {sum(has_image)} samples have placeholder tokens but the chunk has {images} "
                f"global views (one image per sample)"
            )
        if sum(crops_list) != patches:
            raise ValueError(
                f"image: num_patches sums to {sum(crops_list)} but the chunk has {patches} crop patches"
            )
        per_crop = _view_tokens(chunk.patch_pixel_values, patch)
        per_global = _view_tokens(chunk.pixel_values, patch)
        for s, (n_placeholders, n_crops, holds) in enumerate(zip(placeholders, crops_list, has_image)):
            want = n_crops * per_crop + (per_global if holds else 0)
            if n_placeholders != want:
                raise ValueError(
                    f"image: sample {s} of the microbatch has {n_placeholders} placeholder tokens but "
                    f"its {n_crops} crops and {int(holds)} global view give {want} feature rows"
                )
        return [n for n, holds in zip(crops_list, has_image) if holds]
