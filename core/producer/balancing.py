"""The balancing step of the producer path: which sample goes to which microbatch, for a similar
vision-encoder load in every microbatch (the cost model and the assignment; public as :mod:`ppmedia.balance`).

The first pipeline stage runs the vision encoder on its microbatch's media. ``tensor_split`` gives
microbatch ``k`` contiguous samples, so a batch whose images sit in a few samples (bucketed data,
mixed text-only and image datasets) gives a few microbatches all the vision work and stalls every
other stage. :func:`balance_microbatches` returns a permutation of the samples, with the schedule's
microbatch sizes unchanged, that minimises the largest per-microbatch cost;
``split_media(..., balance=True)`` applies it to the media and to every ``[B, ...]`` tensor of the
batch. The loss of a step is normalised by the whole batch's valid tokens, so reordering samples
changes nothing but time (tested: loss and every gradient equal to the unbalanced run within 1e-5).

Costs: per encoder sequence (an image, a video, a crop) ``cost(patches)``; a sample's cost is the sum
over its sequences. The default is linear in patches; :meth:`VlmAdapter.image_costs
<ppmedia.adapters.base.VlmAdapter.image_costs>` gives the family's encoder model
(:func:`encoder_flops`: linear layers per patch plus attention over the image's patches, windowed
layers over a window only).

:func:`balanced_permutation` is the row order ``split_media(balance=...)`` asks for: it reads a
per-sample :class:`~ppmedia.producer.assemble.Planned` (no host read, no view) and returns a permutation; it
calls nothing above it. Another row-order strategy (packing's) takes the same place.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from typing import Any, Callable, Mapping, Sequence, Union

import numpy as np
import torch
from torch import Tensor

from .assemble import Planned
from ..planning.costs import encoder_flops, vision_value

__all__ = [
    "ImageCost",
    "MICROBATCH_ORDERS",
    "balance_microbatches",
    "balanced_permutation",
    "encoder_flops",
    "microbatch_loads",
    "restore_order",
    "sample_costs",
    "vision_value",
]

#: ``patches`` (int64 ``[sequences]``) -> relative cost ``[sequences]`` (float).
ImageCost = Callable[[np.ndarray], np.ndarray]
#: what ``split_media(balance=...)`` accepts besides ``False``: ``True`` (cost linear in patches), an
#: :data:`ImageCost`, or per-sample costs ``[B]``.
BalanceSpec = Union[bool, ImageCost, Sequence[float], np.ndarray, Tensor]

#: how the balanced microbatches are ordered: ``heavy_first`` (descending load), ``heavy_last``,
#: ``assigned`` (the order the heuristic filled them in).
MICROBATCH_ORDERS: tuple[str, ...] = ("heavy_first", "heavy_last", "assigned")
DEFAULT_ORDER = "heavy_first"


# --------------------------------------------------------------------------------------------------
# the assignment


def _sizes(batch_size: int, n: int) -> list[int]:
    """``torch.tensor_split(range(B), n)`` sizes: the first ``B % n`` get one more."""
    q, r = divmod(batch_size, n)
    return [q + 1] * r + [q] * (n - r)


def _as_costs(costs: Any) -> np.ndarray:
    if isinstance(costs, Tensor):
        costs = costs.detach().cpu().numpy()
    values = np.asarray(costs, dtype=np.float64)
    if values.ndim != 1:
        raise ValueError(f"costs: shape {list(values.shape)}; expected [B] (one cost per sample)")
    if values.size and (not np.isfinite(values).all() or values.min() < 0):
        bad = int(np.flatnonzero(~np.isfinite(values) | (values < 0))[0])
        raise ValueError(f"costs: sample {bad} has {values[bad]}; expected a finite cost >= 0")
    return values


def _lpt(costs: np.ndarray, sizes: list[int]) -> list[list[int]]:
    """Longest processing time first, each microbatch capped at its size: every sample, heaviest
    first, goes to the lightest microbatch that still has room (ties: the lower index)."""
    groups: list[list[int]] = [[] for _ in sizes]
    heap = [(0.0, k) for k, size in enumerate(sizes) if size > 0]
    heapq.heapify(heap)
    for s in sorted(range(costs.size), key=lambda i: (-costs[i], i)):
        load, k = heapq.heappop(heap)
        groups[k].append(s)
        if len(groups[k]) < sizes[k]:
            heapq.heappush(heap, (load + costs[s], k))
    return groups


def _improve(costs: np.ndarray, groups: list[list[int]], rounds: int = 200) -> list[list[int]]:
    """Local search: swap one sample of the heaviest microbatch with one of another microbatch while
    that lowers the heavier of the two below the current maximum (sizes never change)."""
    loads = [float(costs[g].sum()) for g in groups]
    for _ in range(rounds):
        top = max(range(len(groups)), key=lambda k: loads[k])
        best: tuple[float, int, int, int] | None = None
        for other, group in enumerate(groups):
            if other == top:
                continue
            for i, a in enumerate(groups[top]):
                for j, b in enumerate(group):
                    delta = costs[a] - costs[b]
                    if delta <= 0:
                        continue
                    worse = max(loads[top] - delta, loads[other] + delta)
                    if worse < loads[top] - 1e-12 and (best is None or worse < best[0]):
                        best = (worse, other, i, j)
        if best is None:
            break
        _, other, i, j = best
        a, b = groups[top][i], groups[other][j]
        groups[top][i], groups[other][j] = b, a
        loads[top] += costs[b] - costs[a]
        loads[other] += costs[a] - costs[b]
    return groups


def balance_microbatches(
    costs: Sequence[float] | np.ndarray | Tensor, n_microbatches: int, *, order: str = DEFAULT_ORDER
) -> list[int]:
    """A permutation of the samples that minimises the largest per-microbatch cost.

    Microbatch ``k`` of the reordered batch holds the samples ``permutation[bounds[k]:bounds[k+1]]``
    with the schedule's sizes (``torch.tensor_split``: B=10, n=4 gives 3, 3, 2, 2). The assignment is
    LPT (heaviest sample first, into the lightest microbatch with room) followed by pairwise swaps out
    of the heaviest microbatch. Against brute force over every assignment on 1,000 random cases
    (``tests/test_balance.py``: B <= 9, n <= 5, 40% text-only samples) its maximum was optimal in 974,
    1.0008x the optimum on average, 1.094x at worst.
    Within a microbatch, samples keep their original order. When the plain split is already as good
    (same maximum), the identity is returned, so balancing an even batch moves nothing.

    Args:
        costs: ``[B]`` per-sample costs (``>= 0``), e.g. from :func:`sample_costs`.
        n_microbatches: the schedule's ``n_microbatches``.
        order: microbatch order after assignment, one of :data:`MICROBATCH_ORDERS`. ``heavy_first``
            (the default) starts the heaviest microbatch first (measured in docs/performance.md).

    Returns:
        ``permutation``, a list of ``B`` sample indices: position ``i`` of the balanced batch holds
        original sample ``permutation[i]``.
    """
    if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ValueError(f"n_microbatches: got {n_microbatches!r}; expected an int >= 1")
    if order not in MICROBATCH_ORDERS:
        raise ValueError(f"order: got {order!r}; expected one of {', '.join(MICROBATCH_ORDERS)}")
    values = _as_costs(costs)
    B = values.size
    sizes = _sizes(B, n_microbatches)
    identity = list(range(B))
    if B <= 1 or n_microbatches == 1:
        return identity
    groups = _improve(values, _lpt(values, sizes))
    for g in groups:
        g.sort()
    loads = [float(values[g].sum()) for g in groups]
    if order != "assigned":
        # the equal-size microbatches (first B % n have one more) are ordered among themselves only
        ranked: list[list[int]] = []
        for size in sorted(set(sizes), reverse=True):
            same = [k for k in range(len(groups)) if len(groups[k]) == size]
            same.sort(key=lambda k: (-loads[k], k) if order == "heavy_first" else (loads[k], k))
            ranked += [groups[k] for k in same]
        groups = ranked
    permutation = list(itertools.chain.from_iterable(groups))
    plain = microbatch_loads(values, n_microbatches)
    if max(plain) <= max(loads) + 1e-12 * max(1.0, max(loads)):
        return identity
    return permutation


def microbatch_loads(
    costs: Sequence[float] | np.ndarray | Tensor, n_microbatches: int, permutation: Sequence[int] | None = None
) -> list[float]:
    """Per-microbatch sums of ``costs`` (``[B]``) under ``permutation`` (default: the plain split)."""
    values = _as_costs(costs)
    if permutation is not None:
        values = values[np.asarray(list(permutation), dtype=np.int64)]
    bounds = np.concatenate(([0], np.cumsum(_sizes(values.size, n_microbatches))))
    return [float(values[a:b].sum()) for a, b in zip(bounds, bounds[1:])]


def restore_order(values: Tensor | Sequence[Any], permutation: Sequence[int]) -> Any:
    """Map per-sample results of the balanced batch back to the original order.

    ``values[i]`` belongs to original sample ``permutation[i]``; returns ``out`` with ``out[s]`` the
    result of original sample ``s`` (a tensor indexed along dim 0, or a list).
    """
    inverse = np.argsort(np.asarray(list(permutation), dtype=np.int64), kind="stable")
    if isinstance(values, Tensor):
        if values.shape[0] != len(inverse):
            raise ValueError(f"values: shape {list(values.shape)}; expected [{len(inverse)}, ...] (one row per sample)")
        return values.index_select(0, torch.as_tensor(inverse, device=values.device))
    if len(values) != len(inverse):
        raise ValueError(f"values: {len(values)} entries; expected {len(inverse)} (one per sample)")
    return [values[i] for i in inverse.tolist()]


# --------------------------------------------------------------------------------------------------
# costs


def sample_costs(per_sample: Any, pixel_tensors: dict[str, Tensor], image_cost: ImageCost | None = None, patch_size: int | None = None) -> np.ndarray:
    """``[B]`` vision cost of each sample from a per-sample split (``split_media(batch, B)``).

    Sequences per sample and their patches: flat or patch-major patch rows (``pixel_values``
    ``[patches, ...]`` with a patch grid) give the sample's rows spread evenly over its images; an
    image-major tensor (``[images, C, H, W]``, crops ``[images, crops, C, H, W]``) gives one sequence
    per image (per crop slot) of ``H * W / patch_size^2`` patches (``H * W`` without a patch size);
    videos their rows per video; Step3 crops one sequence per crop. No host read (shapes and the split's
    host counts only).
    """
    return _costs_of(per_sample.n_microbatches, (per_sample.images, per_sample.image_rows),
                     (per_sample.videos, per_sample.video_rows), per_sample.crop_rows, pixel_tensors, image_cost, patch_size)


def _costs_of(B: int, images: tuple[Sequence[int], Sequence[int]], videos: tuple[Sequence[int], Sequence[int]],
              crop_rows: Sequence[int], pixel_tensors: Mapping[str, Tensor], image_cost: ImageCost | None,
              patch_size: int | None) -> np.ndarray:
    """:func:`sample_costs` from per-sample ``(items, rows)`` of images and videos and Step3's crop rows."""
    def cost(patches: np.ndarray) -> np.ndarray:
        if image_cost is None:
            return patches.astype(np.float64)
        values = np.asarray(image_cost(patches), dtype=np.float64)
        if values.shape != patches.shape:
            raise ValueError(
                f"balance: the cost function returned shape {list(values.shape)} for {patches.size} "
                f"sequences; expected [{patches.size}] (one cost per image, video or crop)"
            )
        return values

    total = np.zeros(B, dtype=np.float64)

    def add(counts: Sequence[int], rows: Sequence[int], tensor: Tensor | None) -> None:
        counts_a = np.asarray(counts, dtype=np.int64)
        rows_a = np.asarray(rows, dtype=np.int64)
        if tensor is None or not counts_a.any():
            return
        if rows_a.sum() != counts_a.sum():  # patch rows (flat or patch-major): spread over the sample's items
            has = counts_a > 0
            patches = np.where(has, rows_a // np.maximum(counts_a, 1), 0)
            total[has] += counts_a[has] * cost(patches[has])
            return
        sequences = 1
        if tensor.dim() == 3:  # padded patches [images, max_patches, D]
            per_item = tensor.shape[1]
        elif tensor.dim() >= 4:  # complete images [images, C, H, W] or crops [images, crops, C, H, W]
            per_item = _image_patches(tensor, patch_size)
            sequences = tensor.shape[1] if tensor.dim() == 5 else 1
        else:
            per_item = 1
        total[:] += counts_a * sequences * float(cost(np.asarray([per_item]))[0])

    add(*images, pixel_tensors.get("pixel_values"))
    add(*videos, pixel_tensors.get("pixel_values_videos"))
    crops = pixel_tensors.get("patch_pixel_values")
    if crops is not None and crops.dim() >= 3:
        total += np.asarray(crop_rows, dtype=np.int64) * float(cost(np.asarray([_image_patches(crops, patch_size)]))[0])
    return total


def _image_patches(tensor: Tensor, patch_size: int | None) -> int:
    h, w = tensor.shape[-2], tensor.shape[-1]
    if patch_size:
        return max(1, (h // patch_size) * (w // patch_size))
    return max(1, h * w)


# --------------------------------------------------------------------------------------------------
# the row-order strategy of split_media(balance=...)


def balanced_permutation(
    balance: BalanceSpec, per_sample: Planned, n_microbatches: int, *, order: str = DEFAULT_ORDER,
    patch_size: int | None = None,
) -> list[int]:
    """The row order of ``split_media(batch, n, balance=...)``: :func:`balance_microbatches` of the
    per-sample costs of ``per_sample`` (the batch planned as ``B`` microbatches of one sample each).

    ``balance``: ``True`` (cost linear in patches), an :data:`ImageCost`, or ``[B]`` per-sample costs
    (the cost model skipped). ``patch_size`` defaults to the vision patch size of the ``config`` of a
    ``functools.partial(adapter.image_costs, config=config)`` cost, else to pixels. No host read.
    """
    B = per_sample.batch_size
    if patch_size is None and isinstance(balance, functools.partial):  # partial(adapter.image_costs, config=...)
        config = balance.keywords.get("config")
        patch_size = vision_value(config, "patch_size") if config is not None else None
        if isinstance(patch_size, (list, tuple)) and len(patch_size) == 2:  # (ph, pw), as InternVL's config gives it
            patch_size = math.isqrt(int(patch_size[0]) * int(patch_size[1]))
    if callable(balance) or balance is True:
        tensors = {f.name: f.tensor for _, part in per_sample.parts for f in part.fields}
        zero = (0,) * B
        items, rows = per_sample.items, per_sample.rows
        costs = _costs_of(B, (items.get("image", zero), rows.get("image", zero)), (items.get("video", zero), rows.get("video", zero)),
                          rows.get("crop", zero), tensors, None if balance is True else balance, patch_size)
    else:
        costs = _as_costs(balance)
        if costs.size != B:
            raise ValueError(f"balance: {costs.size} costs; expected {B} (one per sample)")
    return balance_microbatches(costs, n_microbatches, order=order)
