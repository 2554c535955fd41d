"""The Qwen Omni thinkers (``qwen2_5_omni_thinker``, ``qwen3_omni_moe_thinker``): images, videos
(optionally with their audio tracks) and audio, 3-D positions that include the audio.

Media layout of a chunk (what the Omni processors return, split per microbatch):

* images and videos as Qwen2.5-VL's: flat patch rows ``[patches, D]`` with ``image_grid`` /
  ``video_grid`` ``[n, 3]`` ``(t, h, w)``; the video timing ``video_second_per_grid`` ``[videos]``
  (staged as ``second_per_grid_ts``) is needed for a microbatch's positions when it has videos;
* ``input_features`` ``[audios, mel, T]`` Whisper log-mel features with ``input_features_mask`` (the
  processor's ``feature_attention_mask``) ``[audios, T]``; a clip of ``L`` valid frames gives
  ``((L - 1) // 2 + 1 - 2) // 2 + 1`` tokens (Qwen2.5-Omni; Qwen3-Omni's own arithmetic differs and is
  taken from the model, ``_get_feat_extract_output_lengths``).

Tokens: ``<vision_bos> <image> * n <vision_eos>``, ``<audio_bos> <audio> * n <audio_eos>``, and a video
either ``<vision_bos> <video> * n <vision_eos>`` or, with its audio track (the processor's
``load_audio_from_video`` / the model's ``use_audio_in_video``), ``<vision_bos> <audio_bos>`` video and
audio tokens interleaved per 2-second chunk ``<audio_eos> <vision_eos>``. Audio clips per sample are
its ``<audio_bos>`` tokens (stand-alone clips and video tracks, in token order, as ``input_features``
holds them); ``use_audio_in_video`` is read from the tokens of each microbatch. The model's forward
takes one flag for the whole batch, so a microbatch mixing videos with and without audio tracks is
refused (the model itself would misplace their positions).

Positions: ``[3, b, S]`` from the model's own ``get_rope_index`` on the microbatch (grids, audio
lengths, seconds per grid, the flag), sent batch-first on the wire like Qwen2.5-VL's. Qwen3-Omni's
vision tower also returns deepstack features, which cross stage boundaries as Qwen3-VL's do.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch
from torch import Tensor

from ..chunk import VlmMediaChunk
from ._helpers import as_tower_dtype, check_audio_mask, grid_thw, shape, token_ids
from .base import HostValues, WireTensor, config_get, config_value, inner_model
from .qwen2_5_vl import Qwen2_5_VLAdapter
from .qwen3_vl import Qwen3VLAdapter

__all__ = ["Qwen2_5OmniThinkerAdapter", "Qwen3OmniThinkerAdapter", "thinker_config"]

_OMNI = "a Qwen Omni thinker (Qwen2_5OmniThinkerForConditionalGeneration / Qwen3OmniMoeThinkerForConditionalGeneration, or model.thinker of the Omni model)"


def thinker_config(config: Any) -> Any:
    """The thinker's config: ``config.thinker_config`` of a top-level Omni config, else ``config``."""
    inner = config_get(config, "thinker_config")
    return config if inner is None else inner


_TOKENS = {"image": "image_token_id", "video": "video_token_id", "audio": "audio_token_id",
           "vision_start": "vision_start_token_id", "audio_start": "audio_start_token_id"}


def _ids(config: Any) -> dict[str, int]:
    return token_ids(thinker_config(config), _TOKENS)


def _after(input_ids: Tensor, first: int, second: int) -> Tensor:
    """``[B, S-1]`` bool: ``first`` followed by ``second``."""
    return (input_ids[:, :-1] == first) & (input_ids[:, 1:] == second)


def _require_timing(chunk: VlmMediaChunk) -> None:
    """Refuse a chunk with videos but no ``video_second_per_grid`` (the thinker's positions need it)."""
    if chunk.pixel_values_videos is not None and chunk.second_per_grid_ts is None:
        raise ValueError(
            f"video: the chunk has videos {shape(chunk.video_grid)} but no video_second_per_grid; the "
            f"thinker's positions space frames by it (the Omni processor returns it)"
        )


