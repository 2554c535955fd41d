"""What a :class:`~ppmedia.pipeline.StageModule` does differently under context parallelism (its
``context`` set by :func:`~ppmedia.pipeline.enable_context_parallel`): the first stage pads the row
and keeps its share after the merge (:func:`pad_row`, :func:`shard_first_stage`); every stage gives its
language model global positions and the mask as index vectors (:func:`context_decoder_kwargs`)."""

from __future__ import annotations

from typing import Any, ContextManager, Mapping

import torch
from torch import Tensor

from .context_parallel import padded_length
from .cp_attention import CpMask, cp_mask_scope

__all__ = ["context_decoder_kwargs", "pad_row", "pad_sample_inputs", "shard_first_stage"]


def _pad_id(config: Any) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for source in (text, config):
        value = getattr(source, "pad_token_id", None)
        if value is not None:
            return int(value)
    return 0


def pad_row(stage: Any, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(input_ids, attention_mask)`` ``[b, S]`` padded after every real token to a multiple of
    ``2 x cp`` (the pad id, mask 0; the loss pads the labels with ignored ones)."""
    S = padded_length(input_ids.shape[1], stage.context.size)
    extra = S - input_ids.shape[1]
    if extra == 0:
        return input_ids, attention_mask
    b = input_ids.shape[0]
    ids = torch.cat([input_ids, input_ids.new_full((b, extra), _pad_id(stage.config))], dim=1)
    mask = torch.cat([attention_mask, attention_mask.new_zeros((b, extra))], dim=1)
    return ids, mask


def pad_sample_inputs(stage: Any, wire: dict[str, Tensor], S: int) -> None:
    """Pad the per-sample inputs in ``wire`` (``token_type_ids`` ``[b, S0]``, ...) with zeros to the padded
    row length ``S``, in place (the padding's keys are masked out; its queries carry no label)."""
    for spec in stage.adapter.sample_inputs:
        tensor = wire.get(spec.key)
        if tensor is None or "S" not in spec.shape:
            continue
        dim = list(spec.shape).index("S")
        extra = S - tensor.shape[dim]
        if extra > 0:
            shape = list(tensor.shape)
            shape[dim] = extra
            wire[spec.key] = torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)


def shard_first_stage(stage: Any, hidden: Tensor, attention_mask: Tensor,
                      wire: Mapping[str, Tensor]) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """After the merge on the full row: this rank's share of the hidden states ``[b, S, H]``, the mask
    ``[b, S]`` and every wire tensor, each cut on its own sequence axis (``"S"`` in its declared shape:
    mRoPE positions ``[b, 3, S]`` on dim 2)."""
    shard = stage.context
    out = dict(wire)
    for spec in stage.adapter.stage_wire_tensors(stage.config, 0):
        if "S" in spec.shape and spec.name in out:
            out[spec.name] = shard.shard(out[spec.name], list(spec.shape).index("S"))
    for name, tensor in wire.items():  # stage 0's own (not sent): the same cut when they span the row
        if name not in out or out[name] is not tensor:
            continue
        if tensor.dim() >= 2 and tensor.shape[0] == hidden.shape[0] and tensor.shape[1] == hidden.shape[1]:
            out[name] = shard.shard(tensor, 1)
    return shard.shard(hidden, 1), shard.shard(attention_mask, 1), out


def context_decoder_kwargs(stage: Any, kwargs: dict[str, Any], hidden: Tensor, segments: Tensor,
                           wire: Mapping[str, Tensor]) -> ContextManager[None]:
    """Edit a stage's language-model keywords for its share of the row, in place, and return the scope
    that sets its :class:`~ppmedia.pipeline.cp_attention.CpMask`: global positions (packed rows: the
    adapter's per-sample positions of the whole row; 1-D families: the global indices), no mask tensor
    (the attention builds it from index vectors), the family's bidirectional blocks from the whole row."""
    shard = stage.context
    S = hidden.shape[1] * shard.size
    q_index = shard.indices(S, device=hidden.device)
    k_index = shard.gathered_indices(S, device=hidden.device)
    full_segments = shard.gather(segments, 1)
    if stage.packed:
        positions = stage.adapter.packed_position_ids(stage, full_segments)
        if positions is not None:
            kwargs["position_ids"] = positions.index_select(-1, q_index)
    if "position_ids" not in kwargs:
        kwargs["position_ids"] = q_index.unsqueeze(0).expand(hidden.shape[0], -1)
    kwargs["attention_mask"] = None
    blocks = None
    full_wire = {name: shard.gather(t, 1) for name, t in wire.items()
                 if not t.is_floating_point() and t.dim() == 2 and t.shape[1] == hidden.shape[1]}
    hook = getattr(stage.adapter, "attention_blocks", None)
    if hook is not None:
        blocks = hook(stage.config, full_wire)
    valid = full_segments.ne(0).to(full_segments.dtype)
    key_segments = full_segments if stage.packed else valid
    mask = CpMask(
        q_index=q_index, k_index=k_index,
        q_segment=key_segments.index_select(1, q_index), k_segment=key_segments.index_select(1, k_index),
        packed=bool(stage.packed),
        q_block=None if blocks is None else blocks.index_select(1, q_index),
        k_block=None if blocks is None else blocks.index_select(1, k_index),
        group=shard.group,
        blocks_windowed=bool(getattr(stage.adapter, "attention_blocks_windowed", True)),
        soft_capping=getattr(stage, "context_base_attention", "sdpa") == "eager",
    )
    return cp_mask_scope(mask)
