"""Media-aware microbatch balancing, the public names: reorder a batch's samples so every microbatch
carries a similar vision-encoder load.

The cost model (:func:`encoder_flops`, :func:`sample_costs`, :data:`ImageCost`) and the assignment
(:func:`balance_microbatches`, :func:`microbatch_loads`, :func:`restore_order`) live in
:mod:`ppmedia.producer.balancing`, the balancing step of the producer path; :func:`reorder_plan` in
:mod:`ppmedia.producer.assemble`. :func:`balanced_split` is ``split_media(batch, n, balance=...)`` with the
order of the microbatches and the patch size to choose; it runs the same top-down path
(:func:`ppmedia.producer.split.split_in_order`). Nothing on that path imports this module.
"""

from __future__ import annotations

from typing import Any, Mapping, MutableMapping

from .producer.assemble import reorder_plan
from .producer.balancing import (
    DEFAULT_ORDER,
    MICROBATCH_ORDERS,
    BalanceSpec,
    ImageCost,
    balance_microbatches,
    encoder_flops,
    microbatch_loads,
    restore_order,
    sample_costs,
)
from .producer.layouts import LayoutSet
from .producer.split import balance_order, split_in_order
from .producer.staged import StagedMedia

__all__ = [
    "BalanceSpec",
    "ImageCost",
    "MICROBATCH_ORDERS",
    "balance_microbatches",
    "balanced_split",
    "encoder_flops",
    "microbatch_loads",
    "reorder_plan",
    "restore_order",
    "sample_costs",
]


def balanced_split(
    batch: MutableMapping[str, Any],
    n_microbatches: int,
    balance: BalanceSpec,
    *,
    images_per_sample: Any = None,
    videos_per_sample: Any = None,
    audios_per_sample: Any = None,
    batch_size: int | None = None,
    order: str = DEFAULT_ORDER,
    patch_size: int | None = None,
    counts: Mapping[str, Any] | None = None,
    sample_inputs: Any = None,
    layouts: LayoutSet | None = None,
) -> StagedMedia:
    """``split_media(batch, n, balance=...)``: split with the samples reordered for an even vision load.

    The same path as the plain split: validates and reads the metadata once (a per-sample plan),
    computes the costs and :func:`balance_microbatches`, then reorders every staged tensor (one
    ``index_select`` each; the chunks are views of these reordered tensors) and every ``[B, ...]``
    tensor and length-``B`` list left in ``batch`` (in place), and returns the
    :class:`~ppmedia.StagedMedia` of the reordered batch with ``permutation`` set. A ``[B]`` cost
    sequence skips the cost model. No tensor is copied when the permutation is the identity.
    Image-major layouts count ``H * W / patch_size^2`` patches per image: ``patch_size`` defaults to the
    vision patch size of the ``config`` of a ``functools.partial(adapter.image_costs, config=config)``
    cost, else to pixels. ``order``: one of :data:`MICROBATCH_ORDERS`. The other arguments are
    :func:`ppmedia.split_media`'s.
    """
    return split_in_order(batch, n_microbatches, balance_order(balance, order=order, patch_size=patch_size),
                          images_per_sample=images_per_sample, videos_per_sample=videos_per_sample,
                          audios_per_sample=audios_per_sample, batch_size=batch_size, counts=counts,
                          sample_inputs=sample_inputs, layouts=layouts)