class _OmniThinker(Qwen2_5_VLAdapter):
    """What both thinkers add to their vision adapters (Qwen2.5-VL's, Qwen3-VL's): the audio, the token
    ids and merge size from the thinker config, positions from the thinker's own ``get_rope_index``.
    Put first among a thinker adapter's bases, so its methods come before the vision adapter's."""

    #: set padding positions to 0 on a microbatch without grids (Qwen3-Omni; see its ``position_ids``)
    zero_padding_positions: ClassVar[bool] = False

    @staticmethod
    def _token_ids(config: Any) -> tuple[int, int]:
        ids = _ids(config)
        return ids["image"], ids["video"]

    @staticmethod
    def _merge(config: Any) -> int:
        return int(config_value(thinker_config(config), "vision_config.spatial_merge_size"))

    def _thinker(self, model: torch.nn.Module) -> Any:
        thinker = getattr(model, "thinker", None)  # the top-level Omni model
        return inner_model(thinker if thinker is not None else model, "audio_tower", _OMNI)

    def audios_per_sample(
        self, input_ids: Tensor, config: Any, *, media: Mapping[str, Any] | None = None
    ) -> Tensor:
        """``[B]`` audio clips per sample: its ``<audio_bos>`` tokens (stand-alone clips and video tracks)."""
        return (input_ids == _ids(config)["audio_start"]).sum(dim=1, dtype=torch.int64)

    def media_per_sample(
        self, input_ids: Tensor, config: Any, *, media: Mapping[str, Any] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Images (``<vision_bos> <image>``) and videos (``<vision_bos>`` then ``<video>`` or, with an
        audio track, ``<audio_bos>``) per sample, ``([B], [B])`` int64; device ops only."""
        ids = _ids(config)
        images = _after(input_ids, ids["vision_start"], ids["image"]).sum(dim=1, dtype=torch.int64)
        videos = (_after(input_ids, ids["vision_start"], ids["video"])
                  | _after(input_ids, ids["vision_start"], ids["audio_start"])).sum(dim=1, dtype=torch.int64)
        return images, videos

    def placeholder_masks(self, input_ids: Tensor, config: Any) -> dict[str, Tensor]:
        ids = _ids(config)
        return {m: input_ids == ids[m] for m in ("image", "video", "audio")}

    def audio_host_inputs(self, chunk: VlmMediaChunk) -> dict[str, Tensor]:
        """``{"audio_frames": [audios]}``: each clip's valid frames (a device op on the mask). Also
        checks, before any tower runs, that a chunk with videos has their timing."""
        _require_timing(chunk)
        feats, mask = chunk.input_features, chunk.input_features_mask
        if feats is None:
            if mask is not None:
                raise ValueError(f"audio: input_features_mask {shape(mask)} given without input_features")
            return {}
        mask = check_audio_mask(
            feats, mask, time_dim=2,
            message="audio: input_features {features} with feature_attention_mask {mask}; expected "
            "[audios, mel, T] with [audios, T] (Whisper features and their valid frames)",
        )
        return {"audio_frames": mask.to(torch.int64).sum(dim=-1)}

    def audio_tokens(self, config: Any, frames: list[int]) -> int:
        """Audio tokens of clips of ``frames`` valid mel frames each (Qwen2.5-Omni's two stride-2 steps)."""
        return sum(((n - 1) // 2 + 1 - 2) // 2 + 1 for n in frames)

    def encode_audio(self, model: torch.nn.Module, chunk: VlmMediaChunk) -> dict[str, Tensor]:
        if chunk.input_features is None:
            return {}
        inner = self._thinker(model)
        features = as_tower_dtype(chunk.input_features, inner.audio_tower)
        out = inner.get_audio_features(features, chunk.input_features_mask, return_dict=True)
        return {"audio": out.last_hidden_state}

    def rope_kwargs(self, input_ids: Tensor, chunk: VlmMediaChunk | None, config: Any) -> dict[str, Any]:
        """The media arguments of the thinker's ``get_rope_index`` for one microbatch."""
        kwargs: dict[str, Any] = {"use_audio_in_video": False}
        if chunk is None:
            return kwargs
        if chunk.pixel_values is not None and chunk.image_grid is not None:
            kwargs["image_grid_thw"] = grid_thw(chunk.image_grid, "image grid")
        if chunk.pixel_values_videos is not None and chunk.video_grid is not None:
            kwargs["video_grid_thw"] = grid_thw(chunk.video_grid, "video grid")
            _require_timing(chunk)
            kwargs["second_per_grids"] = chunk.second_per_grid_ts
            ids = _ids(config)
            tracks = int(_after(input_ids, ids["vision_start"], ids["audio_start"]).sum())
            plain = int(_after(input_ids, ids["vision_start"], ids["video"]).sum())
            if tracks and plain:
                raise ValueError(
                    f"video: the microbatch mixes {tracks} videos with audio tracks and {plain} without; the "
                    f"thinker's positions take one use_audio_in_video for all its videos"
                )
            kwargs["use_audio_in_video"] = bool(tracks)
        if chunk.input_features_mask is not None:
            kwargs["audio_seqlens"] = chunk.input_features_mask.to(torch.int64).sum(dim=-1)
        return kwargs

    def host_inputs(self, chunk: VlmMediaChunk, config: Any) -> dict[str, Tensor]:
        return {**super().host_inputs(chunk, config), **self.audio_host_inputs(chunk)}

    def feature_counts(self, chunk: VlmMediaChunk, config: Any, host: HostValues) -> dict[str, int]:
        counts = super().feature_counts(chunk, config, host)
        if "audio_frames" in host.values:
            counts["audio"] = self.audio_tokens(config, host.values["audio_frames"])
        return counts

    def position_ids(
        self,
        model: torch.nn.Module,
        input_ids: Tensor,
        chunk: VlmMediaChunk | None,
        attention_mask: Tensor | None = None,
    ) -> Tensor:
        """3-D positions ``[3, b, S]`` from the thinker's own ``get_rope_index`` on the microbatch (int64;
        Qwen3-Omni's float32: they may be fractional).

        With :attr:`zero_padding_positions` (Qwen3-Omni), padding positions are 0, as the model's own
        per-sample loop writes them; its shortcut for a microbatch without grids writes 1 there (a
        padding position changes no loss, but the positions then differ from the full batch's), so they
        are set to 0 here.
        """
        kwargs = self.rope_kwargs(input_ids, chunk, model.config)
        positions: Tensor = self._thinker(model).get_rope_index(input_ids, attention_mask=attention_mask, **kwargs)[0]
        no_grids = "image_grid_thw" not in kwargs and "video_grid_thw" not in kwargs
        if self.zero_padding_positions and attention_mask is not None and no_grids:
            positions = positions.masked_fill(attention_mask == 0, 0)
        return positions


class Qwen2_5OmniThinkerAdapter(_OmniThinker):
    """Qwen2.5-Omni thinker (``Qwen2_5OmniThinkerForConditionalGeneration``; layout in the module docstring).

    Module paths used: ``model.model.visual`` (Qwen2.5-VL's), ``model.model.audio_tower`` through
    ``model.model.get_audio_features(features, feature_attention_mask)``, ``model.model.get_rope_index``
    for the positions; config fields ``image_token_id``, ``video_token_id``, ``audio_token_id``,
    ``vision_start_token_id``, ``audio_start_token_id``, ``vision_config.spatial_merge_size``. A
    top-level ``Qwen2_5OmniForConditionalGeneration`` is served through its ``thinker`` (build the
    pipeline stages from ``model.thinker``).
    """

    name: ClassVar[str] = "qwen2_5_omni"
    model_types: ClassVar[tuple[str, ...]] = ("qwen2_5_omni_thinker", "qwen2_5_omni")
    layout: ClassVar[str] = (
        "flat patch rows [patches, D] with grids [n, 3] for images and videos (+ video_second_per_grid); "
        "Whisper input_features [audios, mel, T] + feature_attention_mask; 3-D positions include audio"
    )

    def encode(self, model: torch.nn.Module, chunk: VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        return {**super().encode(model, chunk, host), **self.encode_audio(model, chunk)}


class Qwen3OmniThinkerAdapter(_OmniThinker, Qwen3VLAdapter):
    """Qwen3-Omni (MoE) thinker (``Qwen3OmniMoeThinkerForConditionalGeneration``): the Qwen2.5-Omni
    layout with a Qwen3-VL vision tower (deepstack features cross stage boundaries as Qwen3-VL's) and
    Qwen3-Omni's audio encoder (windows of ``n_window`` frames; tokens per clip from the model's own
    ``_get_feat_extract_output_lengths``)."""

    name: ClassVar[str] = "qwen3_omni"
    zero_padding_positions: ClassVar[bool] = True
    model_types: ClassVar[tuple[str, ...]] = ("qwen3_omni_moe_thinker", "qwen3_omni_moe")
    layout: ClassVar[str] = (
        "flat patch rows [patches, D] with grids [n, 3] for images and videos (+ video_second_per_grid); "
        "Whisper input_features [audios, mel, T] + feature_attention_mask; 3-D positions include audio; "
        "deepstack features cross stage boundaries"
    )

    def media_counts(self, batch: Mapping[str, Any], config: Any) -> dict[str, Any]:
        """Images, videos and audio clips per sample from the tokens (a video is one block here)."""
        return Qwen2_5_VLAdapter.media_counts(self, batch, config)

    def audio_tokens(self, config: Any, frames: list[int]) -> int:
        """Qwen3-Omni's audio arithmetic (windows of 100 frames, three stride-2 convolutions)."""
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

        window = int(config_value(thinker_config(config), "audio_config.n_window"))
        return int(_get_feat_extract_output_lengths(torch.tensor(frames, dtype=torch.int64), window).sum()) if frames else 0

    def encode_with_deepstack(
        self, model: torch.nn.Module, chunk: VlmMediaChunk
    ) -> tuple[dict[str, Tensor], dict[str, list[Tensor]]]:
        features, deepstack = super().encode_with_deepstack(model, chunk)
        return {**features, **self.encode_audio(model, chunk)}, deepstack

    def wire_tensors(self, config: Any, first_layer: int) -> tuple[WireTensor, ...]:
        """Qwen3-VL's (positions, deepstack), the positions as float32."""
        return tuple(
            WireTensor(spec.name, spec.shape, dtype="float32") if spec.name == "position_ids" else spec
            for spec in super().wire_tensors(config, first_layer)
        )
