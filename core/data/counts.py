"""The loss's token count: the label tokens of the GLOBAL batch, summed over the replicas."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["global_label_tokens"]


def global_label_tokens(batch: dict[str, Any], dp_group: Any = None) -> int:
    """``batch["n_label_tokens"]`` (a :class:`~ppmedia.data.ReplicaLoader` batch) summed over
    ``dp_group`` (``None``: one replica, no communication): pass it to
    :func:`~ppmedia.pipeline.pipeline_loss` as ``num_valid_tokens``. It may be 0 (no label in the
    whole global batch); ``pipeline_loss`` then gives 0, not NaN. A loader built with ``dp_group``
    summed it already (``batch["global_label_tokens"]``): that is returned, without communication."""
    if "global_label_tokens" in batch:
        return int(batch["global_label_tokens"])
    count = int(batch["n_label_tokens"])
    if dp_group is None:
        return count
    total = torch.tensor(count, dtype=torch.int64)
    dist.all_reduce(total, group=dp_group)
    return int(total)
