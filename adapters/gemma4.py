"""Gemma 4 (``gemma4``): padded image patches, padded video frames, audio; per-layer inputs and
shared KV that cross stage boundaries.

Media layout of a chunk (what ``Gemma4Processor`` returns, split per microbatch):

* ``pixel_values`` ``[images, max_patches, 3 * p * p]`` padded patch rows with ``image_grid`` =
  ``image_position_ids`` ``[images, max_patches, 2]`` (``(x, y)`` per patch, ``-1`` for padding).
  An image of ``n`` real patches gives ``n / k**2`` tokens (``k`` = ``vision_config.pooling_kernel_size``).
* ``pixel_values_videos`` ``[frames, max_patches, D]`` with ``video_position_ids`` ``[frames,
  max_patches, 2]`` and ``num_frames_per_video`` ``[videos]``: every frame is an image of its own,
  written ``mm:ss <boi> <video> * n <eoi>``.
* ``input_features`` ``[audios, T, 128]`` log-mel frames with ``input_features_mask`` ``[audios, T]``
  (bool, valid frames); a clip gives ``mask[::2][::2].sum()`` tokens (two stride-2 convolutions),
  written ``<boa> <audio> * n <eoa>``.

Counts per sample (:meth:`Gemma4Adapter.media_counts`): images = ``<boi> <image>`` pairs; audio clips
= ``<boa>`` tokens; videos = frame blocks (``<boi> <video>``) grouped by the batch's
``num_frames_per_video`` (tokens alone cannot tell one 3-frame video from three videos).

Cross-layer state (what a stage boundary must carry, besides hidden states and mask):

* **Per-layer inputs (PLE)**: ``[b, S, layers, hidden_size_per_layer_input]``, computed once from the
  token ids (multimodal tokens as padding) and the MERGED embeddings with the model's own
  ``get_per_layer_inputs`` / ``project_per_layer_inputs``; layer ``i`` adds entry ``i``. The first
  stage makes them (its PLE tables stay on it: they are vocabulary-sized); each boundary carries the
  entries of the layers still ahead; gradients flow back to the tables, the projection and, through
  the merged embeddings, to the vision and audio towers.
* **Shared KV** (``num_kv_shared_layers``): the last non-shared layer of each attention type stores
  its keys and values, every later ("reuse") layer of that type attends with them. When a boundary
  falls between the producer and a consumer, the pair ``[b, kv_heads, S, head_dim]`` crosses it
  (floating: the consumers' gradient reaches the producer's projections).
* ``mm_token_type_ids`` ``[b, S]`` when ``use_bidirectional_attention == "vision"``: every stage
  builds the model's own masks (sliding layers: causal OR same vision block, within the window).
* The head's ``final_logit_softcapping`` is applied on the last stage, as the model does.

The first stage makes the token types and the per-layer inputs (:meth:`Gemma4Adapter.first_stage`);
:meth:`Gemma4Adapter.decoder_kwargs` hands a stage its per-layer inputs and the shared KV it received;
the ``after`` hook of :meth:`Gemma4Adapter.stage_hooks` on the stage's last layer stores what goes on
(the per-layer inputs still ahead, the KV its producer layers stored); :meth:`Gemma4Adapter.prune_stage`
keeps the PLE tables on the first stage; :meth:`Gemma4Adapter.logits` soft-caps.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping, MutableMapping, Sequence

import torch
from torch import Tensor

from ..chunk import VlmMediaChunk
from ._helpers import as_tower_dtype, check_audio_mask, shape, softcapped, text_config, token_ids
from .base import HostValues, LayerHook, VlmAdapter, WireTensor, config_get, config_value, inner_model

__all__ = ["Gemma4Adapter"]

_GEMMA4 = "a Gemma4ForConditionalGeneration or Gemma4Model"
#: the language model's per-layer-embedding members, kept on the first stage only.
PLE_MODULES: tuple[str, ...] = ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm")


_TOKENS = {"image": "image_token_id", "video": "video_token_id", "audio": "audio_token_id",
           "boi": "boi_token_id", "boa": "boa_token_id"}


def _ids(config: Any) -> dict[str, int]:
    return token_ids(config, _TOKENS)


def _vision(chunk: VlmMediaChunk) -> tuple[tuple[str, Tensor | None, Tensor | None], ...]:
    """``(modality, padded patches, their positions)`` of the chunk's images and video frames."""
    return (("image", chunk.pixel_values, chunk.image_grid), ("video", chunk.pixel_values_videos, chunk.video_position_ids))


