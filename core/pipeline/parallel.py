"""Data parallelism around the pipeline: batch shards, gradient reduction, global-norm clipping.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import Tensor, nn

from .tied import TiedParameters

__all__ = ["all_reduce_gradients", "clip_grad_norm", "shard_batch"]



#: media keys with one entry per SAMPLE (dim 0 = batch), sliced with the samples by :func:`shard_batch`.
_PER_SAMPLE_MEDIA_KEYS = frozenset({"num_patches"})


def shard_batch(
    batch: Mapping[str, Any],
    dp_rank: int,
    dp_size: int,
    *,
    images_per_sample: Any = None,
    videos_per_sample: Any = None,
    audios_per_sample: Any = None,
    counts: Mapping[str, Any] | None = None,
    sample_inputs: Any = None,
    layouts: Any = None,
) -> dict[str, Any]:
    """Data-parallel replica ``dp_rank``'s share of a global batch, media included.

    The replica gets the samples ``torch.tensor_split(range(B), dp_size)[dp_rank]`` of every
    ``[B, ...]`` tensor, and of every media tensor exactly its samples' images, videos and crops (cut
    by :func:`ppmedia.split_media`, so a replica's media never hold another replica's): views of the
    batch's tensors, no copy. Split per microbatch afterwards, on the replica's share. Per-sample count
    keys (``n_images_per_sample``) are sliced with the samples; non-tensor values are kept as they are.

    Takes every count argument :func:`ppmedia.split_media` takes, so
    ``shard_batch(batch, r, dp, **adapter.media_counts(batch, config))`` works for every adapter, those
    with per-sample inputs (:class:`~ppmedia.adapters.base.SampleInput`, e.g. PaliGemma's
    ``token_type_ids``) included. Each per-sample input comes back under its key as the replica's rows
    ``[b, ...]`` of the value split (the batch's own, or the tensor given in ``sample_inputs``), so
    ``adapter.media_counts(local, config)`` finds it again for the per-microbatch split.

    Args:
        batch: a processor/collator batch (not modified).
        dp_rank, dp_size: the replica and the number of replicas.
        images_per_sample, videos_per_sample, audios_per_sample, counts, sample_inputs, layouts: as for
            :func:`ppmedia.split_media` (for the GLOBAL batch).

    Raises:
        ValueError: ``dp_rank`` out of range; anything :func:`ppmedia.split_media` refuses (e.g. a
            non-media tensor whose dim 0 is not the batch size, named with its shape).
    """
    from ..producer.split import split_media

    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"shard_batch: dp_rank {dp_rank}; expected 0 <= dp_rank < dp_size ({dp_size})")
    rest = dict(batch)
    counts = {k: rest[k] for k in ("n_images_per_sample", "n_videos_per_sample", "n_audios_per_sample") if k in rest}
    staged = split_media(rest, dp_size, images_per_sample=images_per_sample, videos_per_sample=videos_per_sample,
                         audios_per_sample=audios_per_sample, counts=counts, sample_inputs=sample_inputs,
                         layouts=layouts)
    a, b = staged.samples[dp_rank]
    out: dict[str, Any] = {}
    for key, value in rest.items():
        if isinstance(value, Tensor) and value.dim() > 0:  # split_media refused any other dim 0 than B
            value = value[a:b]
        out[key] = value
    for key, value in counts.items():
        out[key] = value[a:b]
    for field_name, key in staged.sources.items():
        # per-sample media metadata (Step3's num_patches [B], any layout's "sample" fields) follows the
        # samples, not the media rows: its staged entry is empty for a replica without media
        per_sample = key in _PER_SAMPLE_MEDIA_KEYS or staged.kinds.get(field_name) == "sample"
        out[key] = batch[key][a:b] if per_sample else staged.chunks[field_name][dp_rank]
    return out


def _unique_trainable(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for module in modules:
        for param in module.parameters():
            if param.requires_grad:
                seen.setdefault(id(param), param)
    return list(seen.values())


def _is_dtensor(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def all_reduce_gradients(modules: Sequence[nn.Module], group: Any = None) -> None:
    """Sum the gradients of ``modules``' parameters across the data-parallel ``group`` (replicated
    data parallelism: every replica holds whole parameters).

    Call it on every replica after the pipeline step (and :func:`sync_tied_gradients`), with the
    same stage modules in the same order (the replicas of one pipeline rank hold the same stages).
    A parameter without a gradient (a replica whose share had no images leaves the vision tower's at
    ``None``) contributes zeros and gets the sum. One flat ``all_reduce`` per dtype.

    With :func:`pipeline_loss` normalised by the valid tokens of the GLOBAL batch, the sum is the
    global batch's gradient (no division by the number of replicas).

    Tensor-parallel stages (:func:`~ppmedia.pipeline.apply_tensor_parallel`, without FSDP2): a
    ``DTensor`` parameter's local shard is summed (every replica holds the same shard). Expert shards
    (:func:`~ppmedia.pipeline.apply_expert_parallel`) are left out: the ``dp`` replicas hold different
    experts; :func:`~ppmedia.pipeline.reduce_expert_parallel_gradients` sums them over ``edp``.

    Raises:
        TypeError: a stage is sharded with FSDP2: :func:`~ppmedia.pipeline.apply_fsdp` stages have
            their gradients reduce-scattered by FSDP already.
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for module in modules for m in module.modules()):
        raise TypeError(
            "all_reduce_gradients: the stages are sharded with FSDP2 (DTensor parameters), whose "
            "gradients are already summed over the data-parallel mesh; call it only on replicated stages"
        )
    if dist.get_world_size(group) == 1:
        for param in _unique_trainable(modules):  # one replica: its gradients are the sum (a missing one zeros)
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        return
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for param in _unique_trainable(modules):
        if _is_dtensor(param) and param.device_mesh.mesh_dim_names == ("ep",):  # type: ignore[attr-defined]  # expert shard: summed over edp only (reduce_expert_parallel_gradients)
            continue
        by_dtype.setdefault(param.dtype, []).append(param)
    for dtype in sorted(by_dtype, key=str):
        _sum_flat(by_dtype[dtype], group, dist)


