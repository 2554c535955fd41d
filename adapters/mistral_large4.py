"""Mistral Large 4 (``mistral_large4``): Pixtral images as Mistral 3, and a text model whose layers
hand state to later layers, carried across pipeline stages.

Media layout: the Mistral 3 one (:mod:`ppmedia.adapters.mistral3`): complete images padded to the
batch's largest ``[images, C, Hmax, Wmax]`` with their true sizes ``image_sizes`` ``[images, 2]``;
``(H // (p * m)) * (W // (p * m))`` ``[IMG]`` tokens per image, ``m = spatial_merge_size`` (3 in the
released checkpoint).

Two kinds of state cross decoder layers (``MistralLarge4TextModel``):

* **DSA top-k indices.** A layer whose ``text_config.indexer_types`` entry is ``"full"`` runs its
  indexer and returns ``topk_indices`` ``[b, S, k]`` (``k = min(index_topk, S)``); a ``"shared"`` layer
  reuses the indices of the layer before it, and raises when it has none ("Shared DSA layers require
  top-k indices ..."), which is what a stage starting on a shared layer gets from the model alone.
  The indices before layer ``j`` cross the boundary when layer ``j`` is shared (wire tensor
  ``topk_indices`` ``[b, S, index_topk]`` int64; shorter rows, ``S < index_topk``, are padded by
  repeating their first index, which leaves the sparse mask the model builds from them unchanged).
* **Shared latent KV.** ``text_config.kv_source_layers[j] = s < j``: layer ``j`` attends to the latent
  KV that layer ``s`` computed (a ``KVSharingDict`` the language model hands every layer, one entry
  per RoPE kind: ``"rope"`` ``(k_pass [b, 1, S, kv_lora_rank], k_rot [b, 1, S, qk_rope_head_dim])`` and
  ``"nope"`` ``(k_pass, k_rot [b, 1, S, 0])``). An entry crosses the boundary before layer ``k`` when a
  layer ``j >= k`` of its kind reads a source ``s < k`` (wire tensors ``kv_rope_pass``,
  ``kv_rope_rot``, ``kv_nope_pass``; floating, so the consumer's gradient reaches the source layer's
  ``kv_a_proj_with_mqa`` on its stage).

Each stage runs its layers through the language model's own ``forward``; the hooks of
:meth:`MistralLarge4Adapter.stage_hooks` put the received indices into its first layer's
``prev_topk_indices`` argument and the received KV into the ``KVSharingDict`` the language model
passes every layer, and read what its last layer returned and the dict held. The last stage applies
the model's logit soft-capping (``final_logit_softcapping``) after ``lm_head``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping, MutableMapping, Sequence

import torch
from torch import Tensor

from ._helpers import softcapped, text_config
from .base import LayerHook, WireTensor, config_value
from .mistral3 import Mistral3Adapter

__all__ = ["MistralLarge4Adapter", "crossing_state", "pad_topk"]

#: the ``KVSharingDict`` keys and the wire-tensor name prefixes of their entries.
_KINDS = ("rope", "nope")




def crossing_state(config: Any, boundary: int) -> tuple[bool, tuple[str, ...]]:
    """What must cross the boundary before layer ``boundary``: ``(topk, kinds)``.

    ``topk``: layer ``boundary`` is a ``"shared"`` indexer layer (it reads the indices of the layer
    before). ``kinds``: the ``KVSharingDict`` entries (``"rope"``, ``"nope"``) a layer at or after the
    boundary reads from a source layer before it. Nothing crosses before layer 0 or past the last.
    """
    text = text_config(config)
    n = int(config_value(text, "num_hidden_layers"))
    if not 0 < boundary < n:
        return False, ()
    indexer = list(config_value(text, "indexer_types"))
    sources = list(config_value(text, "kv_source_layers"))
    rope = list(config_value(text, "no_rope_layers"))
    kinds = {
        "rope" if rope[j] else "nope"
        for j in range(boundary, n)
        if sources[j] != j and sources[j] < boundary
    }
    return indexer[boundary] == "shared", tuple(k for k in _KINDS if k in kinds)


def pad_topk(indices: Tensor, width: int) -> Tensor:
    """``indices`` ``[b, S, k]`` as int64 ``[b, S, width]``: rows shorter than ``width`` repeat their
    first index (a set of indices: the sparse mask scattered from it is the same).

    Raises:
        ValueError: ``k > width`` (more indices than ``index_topk``).
    """
    k = indices.shape[-1]
    if k > width:
        raise ValueError(f"topk_indices: shape {list(indices.shape)}; expected at most {width} (index_topk) per row")
    indices = indices.to(torch.int64)
    if k == width:
        return indices
    return torch.cat([indices, indices[..., :1].expand(*indices.shape[:-1], width - k)], dim=-1)


class MistralLarge4Adapter(Mistral3Adapter):
    """Mistral Large 4 adapter (``MistralLarge4ForConditionalGeneration``).

    The media side is :class:`~ppmedia.adapters.mistral3.Mistral3Adapter`'s (the same module paths:
    ``model.model.get_image_features(pixel_values, image_sizes)``); the pipeline side carries the DSA
    top-k indices and the shared latent KV across stage boundaries (see the module docstring) and
    soft-caps the logits on the last stage.
    """

    name: ClassVar[str] = "mistral_large4"
    context_refusal: ClassVar[str | None] = (
        "its sparse-attention indexer passes top-k key indices over the whole row to the next layer (topk_indices) and shares KV between layers (kv_source_layers)"
    )
    model_types: ClassVar[tuple[str, ...]] = ("mistral_large4",)
    layout: ClassVar[str] = (
        "complete images padded to the batch's largest [images, C, Hmax, Wmax] with true sizes "
        "image_sizes [images, 2]; DSA top-k indices and shared latent KV cross stage boundaries"
    )

    # -- pipeline wire format ---------------------------------------------------------------
    def wire_tensors(self, config: Any, first_layer: int) -> tuple[WireTensor, ...]:
        """Before layer ``first_layer``: ``topk_indices`` ``[b, S, index_topk]`` when it is a shared
        indexer layer; ``kv_{kind}_pass`` ``[b, 1, S, kv_lora_rank]`` (and ``kv_rope_rot`` ``[b, 1, S,
        qk_rope_head_dim]``) for each KV entry a later layer reads from an earlier source."""
        topk, kinds = crossing_state(config, first_layer)
        text = text_config(config)
        specs = []
        if topk:
            specs.append(WireTensor("topk_indices", ("b", "S", int(config_value(text, "index_topk")))))
        rank = int(config_value(text, "kv_lora_rank"))
        for kind in kinds:
            specs.append(WireTensor(f"kv_{kind}_pass", ("b", 1, "S", rank), floating=True))
            if kind == "rope":
                specs.append(WireTensor("kv_rope_rot", ("b", 1, "S", int(config_value(text, "qk_rope_head_dim"))), floating=True))
        return tuple(specs)

    def stage_hooks(
        self, stage: torch.nn.Module, layers: range, state: MutableMapping[str, Tensor]
    ) -> Sequence[LayerHook]:
        """A ``before`` hook on the stage's first layer (received indices into ``prev_topk_indices``,
        received KV into the language model's ``shared_kv_states``) and an ``after`` hook on its last
        (the indices it returned and the dict's entries into ``state``)."""
        if not layers:
            return ()
        decoder = list(getattr(stage, "stage_language_model").layers)
        width = int(config_value(text_config(getattr(stage, "config")), "index_topk"))

        def before(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            indices = state.get("topk_indices")
            if indices is not None:
                # a no-op on the model's indices; torch's shape-inference forward (inferred shapes)
                # hands a later stage uninitialised tensors, which must not index out of range
                kwargs["prev_topk_indices"] = indices.clamp(0, indices.shape[1] - 1)
            shared = kwargs["shared_kv_states"]
            for kind in _KINDS:
                k_pass = state.get(f"kv_{kind}_pass")
                if k_pass is not None:
                    k_rot = state.get(f"kv_{kind}_rot")
                    shared[kind] = (k_pass, k_pass.new_zeros(*k_pass.shape[:-1], 0) if k_rot is None else k_rot)
            return args, kwargs

        def after(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            state["topk_indices"] = pad_topk(output[1], width)
            shared: Mapping[str, tuple[Tensor, Tensor]] = kwargs["shared_kv_states"]
            for kind, (k_pass, k_rot) in shared.items():
                state[f"kv_{kind}_pass"] = k_pass
                if kind == "rope":
                    state["kv_rope_rot"] = k_rot

        return (LayerHook(decoder[0], before=before), LayerHook(decoder[-1], after=after))

    def logits(self, stage: torch.nn.Module, hidden: Tensor) -> Tensor:
        """``lm_head``, then the model's soft-capping ``tanh(logits / c) * c``
        (``c = text_config.final_logit_softcapping``)."""
        return softcapped(super().logits(stage, hidden), getattr(stage, "config"))
