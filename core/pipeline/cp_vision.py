"""Frame sharding: the vision tower's items divided over the ``cp`` ranks of stage 0, gathered back.

Under context parallelism every ``cp`` rank of stage 0 holds the same rows, so each would encode all of a
microbatch's media. With frame sharding (``--cp-vision shard``) each rank encodes only its share of the
microbatch's media ITEMS (each a sequence the tower attends within: a whole image, or one temporal
patch of a video where the tower attends frame by frame; never a piece of one), the items assigned
longest first to the least loaded rank by the family's vision cost model (:meth:`VlmAdapter.image_costs
<ppmedia.adapters.base.VlmAdapter.image_costs>`: :func:`assign_items`), through the family's own
``encode``. The features ``[rows, H]`` are then all-gathered over ``cp`` (:class:`GatherRows`: padded to the
largest share) and put back in item order, so the merge sees exactly the replicated tower's features.

Gradients: the gather's backward sums the gathered gradient over ``cp`` and hands each rank the rows it
encoded, so every item's tower backward runs once, on its owner, with the WHOLE row's gradient; the tower
gradients are then summed over ``cp`` by :func:`~ppmedia.pipeline.reduce_context_gradients` (ranks
without the item add 0), which counts each item exactly once. A rank with no item of a modality still
joins that modality's gather (a zero-row share that requires grad, so its backward joins the sum too).

Which families shard is decided here, in :data:`VISION_SHARDING` (adapter name -> item splitter) and
:func:`vision_shard_problem`: the Qwen2-VL / Qwen2.5-VL layout (flat patch rows with a ``(t, h, w)`` grid
per image and per video; the tower attends within one image or one temporal patch). Every other family keeps the
replicated tower: towers with outputs beyond one feature row per placeholder (Qwen3-VL's deepstack), audio
encoders (the Omni thinkers), and layouts without a per-item splitter here.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from ..chunk import VlmMediaChunk

__all__ = [
    "CP_VISION_MODES",
    "GatherRows",
    "MediaItem",
    "VISION_SHARDING",
    "assign_items",
    "resolve_cp_vision",
    "sharded_encode",
    "vision_shard_problem",
    "vision_sharded",
]

#: the values of ``--cp-vision``
CP_VISION_MODES = ("shard", "replicate")


@dataclass(frozen=True)
class MediaItem:
    """One unit of a chunk's media that the tower encodes on its own: ``modality`` (``"image"`` /
    ``"video"``), its ``index`` among the chunk's items of that modality, ``frame`` (a video's temporal
    patch; 0 for an image), ``start`` (its first patch row in the modality's pixels), its ``patches`` (patch
    rows), ``rows`` (feature rows it gives) and ``cost`` (the family's vision cost model)."""

    modality: str
    index: int
    frame: int
    start: int
    patches: int
    rows: int
    cost: float


def _grid_items(adapter: Any, chunk: VlmMediaChunk, config: Any) -> list[MediaItem]:
    """The Qwen2-VL / Qwen2.5-VL layout: every image, then every temporal patch of every video (``h x w``
    patch rows each, ``t``-major): the tower attends within one temporal patch only (its ``cu_seqlens`` and
    windows are per ``t``, its rotary positions ``(h, w)``), so each is encoded alone as ``(1, h, w)``."""
    from ..adapters.base import config_value

    merge = int(config_value(config, "vision_config.spatial_merge_size", "spatial_merge_size"))
    units: list[tuple[str, int, int, int, int]] = []
    for modality, grid in (("image", chunk.image_grid), ("video", chunk.video_grid)):
        if grid is None:
            continue
        start = 0
        for index, row in enumerate(grid.to(torch.int64).tolist()):
            t, hw = (row[0], row[1] * row[2]) if len(row) == 3 else (1, row[0] * row[1])
            for frame in range(t):
                units.append((modality, index, frame, start, hw))
                start += hw
    costs = adapter.image_costs(np.asarray([u[4] for u in units], dtype=np.int64), config) if units else []
    return [MediaItem(m, i, f, s0, n, n // merge**2, float(c)) for (m, i, f, s0, n), c in zip(units, costs)]


def _grid_subchunk(chunk: VlmMediaChunk, items: list[MediaItem]) -> VlmMediaChunk:
    """The chunk holding only ``items`` (in chunk order): their patch rows, each with grid row ``(1, h, w)``;
    a modality without one of them is left out (``None``)."""
    fields: dict[str, Any] = {"pixel_values": None, "image_grid": None, "pixel_values_videos": None,
                              "video_grid": None}
    for modality, pixels_name, grid_name in (("image", "pixel_values", "image_grid"),
                                             ("video", "pixel_values_videos", "video_grid")):
        pixels, grid = getattr(chunk, pixels_name), getattr(chunk, grid_name)
        mine = [item for item in items if item.modality == modality]
        if pixels is None or grid is None or not mine:
            continue
        rows = grid.to(torch.int64).tolist()
        fields[pixels_name] = torch.cat([pixels[i.start:i.start + i.patches] for i in mine])
        fields[grid_name] = torch.tensor([[1, *rows[i.index][-2:]] for i in mine], dtype=grid.dtype, device=grid.device)
    return VlmMediaChunk(**fields)


#: adapter name -> ``(items, subchunk)``: how that family's chunk is cut into whole items; the families
#: whose tower is frame-sharded over ``cp`` (every other keeps it replicated: :func:`vision_shard_problem`)
VISION_SHARDING: dict[str, tuple[Callable[[Any, VlmMediaChunk, Any], list[MediaItem]],
                                 Callable[[VlmMediaChunk, list[MediaItem]], VlmMediaChunk]]] = {
    "qwen2_5_vl": (_grid_items, _grid_subchunk),
}

_REASONS = {
    "qwen3_vl": "its tower also gives deepstack features per layer, gathered with the merge",
    "qwen3_vl_moe": "its tower also gives deepstack features per layer, gathered with the merge",
}


def vision_shard_problem(adapter: Any) -> str | None:
    """Why ``adapter``'s family keeps its vision tower replicated over ``cp`` (in words), or ``None``
    when its items can be divided over the ``cp`` ranks (:data:`VISION_SHARDING`)."""
    name = getattr(adapter, "name", type(adapter).__name__)
    if name in VISION_SHARDING:
        return None
    if name in _REASONS:
        return _REASONS[name]
    if getattr(adapter, "encode_audio", None) is not None:
        return "it also encodes audio, whose clips are not divided over cp"
    return "no per-item splitter of its media layout is built (docs/context-parallel.md)"


def resolve_cp_vision(adapter: Any, mode: str | None) -> str:
    """``"shard"`` or ``"replicate"`` for ``adapter``'s family: ``mode`` (``None``: shard where the
    family allows, else replicate).

    Raises:
        ValueError: ``mode`` is not one of :data:`CP_VISION_MODES`, or ``"shard"`` for a family that
            keeps its tower replicated (naming ``--cp-vision`` and why).
    """
    problem = vision_shard_problem(adapter)
    if mode is None:
        return "replicate" if problem else "shard"
    if mode not in CP_VISION_MODES:
        raise ValueError(f"--cp-vision {mode}: expected one of {', '.join(CP_VISION_MODES)}")
    if mode == "shard" and problem:
        raise ValueError(f"--cp-vision shard: {getattr(adapter, 'name', '?')} keeps its vision tower replicated "
                         f"over cp: {problem}")
    return mode


def assign_items(costs: list[float], ranks: int) -> list[int]:
    """The owner rank of each item: longest first (ties: lower index), each to the least loaded rank
    (ties: lower rank). The same on every rank (plain Python on host numbers)."""
    owners = [0] * len(costs)
    load = [0.0] * ranks
    for i in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        r = min(range(ranks), key=lambda k: (load[k], k))
        owners[i] = r
        load[r] += costs[i]
    return owners


class GatherRows(torch.autograd.Function):
    """``[cp * most, H]``: every ``cp`` rank's rows ``[n_r, H]`` padded to ``most`` rows and gathered
    (ranks in order). Backward: the gradient summed over ``cp`` (each rank's loss reached every row),
    and this rank's own ``n_r`` rows of it."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, most: int, group: Any) -> Tensor:
        import torch.distributed as dist

        ctx.group, ctx.n, ctx.most = group, local.shape[0], most
        ctx.rank, ctx.size = dist.get_rank(group), dist.get_world_size(group)
        padded = torch.cat([local, local.new_zeros((most - local.shape[0], *local.shape[1:]))]).contiguous()
        out = padded.new_empty((ctx.size * most, *local.shape[1:]))
        dist.all_gather_single(out, padded, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        import torch.distributed as dist

        summed = grad.contiguous().clone()
        dist.all_reduce(summed, group=ctx.group)
        start = ctx.rank * ctx.most
        return summed[start:start + ctx.n], None, None


def sharded_encode(adapter: Any, model: Any, chunk: VlmMediaChunk, host: Any, shard: Any) -> dict[str, Tensor]:
    """``{modality: [rows, H]}``, the features ``adapter.encode`` would give for the whole ``chunk``
    (placeholder order), each item encoded on one ``cp`` rank of ``shard`` (:func:`assign_items`) and
    gathered (:class:`GatherRows`); ``H`` the text width, in the embedding's dtype."""
    from ..adapters.base import HostValues

    items_of, subchunk = VISION_SHARDING[adapter.name]
    items = items_of(adapter, chunk, model.config)
    owners = assign_items([item.cost for item in items], shard.size)
    mine = [item for item, owner in zip(items, owners) if owner == shard.rank]
    sub = subchunk(chunk, mine)
    sub_host = HostValues(
        placeholders={}, totals={m: sum(i.rows for i in mine if i.modality == m) for m in ("image", "video")},
        values={name: t.to(torch.int64).flatten().tolist() for name, t in adapter.host_inputs(sub, model.config).items()})
    local = adapter.encode(model, sub, sub_host) if mine else {}
    weight = model.stage_language_model.get_input_embeddings().weight
    out: dict[str, Tensor] = {}
    for modality in dict.fromkeys(item.modality for item in items):
        of = [(item, owner) for item, owner in zip(items, owners) if item.modality == modality]
        per_rank = [sum(i.rows for i, o in of if o == r) for r in range(shard.size)]
        most = max(per_rank)
        rows = local.get(modality)
        if rows is None:  # no item of this modality here: a zero-row share, it still joins the gather
            rows = weight.new_zeros((0, weight.shape[1]))
        rows = rows.to(weight.dtype)
        if torch.is_grad_enabled() and not rows.requires_grad:
            # every rank's share requires grad alike (a zero-row share, a frozen tower's), so every rank's
            # backward reaches the gather's sum over cp
            rows = rows.detach().requires_grad_()
        gathered = GatherRows.apply(rows, most, shard.group)
        offset = [r * most for r in range(shard.size)]
        index: list[int] = []
        for item, owner in of:
            index.extend(range(offset[owner], offset[owner] + item.rows))
            offset[owner] += item.rows
        out[modality] = gathered.index_select(0, torch.tensor(index, dtype=torch.int64, device=gathered.device))
    return out


_SHARDED: dict[type, type] = {}


def _sharded_class(cls: type) -> type:
    """A subclass of adapter class ``cls`` whose ``encode`` is :func:`sharded_encode` (made once per class)."""
    if cls not in _SHARDED:
        def encode(self: Any, model: Any, chunk: VlmMediaChunk, host: Any) -> dict[str, Tensor]:
            base = copy.copy(self)
            base.__class__ = cls
            return sharded_encode(base, model, chunk, host, self.__dict__["_ppmedia_cp_shard"])

        _SHARDED[cls] = type(f"CpSharded{cls.__name__}", (cls,), {"encode": encode, "__module__": __name__})
    return _SHARDED[cls]


def vision_sharded(adapter: Any, shard: Any) -> Any:
    """``adapter`` with its ``encode`` frame-sharded over ``shard``'s ``cp`` group (everything else its own)."""
    proxy = copy.copy(adapter)
    proxy.__class__ = _sharded_class(type(adapter))
    proxy.__dict__["_ppmedia_cp_shard"] = shard
    return proxy
