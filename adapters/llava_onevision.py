"""LLaVA-OneVision (``llava_onevision``): LLaVA-NeXT crops with per-sample tiling, and videos without a grid.

Media layout of a chunk:

* ``chunk.pixel_values``: the processor's padded crops ``[images, max_crops, C, H, W]`` (crops past an
  image's own count are padding), or the crops flattened ``[crops, C, H, W]``; core layout
  ``images_with_sizes``.
* ``chunk.image_grid``: ``image_sizes`` ``[images, 2]``, each image's original (height, width).
* ``chunk.pixel_values_videos``: ``[videos, frames, C, H, W]``, no grid (layout ``onevision_videos``
  of :mod:`ppmedia.adapters.media_layouts`).
* ``chunk.extras["batch_num_images"]``: ``[b]`` images of each sample of the microbatch (a per-sample
  input, :class:`~ppmedia.adapters.base.SampleInput`), staged when the batch holds ``batch_num_images``.

``batch_num_images``: ``LlavaOnevisionImageProcessor`` writes ONE ENTRY PER SAMPLE THAT HOLDS IMAGES
(text-only samples are skipped), not one per sample of the batch. :meth:`LlavaOnevisionAdapter.media_counts`
turns it into ``[B]`` (zeros for samples without image tokens; a ``[B]`` value with those zeros is
taken as it is), which then counts each sample's images exactly and is split with the samples. The
model tiles an image (base crop + anyres grid, as LLaVA-NeXT) only when its sample holds exactly one
image; the images of a several-image sample keep their base crop only. Without ``batch_num_images``
every image is tiled, as in the model.

Token counts, all from the sizes and the config, as the model computes them: with ``P = image_size //
patch_size`` feature rows per crop side, a base-only image gives ``P * P + 1`` tokens (one newline); a
tiled image gives ``P * P`` base rows plus its grid feature map (``grid_h * P x grid_w * P``,
letterbox padding removed: ``rows x cols``), bilinearly downsampled to ``int(rows // r) x int(cols // r)``
when ``r = sqrt(rows * cols / (max * P * P)) > 1.1`` (``vision_aspect_ratio = "anyres_max_<max>"``),
each row ending in one newline. A video of ``F`` frames gives ``F * ceil(P / 2) ** 2 + 1`` tokens.

Videos and images in one sample, several images back to back (one run of image tokens) and text-only
microbatches are all handled. A crop gives ``P * P`` feature rows with the released SigLIP towers and
``vision_feature_select_strategy = "full"`` (CLIP: ``"default"``, which drops the CLS row); any other
combination is refused for tiled images and videos (the model's own ``pack_image_features`` /
``apply_pooling`` cannot reshape the rows), a base-only image then gives those rows plus one newline.
The video processor (``LlavaOnevisionVideoProcessor``) needs torchvision; the image processor has a
``LlavaOnevisionImageProcessorPil`` class that runs without it.
"""

from __future__ import annotations

import functools
import math
from typing import Any, ClassVar, Mapping

import torch
from torch import Tensor

from ..chunk import VlmMediaChunk
from ..producer.hostreads import HostReader
from ._helpers import anyres_geometry, as_tower_dtype, count_runs, images_from_runs, shape
from .base import HostValues, SampleInput, VlmAdapter, config_get, config_value, inner_model

__all__ = ["LlavaOnevisionAdapter", "image_crops", "image_tokens", "video_tokens"]

_COUNTS = "batch_num_images"

#: (crop side in pixels, P = feature rows per crop side, pinpoints, anyres max, feature rows a crop gives)
_Geometry = tuple[int, int, tuple[tuple[int, int], ...], int, int]

#: vision towers with a CLS position in front of the patches (SigLIP, the released towers, has none).
_CLS_TOWERS = frozenset({"clip_vision_model"})


def _geometry(config: Any) -> _Geometry:
    crop, side, pinpoints = anyres_geometry(config, "LLaVA-OneVision")
    aspect = str(config_get(config, "vision_aspect_ratio") or "anyres_max_9")
    positions = side * side + (1 if config_get(config_get(config, "vision_config"), "model_type") in _CLS_TOWERS else 0)
    kept = positions - (1 if (config_get(config, "vision_feature_select_strategy") or "default") == "default" else 0)
    return crop, side, pinpoints, int(aspect.strip("anyres_max_")), kept


