"""Phi-4-multimodal (``phi4_multimodal``): padded image crops and audio features, with both encoders and
the merge INSIDE the decoder stack (``model.model.embed_tokens_extend``).

Media layout of a chunk (what ``Phi4MultimodalProcessor`` returns, split per microbatch; the batch keys
are the processor's, :data:`ppmedia.adapters.media_layouts.PHI4_IMAGES` / ``PHI4_AUDIO``):

* ``image_pixel_values`` ``[images, max_crops, 3, S, S]`` (staged as ``pixel_values``): per image its
  global view, then its ``h/S x w/S`` sub-crops row by row, then zero crops up to the batch's most;
  ``image_sizes`` ``[images, 2]`` (``image_grid``: the resized, padded ``(h, w)``, multiples of ``S``);
  ``image_attention_mask`` ``[images, max_crops, S/p, S/p]`` (``chunk.extras``: real patches, the
  image's right and bottom padding zero). An image gives ``u_h * (u_w + 1) + 1 + b * (b + 1)`` tokens:
  its sub-crops' ``u_h x u_w`` useful features (after 2 x 2 pooling) with one separator column per row,
  one separator, the global view's ``b x b`` features (``b = S/p/2``) with one per row.
* ``audio_input_features`` ``[audios, T, mel]`` (staged as ``input_features``) with
  ``audio_attention_mask`` ``[audios, T]`` (``input_features_mask``; the processor leaves it out for a
  single clip) and ``audio_embed_sizes`` ``[audios]`` (``chunk.extras``): a clip gives
  ``audio_embed_sizes[i]`` tokens (``ceil(frames / 8)``).

The model projects audio with its "vision" projections when its forward got images at all, else with
its "speech" ones: a property of the whole batch, not of a microbatch. :meth:`Phi4MultimodalAdapter.
sample_input_values` therefore stages ``audio_projection_mode`` ``[B]`` (1: vision, 0: speech; the
batch's own value when it holds one) with the samples, and every microbatch projects as the whole
batch would.

The vision tower runs with eager attention (:func:`eager_attention`): transformers 5.23 marks
``Phi4MultimodalVisionAttention`` causal, so under SDPA a crop is encoded causally unless another crop
of the same forward is padded (then the mask is materialised and attention is bidirectional); eager
attention ignores the flag, so a crop's features never depend on the rest of the batch.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, ClassVar, Iterator, Mapping

import torch
from torch import Tensor

from ..chunk import VlmMediaChunk
from ._helpers import count_runs, images_from_runs, refuse_videos, shape
from .base import HostValues, SampleInput, VlmAdapter, config_value

__all__ = ["MERGE_PATH", "Phi4MultimodalAdapter", "eager_attention", "image_tokens"]

#: the module whose output is the merged embeddings, inside the decoder stack ``model``
MERGE_PATH = "model.embed_tokens_extend"
#: the per-sample input saying how the batch's audio is projected (1: "vision", 0: "speech")
MODE_KEY = "audio_projection_mode"


def image_tokens(useful_rows: int, useful_cols: int, base: int) -> int:
    """Placeholders of one image: ``useful_rows x useful_cols`` sub-crop features plus a separator per
    row, one separator, the global view's ``base x base`` features plus one per row."""
    return useful_rows * (useful_cols + 1) + 1 + base * (base + 1)


@contextlib.contextmanager
def eager_attention(tower: Any) -> Iterator[None]:
    """Run ``tower`` (a ``Phi4MultimodalVisionModel``) with eager attention inside the block, restoring
    its config's ``_attn_implementation`` after (see the module docstring)."""
    config = tower.config
    before = config._attn_implementation
    if before == "eager":
        yield
        return
    config._attn_implementation = "eager"
    try:
        yield
    finally:
        config._attn_implementation = before


def _geometry(config: Any) -> tuple[int, int]:
    """``(crop size S in pixels, base b features per side of a crop after pooling)``."""
    vision = config.vision_config
    patches = int(vision.image_size) // int(vision.patch_size)
    return int(vision.crop_size), (patches + patches % 2) // 2


