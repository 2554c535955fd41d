"""Packed rows on the pipeline's stages: which families can isolate samples, their masks and positions.

A packed microbatch's ``attention_mask`` ``[b, S]`` holds sample numbers (1, 2, ... per row; 0 on
padding) and travels between stages as the plain mask does. On every stage of a packed pipeline
(:func:`enable_packing`) the language model gets per-sample positions (the adapter's
``packed_position_ids``) and a dense 4-D mask (:func:`isolate`): whatever mask the family builds for
the row (causal, its sliding window, Gemma 3's image blocks, PaliGemma's prefix) AND "same sample".
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import Tensor

__all__ = ["PACKED_ATTENTION", "enable_packing", "isolate", "packing_problem", "rows_as_samples"]

#: attention implementations whose packed masks ppmedia builds (dense 4-D: bool for ``sdpa``, additive
#: float for ``eager``); flash-attention would need ``cu_seqlens``, flex a ``BlockMask``
PACKED_ATTENTION: tuple[str, ...] = ("sdpa", "eager")
_LAYERS = ("full_attention", "sliding_attention")


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def packing_problem(config: Any, adapter: Any = None) -> str | None:
    """Why samples packed into one row would not stay isolated on this model, in words, or ``None``.

    Refused: decoder layers other than full or sliding-window attention (linear attention, recurrent
    or convolutional layers carry state along the row, across sample boundaries); chunked attention
    (Llama 4: chunks aligned to row positions, not to each sample's); an attention implementation
    outside :data:`PACKED_ATTENTION`; an adapter whose ``packing_refusal`` says why. Sliding windows are
    kept exactly (the window is a distance, the same inside a row as in the sample alone).
    """
    text = _text_config(config)
    model_type = getattr(config, "model_type", "?")
    name = getattr(adapter, "name", None)
    family = model_type if name in (None, model_type) else f"{model_type} ({name} adapter)"
    refusal = getattr(adapter, "packing_refusal", None)
    if refusal:
        return f"{family}: {refusal}"
    if getattr(text, "attention_chunk_size", None):
        return (f"{family}: chunked attention (attention_chunk_size={text.attention_chunk_size}) cuts a row into "
                f"chunks at row positions, not at each sample's, so a packed sample sees other chunks than alone")
    types = list(getattr(text, "layer_types", None) or [])
    other = sorted({t for t in types if t not in _LAYERS})
    if other:
        return (f"{family}: decoder layers of type {', '.join(other)} are not plain attention (state carried along "
                f"the row, or keys selected over the whole row) and cannot keep packed samples apart; packing "
                f"supports {' and '.join(_LAYERS)} layers")
    impl = getattr(text, "_attn_implementation", None) or "sdpa"
    if impl not in PACKED_ATTENTION:
        return (f"{family}: attention implementation {impl!r}; packed masks are dense 4-D masks for "
                f"{' / '.join(PACKED_ATTENTION)} (set attn_implementation='sdpa')")
    return None


def enable_packing(modules: Iterable[Any], enabled: bool = True) -> None:
    """Mark pipeline stage modules (or ``PipelineStage`` objects) as taking packed rows, or not.

    Every stage of the pipeline, on every rank, must agree: call it wherever the stages are built.

    Raises:
        ValueError: the family cannot isolate packed samples (:func:`packing_problem`), naming it and why.
    """
    for module in modules:
        module = getattr(module, "submod", module)
        if enabled:
            problem = packing_problem(module.config, module.adapter)
            if problem is not None:
                raise ValueError(f"sequence packing refused for {problem}")
        module.packed = bool(enabled)


def _sliding_window(text: Any) -> int | None:
    window = getattr(text, "sliding_window", None)
    types = list(getattr(text, "layer_types", None) or [])
    return int(window) if window and "sliding_attention" in types else None


def _allowed(mask: Tensor | None, same: Tensor, causal: Tensor, window: int | None, S: int) -> Tensor:
    """bool ``[b, 1, S, S]``: ``mask`` (a built 4-D mask, bool or additive float; ``None``: causal with
    ``window``) AND same sample, the diagonal kept (a padding query attends itself: no empty row)."""
    if mask is None:
        base = causal
        if window is not None:
            index = torch.arange(S, device=same.device)
            base = base & ((index[:, None] - index[None, :]) < window)
    elif mask.dtype == torch.bool:
        base = mask
    else:
        base = mask == 0
    eye = torch.eye(S, dtype=torch.bool, device=same.device)
    return (base & same) | eye


def _as_implementation(allowed: Tensor, impl: str, dtype: torch.dtype) -> Tensor:
    if impl == "eager":
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)
    return allowed


def isolate(config: Any, hidden: Tensor, mask: Any, segments: Tensor) -> Any:
    """The mask(s) for a stage's language model on packed rows.

    Args:
        config: the model's (or text) config: ``layer_types``, ``sliding_window``, ``_attn_implementation``.
        hidden: ``[b, S, H]`` (dtype, device).
        mask: what the stage would pass otherwise: the 0/1 mask ``[b, S]`` (the language model would
            build its own: causal, plus the window for ``sliding_attention`` layers), or the family's
            own prepared mask (``[b, 1, S, S]`` bool / additive float, ``None`` for plain causal), or a
            dict of those by layer type.
        segments: ``[b, S]`` sample numbers (0 padding).

    Returns:
        The same form, each mask ANDed with "same sample" (``[b, 1, S, S]``, bool for ``sdpa``,
        additive float for ``eager``); a plain mask becomes a tensor, or a dict by layer type when
        the model has sliding-window layers.
    """
    text = _text_config(config)
    impl = getattr(text, "_attn_implementation", None) or "sdpa"
    S = segments.shape[1]
    same = (segments[:, None, :, None] == segments[:, None, None, :])
    causal = torch.ones(S, S, dtype=torch.bool, device=segments.device).tril()
    window = _sliding_window(text)

    def one(value: Any, sliding: bool) -> Tensor:
        built = value if isinstance(value, Tensor) and value.dim() == 4 else None
        if value is not None and built is None and not (isinstance(value, Tensor) and value.dim() == 2):
            raise TypeError(f"packed rows: a prepared mask of type {type(value).__name__}; expected a 4-D tensor")
        allowed = _allowed(built, same, causal, window if sliding else None, S)
        return _as_implementation(allowed, impl, hidden.dtype)

    if isinstance(mask, dict):
        return {kind: one(value, kind == "sliding_attention") for kind, value in mask.items()}
    if isinstance(mask, Tensor) and mask.dim() == 4 or mask is None:
        return one(mask, False)
    if window is None:
        return one(mask, False)
    return {"full_attention": one(mask, False), "sliding_attention": one(mask, True)}


def rows_as_samples(segments: Tensor) -> list[tuple[int, int, int]]:
    """``(row, start, stop)`` of every sample of packed rows, in row order (one host read of ``segments``)."""
    runs: list[tuple[int, int, int]] = []
    for r, row in enumerate(segments.tolist()):
        start = 0
        for t in range(1, len(row) + 1):
            if t == len(row) or row[t] != row[start]:
                if row[start] != 0:
                    runs.append((r, start, t))
                start = t
    return runs
