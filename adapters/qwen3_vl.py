"""Qwen3-VL (and Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE): flat patch rows, ``(t, h, w)`` grids, deepstack.

Media layout (what a :class:`~ppmedia.VlmMediaChunk` holds for this family), as Qwen2.5-VL:

* ``pixel_values`` ``[patches, D]``: the patch rows of the microbatch's images, image after image
  (``D = C * temporal_patch * patch * patch``, 1536 for patch 16); ``image_grid`` ``[images, 3]``
  ``(t, h, w)`` in patches, or ``[images, 2]`` ``(h, w)`` meaning ``t = 1``.
* ``pixel_values_videos`` / ``video_grid``: the same for videos.

An image yields ``t * h * w / merge**2`` features. A video is written **one block per temporal step**,
each with its timestamp as text: ``<0.5 seconds> vision_start, video * (h * w / merge**2), vision_end``
(the processor's own layout). The video timing is therefore in the text tokens, and the model's
``get_rope_index`` takes no ``second_per_grid_ts``: a chunk's ``second_per_grid_ts`` is not needed.
Because of the per-step blocks, tokens alone cannot tell one 3-step video from three 1-step videos:
:meth:`Qwen3VLAdapter.media_per_sample` needs the video grid (or the batch needs ``n_videos_per_sample``).

**Deepstack** (Qwen3-VL, Qwen3-VL-MoE): the vision tower also returns one feature set per
``vision_config.deepstack_visual_indexes`` entry; the language model adds set ``i`` to the hidden
states at the visual positions right after decoder layer ``i``. In a pipeline those layers may sit on
later stages, so the sets travel between stages (:meth:`Qwen3VLAdapter.wire_tensors`). Qwen3.5 has no
deepstack; everything else is the same.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch
from torch import Tensor

from ..chunk import VlmMediaChunk
from .base import HostValues, WireTensor, config_value, inner_model
from .qwen2_5_vl import Qwen2_5_VLAdapter

__all__ = ["Qwen3VLAdapter"]

_QWEN3 = "a Qwen3-VL-style model (Qwen3VLForConditionalGeneration or its inner model)"


def _grid_thw(grid: Tensor | None, what: str) -> Tensor | None:
    """``grid`` as ``[n, 3]`` ``(t, h, w)``; an ``[n, 2]`` ``(h, w)`` grid gets ``t = 1`` prepended."""
    if grid is None:
        return None
    if grid.dim() != 2 or grid.shape[1] not in (2, 3):
        raise ValueError(f"{what}: expected [n, 3] (t, h, w) or [n, 2] (h, w); got shape {list(grid.shape)}")
    return grid if grid.shape[1] == 3 else torch.nn.functional.pad(grid, (1, 0), value=1)


def _rows(pixels: Tensor | None) -> int:
    return 0 if pixels is None else int(pixels.shape[0])


def _deepstack_levels(config: Any) -> int:
    """How many deepstack feature sets the vision tower returns (0 for Qwen3.5)."""
    vision = getattr(config, "vision_config", None)
    return len(getattr(vision, "deepstack_visual_indexes", None) or ())


class Qwen3VLAdapter(Qwen2_5_VLAdapter):
    """Adapter of Qwen3-VL (``qwen3_vl``, ``qwen3_vl_moe``) and Qwen3.5 (``qwen3_5``, ``qwen3_5_moe``).

    Module paths it expects (transformers' ``Qwen3VLForConditionalGeneration``,
    ``Qwen3VLMoeForConditionalGeneration``, ``Qwen3_5ForConditionalGeneration`` and
    ``Qwen3_5MoeForConditionalGeneration`` have them):

    * ``model.model.visual`` (or ``model.visual``): called as ``visual(pixel_rows, grid_thw=grid)``; its
      output has ``pooler_output`` ``[tokens, hidden]`` and, with deepstack, ``deepstack_features``
      (one ``[tokens, hidden]`` per level);
    * ``model.model.get_rope_index(input_ids, mm_token_type_ids, image_grid_thw=, video_grid_thw=,
      attention_mask=)`` for the interleaved mrope positions ``[3, b, S]``;
    * config fields ``image_token_id``, ``video_token_id``, ``vision_start_token_id``,
      ``vision_config.spatial_merge_size`` and (deepstack) ``vision_config.deepstack_visual_indexes``.

    The media side (:meth:`host_inputs`, :meth:`feature_counts`: grids read in merge's one host read
    and checked against the patch rows) is Qwen2.5-VL's, whose layout this family shares.
    """

    name: ClassVar[str] = "qwen3_vl"
    model_types: ClassVar[tuple[str, ...]] = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
    layout: ClassVar[str] = (
        "flat patch rows [patches, D] with grid [images, 3] (t, h, w) or [images, 2]; videos likewise, "
        "one token block per temporal step; deepstack features cross stage boundaries"
    )

    # -- token side ------------------------------------------------------------------------------
    def _blocks(self, input_ids: Tensor, config: Any, token: int) -> Tensor:
        """``[B]`` blocks of ``token`` per sample: ``vision_start`` followed by it (or runs of it)."""
        try:
            start: int | None = int(config_value(config, "vision_start_token_id"))
        except AttributeError:
            start = None
        if start is not None:
            return ((input_ids[:, :-1] == start) & (input_ids[:, 1:] == token)).sum(dim=1).to(torch.int64)
        hit = input_ids == token
        first = hit.clone()
        first[:, 1:] &= ~hit[:, :-1]
        return first.sum(dim=1).to(torch.int64)

    def media_per_sample(
        self, input_ids: Tensor, config: Any, *, media: Mapping[str, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Images and videos per sample, ``([B], [B])`` int64.

        Images: one per ``vision_start, image`` pair. Videos: each temporal step of a video is its own
        token block, so the blocks are assigned to videos with ``media["video_grid_thw"]`` ``[videos, 3]`` (video
        ``j`` spans ``t_j`` consecutive blocks; one host read checks that every video's blocks lie in
        one sample). Without the grid, a batch with video blocks is refused (one host read to tell): pass
        the grid, or put ``n_videos_per_sample`` in the batch (:meth:`media_counts` does either).

        Raises:
            ValueError: video blocks but no grid; or blocks and grid that do not line up.
        """
        image_id, video_id = self._token_ids(config)
        images = self._blocks(input_ids, config, image_id)
        blocks = self._blocks(input_ids, config, video_id)
        video_grid_thw = None if media is None else media.get("video_grid_thw")
        if video_grid_thw is None:
            if bool((blocks > 0).any()):  # one host read
                raise ValueError(
                    f"{self.name}: samples {(blocks > 0).nonzero().flatten().tolist()} hold video token blocks, "
                    f"one per temporal step, so tokens alone do not tell one 3-step video from three videos; "
                    f"pass media=batch (its video_grid_thw) or put n_videos_per_sample [B] in the batch"
                )
            return images, torch.zeros_like(blocks)
        grid = _grid_thw(video_grid_thw, "video_grid_thw")
        assert grid is not None
        return images, self._videos_from_blocks(blocks, grid)

    def media_counts(self, batch: Mapping[str, Any], config: Any) -> dict[str, Any]:
        """As the base method, counting videos with the batch's ``video_grid_thw`` (see
        :meth:`media_per_sample`)."""
        ids = batch["input_ids"]
        counts: dict[str, Any] = {}
        if batch.get("n_images_per_sample") is None:
            counts["images_per_sample"] = self._blocks(ids, config, self._token_ids(config)[0])
        if batch.get("n_videos_per_sample") is None:
            counts["videos_per_sample"] = self.media_per_sample(ids, config, media=batch)[1]
        return counts

    @staticmethod
    def _videos_from_blocks(blocks: Tensor, grid: Tensor) -> Tensor:
        steps = grid[:, 0].to(blocks.device, torch.int64)  # [videos]
        last_block = torch.cumsum(blocks, 0)  # [B]: one past each sample's last block
        first_of_video = torch.cumsum(steps, 0) - steps  # [videos]
        sample = torch.searchsorted(last_block, first_of_video, right=True)  # [videos]
        ends = sample < blocks.shape[0]
        per_sample = torch.zeros_like(blocks).index_add_(0, sample.clamp(max=blocks.shape[0] - 1), steps * ends)
        B = blocks.shape[0]
        values = torch.cat([per_sample, blocks, (~ends).sum().reshape(1)]).tolist()  # the one host read
        assigned, held, past_the_end = values[:B], values[B : 2 * B], values[-1]
        if assigned != held or past_the_end:
            raise ValueError(
                f"video_grid_thw: its {grid.shape[0]} videos span {int(steps.sum())} temporal steps, "
                f"assigned to samples as {assigned}, but the samples hold {held} video token blocks "
                f"(one per temporal step); a video's blocks must all be in one sample"
            )
        return torch.bincount(sample, minlength=blocks.shape[0]).to(torch.int64)

    # -- media side ------------------------------------------------------------------------------
    def encode_with_deepstack(
        self, model: torch.nn.Module, chunk: VlmMediaChunk
    ) -> tuple[dict[str, Tensor], dict[str, list[Tensor]]]:
        """Run ``visual`` once per present modality.

        Returns:
            ``(features, deepstack)``: ``{modality: [tokens, hidden]}`` and ``{modality: one
            [tokens, hidden] per deepstack level}`` (empty lists without deepstack).
        """
        visual = inner_model(model, "visual", _QWEN3).visual
        dtype = next(visual.parameters()).dtype
        todo: list[tuple[str, Tensor, Tensor]] = []
        for modality, pixels, grid in (
            ("image", chunk.pixel_values, chunk.image_grid),
            ("video", chunk.pixel_values_videos, chunk.video_grid),
        ):
            if pixels is None:
                continue
            grid = _grid_thw(grid, f"{modality} grid")
            if grid is None:
                raise ValueError(f"{modality}: the chunk has {_rows(pixels)} patch rows but no grid")
            if pixels.dim() != 2:
                raise ValueError(
                    f"{modality}: expected flat patch rows [patches, D]; got shape {list(pixels.shape)}"
                )
            todo.append((modality, pixels, grid))
        features: dict[str, Tensor] = {}
        deepstack: dict[str, list[Tensor]] = {}
        for modality, pixels, grid in todo:
            out = visual(pixels.to(dtype), grid_thw=grid)
            features[modality] = out.pooler_output
            deepstack[modality] = list(getattr(out, "deepstack_features", None) or ())
        return features, deepstack

    def encode(self, model: torch.nn.Module, chunk: VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        """The merged features ``{modality: [tokens, hidden]}`` (deepstack sets: :meth:`first_stage`)."""
        return self.encode_with_deepstack(model, chunk)[0]

    def encoder_outputs(self, model: torch.nn.Module, chunk: VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        """``{modality: [tokens, H]}`` and, per deepstack level ``i``, ``{"{modality}.deepstack_{i}":
        [tokens, H]}`` (see :meth:`encoder_output_names`)."""
        features, deepstack = self.encode_with_deepstack(model, chunk)
        outputs = dict(features)
        for modality, sets in deepstack.items():
            outputs.update({f"{modality}.deepstack_{i}": tensor for i, tensor in enumerate(sets)})
        return outputs

    def tp_plan(self, config: Any) -> dict[str, str]:
        """Qwen3-VL's text config has no ``base_model_tp_plan`` in transformers 5.23: attention and MLP
        projections split like Qwen3's, the per-head ``q_norm`` / ``k_norm`` whole with summed gradients."""
        attention = {f"layers.*.self_attn.{n}_proj": "colwise" for n in ("q", "k", "v")}
        norms = {f"layers.*.self_attn.{n}_norm": "replicated_with_grad_allreduce" for n in ("q", "k")}
        mlp = {"layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}
        return {**attention, **norms, "layers.*.self_attn.o_proj": "rowwise", **mlp}

    def encoder_output_names(self, config: Any, modality: str) -> tuple[str, ...]:
        """``modality``, then (images and videos) ``modality.deepstack_{i}`` for each deepstack level."""
        if modality not in ("image", "video"):
            return (modality,)
        return (modality, *(f"{modality}.deepstack_{i}" for i in range(_deepstack_levels(config))))

    # -- positions -------------------------------------------------------------------------------
    def position_ids(
        self,
        model: torch.nn.Module,
        input_ids: Tensor,
        chunk: VlmMediaChunk | None,
        attention_mask: Tensor | None = None,
    ) -> Tensor:
        """Interleaved mrope positions ``[3, b, S]`` from the tokens and the chunk's grids.

        Video timing comes from the timestamp tokens in the text, as in the model's own forward.
        """
        inner = inner_model(model, "visual", _QWEN3)
        image_id, video_id = self._token_ids(model.config)
        image_grid = video_grid = None
        if chunk is not None:
            image_grid = _grid_thw(chunk.image_grid, "image grid") if chunk.pixel_values is not None else None
            video_grid = _grid_thw(chunk.video_grid, "video grid") if chunk.pixel_values_videos is not None else None
        types = (input_ids == image_id).to(torch.int32) + 2 * (input_ids == video_id).to(torch.int32)
        positions, _deltas = inner.get_rope_index(
            input_ids, types, image_grid_thw=image_grid, video_grid_thw=video_grid, attention_mask=attention_mask
        )
        return positions

    # -- pipeline wire format --------------------------------------------------------------------
    def wire_tensors(self, config: Any, first_layer: int) -> tuple[WireTensor, ...]:
        """Positions ``[b, 3, S]`` always; while deepstack levels ``first_layer ..`` are still ahead, the
        visual position mask ``[b, S]`` and one ``deepstack_{i}`` ``[b, S, H]`` per such level."""
        specs = [WireTensor("position_ids", ("b", 3, "S"))]
        levels = _deepstack_levels(config)
        if first_layer < levels:
            specs.append(WireTensor("visual_pos_mask", ("b", "S")))
            specs += [WireTensor(f"deepstack_{i}", ("b", "S", "H"), floating=True) for i in range(first_layer, levels)]
        return tuple(specs)

    def first_stage(
        self,
        model: torch.nn.Module,
        input_ids: Tensor,
        attention_mask: Tensor,
        inputs_embeds: Tensor,
        chunk: VlmMediaChunk | None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Merge, positions, and each deepstack level scattered to the visual positions ``[b, S, H]``."""
        # the one host read; outputs: the features and the deepstack sets, by name
        hidden, masks, outputs = self.merge_with_outputs(model, input_ids, inputs_embeds, chunk)
        wire = {"position_ids": self._wire_positions(model, input_ids, chunk, attention_mask)}
        levels = _deepstack_levels(model.config)
        if levels:
            wire["visual_pos_mask"] = (masks["image"] | masks["video"]).to(torch.int64)
            for level in range(levels):
                # zeros off the visual positions: the model adds level i only at its visual positions
                # only the vision modalities have deepstack sets (Qwen3-Omni's audio has none)
                per_modality = {m: outputs[key] for m in masks if (key := f"{m}.deepstack_{level}") in outputs}
                wire[f"deepstack_{level}"] = self.scatter(torch.zeros_like(inputs_embeds), masks, per_modality)
        return hidden, wire

    def decoder_kwargs(
        self,
        stage: torch.nn.Module,
        layers: range,
        hidden: Tensor,
        attention_mask: Tensor,
        wire: Mapping[str, Tensor],
    ) -> dict[str, Any]:
        """``position_ids`` ``[3, b, S]``; for the stage's layers that have a deepstack level, the
        language model's own ``visual_pos_masks`` and ``deepstack_visual_embeds`` (``[visual, H]`` each).

        The language model adds ``deepstack_visual_embeds[j]`` after its ``j``-th layer, counting the
        stage's layers; the stage's layers are the full model's ``layers``, so entry ``j`` is level
        ``layers[j]``.
        """
        kwargs = super().decoder_kwargs(stage, layers, hidden, attention_mask, wire)  # the positions
        own = [i for i in layers if i < _deepstack_levels(stage.config)]
        if own:
            mask = wire["visual_pos_mask"].bool()
            kwargs["visual_pos_masks"] = mask
            kwargs["deepstack_visual_embeds"] = [wire[f"deepstack_{i}"][mask] for i in own]
        return kwargs