def _useful_features(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per image and crop, the real feature rows and columns after pooling: ``[images, crops]`` each,
    from ``image_attention_mask`` ``[images, crops, P, P]`` (the first column's and the first row's
    real patches at even positions, as the model samples them)."""
    real = mask > 0
    return real[..., 0::2, 0].sum(dim=-1, dtype=torch.int64), real[..., 0, 0::2].sum(dim=-1, dtype=torch.int64)


def _image_metadata(sizes: Tensor, mask: Tensor) -> Tensor:
    """``[images, 2 + 2 * crops]``: each image's ``(h, w)``, its crops' feature rows, then columns."""
    rows, cols = _useful_features(mask)
    return torch.cat([sizes.to(torch.int64).reshape(-1, 2), rows, cols], dim=1)


def _image_counts(flat: list[int], crops: int, config: Any) -> list[tuple[int, int, int, int]]:
    """Per image ``(crop rows, crop columns, useful feature rows, useful feature columns)`` from the
    flattened :func:`_image_metadata` (one host read)."""
    crop, _ = _geometry(config)
    width = 2 + 2 * crops
    out = []
    for i in range(0, len(flat), width):
        h, w = flat[i], flat[i + 1]
        rows, cols = flat[i + 2 : i + 2 + crops], flat[i + 2 + crops : i + width]
        hr, wr = h // crop, w // crop
        if h % crop or w % crop or hr * wr < 1 or 1 + hr * wr > crops:
            raise ValueError(
                f"phi4_multimodal image {i // width}: image_sizes ({h}, {w}) with {crops} crops a row; expected "
                f"multiples of the crop size {crop} whose {hr} x {wr} sub-crops plus the global view fit the crops"
            )
        out.append((hr, wr, sum(rows[1 + r * wr] for r in range(hr)), sum(cols[1 : 1 + wr])))
    return out


class Phi4MultimodalAdapter(VlmAdapter):
    """Phi-4-multimodal adapter (``Phi4MultimodalForCausalLM``; the layout is in the module docstring).

    Module paths used: ``model.model.embed_tokens_extend`` (:data:`MERGE_PATH`: the merge, declared as
    ``merge_path``), its ``image_embed`` (``img_processor``, the tower, through ``get_img_features``;
    the separators ``sub_img_feature_extensor`` / ``global_img_feature_extensor``;
    ``img_projection_up`` / ``_down``) and ``audio_embed`` (``encoder``; ``up_proj_for_speech`` /
    ``down_proj_for_speech`` and the ``..._vision_speech`` pair); config fields
    ``vision_config.image_token_id``, ``.image_size``, ``.patch_size``, ``.crop_size`` and
    ``audio_config.audio_token_id``.
    """

    name: ClassVar[str] = "phi4_multimodal"
    model_types: ClassVar[tuple[str, ...]] = ("phi4_multimodal",)
    layout: ClassVar[str] = (
        "padded crops image_pixel_values [images, max_crops, 3, S, S] (global view first) + image_sizes + "
        "image_attention_mask; audio_input_features [audios, T, mel] + audio_embed_sizes (+ audio_attention_mask); "
        "encoders and merge inside the decoder stack (model.embed_tokens_extend)"
    )
    language_model_path: ClassVar[str | None] = "model"
    merge_path: ClassVar[str | None] = MERGE_PATH
    sample_inputs: ClassVar[tuple[SampleInput, ...]] = (SampleInput(MODE_KEY),)

    # -- token side -------------------------------------------------------------------------
    def media_per_sample(
        self, input_ids: Tensor, config: Any, *, media: Mapping[str, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Images per sample: the runs of image tokens (device ops), or, with the batch's
        ``image_sizes`` and ``image_attention_mask`` in ``media``, the runs split by each image's token
        count (one host read: images written back to back form one run). No videos (zeros)."""
        is_image = self.placeholder_masks(input_ids, config)["image"]
        sizes = None if media is None else media.get("image_sizes")
        mask = None if media is None else media.get("image_attention_mask")
        if sizes is None or mask is None or mask.dim() != 4:
            images = count_runs(is_image)
        else:
            crops, (_, base) = int(mask.shape[1]), _geometry(config)

            def tokens(flat: list[int]) -> list[int]:
                return [image_tokens(uh, uw, base) for _, _, uh, uw in _image_counts(flat, crops, config)]

            images = images_from_runs(is_image, _image_metadata(sizes, mask), tokens, token="input_ids",
                                      metadata="image_sizes with image_attention_mask")
        return images, torch.zeros_like(images)

    def audios_per_sample(
        self, input_ids: Tensor, config: Any, *, media: Mapping[str, Any] | None = None
    ) -> Tensor:
        """``[B]`` audio clips per sample: its runs of audio tokens (clips written back to back count
        as one: put ``n_audios_per_sample`` ``[B]`` in the batch then)."""
        return count_runs(self.placeholder_masks(input_ids, config)["audio"])

    def placeholder_masks(self, input_ids: Tensor, config: Any) -> dict[str, Tensor]:
        return {"image": input_ids == int(config_value(config, "vision_config.image_token_id")),
                "audio": input_ids == int(config_value(config, "audio_config.audio_token_id"))}

    def sample_input_values(self, batch: Mapping[str, Any], config: Any) -> dict[str, Tensor | None]:
        """``{"audio_projection_mode": [B]}`` for a batch with audio: the batch's own value, else 1
        ("vision") for every sample when the batch holds images, 0 ("speech") when not, as the model's
        own forward on the whole batch projects; ``{}`` without audio."""
        if batch.get(MODE_KEY) is not None:
            return {MODE_KEY: None}
        if batch.get("audio_input_features") is None:
            return {}
        ids = batch["input_ids"]
        vision = batch.get("image_pixel_values") is not None
        return {MODE_KEY: torch.full((ids.shape[0],), int(vision), dtype=torch.int64, device=ids.device)}

    # -- media side -------------------------------------------------------------------------
    def host_inputs(self, chunk: VlmMediaChunk, config: Any) -> dict[str, Tensor]:
        """Each image's size and its crops' useful feature rows and columns, each clip's tokens, the
        microbatch's projection modes; every shape checked first (device ops, read in merge's one read)."""
        refuse_videos(chunk, self.name)
        extras = chunk.extras or {}
        out: dict[str, Tensor] = {}
        pixels, sizes, mask = chunk.pixel_values, chunk.image_grid, extras.get("image_attention_mask")
        if pixels is not None or sizes is not None:
            if (pixels is None or sizes is None or mask is None or pixels.dim() != 5 or mask.dim() != 4
                    or list(mask.shape[:2]) != list(pixels.shape[:2]) or list(sizes.shape) != [pixels.shape[0], 2]):
                raise ValueError(
                    f"phi4_multimodal images: image_pixel_values {shape(pixels)}, image_sizes {shape(sizes)}, "
                    f"image_attention_mask {shape(mask)}; expected [images, crops, 3, S, S], [images, 2] and "
                    f"[images, crops, S/p, S/p]"
                )
            out["images"] = _image_metadata(sizes, mask)
        if chunk.input_features is not None:
            embed_sizes = extras.get("audio_embed_sizes")
            features, audio_mask = chunk.input_features, chunk.input_features_mask
            if (embed_sizes is None or features.dim() != 3 or list(embed_sizes.shape) != [features.shape[0]]
                    or (audio_mask is not None and list(audio_mask.shape) != list(features.shape[:2]))):
                raise ValueError(
                    f"phi4_multimodal audio: audio_input_features {shape(features)}, audio_embed_sizes "
                    f"{shape(embed_sizes)}, audio_attention_mask {shape(audio_mask)}; expected [audios, T, mel], "
                    f"[audios] and [audios, T] (or none)"
                )
            out["audio_tokens"] = embed_sizes.to(torch.int64)
            mode = extras.get(MODE_KEY)
            if mode is not None:
                out[MODE_KEY] = mode.to(torch.int64)
        return out

    def feature_counts(self, chunk: VlmMediaChunk, config: Any, host: HostValues) -> dict[str, int]:
        """``{"image": .., "audio": ..}`` feature rows from the host values.

        Raises:
            ValueError: an image size that is no multiple of the crop size or needs more crops than
                the pixels hold; audio clips giving more tokens than their frames can.
        """
        counts: dict[str, int] = {}
        if "images" in host.values:
            assert chunk.pixel_values is not None
            _, base = _geometry(config)
            per_image = _image_counts(host.values["images"], int(chunk.pixel_values.shape[1]), config)
            counts["image"] = sum(image_tokens(uh, uw, base) for _, _, uh, uw in per_image)
        if "audio_tokens" in host.values:
            assert chunk.input_features is not None
            longest = math.ceil(int(chunk.input_features.shape[1]) / int(config_value(config, "audio_config.time_reduction")))
            tokens = host.values["audio_tokens"]
            if any(n < 0 or n > longest for n in tokens):
                raise ValueError(
                    f"phi4_multimodal audio: audio_embed_sizes {tokens}; expected 0..{longest} each (the "
                    f"encoder gives ceil(T / time_reduction) rows for T = {chunk.input_features.shape[1]} frames)"
                )
            counts["audio"] = sum(tokens)
        return counts

    def encode(self, model: torch.nn.Module, chunk: VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        """The model's own encoders and projections on the chunk: ``{modality: [tokens, hidden]}``
        (what ``embed_tokens_extend`` scatters, without reading anything to the host)."""
        extend: Any = model.get_submodule(MERGE_PATH)
        out: dict[str, Tensor] = {}
        if "images" in host.values:
            out["image"] = self._images(extend.image_embed, chunk, host, model.config)
        if "audio_tokens" in host.values:
            modes = set(host.values.get(MODE_KEY, [int(chunk.pixel_values is not None)]))
            if len(modes) != 1:
                raise ValueError(
                    f"phi4_multimodal audio: the microbatch's samples ask for both audio projection modes "
                    f"({MODE_KEY} {host.values[MODE_KEY]}); expected one mode a microbatch, as the model's forward takes"
                )
            out["audio"] = self._audio(extend.audio_embed, chunk, host, vision=modes.pop() == 1)
        return out

    def _images(self, embed: Any, chunk: VlmMediaChunk, host: HostValues, config: Any) -> Tensor:
        """``Phi4MultimodalImageEmbedding.forward``'s features, from the host values (no ``.item()``)."""
        pixels, mask = chunk.pixel_values, (chunk.extras or {})["image_attention_mask"]
        assert pixels is not None
        tower = embed.img_processor
        images, crops = int(pixels.shape[0]), int(pixels.shape[1])
        with eager_attention(tower):
            feats = embed.get_img_features(pixels.flatten(0, 1).to(tower.embeddings.patch_embedding.weight.dtype),
                                           attention_mask=mask.flatten(0, 1).to(torch.bool))
        base, dim = math.isqrt(int(feats.shape[1])), int(feats.shape[-1])
        feats = feats.view(images, crops, base, base, dim)
        sub_sep, global_sep = embed.sub_img_feature_extensor, embed.global_img_feature_extensor
        rows = []
        for i, (hr, wr, uh, uw) in enumerate(_image_counts(host.values["images"], crops, config)):
            glob = torch.cat([feats[i, 0].unsqueeze(0), sub_sep.repeat(1, base, 1, 1)], dim=2).reshape(1, -1, dim)
            sub = feats[i, 1 : 1 + hr * wr].reshape(hr, wr, base, base, dim).transpose(1, 2)
            sub = sub.reshape(1, hr * base, wr * base, dim)[:, :uh, :uw]
            sub = torch.cat([sub, sub_sep.repeat(1, uh, 1, 1)], dim=2).reshape(1, -1, dim)
            image = torch.cat([sub, global_sep, glob], dim=1).to(embed.img_projection_up.bias.dtype)
            rows.append(embed.img_projection_down(torch.nn.functional.gelu(embed.img_projection_up(image)))[0])
        return embed.drop(torch.cat(rows, dim=0))

    @staticmethod
    def _audio(embed: Any, chunk: VlmMediaChunk, host: HostValues, *, vision: bool) -> Tensor:
        """``Phi4MultimodalAudioEmbedding.forward``'s features: each clip's first ``audio_embed_sizes[i]`` rows."""
        up = embed.up_proj_for_vision_speech if vision else embed.up_proj_for_speech
        down = embed.down_proj_for_vision_speech if vision else embed.down_proj_for_speech
        features = chunk.input_features
        assert features is not None
        hidden = embed.encoder(features.to(up.bias.dtype), chunk.input_features_mask)
        projected = down(torch.nn.functional.gelu(up(hidden)))
        rows = [projected[i, :n] for i, n in enumerate(host.values["audio_tokens"])]
        return embed.drop(torch.cat(rows, dim=0))