def _pairs(input_ids: Tensor, first: int, second: int) -> Tensor:
    """``[B]``: positions where ``first`` is followed by ``second``."""
    return ((input_ids[:, :-1] == first) & (input_ids[:, 1:] == second)).sum(dim=1, dtype=torch.int64)


def _bidirectional(config: Any) -> bool:
    return config_get(text_config(config), "use_bidirectional_attention") == "vision"


def kv_links(text_config: Any) -> dict[str, tuple[int, int]]:
    """``{layer_type: (producer, last consumer)}``: layer indices of the shared-KV pairs (empty without
    ``num_kv_shared_layers``)."""
    modes = list(text_config.kv_sharing_modes)
    types = list(text_config.layer_types)
    links = {}
    for t in dict.fromkeys(types):
        producers = [i for i, (m, lt) in enumerate(zip(modes, types)) if m == "store" and lt == t]
        consumers = [i for i, (m, lt) in enumerate(zip(modes, types)) if m == "reuse" and lt == t]
        if producers and consumers:
            links[t] = (producers[-1], consumers[-1])
    return links


def _already_projected(inputs_embeds: Tensor, per_layer_inputs: Tensor | None = None) -> Tensor:
    """A stage's ``project_per_layer_inputs``: the first stage projected them already (with the merged
    embeddings, which later stages no longer have)."""
    if per_layer_inputs is None:
        raise ValueError("gemma4 stage: per_layer_inputs missing; the first stage computes them (wire 'per_layer_inputs')")
    return per_layer_inputs