@functools.lru_cache(maxsize=1 << 16)
def _tiled(height: int, width: int, geometry: _Geometry) -> tuple[int, int]:
    """(crops, tokens) of an image the model tiles; cached (a dataset has few distinct sizes)."""
    from transformers.models.llava_onevision.modeling_llava_onevision import (
        get_anyres_image_grid_shape,
        image_size_to_num_patches,
    )

    crop, side, pinpoints, max_patches, _ = geometry  # P * P rows a crop: checked by the callers
    points = [list(p) for p in pinpoints]
    crops = int(image_size_to_num_patches([height, width], points, crop))
    grid_h, grid_w = get_anyres_image_grid_shape([height, width], points, crop)
    rows, cols = grid_h * side, grid_w * side
    if width / height > cols / rows:  # unpad_image's arithmetic, on Python floats as the model does it
        rows -= 2 * ((rows - int(round(height * (cols / width), 7))) // 2)
    else:
        cols -= 2 * ((cols - int(round(width * (rows / height), 7))) // 2)
    ratio = math.sqrt(rows * cols / (max_patches * side**2))
    if ratio > 1.1:  # the model's bilinear downsampling
        rows, cols = int(rows // ratio), int(cols // ratio)
    return crops, side * side + rows * (cols + 1)


def image_crops(height: int, width: int, config: Any, *, tiled: bool = True) -> int:
    """Crops the model takes of an image of original size ``(height, width)``: ``1 + grid`` when tiled
    (its sample holds one image), else 1 (the base crop)."""
    return _tiled(int(height), int(width), _geometry(config))[0] if tiled else 1


def image_tokens(height: int, width: int, config: Any, *, tiled: bool = True) -> int:
    """Placeholder tokens of one image of original size ``(height, width)`` (see the module docstring).

    Raises:
        ValueError: a tiled image whose crops do not give ``P x P`` feature rows (a CLS row kept, or a
            patch dropped: the model cannot pack it).
    """
    geometry = _geometry(config)
    if not tiled:
        return geometry[4] + 1
    _check_square(geometry, "a tiled image", "pack_image_features")
    return _tiled(int(height), int(width), geometry)[1]


def _check_square(geometry: _Geometry, what: str, where: str) -> None:
    side, kept = geometry[1], geometry[4]
    if kept != side * side:
        raise ValueError(
            f"llava_onevision: {what} needs {side} x {side} feature rows a crop, but the tower and "
            f"vision_feature_select_strategy keep {kept} (a CLS row kept with 'full' on a CLIP tower, or a patch "
            f"dropped with 'default' on SigLIP); the model's {where} cannot reshape them"
        )


def video_tokens(frames: int, config: Any) -> int:
    """Placeholder tokens of one video of ``frames`` frames: ``frames * ceil(P / 2) ** 2 + 1``.

    Raises:
        ValueError: frames that do not give ``P x P`` feature rows (the model's pooling cannot reshape them).
    """
    geometry = _geometry(config)
    _check_square(geometry, "a video frame", "apply_pooling")
    return int(frames) * math.ceil(geometry[1] / 2) ** 2 + 1


def _ids(config: Any) -> tuple[int, int]:
    image = config_value(config, "image_token_index", "image_token_id")
    video = config_value(config, "video_token_index", "video_token_id")
    return int(image), int(video)


class LlavaOnevisionAdapter(VlmAdapter):
    """LLaVA-OneVision adapter (``LlavaOnevisionForConditionalGeneration``).

    Module paths used: ``model.model.get_image_features(pixel_values, image_sizes, batch_num_images=)``
    and ``model.model.get_video_features(pixel_values_videos)`` (``model.get_...`` on the inner
    ``LlavaOnevisionModel``), which read ``vision_feature_layer``, ``vision_feature_select_strategy``
    and ``vision_aspect_ratio`` from the config; config fields ``image_token_index``,
    ``video_token_index``, ``image_grid_pinpoints``, ``vision_config.image_size`` / ``patch_size``.
    """

    name: ClassVar[str] = "llava_onevision"
    model_types: ClassVar[tuple[str, ...]] = ("llava_onevision",)
    layout: ClassVar[str] = (
        "padded crops [images, max_crops, C, H, W] + image_sizes [images, 2] (+ batch_num_images: one-image "
        "samples tiled, others base crop only); videos [videos, frames, C, H, W], no grid"
    )
    sample_inputs: ClassVar[tuple[SampleInput, ...]] = (SampleInput(_COUNTS),)
    packing_refusal: ClassVar[str | None] = (
        "the model tiles an image only when its sample holds exactly one image (batch_num_images, one entry "
        "per sample): samples packed into one row would read as one several-image sample, their images "
        "encoded as base crops only, other features and token counts than alone"
    )

    # -- token side -------------------------------------------------------------------------
    def media_per_sample(
        self, input_ids: Tensor, config: Any, *, media: Mapping[str, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Images per sample from ``media["batch_num_images"]`` when given (one host read checks it),
        else from the runs of image tokens split by the images' tiled token counts
        (``media["image_sizes"]``, one host read), else one image per run. Videos: video tokens
        divided by one video's tokens (``media["pixel_values_videos"]`` gives the frames; device ops
        only, a remainder counts one video more, which the split refuses), else one per run.

        Raises:
            ValueError: ``batch_num_images`` that does not fit the samples holding image tokens, or
                image runs that the sizes do not fill (named, with the way out).
        """
        image, video = _ids(config)
        counts = None if media is None else media.get(_COUNTS)
        sizes = None if media is None else media.get("image_sizes")
        if counts is not None:
            images = self.per_sample_images(input_ids, config, counts)
        elif sizes is not None:
            if not isinstance(sizes, Tensor) or sizes.dim() != 2 or sizes.shape[-1] != 2:
                raise ValueError(f"image_sizes: shape {shape(sizes if isinstance(sizes, Tensor) else None)}; expected [images, 2]")

            def tokens(flat: list[int]) -> list[int]:
                return [image_tokens(h, w, config) for h, w in zip(flat[0::2], flat[1::2])]

            images = images_from_runs(input_ids == image, sizes, tokens, token="input_ids", metadata="image_sizes")
        else:
            images = count_runs(input_ids == image)
        videos_px = None if media is None else media.get("pixel_values_videos")
        if isinstance(videos_px, Tensor) and videos_px.dim() == 5:
            per = video_tokens(videos_px.shape[1], config)
            tokens_v = (input_ids == video).sum(dim=-1, dtype=torch.int64)
            videos = torch.div(tokens_v + per - 1, per, rounding_mode="floor")
        else:
            videos = count_runs(input_ids == video)
        return images, videos

    def per_sample_images(self, input_ids: Tensor, config: Any, batch_num_images: Any) -> Tensor:
        """``[B]`` int64 images per sample from the processor's ``batch_num_images``: one entry per
        sample holding image tokens (scattered to those samples), or one per sample (taken as is).
        One host read (the holders and the counts together).

        Raises:
            TypeError: not an integer tensor.
            ValueError: the wrong number of entries, a holder given 0 images, or images given to a
                sample without image tokens (sample named).
        """
        if isinstance(batch_num_images, (list, tuple)) and all(type(n) is int for n in batch_num_images):
            batch_num_images = torch.tensor(batch_num_images, dtype=torch.int64)  # the processor without return_tensors
        if not isinstance(batch_num_images, Tensor) or batch_num_images.dim() != 1:
            seen = shape(batch_num_images) if isinstance(batch_num_images, Tensor) else type(batch_num_images).__name__
            raise ValueError(f"{_COUNTS}: {seen}; expected a [samples holding images] (or [B]) integer tensor")
        if batch_num_images.dtype.is_floating_point or batch_num_images.dtype in (torch.bool, torch.complex64, torch.complex128):
            raise TypeError(f"{_COUNTS}: dtype {batch_num_images.dtype}; expected an integer dtype")
        holders = (input_ids == _ids(config)[0]).any(dim=-1)
        reader = HostReader()
        slots = reader.add(holders.to(torch.int64)), reader.add(batch_num_images)
        reader.read()  # the one host read of the counting
        held, given = reader.values[slots[0]].tolist(), reader.values[slots[1]].tolist()
        B, n_held = len(held), sum(held)
        if len(given) == n_held:
            per = iter(given)
            values = [next(per) if h else 0 for h in held]
        elif len(given) == B:
            values = given
        else:
            raise ValueError(
                f"{_COUNTS}: shape [{len(given)}]; expected [{n_held}] (one entry per sample holding image tokens, as "
                f"the processor writes it) or [{B}] (one per sample)"
            )
        for sample, (h, n) in enumerate(zip(held, values)):
            if n < 0 or bool(h) != (n > 0):
                raise ValueError(
                    f"{_COUNTS}: sample {sample} is given {n} images but {'holds' if h else 'has no'} image tokens; "
                    f"expected >= 1 for a sample holding image tokens, 0 otherwise (values {given})"
                )
        return torch.tensor(values, dtype=torch.int64).to(input_ids.device)

    def media_counts(self, batch: Mapping[str, Any], config: Any) -> dict[str, Any]:
        """Counts for :func:`ppmedia.split_media` (those the batch holds left out), and ``batch_num_images``
        as ``[B]`` to stage with the samples (counted once, at most one host read)."""
        media = dict(batch)
        if batch.get(_COUNTS) is None and batch.get("n_images_per_sample") is not None:
            media.pop("image_sizes", None)  # the batch counts its images: no runs to split
        images, videos = self.media_per_sample(batch["input_ids"], config, media=media)
        counts: dict[str, Any] = {"images_per_sample": images, "videos_per_sample": videos}
        for key, arg in (("n_images_per_sample", "images_per_sample"), ("n_videos_per_sample", "videos_per_sample")):
            if batch.get(key) is not None:
                del counts[arg]
        if batch.get(_COUNTS) is not None:
            counts["sample_inputs"] = {_COUNTS: images}
        return counts

    def sample_input_values(self, batch: Mapping[str, Any], config: Any) -> dict[str, Tensor | None]:
        """``{"batch_num_images": [B]}`` (:meth:`per_sample_images`) when the batch holds it, else ``{}``."""
        if batch.get(_COUNTS) is None:
            return {}
        return {_COUNTS: self.per_sample_images(batch["input_ids"], config, batch[_COUNTS])}

    def placeholder_masks(self, input_ids: Tensor, config: Any) -> dict[str, Tensor]:
        image, video = _ids(config)
        return {"image": input_ids == image, "video": input_ids == video}

    # -- media side -------------------------------------------------------------------------
    def host_inputs(self, chunk: VlmMediaChunk, config: Any) -> dict[str, Tensor]:
        """``image_sizes`` and the microbatch's ``batch_num_images`` (when staged), after checking shapes.

        Raises:
            ValueError: pixels without sizes (or sizes without pixels), sizes not ``[images, 2]``,
                padded crops whose image count differs from the sizes', videos not ``[videos, frames, C, H, W]``.
        """
        pixels, sizes, videos = chunk.pixel_values, chunk.image_grid, chunk.pixel_values_videos
        if chunk.video_grid is not None:
            raise ValueError(f"llava_onevision videos have no grid, but the chunk carries video_grid {shape(chunk.video_grid)}")
        if videos is not None and videos.dim() != 5:
            raise ValueError(f"llava_onevision pixel_values_videos: shape {shape(videos)}; expected [videos, frames, C, H, W]")
        inputs: dict[str, Tensor] = {}
        if (pixels is None) != (sizes is None):
            missing = "pixel_values" if pixels is None else "image sizes (image_grid)"
            raise ValueError(f"llava_onevision chunk has no {missing}: pixel_values {shape(pixels)}, image_grid {shape(sizes)}")
        if pixels is not None and sizes is not None:
            if sizes.dim() != 2 or sizes.shape[-1] != 2:
                raise ValueError(f"llava_onevision image sizes (image_grid): shape {shape(sizes)}; expected [images, 2]")
            if pixels.dim() not in (4, 5) or (pixels.dim() == 5 and pixels.shape[0] != sizes.shape[0]):
                raise ValueError(
                    f"llava_onevision pixel_values: shape {shape(pixels)}; expected [{sizes.shape[0]}, max_crops, C, H, W] "
                    f"(one row per image of image_sizes {shape(sizes)}) or flat crops [crops, C, H, W]"
                )
            inputs["image_sizes"] = sizes
        counts = (chunk.extras or {}).get(_COUNTS)
        if counts is not None:
            inputs[_COUNTS] = counts
        return inputs

    def _tiling(self, host: HostValues, images: int) -> list[bool]:
        """Per image of the chunk: tiled (its sample holds one image) or base crop only."""
        counts = host.values.get(_COUNTS)
        if counts is None:
            return [True] * images
        tiling = [n == 1 for n in counts for _ in range(n)]
        if len(tiling) != images:
            raise ValueError(
                f"llava_onevision: the microbatch's {_COUNTS} {counts} count {len(tiling)} images but image_sizes "
                f"describes {images}"
            )
        return tiling

    def feature_counts(self, chunk: VlmMediaChunk, config: Any, host: HostValues) -> dict[str, int]:
        """Image tokens from the sizes and the tiling, after checking the crops the pixels hold; video
        tokens from the frames.

        Raises:
            ValueError: fewer padded crops than an image needs, flat crops that do not add up, or a
                ``batch_num_images`` that does not cover the chunk's images.
        """
        counts: dict[str, int] = {"image": 0, "video": 0}
        pixels = chunk.pixel_values
        if pixels is not None:
            sizes = host.rows("image_sizes", 2)
            tiling = self._tiling(host, len(sizes))
            for row, (h, w) in enumerate(sizes):
                if h < 1 or w < 1:
                    raise ValueError(f"image sizes (image_grid): row {row} is [{h}, {w}]; expected a height and width >= 1")
            crops = [image_crops(h, w, config, tiled=t) for (h, w), t in zip(sizes, tiling)]
            if pixels.dim() == 5 and pixels.shape[1] < max(crops, default=0):
                raise ValueError(f"llava_onevision padded crops {shape(pixels)} cannot hold {len(crops)} images of {crops} crops")
            if pixels.dim() == 4 and pixels.shape[0] != sum(crops):
                raise ValueError(
                    f"llava_onevision flat crops: pixel_values has {pixels.shape[0]} crops but the image sizes and "
                    f"{_COUNTS} imply {sum(crops)} ({crops} per image)"
                )
            counts["image"] = sum(image_tokens(h, w, config, tiled=t) for (h, w), t in zip(sizes, tiling))
        if chunk.pixel_values_videos is not None:
            videos = chunk.pixel_values_videos
            counts["video"] = videos.shape[0] * video_tokens(videos.shape[1], config)
        return counts

    def encode(self, model: torch.nn.Module, chunk: VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        """The model's own ``get_image_features`` (tower, projector, anyres packing with the tiling of
        ``batch_num_images``) and ``get_video_features`` (tower, projector, 2 x 2 pooling, newline)."""
        inner = inner_model(model, "get_image_features", "a LlavaOnevisionForConditionalGeneration or LlavaOnevisionModel")
        tower = getattr(inner, "vision_tower", None)
        out: dict[str, Tensor] = {}
        if chunk.pixel_values is not None:
            counts = host.values.get(_COUNTS)
            features = inner.get_image_features(
                as_tower_dtype(chunk.pixel_values, tower), host.rows("image_sizes", 2),
                batch_num_images=None if counts is None else [n for n in counts if n], return_dict=True,
            ).pooler_output
            out["image"] = torch.cat(list(features), dim=0)
        if chunk.pixel_values_videos is not None:
            videos = inner.get_video_features(as_tower_dtype(chunk.pixel_values_videos, tower), return_dict=True).pooler_output
            out["video"] = videos.reshape(-1, videos.shape[-1])
        return out
