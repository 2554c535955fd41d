"""The encoder spread's traffic between the pipeline ranks: the vision weights broadcast to the copies
(and which of them train), the encoded outputs sent to stage 0 and their gradients sent back, the media
sent from stage 0's rank, and the vision gradients summed onto stage 0 (and over the data-parallel
replicas with FSDP2). Everything on the spread's own process group and tags, so that nothing it sends
can be matched with the schedule's traffic.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor, nn

from ..adapters.base import HostValues
from ..chunk import VlmMediaChunk
from .encoder_plan import SpreadPlan

#: point-to-point tags of the spread's own traffic (features forward, gradients back, media out).
_FEATURE_TAG, _GRAD_TAG, _MEDIA_TAG = 7301, 7302, 7303


def _group_ranks(group: Any) -> list[int]:
    import torch.distributed as dist

    return list(dist.get_process_group_ranks(group)) if group is not None else list(range(dist.get_world_size()))


def _wait_all(works: Sequence[Any]) -> None:
    for work in works:
        work.wait()


def _chunk_layout(chunk: VlmMediaChunk | None) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
    """``(name, shape, dtype)`` of each tensor of ``chunk`` (a field, or ``extras.NAME``), in order."""
    if chunk is None:
        return ()
    out = [(f.name, tuple(v.shape), v.dtype) for f in dataclass_fields(chunk)
           if f.name != "extras" and (v := getattr(chunk, f.name)) is not None]
    out += [(f"extras.{n}", tuple(t.shape), t.dtype) for n, t in (chunk.extras or {}).items()]
    return tuple(out)


def _chunk_tensor(chunk: VlmMediaChunk | None, name: str) -> Tensor:
    assert chunk is not None
    if name.startswith("extras."):
        assert chunk.extras is not None
        return chunk.extras[name[len("extras."):]]
    tensor = getattr(chunk, name)
    assert isinstance(tensor, Tensor)
    return tensor


def _chunk_from(tensors: Mapping[str, Tensor]) -> VlmMediaChunk:
    """The chunk of the tensors :func:`_chunk_layout` named (received from stage 0's rank)."""
    fields = {n: t for n, t in tensors.items() if not n.startswith("extras.")}
    extras = {n[len("extras."):]: t for n, t in tensors.items() if n.startswith("extras.")}
    chunk = VlmMediaChunk(None, None, None, None)
    for name, tensor in fields.items():
        setattr(chunk, name, tensor)
    chunk.extras = extras or None
    return chunk


@dataclass
class _Incoming:
    """Microbatch ``k``'s outputs on the first stage: received (or encoded here), then leaves."""

    k: int
    buffers: dict[str, Tensor]
    works: list[Any] = field(default_factory=list)
    leaves: dict[str, Tensor] | None = None
    sent: bool = False
    #: set once the first stage's backward has filled every leaf's gradient (or the step ends)
    ready: threading.Event = field(default_factory=threading.Event)
    #: encoded here (stage 0's rank): set once the buffers hold the outputs
    encoded: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Step:
    """What one step's encodes fill (on the caller's thread or the lane's), and the encodes left to
    the lane, which stage 0's forward takes back when the lane has not started one it needs."""

    incoming: dict[int, _Incoming]
    outputs: dict[int, dict[str, Tensor]]
    sends: list[Any]
    later: dict[int, tuple[VlmMediaChunk, HostValues]] = field(default_factory=dict)
    claimed: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def claim(self, k: int) -> bool:
        """Take microbatch ``k``'s encode (once: the lane or the caller, whoever asks first)."""
        with self.lock:
            if k in self.claimed:
                return False
            self.claimed.add(k)
            return True


class _SpreadExchange:
    """The traffic half of :class:`~ppmedia.pipeline.encoder.EncoderSpread` (its base class): broadcasts,
    sends and receives, reductions."""

    #: set by :class:`~ppmedia.pipeline.encoder.EncoderSpread`'s constructor (what the exchange reads)
    group: Any
    rank: int
    size: int
    params: list[tuple[str, nn.Parameter]]
    device: torch.device
    wire_dtype: torch.dtype
    hidden: int
    trace: list[tuple[str, int, float, float]] | None
    replica_groups: tuple[Any, ...]
    _synced: bool
    _keep: list[Tensor]
    _grad_sends: list[Any]
    _pending: list[Any]

    def _record(self, kind: str, k: int, t0: float, t1: float) -> None:
        if self.trace is not None:
            self.trace.append((kind, k, t0, t1))

    def _check_layout(self) -> None:
        """Every rank holds the same vision parameters (names, shapes, dtypes), or the broadcasts
        and reductions would pair the wrong tensors."""
        import torch.distributed as dist

        if self.size == 1:
            return
        mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in self.params]
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, mine, group=self.group)
        for rank, theirs in enumerate(gathered):
            if theirs != mine:
                diff = sorted(set(map(str, theirs)) ^ set(map(str, mine)))[:4]
                raise ValueError(
                    f"EncoderSpread: pipeline rank {rank} holds other vision parameters than rank {self.rank} "
                    f"({len(theirs)} vs {len(mine)}; e.g. {diff}); expected the same model on every rank"
                )

    def _flat(self, tensors: Sequence[Tensor]) -> dict[torch.dtype, tuple[Tensor, list[int]]]:
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(i)
        return {d: (torch.cat([tensors[i].detach().reshape(-1) for i in idx]), idx) for d, idx in by_dtype.items()}

    def shard_over(self, mesh: Any) -> set[nn.Parameter]:
        """FSDP2: the vision parameters the first stage's ``fully_shard`` must leave alone
        (``ignored_params``), and, on the rank holding stage 0, sum their gradients over ``mesh``
        (the data-parallel mesh, 1-D or 2-D) at the end of every step.

        :func:`~ppmedia.pipeline.apply_fsdp` calls it. The vision side stays whole on stage 0, as the
        copies on the other pipeline ranks are: the spread broadcasts whole weights to them and runs
        the tower outside the stage's forward (where FSDP2 would gather it), and a sharded tower would
        need an all-gather of its own every step. So with FSDP2 the vision parameters, gradients and
        optimizer state are replicated over the data-parallel replicas (summed gradients keep them
        equal); everything else is sharded as without the spread.
        """
        if self.rank != 0:
            return set()
        self.replica_groups = tuple(mesh.get_group(d) for d in range(mesh.ndim))
        return {p for _, p in self.params}

    def _follow_trainable(self) -> None:
        """The copies' ``requires_grad`` follows stage 0's, parameter by parameter (one small broadcast
        per step, in the background on stage 0's rank, and one host read of it on the other ranks):
        freezing the tower on stage 0, as the optimizer sees it, freezes it everywhere, so every rank
        agrees on whether gradients travel."""
        import torch.distributed as dist

        if self.size == 1:
            return
        flags = torch.tensor([p.requires_grad for _, p in self.params], dtype=torch.int32, device=self.device)
        work = dist.broadcast(flags, group_src=0, group=self.group, async_op=True)
        assert work is not None  # async_op=True returns its Work
        if self.rank == 0:  # stage 0 goes on; the step waits for it at the end
            self._pending.append(work)
            self._keep.append(flags)
        else:
            work.wait()
            for (_, p), trainable in zip(self.params, flags.tolist()):
                p.requires_grad_(bool(trainable))

    def refresh(self, everything: bool = True) -> None:
        """Broadcast stage 0's vision parameters to the copies (collective over the pipeline group).

        :meth:`step` calls it: everything on the first step, the trainable parameters after. Call it
        yourself (with ``everything=True``) after loading frozen vision weights into stage 0 mid-run.
        On stage 0's rank the broadcast runs in the background (it goes on encoding its own share;
        :meth:`step` waits for it at the end); the copies wait for their weights.
        """
        import torch.distributed as dist

        if self.size == 1:
            return
        params = [p for _, p in self.params if everything or p.requires_grad]
        for _, (flat, idx) in sorted(self._flat(params).items(), key=lambda item: str(item[0])):
            work = dist.broadcast(flat, group_src=0, group=self.group, async_op=True)
            assert work is not None  # async_op=True returns its Work
            if self.rank == 0:
                self._pending.append(work)
                self._keep.append(flat)
                continue
            work.wait()
            offset = 0
            with torch.no_grad():
                for i in idx:
                    n = params[i].numel()
                    params[i].copy_(flat[offset : offset + n].view_as(params[i]))
                    offset += n
        self._synced = True

    def _post_receives(self, plan: SpreadPlan) -> dict[int, _Incoming]:
        """Stage 0: a buffer and a receive for every output another rank encodes."""
        import torch.distributed as dist

        incoming = {}
        for k, names in enumerate(plan.names):
            if not names:
                continue
            if plan.owners[k] == 0:  # encoded here: _encode fills the buffers
                incoming[k] = _Incoming(k, {})
                continue
            buffers = {name: torch.empty(plan.rows[k][m], self.hidden, dtype=self.wire_dtype, device=self.device)
                       for name, m in names}
            item = _Incoming(k, buffers)
            item.works = [dist.irecv(t, group_src=plan.owners[k], group=self.group, tag=_FEATURE_TAG)
                          for t in buffers.values()]
            incoming[k] = item
        return incoming

    def _post_gradient_receives(self, plan: SpreadPlan, mine: Sequence[int]) -> dict[int, tuple[list[Any], dict[str, Tensor]]]:
        import torch.distributed as dist

        receives = {}
        for k in mine:
            grads = {name: torch.empty(plan.rows[k][m], self.hidden, dtype=self.wire_dtype, device=self.device)
                     for name, m in plan.names[k]}
            works = [dist.irecv(g, group_src=0, group=self.group, tag=_GRAD_TAG) for g in grads.values()]
            receives[k] = (works, grads)
        return receives

    def _send_gradients(self, item: _Incoming, owner: int) -> None:
        """Stage 0: send microbatch ``item.k``'s output gradients (zeros where none came) to ``owner``."""
        import torch.distributed as dist

        assert item.leaves is not None or item.buffers
        leaves = item.leaves if item.leaves is not None else item.buffers
        grads = [(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)).contiguous() for leaf in leaves.values()]
        self._grad_sends += [dist.isend(g, group_dst=owner, group=self.group, tag=_GRAD_TAG) for g in grads]
        self._keep += grads
        item.sent = True

    def _start_reduction(self) -> Any:
        """Start summing the copies' vision gradients onto stage 0 (a ``reduce`` per dtype, in the
        background). Stage 0's rank contributes zeros: it adds the sum to its own gradients in
        :meth:`_finish_reduction`, after its own share's backward, which the transfer overlaps."""
        import torch.distributed as dist

        if self.size == 1:
            return None
        t0 = time.perf_counter()
        params = [p for _, p in self.params if p.requires_grad]
        own = self.rank == 0
        grads = [torch.zeros_like(p) if own or p.grad is None else p.grad for p in params]
        flags = torch.tensor([not own and p.grad is not None for p in params], dtype=torch.int32, device=self.device)
        works = [dist.reduce(flags, group_dst=0, group=self.group, async_op=True)]
        flats = sorted(self._flat(grads).items(), key=lambda item: str(item[0]))
        works += [dist.reduce(flat, group_dst=0, group=self.group, async_op=True) for _, (flat, _) in flats]
        self._record("R", -1, t0, time.perf_counter())
        return params, flags, flats, works

    def _finish_reduction(self, reduction: Any) -> None:
        """Wait for the sum; on stage 0 add it to the vision gradients (a parameter whose gradient is
        ``None`` on every rank stays ``None``); drop the copies' gradients."""
        if reduction is None:
            return
        t0 = time.perf_counter()
        params, flags, flats, works = reduction
        _wait_all(works)
        if self.rank == 0:
            theirs = flags.tolist()  # one small host read, on stage 0
            for _, (flat, idx) in flats:
                offset = 0
                for i in idx:
                    p, n = params[i], params[i].numel()
                    if theirs[i]:
                        total = flat[offset : offset + n].view_as(p)
                        p.grad = total if p.grad is None else p.grad.add_(total)
                    offset += n
        else:
            for p in params:
                p.grad = None
        self._record("R", -1, t0, time.perf_counter())

    def _reduce_over_replicas(self) -> None:
        """FSDP2 (:meth:`shard_over`): sum stage 0's vision gradients over the data-parallel replicas
        (which ran the same code, so they reach this in the same order); a parameter without a gradient
        on every replica keeps ``None``."""
        import torch.distributed as dist

        if not self.replica_groups:
            return
        t0 = time.perf_counter()
        params = [p for _, p in self.params if p.requires_grad]
        flags = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=self.device)
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
        flats = sorted(self._flat(grads).items(), key=lambda item: str(item[0]))
        for group in self.replica_groups:
            dist.all_reduce(flags, group=group)
            for _, (flat, _) in flats:
                dist.all_reduce(flat, group=group)
        some = flags.tolist()  # one small host read
        for _, (flat, idx) in flats:
            offset = 0
            for i in idx:
                p, n = params[i], params[i].numel()
                p.grad = flat[offset : offset + n].view_as(p).clone() if some[i] else None
                offset += n
        self._record("R", -1, t0, time.perf_counter())

    def _reduce_gradients(self) -> None:
        """Sum the copies' vision gradients onto stage 0 now (both halves of the reduction at once)."""
        self._finish_reduction(self._start_reduction())