def _local(tensor: Tensor) -> Tensor:
    """A tensor-parallel ``DTensor``'s local shard (a plain tensor as it is)."""
    return tensor.to_local() if _is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def _sum_flat(params: Sequence[nn.Parameter], group: Any, dist: Any) -> None:
    """All-reduce the (local) gradients of ``params`` as one flat buffer; a missing one as zeros."""
    from torch.distributed.tensor import DTensor

    grads = [_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p)) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p, g in zip(params, grads):
        part = flat[offset : offset + g.numel()].view_as(g)
        offset += g.numel()
        # laid out like the gradient it replaces (a vocabulary-split embedding's may be a partial sum)
        like = p.grad if p.grad is not None else p
        if isinstance(like, DTensor):
            p.grad = DTensor.from_local(part, like.device_mesh, like.placements, run_check=False,
                                        shape=like.shape, stride=like.stride())
        else:
            p.grad = part


def _squared_norm(grads: Sequence[Tensor], device: Any) -> Tensor:
    """Sum of squares of ``grads`` on this rank's part of the model: plain tensors as they are, FSDP2
    shards (``DTensor``) summed over their data-parallel mesh (one reduction per mesh layout)."""
    squares = torch.zeros((), dtype=torch.float32, device=device)
    sharded: dict[Any, Any] = {}
    for grad in grads:
        if _is_dtensor(grad):
            key = (grad.device_mesh, tuple(grad.placements))  # type: ignore[attr-defined]
            part = grad.detach().float().pow(2).sum()  # a DTensor with a Partial placement
            sharded[key] = part if key not in sharded else sharded[key] + part
        else:  # without a squared copy of the gradient
            squares += torch.linalg.vector_norm(grad.detach(), dtype=torch.float32).square()
    for key in sorted(sharded, key=str):
        squares += sharded[key].full_tensor()
    return squares


def clip_grad_norm(
    modules: Sequence[nn.Module],
    max_norm: float,
    *,
    tied: Sequence[TiedParameters] = (),
    group: Any = None,
) -> Tensor:
    """Clip the gradients of a pipeline to a GLOBAL L2 norm, like ``torch.nn.utils.clip_grad_norm_`` on
    the whole model; returns the total norm before clipping (a float32 scalar, equal on every rank).

    Call it after :func:`sync_tied_gradients` and :func:`all_reduce_gradients`: each rank sums the
    squares of its stages' gradients (a tied parameter counted once, on the rank holding its first
    name), ``group`` (the pipeline group) sums them across stages, and every gradient is scaled by
    ``max_norm / (norm + 1e-6)`` when that is below 1. After the data-parallel reduction the replicas
    hold equal gradients, so the pipeline group's sum is the global norm.

    FSDP2 stages (:func:`~ppmedia.pipeline.apply_fsdp`): each replica holds a shard of every gradient
    (``DTensor``); the shards' squares are summed over the data-parallel mesh first (a collective
    among the replicas of this pipeline rank), then over ``group``; every shard is scaled in place.
    """
    import torch.distributed as dist

    params = _unique_trainable(modules)
    skip: set[int] = set()
    for entry in tied:
        holders = {}
        for module in modules:
            named = dict(module.named_parameters(remove_duplicate=False))
            holders.update({name: named[name] for name in entry.names if name in named})
        if holders and entry.names[0] not in holders:
            skip.update(id(p) for p in holders.values())
        elif len({id(p) for p in holders.values()}) > 1:  # copies on one rank: count the first name's
            first = id(holders[entry.names[0]])
            skip.update(id(p) for p in holders.values() if id(p) != first)
    device = params[0].device if params else "cpu"
    squares = _squared_norm([p.grad for p in params if p.grad is not None and id(p) not in skip], device)
    dist.all_reduce(squares, group=group)
    total = squares.sqrt()
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if float(scale) == 1.0:  # nothing to clip: multiplying by 1 would change no gradient
        return total
    for p in params:
        if p.grad is not None:
            grad = p.grad.to_local() if _is_dtensor(p.grad) else p.grad  # type: ignore[attr-defined]
            grad.detach().mul_(scale.to(grad.dtype))
    return total
