"""The batches of a parity scenario: the tiny batch in the scenario's sample order (text-only first, a
text-only replica, packed rows, padded to another length), its split into microbatches (plain or
balanced), a replica's share of it, and the per-microbatch table (:func:`microbatch_table`, no
processes needed)."""

from __future__ import annotations

from typing import Any

import torch

from .groups import _Groups
from .report import MicrobatchInfo
from .scenarios import PACKED_PER_ROW, Scenario

__all__ = [
    "microbatch_table",
]


def _split(adapter: Any, config: Any, batch: dict[str, Any], n: int) -> Any:
    from ...producer.split import split_media
    return split_media(batch, n, **adapter.media_counts(batch, config))


def _balanced_split(adapter: Any, config: Any, local: dict[str, Any], n: int) -> Any:
    """``split_media(local, n, balance=adapter's image_costs)``: pops the media from ``local`` and
    reorders its ``[B, ...]`` entries (new tensors; the caller's batch keeps its order)."""
    import functools

    from ...producer.split import split_media

    cost = functools.partial(adapter.image_costs, config=config)
    return split_media(local, n, **adapter.media_counts(local, config), balance=cost)


def _microbatch_infos(adapter: Any, config: Any, batch: dict[str, Any], n: int, dp: int = 1) -> list[MicrobatchInfo]:
    """Per microbatch (per replica with ``dp > 1``: replica ``r``'s microbatch ``k`` holds the global
    batch's ``tensor_split(range(B), dp * n)[r * n + k]`` samples when the shares are even)."""
    ids = batch["input_ids"]
    staged = _split(adapter, config, dict(batch), n * dp)
    placeholders = torch.zeros(ids.shape[0], dtype=torch.int64)
    for mask in adapter.placeholder_masks(ids, config).values():
        placeholders += mask.sum(dim=1)
    infos = []
    for k, (a, b) in enumerate(staged.samples):
        infos.append(
            MicrobatchInfo(
                index=k % n,
                replica=k // n,
                samples=b - a,
                images=staged.images[k],
                videos=staged.videos[k],
                image_rows=staged.image_rows[k],
                video_rows=staged.video_rows[k],
                crop_rows=staged.crop_rows[k],
                placeholder_tokens=int(placeholders[a:b].sum()),
                audios=staged.audios[k],
            )
        )
    return infos


def microbatch_table(family: str, n_microbatches: int = 4, seed: int = 0) -> list[MicrobatchInfo]:
    """What each microbatch of ``family``'s tiny batch holds (builds only the config, no model)."""
    from .. import tiny_models as tiny
    from ...registry import get_adapter

    module = tiny.load(family)
    config = module.build_config()
    return _microbatch_infos(get_adapter(config), config, module.build_batch(seed), n_microbatches)


def _build_batch(tiny_module: Any, scenario: Scenario, seed: int) -> dict[str, Any]:
    """The tiny batch of ``seed``, in the scenario's sample order."""
    if scenario.variant == "text_only_first":
        return dict(tiny_module.build_batch(seed, text_only_first=True))
    if scenario.variant == "text_only_replica":
        return _text_only_first_half(tiny_module, dict(tiny_module.build_batch(seed)))
    return dict(tiny_module.build_batch(seed))


def _pipeline_batch(scenario: Scenario, batch: dict[str, Any], config: Any) -> dict[str, Any]:
    """What the pipeline runs: ``batch``, or with ``/packed`` its :data:`PACKED_PER_ROW` samples a row."""
    if not scenario.packed:
        return batch
    from ..packed import in_order_rows, pack_batch

    pad = getattr(config.get_text_config(), "pad_token_id", None)
    return pack_batch(batch, in_order_rows(int(batch["input_ids"].shape[0]), PACKED_PER_ROW), int(pad or 0))


def _text_only_first_half(tiny_module: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """``B`` samples: the batch's text-only samples, repeated, for the first half; its first half,
    with exactly that half's media (views), for the second."""
    from ...pipeline.parallel import _PER_SAMPLE_MEDIA_KEYS
    from ...registry import get_adapter

    config = tiny_module.build_config()
    adapter = get_adapter(config)
    B = int(batch["input_ids"].shape[0])
    per_sample = _split(adapter, config, dict(batch), B)
    text_only = [k for k in range(B) if per_sample.chunk(k) is None]
    if not text_only:
        raise ValueError("text_only_replica: the tiny batch has no text-only sample")
    # repeated in alternating order, so no two microbatches of the half hold the same rows
    cycled = [i for r in range(B) for i in (text_only if r % 2 == 0 else text_only[::-1])]
    order = cycled[: B // 2] + list(range(B // 2))
    halves = _split(adapter, config, dict(batch), 2)
    media_keys = set(halves.sources.values())
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key in _PER_SAMPLE_MEDIA_KEYS:
            out[key] = torch.cat([torch.zeros_like(value[: B // 2]), value[: B // 2]])
        elif key in media_keys:
            out[key] = halves.chunks[next(f for f, k in halves.sources.items() if k == key)][0]
        elif isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == B:
            out[key] = value[order]
        else:
            out[key] = value
    return out


def _padded(batch: dict[str, Any], config: Any, columns: int) -> dict[str, Any]:
    """``batch`` with ``columns`` more padding positions at the end of every row (another ``S``)."""
    from ...adapters.base import config_value

    ids, mask = batch["input_ids"], batch["attention_mask"]
    pad = int(config_value(config, "pad_token_id", "text_config.pad_token_id"))
    extra = torch.full((ids.shape[0], columns), pad, dtype=ids.dtype)
    return dict(batch, input_ids=torch.cat([ids, extra], 1), attention_mask=torch.cat([mask, torch.zeros_like(extra)], 1))


def _shares(scenario: Scenario, tiny_module: Any, batch: dict[str, Any], media_seed: int, g: _Groups, adapter: Any,
            config: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(media_batch, local, media_local)``: what the pipeline runs (``batch``, packed with ``/packed``; the
    reference runs ``batch``), the batch its media come from, and this replica's shares of both."""
    from ...pipeline import shard_batch

    rows = _pipeline_batch(scenario, batch, config)
    media_batch = _build_batch(tiny_module, scenario, media_seed) if scenario.fault == "wrong_batch" else rows
    media_counts = adapter.media_counts(rows, config)
    if g.dp > 1:
        return media_batch, shard_batch(rows, g.dp_rank, g.dp, **media_counts), shard_batch(media_batch, g.dp_rank, g.dp, **media_counts)
    return media_batch, dict(rows), dict(media_batch)