class Gemma4Adapter(VlmAdapter):
    """Gemma 4 adapter (``Gemma4ForConditionalGeneration``; the layout and the cross-layer state are in
    the module docstring).

    Module paths used: ``model.model.vision_tower(pixel_values=, pixel_position_ids=)`` and
    ``model.model.embed_vision`` (images and video frames), ``model.model.get_audio_features(features,
    mask)`` (``audio_tower`` and ``embed_audio``), ``model.model.language_model`` (``get_per_layer_inputs``,
    ``project_per_layer_inputs``, its layers' ``shared_kv_states``); config fields ``image_token_id``,
    ``video_token_id``, ``audio_token_id``, ``boi_token_id``, ``boa_token_id``,
    ``vision_config.pooling_kernel_size`` and the text config's ``num_kv_shared_layers``,
    ``hidden_size_per_layer_input``, ``use_bidirectional_attention``, ``final_logit_softcapping``.
    """

    name: ClassVar[str] = "gemma4"
    context_refusal: ClassVar[str | None] = (
        "its kv-shared layers read the keys and values of an earlier layer over the whole row (num_kv_shared_layers), state the gathered attention of one layer does not hand on"
    )
    model_types: ClassVar[tuple[str, ...]] = ("gemma4",)
    layout: ClassVar[str] = (
        "padded patches [images, max_patches, 3*p*p] + image_position_ids (-1 = padding); video frames "
        "[frames, max_patches, D] + video_position_ids + num_frames_per_video; audio input_features "
        "[audios, T, 128] + input_features_mask; per-layer inputs and shared KV cross stage boundaries"
    )

    # -- token side -------------------------------------------------------------------------
    def media_per_sample(
        self, input_ids: Tensor, config: Any, *, media: Mapping[str, Any] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Images (``<boi> <image>`` pairs) and videos per sample, ``([B], [B])`` int64.

        Each video frame is its own ``<boi> <video>`` block, so the blocks are grouped into videos with
        ``media["num_frames_per_video"]`` (one host read checks every video's frames lie in one
        sample). Video blocks without it are refused (pass the batch, or ``n_videos_per_sample``).
        """
        from .qwen3_vl import Qwen3VLAdapter

        ids = _ids(config)
        images = _pairs(input_ids, ids["boi"], ids["image"])
        frames = _pairs(input_ids, ids["boi"], ids["video"])
        per_video = None if media is None else media.get("num_frames_per_video")
        if per_video is None:
            if bool((frames > 0).any()):  # one host read
                raise ValueError(
                    f"gemma4: samples {(frames > 0).nonzero().flatten().tolist()} hold video frame blocks, one "
                    f"per frame, so tokens alone do not tell one 3-frame video from three videos; pass "
                    f"media=batch (its num_frames_per_video) or put n_videos_per_sample [B] in the batch"
                )
            return images, torch.zeros_like(frames)
        grid = per_video.reshape(-1, 1).to(torch.int64)  # [videos, 1]: "temporal steps" = frames
        return images, Qwen3VLAdapter._videos_from_blocks(frames, grid)

    def audios_per_sample(
        self, input_ids: Tensor, config: Any, *, media: Mapping[str, Any] | None = None
    ) -> Tensor:
        """``[B]`` audio clips per sample: its ``<boa>`` tokens (one per clip)."""
        return (input_ids == _ids(config)["boa"]).sum(dim=1, dtype=torch.int64)

    def placeholder_masks(self, input_ids: Tensor, config: Any) -> dict[str, Tensor]:
        ids = _ids(config)
        return {m: input_ids == ids[m] for m in ("image", "video", "audio")}

    def mm_token_type_ids(self, input_ids: Tensor, config: Any) -> Tensor:
        """``[b, S]`` int64: 1 image, 2 video, 3 audio tokens, 0 text (what ``Gemma4Processor`` returns)."""
        ids = _ids(config)
        return ((input_ids == ids["image"]).to(torch.int64) + 2 * (input_ids == ids["video"]).to(torch.int64)
                + 3 * (input_ids == ids["audio"]).to(torch.int64))

    # -- media side -------------------------------------------------------------------------
    def host_inputs(self, chunk: VlmMediaChunk, config: Any) -> dict[str, Tensor]:
        """Real patches per image and per frame, frames per video, tokens per audio clip (device ops on
        the metadata, read in merge's one host read); every shape checked first."""
        out: dict[str, Tensor] = {}
        for what, pixels, positions in _vision(chunk):
            if pixels is None:
                if positions is not None:
                    raise ValueError(f"gemma4 {what}: positions of shape {shape(positions)} given without pixels")
                continue
            key = "image_position_ids" if what == "image" else "video_position_ids"
            if positions is None or pixels.dim() != 3 or list(positions.shape) != [*pixels.shape[:2], 2]:
                raise ValueError(
                    f"gemma4 {what}: pixels {shape(pixels)} with {key} {shape(positions)}; expected "
                    f"[n, max_patches, D] with [n, max_patches, 2] (padded patches and their positions)"
                )
            out[f"{what}_patches"] = (positions != -1).all(dim=-1).sum(dim=-1)
        if chunk.pixel_values_videos is not None:
            frames = chunk.num_frames_per_video
            if frames is None or frames.dim() != 1:
                raise ValueError(f"gemma4 video: num_frames_per_video {shape(frames)}; expected [videos]")
            out["frames"] = frames
        elif chunk.video_grid is not None:
            raise ValueError(f"gemma4 takes no video_grid; the chunk carries one of shape {shape(chunk.video_grid)}")
        if chunk.input_features is not None:
            mask = check_audio_mask(
                chunk.input_features, chunk.input_features_mask, time_dim=1,
                message="gemma4 audio: input_features {features} with input_features_mask {mask}; "
                "expected [audios, T, mel] with [audios, T]",
            )
            out["audio_tokens"] = mask[:, ::2][:, ::2].to(torch.int64).sum(dim=-1)
        return out

    def feature_counts(self, chunk: VlmMediaChunk, config: Any, host: HostValues) -> dict[str, int]:
        """``{"image": .., "video": .., "audio": ..}`` feature rows, from the host values.

        Raises:
            ValueError: an image or frame whose real patches are not a multiple of ``k**2``, frames per
                video that do not cover ``pixel_values_videos``.
        """
        k2 = int(config_value(config, "vision_config.pooling_kernel_size")) ** 2
        counts: dict[str, int] = {}
        for what in ("image", "video"):
            patches = host.values.get(f"{what}_patches")
            if patches is None:
                continue
            for i, n in enumerate(patches):
                if n % k2:
                    raise ValueError(
                        f"gemma4 {what} {i} of the chunk has {n} real patches (positions != -1); expected a "
                        f"multiple of pooling_kernel_size**2 = {k2}"
                    )
            counts[what] = sum(n // k2 for n in patches)
        if "frames" in host.values:
            frames, rows = host.values["frames"], len(host.values["video_patches"])
            if sum(frames) != rows or min(frames, default=1) <= 0:
                raise ValueError(
                    f"gemma4 video: num_frames_per_video {frames} (sum {sum(frames)}); expected positive counts "
                    f"summing to the chunk's {rows} frames of pixel_values_videos"
                )
        if "audio_tokens" in host.values:
            counts["audio"] = sum(host.values["audio_tokens"])
        return counts

    def encode(self, model: torch.nn.Module, chunk: VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        """The model's own towers and embedders: ``{modality: [tokens, text_hidden]}``."""
        inner = inner_model(model, "vision_tower", _GEMMA4)
        out: dict[str, Tensor] = {}
        for what, pixels, positions in _vision(chunk):
            if pixels is not None:
                tower = inner.vision_tower(pixel_values=as_tower_dtype(pixels, inner.vision_tower),
                                           pixel_position_ids=positions)
                out[what] = inner.embed_vision(inputs_embeds=tower.last_hidden_state)
        if chunk.input_features is not None:
            features = as_tower_dtype(chunk.input_features, inner.audio_tower)
            audio = inner.get_audio_features(features, chunk.input_features_mask, return_dict=True)
            out["audio"] = audio.pooler_output[audio.attention_mask]
        return out

    # -- pipeline wire format ---------------------------------------------------------------
    def wire_tensors(self, config: Any, first_layer: int) -> tuple[WireTensor, ...]:
        """``mm_token_type_ids`` ``[b, S]`` (bidirectional vision blocks); the per-layer inputs of the
        layers ``first_layer ..`` still ahead; each attention type's shared ``key`` / ``value``
        ``[b, kv_heads, S, head_dim]`` while its producer is behind and a consumer ahead."""
        text = text_config(config)
        specs = []
        if _bidirectional(config):
            specs.append(WireTensor("mm_token_type_ids", ("b", "S")))
        layers = int(text.num_hidden_layers)
        ple = config_get(text, "hidden_size_per_layer_input")
        if ple and first_layer < layers:
            specs.append(WireTensor("per_layer_inputs", ("b", "S", layers - first_layer, int(ple)), floating=True))
        for layer_type, (producer, last_consumer) in kv_links(text).items():
            if producer < first_layer <= last_consumer:
                layer = text.per_layer_config[producer]
                kv_shape = ("b", int(layer.num_key_value_heads), "S", int(layer.head_dim))
                specs += [WireTensor(f"shared_kv_{layer_type}_{part}", kv_shape, floating=True) for part in ("key", "value")]
        return tuple(specs)

    def first_stage(
        self,
        model: torch.nn.Module,
        input_ids: Tensor,
        attention_mask: Tensor,
        inputs_embeds: Tensor,
        chunk: VlmMediaChunk | None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Merge (one host read), then the token types and the per-layer inputs of every layer."""
        config = model.config
        hidden, masks, _outputs = self.merge_with_outputs(model, input_ids, inputs_embeds, chunk)
        wire: dict[str, Tensor] = {}
        if _bidirectional(config):
            wire["mm_token_type_ids"] = self.mm_token_type_ids(input_ids, config)
        if config_get(text_config(config), "hidden_size_per_layer_input"):
            wire["per_layer_inputs"] = self.per_layer_inputs(model, input_ids, hidden, masks)
        return hidden, wire

    def per_layer_inputs(self, model: torch.nn.Module, input_ids: Tensor, merged: Tensor,
                         masks: Mapping[str, Tensor]) -> Tensor:
        """``[b, S, layers, ple]``: the model's own PLE from the ids (multimodal tokens as padding, as
        ``Gemma4Model`` does) and the merged embeddings ``merged`` ``[b, S, H]``."""
        lm = inner_model(model, "language_model", _GEMMA4).language_model
        multimodal = masks["image"] | masks["video"] | masks["audio"]
        pad = int(config_value(text_config(model.config), "pad_token_id"))
        token_part = lm.get_per_layer_inputs(torch.where(multimodal, pad, input_ids))
        # the class's method: a stage's language model answers project_per_layer_inputs with its input
        return type(lm).project_per_layer_inputs(lm, merged, token_part)

    def decoder_kwargs(
        self,
        stage: torch.nn.Module,
        layers: range,
        hidden: Tensor,
        attention_mask: Tensor,
        wire: Mapping[str, Tensor],
    ) -> dict[str, Any]:
        """The model's own masks, this stage's per-layer inputs, and the shared KV received (in the
        ``KVSharingDict`` the language model hands every layer; the stage's producer layers fill it,
        and :meth:`stage_hooks` reads it after the stage's last layer)."""
        from transformers.cache_utils import KVSharingDict

        kwargs: dict[str, Any] = {}
        lm: Any = getattr(stage, "stage_language_model")
        if "mm_token_type_ids" in wire:
            kwargs["attention_mask"] = self.attention_masks(lm, hidden, attention_mask, wire["mm_token_type_ids"])
        if "per_layer_inputs" in wire:
            kwargs["per_layer_inputs"] = wire["per_layer_inputs"][:, :, : len(layers)]
        elif ple := config_get(text_config(stage.config), "hidden_size_per_layer_input"):  # no layer ahead: none needed
            kwargs["per_layer_inputs"] = hidden.new_zeros(*hidden.shape[:2], 0, int(ple))
        shared = KVSharingDict()
        for layer_type in kv_links(text_config(stage.config)):
            key = wire.get(f"shared_kv_{layer_type}_key")
            if key is not None:
                shared[layer_type] = (key, wire[f"shared_kv_{layer_type}_value"])
        kwargs["shared_kv_states"] = shared
        return kwargs

    def stage_hooks(
        self, stage: torch.nn.Module, layers: range, state: MutableMapping[str, Tensor]
    ) -> Sequence[LayerHook]:
        """An ``after`` hook on the stage's last layer: the per-layer inputs of the layers after the
        stage's (the received ones minus its own) and every key / value pair in the ``KVSharingDict``
        (received, or stored by the stage's producer layers) into ``state``."""
        if not layers:
            return ()
        last_layer = list(getattr(stage, "stage_language_model").layers)[-1]
        own = len(layers)

        def after(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            ple = state.get("per_layer_inputs")
            if ple is not None:
                state["per_layer_inputs"] = ple[:, :, own:]
            shared: Mapping[str, tuple[Tensor, Tensor]] = kwargs["shared_kv_states"]
            for layer_type, (key, value) in shared.items():
                state[f"shared_kv_{layer_type}_key"], state[f"shared_kv_{layer_type}_value"] = key, value

        return (LayerHook(last_layer, after=after),)

    def prune_stage(self, language_model: torch.nn.Module, *, layers: range, first: bool, last: bool) -> None:
        """PLE tables and projection on the first stage only (they are vocabulary-sized); every stage's
        language model takes the per-layer inputs as the first stage projected them."""
        if not config_get(getattr(language_model, "config"), "hidden_size_per_layer_input"):
            return
        language_model.__dict__["project_per_layer_inputs"] = _already_projected
        if not first:
            for name in PLE_MODULES:
                language_model._modules.pop(name, None)

    def logits(self, stage: torch.nn.Module, hidden: Tensor) -> Tensor:
        """``lm_head``, then the model's soft-capping ``tanh(logits / c) * c``
        (``c = text_config.final_logit_softcapping``)."""
        return softcapped(super().logits(stage, hidden), getattr(stage, "config"))

    def attention_masks(
        self, language_model: torch.nn.Module, inputs_embeds: Tensor, attention_mask: Tensor | None,
        mm_token_type_ids: Tensor,
    ) -> dict[str, Any]:
        """The masks ``Gemma4Model.forward`` builds with ``use_bidirectional_attention == "vision"``:
        full layers causal, sliding layers causal OR same vision block, within the window."""
        from transformers.models.gemma4.modeling_gemma4 import (
            create_masks_for_vision_model,
            get_block_sequence_ids_for_mask,
        )

        positions = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device).unsqueeze(0)
        blocks = get_block_sequence_ids_for_mask(mm_token_type_ids, device=inputs_embeds.device)
        config: Any = getattr(language_model, "config")
        return create_masks_for_vision_model(
            config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
            past_key_values=None, position_ids=positions, block_sequence_ids=blocks,
        )
