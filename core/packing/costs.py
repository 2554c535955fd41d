"""Per-sample vision costs of processor outputs, from the balancing cost model."""

from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = ["sample_costs"]


def sample_costs(samples: Sequence[Mapping[str, Any]], config: Any, adapter: Any = None, pad_id: int = 0) -> np.ndarray:
    """``[samples]`` float: each sample's vision-encoder cost, as ``split_media(..., balance=...)`` costs it.

    The samples are collated unpadded-style (:func:`ppmedia.data.collate_samples`), split one sample
    per microbatch with the adapter's counts (:func:`ppmedia.split_media`), and costed by
    :func:`ppmedia.balance.sample_costs` with the family's encoder model (``adapter.image_costs``).
    Text-only samples cost 0. One host read (the split's).

    Args:
        samples: per-sample processor outputs (:func:`pack_samples`' form, no ``None``).
        config: the model's config; adapter: its adapter (default: the registry's).
        pad_id: the padding id (any: the costs do not depend on it).
    """
    from ..balance import sample_costs as costs_of_split
    from ..data.batching import collate_samples
    from ..producer.split import split_media

    if adapter is None:
        from ..registry import get_adapter

        adapter = get_adapter(config)
    if not samples:
        return np.zeros(0, dtype=np.float64)
    batch: dict[str, Any] = dict(collate_samples([dict(s) for s in samples], pad_id))
    staged = split_media(batch, len(samples), **adapter.media_counts(batch, config))
    patch = getattr(getattr(config, "vision_config", None) or config, "patch_size", None)
    if isinstance(patch, (list, tuple)):
        patch = int(patch[0])
    cost = functools.partial(adapter.image_costs, config=config)
    return np.asarray(costs_of_split(staged, staged.tensors, cost, patch), dtype=np.float64)
