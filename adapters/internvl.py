"""InternVL (``internvl``): image tiles and video frames in one ``pixel_values``, in prompt order.

Media layout of a chunk (as ``InternVLProcessor`` gives them):

* ``chunk.pixel_values`` ``[rows, C, S, S]`` at the vision tower's ``image_size`` (448 in the released
  models): an image is its tile rows (``GotOcr2ImageProcessor``'s crops, then the thumbnail: its
  ``num_patches``), a video one row per frame, images and videos interleaved in the order the prompt
  names them. ``InternVLProcessor`` merges ``pixel_values_videos`` into ``pixel_values`` this way and
  drops ``num_patches``.
* ``chunk.image_grid``: unused (``None``).

Every row gives ``image_seq_length = (S / patch)^2 * downsample_ratio^2`` features (256 in the released
models), one per ``<IMG_CONTEXT>`` token; an image is one ``<img> ... </img>`` block of ``256 * tiles``
tokens and a video one such block of 256 per frame, all with the image token. Rows therefore map to
samples in prompt order by their placeholder tokens: a sample's rows are its image tokens / 256
(:meth:`InternVLAdapter.media_per_sample`), and the batch splits with ppmedia's plain ``images``
layout, one row per tile or frame. Videos are "images" to ppmedia here, as they are to the model.

A batch straight from ``GotOcr2ImageProcessor`` (not the processor) still holds ``num_patches``
``[images]``: :meth:`InternVLAdapter.media_counts` checks it against the tokens and refuses it with
the way out (leave it out: the tokens say the same).
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

from torch import Tensor

from ..chunk import VlmMediaChunk
from ._helpers import ImageRowsAdapter, check_image_rows, refuse_grid, refuse_videos
from .base import HostValues, config_get, config_value

__all__ = ["InternVLAdapter", "tokens_per_row"]

def _pair(value: Any) -> tuple[int, int]:
    if isinstance(value, (list, tuple)):
        return int(value[0]), int(value[1])
    return int(value), int(value)


def tokens_per_row(config: Any) -> int:
    """Features of one tile or frame: ``(H / patch_h) * (W / patch_w) * downsample_ratio^2``.

    Raises:
        ValueError: a select strategy other than ``"default"`` (the CLS position would leave a feature
            map the pixel shuffle cannot fold), or a grid that does not shuffle into whole tokens.
    """
    vision = config_value(config, "vision_config")
    (h, w), (ph, pw) = _pair(config_value(vision, "image_size")), _pair(config_value(vision, "patch_size"))
    strategy = config_get(config, "vision_feature_select_strategy") or "default"
    if strategy != "default":
        raise ValueError(f"internvl vision_feature_select_strategy {strategy!r}; expected 'default' (the CLS dropped)")
    ratio = float(config_value(config, "downsample_ratio"))
    tokens = (h // ph) * (w // pw) * ratio * ratio
    if tokens != int(tokens) or tokens < 1:
        raise ValueError(f"internvl: {h // ph} x {w // pw} patches with downsample_ratio {ratio} give {tokens} tokens per row")
    return int(tokens)


class InternVLAdapter(ImageRowsAdapter):
    """InternVL adapter (``InternVLForConditionalGeneration``): InternVL 2.5 / 3 / 3.5 in transformers' format.

    Module path: ``model.model.get_image_features(pixel_values, vision_feature_layer=,
    vision_feature_select_strategy=)`` (vision tower, pixel shuffle, projector); config fields
    ``image_token_id``, ``downsample_ratio``, ``vision_feature_layer``,
    ``vision_feature_select_strategy``, ``vision_config.image_size`` / ``patch_size`` / ``num_channels``.
    """

    name: ClassVar[str] = "internvl"
    model_types: ClassVar[tuple[str, ...]] = ("internvl",)
    layout: ClassVar[str] = (
        "rows [rows, C, S, S]: image tiles and video frames interleaved in prompt order, "
        "image_seq_length image tokens per row; no grid"
    )
    image_token_fields: ClassVar[tuple[str, ...]] = ("image_token_id", "image_token_index")
    expected_model: ClassVar[str] = "an InternVLForConditionalGeneration or InternVLModel"

    def tokens_per_row(self, config: Any) -> int:
        """:func:`tokens_per_row`: a row is a tile or a video frame (videos are rows of ``pixel_values``)."""
        return tokens_per_row(config)

    # -- token side -------------------------------------------------------------------------
    def media_counts(self, batch: Mapping[str, Any], config: Any) -> dict[str, Any]:
        """:meth:`VlmAdapter.media_counts`, after refusing an image processor's ``num_patches``.

        Raises:
            ValueError: the batch holds ``num_patches`` (``GotOcr2ImageProcessor``'s tiles per image,
                which ``split_media`` would take for Step3's per-sample crop counts): leave it out.
        """
        tiles = batch.get("num_patches")
        if tiles is not None:
            per_sample = self.media_per_sample(batch["input_ids"], config)[0].tolist()  # error path only
            given = tiles.tolist() if isinstance(tiles, Tensor) else list(tiles)
            raise ValueError(
                f"internvl: the batch holds num_patches {given} (the image processor's tiles per image); ppmedia reads "
                f"the rows of pixel_values per sample (tiles and video frames, in prompt order) from the image tokens, "
                f"{per_sample} here, as InternVLProcessor does when it drops num_patches: remove num_patches from the "
                f"batch (or split with n_images_per_sample = rows per sample)"
            )
        return super().media_counts(batch, config)

    # -- media side -------------------------------------------------------------------------
    def feature_counts(self, chunk: VlmMediaChunk, config: Any, host: HostValues) -> dict[str, int]:
        """``{"image": rows * image_seq_length}``, from shapes only.

        Raises:
            ValueError: separate videos or a grid in the chunk (InternVL's frames are rows of
                ``pixel_values``), or ``pixel_values`` not ``[rows, C, H, W]`` at the tower's size.
            TypeError: ``pixel_values`` not floating point.
        """
        refuse_videos(chunk, self.name)
        refuse_grid(chunk, self.name, "per-image metadata")
        pixels = chunk.pixel_values
        if pixels is None:
            return {"image": 0}
        vision = config_value(config, "vision_config")
        h, w = _pair(config_value(vision, "image_size"))
        channels = int(config_get(vision, "num_channels") or 3)
        check_image_rows(pixels, self.name, channels, h, w, rows="rows", note="tiles and frames at vision_config.image_size")
        return {"image": pixels.shape[0] * tokens_per_row(config)}
