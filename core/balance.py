"""Media-aware microbatch balancing: reorder a batch's samples so every microbatch carries a similar
vision-encoder load.

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
(:func:`encoder_flops`, defined in :mod:`ppmedia.costs`: linear layers per patch plus attention over the
image's patches, windowed layers over a window only).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from typing import Any, Callable, Mapping, MutableMapping, Sequence, Union

import numpy as np
import torch
from torch import Tensor

from .costs import encoder_flops, vision_value
from .layouts import LayoutSet
from .planners import Part
from .splitter import Planned, assemble, default_layouts, plan_split, pop_media
from .staged import StagedMedia, cached_bounds

__all__ = [
    "ImageCost",
    "MICROBATCH_ORDERS",
    "balance_microbatches",
    "balanced_split",
    "encoder_flops",
    "microbatch_loads",
    "restore_order",
    "sample_costs",
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

    B = per_sample.n_microbatches
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

    add(per_sample.images, per_sample.image_rows, pixel_tensors.get("pixel_values"))
    add(per_sample.videos, per_sample.video_rows, pixel_tensors.get("pixel_values_videos"))
    crops = pixel_tensors.get("patch_pixel_values")
    if crops is not None and crops.dim() >= 3:
        crop_rows = np.asarray(per_sample.crop_rows, dtype=np.int64)
        total += crop_rows * float(cost(np.asarray([_image_patches(crops, patch_size)]))[0])
    return total


def _image_patches(tensor: Tensor, patch_size: int | None) -> int:
    h, w = tensor.shape[-2], tensor.shape[-1]
    if patch_size:
        return max(1, (h // patch_size) * (w // patch_size))
    return max(1, h * w)


# --------------------------------------------------------------------------------------------------
# applying it to a batch


def _batch_size(batch: MutableMapping[str, Any], batch_size: int | None) -> int | None:
    if batch_size is not None:
        return batch_size
    ids = batch.get("input_ids")
    return ids.shape[0] if isinstance(ids, Tensor) and ids.dim() >= 1 else None


def _row_keys(batch: MutableMapping[str, Any], media_keys: frozenset[str], B: int) -> list[str]:
    """Keys of the batch's ``[B, ...]`` tensors and length-``B`` lists; refuses any other tensor with
    a dim 0 (it could not follow the reordering, and would silently pair rows with other samples)."""
    keys = []
    for key, value in batch.items():
        if key in media_keys:
            continue
        if isinstance(value, Tensor) and value.dim() >= 1:
            if value.shape[0] != B:
                raise ValueError(
                    f"{key}: shape {list(value.shape)}; expected [{B}, ...] (one row per sample) to reorder "
                    f"with balance=True: compute such tensors after balancing (e.g. Qwen's [3, B, S] "
                    f"position_ids per microbatch in the first stage)"
                )
            keys.append(key)
        elif isinstance(value, list) and len(value) == B:
            keys.append(key)
    return keys


def _gather(tensor: Tensor, ranges: Sequence[tuple[int, int]], order: Sequence[int]) -> tuple[Tensor, list[int]]:
    """``cat(tensor[ranges[s]] for s in order)`` as one ``index_select``, and the lengths in that order."""
    lengths = [ranges[s][1] - ranges[s][0] for s in order]
    if list(order) == sorted(order) and all(ranges[a][1] == ranges[b][0] for a, b in zip(order, order[1:])):
        return tensor, lengths
    index = np.concatenate([np.arange(*ranges[s], dtype=np.int64) for s in order] or [np.zeros(0, np.int64)])
    return tensor.index_select(0, torch.as_tensor(index, device=tensor.device)), lengths


def reorder_plan(per_sample: Planned, permutation: Sequence[int], n_microbatches: int) -> Planned:
    """The per-sample plan (``B`` microbatches of one sample) with its samples in ``permutation`` order,
    cut in ``n_microbatches``: every staged tensor gathered once (nothing copied for the identity)."""
    B = per_sample.batch_size
    bounds, _, samples = cached_bounds(B, n_microbatches)
    order = list(permutation)

    def per_mb(values: Sequence[int]) -> tuple[int, ...]:
        ordered = [values[s] for s in order]
        return tuple(sum(ordered[a:b]) for a, b in zip(bounds, bounds[1:]))

    parts: list[tuple[Any, Part]] = []
    for layout, part in per_sample.parts:
        fields = []
        for f in part.fields:
            tensor, lengths = _gather(f.tensor, f.ranges, order)
            at = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))[list(bounds)].tolist()
            fields.append(f._replace(tensor=tensor, ranges=tuple(zip(at, at[1:])), sizes=tuple(b - a for a, b in zip(at, at[1:]))))
        parts.append((layout, Part(fields, per_mb(part.items), per_mb(part.rows))))
    return Planned(B, bounds, samples, parts, per_sample.popped)


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

    The same path as the plain split (:mod:`ppmedia.splitter`): validates and reads the metadata once
    (a per-sample plan), computes the costs and :func:`balance_microbatches`, then reorders every staged
    tensor (one ``index_select`` each; the chunks are views of these reordered tensors) and every
    ``[B, ...]`` tensor and length-``B`` list left in ``batch`` (in place), and returns the
    :class:`~ppmedia.StagedMedia` of the reordered batch with ``permutation`` set. A ``[B]`` cost
    sequence skips the cost model. No tensor is copied when the permutation is the identity.
    Image-major layouts count ``H * W / patch_size^2`` patches per image: ``patch_size`` defaults to the
    vision patch size of the ``config`` of a ``functools.partial(adapter.image_costs, config=config)``
    cost, else to pixels. The other arguments are :func:`ppmedia.split_media`'s.
    """
    if isinstance(balance, (str, bytes)) or not (
        balance is True or callable(balance) or isinstance(balance, (Sequence, np.ndarray, Tensor))
    ):
        raise TypeError(
            f"balance: got {type(balance).__name__}; expected True, a cost function patches -> costs, "
            f"or [B] per-sample costs"
        )
    layouts = default_layouts() if layouts is None else layouts
    kwargs: dict[str, Any] = dict(images_per_sample=images_per_sample, videos_per_sample=videos_per_sample,
                                  audios_per_sample=audios_per_sample, batch_size=batch_size, counts=counts,
                                  sample_inputs=sample_inputs, layouts=layouts)
    B = _batch_size(batch, batch_size)
    if B is None or B <= 1 or n_microbatches == 1:
        planned = plan_split(batch, n_microbatches, **kwargs)
        staged = assemble(planned, tuple(range(planned.batch_size)))
        pop_media(batch, planned)
        return staged
    popped = layouts.keys.union(sample_inputs or ())
    row_keys = _row_keys(batch, popped, B)
    try:
        per_sample = plan_split(batch, B, **kwargs)  # the batch changes only once everything has succeeded
    except ValueError:
        plan_split(batch, n_microbatches, **kwargs)  # the same error, worded for n microbatches
        raise
    permutation = balance_microbatches(_costs(balance, assemble(per_sample), B, patch_size), n_microbatches, order=order)
    staged = assemble(reorder_plan(per_sample, permutation, n_microbatches), tuple(permutation))
    pop_media(batch, per_sample)
    if permutation != list(range(B)):
        index = torch.as_tensor(permutation, dtype=torch.int64)
        for key in row_keys:
            value = batch[key]
            batch[key] = value.index_select(0, index.to(value.device)) if isinstance(value, Tensor) else [value[s] for s in permutation]
    return staged


def _costs(balance: BalanceSpec, per_sample: StagedMedia, B: int, patch_size: int | None) -> np.ndarray:
    if patch_size is None and isinstance(balance, functools.partial):  # partial(adapter.image_costs, config=...)
        config = balance.keywords.get("config")
        patch_size = vision_value(config, "patch_size") if config is not None else None
        if isinstance(patch_size, (list, tuple)) and len(patch_size) == 2:  # (ph, pw), as InternVL's config gives it
            patch_size = math.isqrt(int(patch_size[0]) * int(patch_size[1]))
    if callable(balance) or balance is True:
        return sample_costs(per_sample, per_sample.tensors, None if balance is True else balance, patch_size)
    costs = _as_costs(balance)
    if costs.size != B:
        raise ValueError(f"balance: {costs.size} costs; expected {B} (one per sample)")
    return costs
