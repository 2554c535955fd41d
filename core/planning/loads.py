"""Per-microbatch vision loads of a batch, plain and balanced: what ``ppmedia plan`` prints and the
step model plans ``layers_per_stage="auto"`` with (:func:`ppmedia.planning.stepmodel.auto_layer_split`).
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["plan_batch"]


def plan_batch(batch: dict[str, Any], n_microbatches: int, adapter: Any = None, config: Any = None) -> dict[str, Any]:
    """Per-sample costs, the plain and balanced per-microbatch loads and media (images + videos) counts,
    and the balancing permutation.

    Args:
        batch: a processor batch with ``input_ids`` ``[B, S]`` (not modified).
        n_microbatches: the schedule's microbatches.
        adapter, config: the family's adapter and model config: costs are its encoder cost
            (:meth:`~ppmedia.adapters.base.VlmAdapter.image_costs`, in MFLOP) and its per-sample media
            counts; without them, costs are patches.

    Returns:
        ``{"unit", "costs" [B], "permutation" [B], "loads" [n_microbatches], "balanced_loads",
        "images" [n_microbatches] (images + videos), "balanced_images"}``.
    """
    from ..balance import balance_microbatches, microbatch_loads, sample_costs
    from ..producer.split import split_media

    work = dict(batch)
    kwargs: dict[str, Any] = {}
    if adapter is not None and config is not None and "input_ids" in work:
        kwargs = dict(adapter.media_counts(work, config))
    ids = work.get("input_ids")
    B = ids.shape[0] if ids is not None and ids.dim() else None
    if not B:
        raise ValueError("batch: no input_ids [B, S] to plan for")
    per_sample = split_media(work, B, **kwargs)
    if adapter is not None and config is not None:
        costs = sample_costs(per_sample, per_sample.tensors, functools.partial(adapter.image_costs, config=config)) / 1e6
        unit = "MFLOP"
    else:
        costs, unit = sample_costs(per_sample, per_sample.tensors), "patches"
    permutation = balance_microbatches(costs, n_microbatches)
    images = [float(i + v) for i, v in zip(per_sample.images, per_sample.videos)]
    return {
        "unit": unit,
        "costs": costs.tolist(),
        "permutation": permutation,
        "loads": microbatch_loads(costs, n_microbatches),
        "balanced_loads": microbatch_loads(costs, n_microbatches, permutation),
        "images": microbatch_loads(images, n_microbatches),
        "balanced_images": microbatch_loads(images, n_microbatches, permutation),
    }
