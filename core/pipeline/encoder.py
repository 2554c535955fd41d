"""Encoder spread: every pipeline rank encodes a share of the step's media, off stage 0's critical path.

With the vision tower on stage 0 (``encoder="stage0"``, the default) the first stage's forward runs the
tower on its microbatch, so under 1F1B the whole step runs at the pace of the stage that also does
all the vision work. :class:`EncoderSpread` (``make_pipeline_stages(..., encoder="spread")``) moves it:

1. **refresh**: every rank without stage 0 holds a copy of the vision side (:func:`vision_replica`:
   the tower, projector, whatever the adapter's ``encode`` reads; not the language model). Stage 0
   keeps the original (its optimizer, checkpoint, clipping and data-parallel reduction are unchanged);
   at the start of each step its parameters are broadcast to the copies (all of them on the first
   step, the trainable ones after that: the optimizer step in between changed only those);
2. **plan** (:class:`SpreadPlan`, the same on every rank): each microbatch's vision cost (the
   adapter's :meth:`~ppmedia.adapters.base.VlmAdapter.image_costs` model) and placeholder rows (one
   host read per batch), and its encoding rank (:func:`interleave_encoders`, or
   :func:`assign_encoders` without the lane);
3. **encode**: each rank checks its microbatches' chunks (``check_counts``, as stage 0 would), runs the
   adapter's :meth:`~ppmedia.adapters.base.VlmAdapter.encoder_outputs` on the first of them (views of
   the staged batch; :data:`AHEAD` of its share) and sends the outputs to stage 0 (a process group of
   its own, so that nothing it sends can be matched with the schedule's traffic); stage 0 posts the
   receives before it encodes its own share. The rank's background lane
   (:class:`~ppmedia.pipeline.lane.Lane`, a thread of the lowest priority) encodes the rest while the
   schedule runs; stage 0's forward takes back an encode of its own the lane has not started;
4. **step**: the media are staged on stage 0 as always (``stage_media``: the cursor contract is
   unchanged, each forward takes its own chunk once); its forward takes microbatch ``k``'s outputs
   instead of running the tower (waiting for them only then) as leaf tensors that collect their
   gradient in the schedule's backward;
5. **return**: as soon as microbatch ``k``'s backward on stage 0 has filled those gradients they are
   sent back to its encoder (the rest at the end of the step), whose lane runs the tower's backward
   for it in the schedule's idle time (without the lane: after ``schedule.step`` returns); then the
   tower's gradients are summed onto stage 0 (one ``reduce`` per dtype) and the copies' gradients are
   dropped.

Loss and gradients equal the stage-0 placement's (and the model's own full-batch run) within float
rounding: the tower runs on exactly the same chunks, only on another rank. Every rank must hold the
same batch (each splits it, ``split_media``, the same way; the media only on stage 0's rank with
``media_from_first_stage``, below). Deepstack outputs (Qwen3-VL) travel as
further ``[tokens, H]`` tensors (``adapter.encoder_output_names``).

With ``media_from_first_stage`` only the rank holding stage 0 has the media (a
:class:`ppmedia.data.ReplicaLoader` reads them there): it makes the plan alone, broadcasts it, and
sends each rank the tensors of the chunks that rank encodes, so nothing is read or decoded twice.

With FSDP2 stages (:func:`~ppmedia.pipeline.apply_fsdp` after ``make_pipeline_stages``) the first
stage's vision side stays whole, outside its FSDP2 group (:meth:`EncoderSpread.shard_over`), and the
spread sums its gradients over the data-parallel replicas at the end of the step.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import threading
import time
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

from ..adapters.base import HostValues, VlmAdapter, read_host
from ..chunk import CURSOR_ATTRIBUTE, VlmMediaChunk
from .lane import Lane
from .stages import FEATURES_ATTRIBUTE, StageModule, _text_dims
from .surgery import _child_name, _get_path, _shallow, _stage_children, find_language_model, find_merge_module, find_output_head

__all__ = [
    "AHEAD",
    "ENCODER_MODES",
    "EncoderSpread",
    "SpreadPlan",
    "assign_encoders",
    "encoded_ahead",
    "encoder_spread_of",
    "interleave_encoders",
    "vision_replica",
]

#: where the vision tower runs: on the first stage (``stage0``) or spread over the pipeline ranks.
ENCODER_MODES: tuple[str, ...] = ("stage0", "spread")
#: the attribute of a stage module that holds its rank's :class:`EncoderSpread`.
SPREAD_ATTRIBUTE = "encoder_spread"
#: point-to-point tags of the spread's own traffic (features forward, gradients back, media out).
_FEATURE_TAG, _GRAD_TAG, _MEDIA_TAG = 7301, 7302, 7303
#: with the background lane: the share of its microbatches a rank encodes before the schedule (the
#: first ones, which stage 0 needs first); the lane encodes the rest in the schedule's idle time.
AHEAD = 0.5


def encoded_ahead(n: int, ahead: float) -> int:
    """How many of a rank's ``n`` microbatches (the first, in order) it encodes before the schedule:
    ``ceil(ahead * n)``, at least one when it has any."""
    if not 0 <= ahead <= 1:
        raise ValueError(f"ahead: got {ahead}; expected a share 0..1")
    return min(n, max(1 if n else 0, math.ceil(ahead * n)))


# --------------------------------------------------------------------------------------------------
# who encodes what


def _linear_partition(costs: Sequence[float], parts: int) -> list[int]:
    """Cut points of ``costs`` into ``parts`` contiguous blocks: the largest block sum as small as
    possible, and among those cuts the most even (smallest sum of squares; ties: earlier ranks take
    more). ``bounds[i]:bounds[i + 1]`` is block ``i``; two dynamic programmes over ``O(parts n^2)``."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")

    def solve(cap: float | None) -> tuple[list[list[float]], list[list[int]]]:
        best = [[inf] * (n + 1) for _ in range(parts + 1)]
        cut = [[0] * (n + 1) for _ in range(parts + 1)]
        best[0][0] = 0.0
        for p in range(1, parts + 1):
            for j in range(n + 1):
                for i in range(j + 1):
                    if best[p - 1][i] == inf:
                        continue
                    block = prefix[j] - prefix[i]
                    if cap is None:
                        value = max(best[p - 1][i], block)
                    elif block > cap + 1e-9 * max(1.0, cap):
                        continue
                    else:
                        value = best[p - 1][i] + block * block
                    if value <= best[p][j] + 1e-12 * max(1.0, abs(value)):
                        best[p][j], cut[p][j] = value, i
        return best, cut

    largest, _ = solve(None)
    _, cut = solve(largest[parts][n])
    bounds = [n]
    for p in range(parts, 0, -1):
        bounds.append(cut[p][bounds[-1]])
    return bounds[::-1]


def assign_encoders(costs: Sequence[float], n_ranks: int, *, weights: Sequence[float] | None = None) -> list[int]:
    """The pipeline rank that encodes each microbatch.

    Contiguous blocks of microbatches with balanced vision cost, in rank order: rank 0 (the first
    stage's) encodes the first block, so it can start its first forward as soon as its own first
    chunk is encoded; later ranks encode later microbatches, which stage 0 needs later. A block may be
    empty (fewer microbatches with media than ranks). Microbatches without media (cost 0) go to the
    block they sit in and cost nothing.

    Args:
        costs: ``[n]`` vision cost per microbatch (any unit, ``>= 0``).
        n_ranks: pipeline ranks.
        weights: optional ``[n_ranks]`` relative speed (share) of each rank; default equal.

    Returns:
        ``[n]`` group ranks.
    """
    values = _checked_costs(costs, n_ranks, weights)
    owners = [0] * len(values)
    if n_ranks == 1 or not any(values):
        return owners
    if weights is None:
        bounds = _linear_partition(values, n_ranks)
    else:  # greedy on the cumulative shares: block r ends where the cost reaches its share
        total, share, bounds, acc = sum(values), 0.0, [0], 0.0
        for r in range(n_ranks - 1):
            share += float(weights[r]) / float(sum(weights))
            k = bounds[-1]
            while k < len(values) and acc + values[k] / 2 <= share * total:
                acc += values[k]
                k += 1
            bounds.append(k)
        bounds.append(len(values))
    for rank in range(n_ranks):
        for k in range(bounds[rank], bounds[rank + 1]):
            owners[k] = rank
    return owners


def interleave_encoders(costs: Sequence[float], n_ranks: int, *, weights: Sequence[float] | None = None) -> list[int]:
    """The pipeline rank that encodes each microbatch: in microbatch order (the order stage 0 needs
    them), each to the rank with the least vision cost so far (relative to its ``weights`` share;
    ties: the lower rank). Equal costs go round-robin (0, 1, ..., 0, 1, ...), so every rank's first
    microbatches are the step's first ones: what the background lane wants, where each rank encodes
    its first microbatches before the schedule and the rest while it runs. Microbatches without media
    (cost 0) go to the previous microbatch's rank (rank 0 first) and cost nothing.

    Args:
        costs: ``[n]`` vision cost per microbatch (any unit, ``>= 0``).
        n_ranks: pipeline ranks.
        weights: optional ``[n_ranks]`` relative speed (share) of each rank; default equal.

    Returns:
        ``[n]`` group ranks.
    """
    values = _checked_costs(costs, n_ranks, weights)
    shares = [1.0] * n_ranks if weights is None else [float(w) for w in weights]
    load = [0.0] * n_ranks
    owners: list[int] = []
    for c in values:
        if c == 0:
            owners.append(owners[-1] if owners else 0)
            continue
        rank = min(range(n_ranks), key=lambda r: (load[r] / shares[r], r))
        owners.append(rank)
        load[rank] += c
    return owners


def _checked_costs(costs: Sequence[float], n_ranks: int, weights: Sequence[float] | None) -> list[float]:
    if n_ranks < 1:
        raise ValueError(f"n_ranks: got {n_ranks}; expected >= 1")
    values = [float(c) for c in costs]
    if any(c < 0 or c != c for c in values):
        raise ValueError(f"costs: got {values}; expected costs >= 0")
    if weights is not None and (len(weights) != n_ranks or any(w <= 0 for w in weights)):
        raise ValueError(f"weights: got {list(weights)}; expected {n_ranks} positive shares")
    return values


def default_assign(background: bool) -> Callable[[Sequence[float], int], list[int]]:
    """The spread's assignment rule: :func:`interleave_encoders` with the background lane, else
    :func:`assign_encoders` (contiguous blocks, all encoded before the schedule)."""
    return interleave_encoders if background else assign_encoders


@dataclass(frozen=True)
class SpreadPlan:
    """One step's encoder assignment, computed the same way on every pipeline rank.

    Attributes:
        owners: ``[n]`` the pipeline-group rank that encodes each microbatch.
        costs: ``[n]`` each microbatch's vision cost (the adapter's cost model, MFLOP).
        rows: per microbatch, ``{modality: placeholder tokens}`` (the feature rows it needs).
        names: per microbatch, the ``(name, modality)`` pairs of the tensors its encoder sends, in
            send order (``adapter.encoder_output_names`` of each modality with rows).
    """

    owners: tuple[int, ...]
    costs: tuple[float, ...]
    rows: tuple[dict[str, int], ...]
    names: tuple[tuple[tuple[str, str], ...], ...]

    def encoded_by(self, rank: int) -> list[int]:
        """The microbatches ``rank`` encodes, in order."""
        return [k for k, owner in enumerate(self.owners) if owner == rank and self.names[k]]


# --------------------------------------------------------------------------------------------------
# the vision side on ranks without stage 0


class _VisionReplica(nn.Module):
    """The vision side of a model under the full model's names (``model.visual.blocks.0...``)."""

    def __init__(self, children: Mapping[str, nn.Module], parameters: Mapping[str, nn.Parameter], config: Any) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)
        for name, param in parameters.items():
            self.register_parameter(name, param)
        self.config = config


def vision_replica(model: nn.Module, adapter: VlmAdapter | None = None) -> nn.Module:
    """What the first stage holds besides the language model and head, as a module of its own:
    the vision tower, projector and any root-level parameter, under the full model's names.

    It shares parameters with ``model`` (no copy); the language model in it keeps no decoder layer,
    no embedding, no norm (only its shell, so paths like ``model.model.visual`` resolve), except the
    merge module when the adapter's ``merge_path`` puts it inside (Phi-4-multimodal's
    ``model.embed_tokens_extend``, encoders included), under its own path. An adapter's
    ``encode(replica, chunk, host)`` runs as on the first stage. ``adapter``: the family's (default:
    the registry's), which may say where the language model sits and where it merges.
    """
    lm_path, lm = find_language_model(model, adapter)
    embed_name = _child_name(lm, lm.get_input_embeddings(), "input embedding")
    norm_name = "norm" if isinstance(lm._modules.get("norm"), nn.Module) else None
    head_path = find_output_head(model, lm_path)
    children = _stage_children(model, lm, lm_path, head_path, (0, 0), first=True, last=False,
                               embed_name=embed_name, norm_name=norm_name)
    replica = _VisionReplica(children, {k: v for k, v in model._parameters.items() if v is not None}, model.config)
    shell = _get_path(replica, lm_path)
    assert shell is not None
    shell._modules.clear()  # nothing of the language model: its shell only (a new registry: the model keeps its own)
    shell._parameters.clear()
    shell._buffers.clear()
    merge_path, merge = find_merge_module(model, adapter)
    if merge_path is not None and merge is not None and merge_path.startswith(lm_path + "."):
        _restore_path(shell, lm, merge_path[len(lm_path) + 1 :], merge)
    return replica


def _restore_path(shell: nn.Module, original: nn.Module, path: str, module: nn.Module) -> None:
    """Put ``module`` back at dotted ``path`` under the emptied ``shell`` (of ``original``), with empty
    shells of the modules on the way."""
    head, _, rest = path.partition(".")
    if not rest:
        shell._modules[head] = module
        return
    child = original._modules[head]
    assert child is not None
    inner = _shallow(child, keep_members=False)
    shell._modules[head] = inner
    _restore_path(inner, child, rest, module)


def _vision_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The vision-side parameters of a first-stage module or a replica, sorted by name."""
    if isinstance(module, StageModule):
        named = [(n, p) for n, p in module.named_parameters() if not module.is_language_parameter(n)]
    else:
        named = list(module.named_parameters())
    return sorted(named, key=lambda item: item[0])


# --------------------------------------------------------------------------------------------------
# the first stage's side: precomputed outputs instead of the tower


_PRECOMPUTED: dict[type, type] = {}


def _precomputed_class(cls: type) -> type:
    """A subclass of adapter class ``cls`` whose ``encoder_outputs``/``encode`` return the outputs
    handed to it (checked against the chunk's placeholders) instead of running the tower (made once
    per class)."""
    if cls in _PRECOMPUTED:
        return _PRECOMPUTED[cls]

    def encoder_outputs(self: Any, model: nn.Module, chunk: VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        k, outputs, rows = self.__dict__["_ppmedia_precomputed"]
        wanted = {m: host.total(m) for m in set(host.totals) | set(rows) if host.total(m) or rows.get(m)}
        if wanted != {m: n for m, n in rows.items() if n}:
            raise ValueError(
                f"encoder spread, microbatch {k}: the chunk's placeholders {wanted} differ from the rows "
                f"the step's plan encoded {rows} (the first stage consumed another batch's chunk?)"
            )
        return outputs

    def encode(self: Any, model: nn.Module, chunk: VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        outputs = self.encoder_outputs(model, chunk, host)
        return {m: t for m, t in outputs.items() if "." not in m}

    made = type(f"Precomputed{cls.__name__}", (cls,), {"encoder_outputs": encoder_outputs, "encode": encode,
                                                       "__module__": __name__})
    _PRECOMPUTED[cls] = made
    return made


def _precomputed(adapter: VlmAdapter, k: int, outputs: dict[str, Tensor], rows: dict[str, int]) -> VlmAdapter:
    if not hasattr(adapter, "__dict__"):
        raise TypeError(f"encoder spread: {type(adapter).__name__} has no __dict__ (slots); expected a plain adapter class")
    proxy = copy.copy(adapter)
    proxy.__class__ = _precomputed_class(type(adapter))
    proxy.__dict__["_ppmedia_precomputed"] = (k, outputs, rows)
    return proxy


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


class _StepFeatures:
    """Hung on the first stage's module for one step: ``adapter_for(k, chunk)`` gives the adapter
    that hands the stage microbatch ``k``'s precomputed outputs (waiting for them only now)."""

    def __init__(self, spread: "EncoderSpread", plan: SpreadPlan, step: _Step) -> None:
        self.spread, self.plan, self.step, self.incoming = spread, plan, step, step.incoming
        self.takes: list[int] = []

    def adapter_for(self, k: int | None, chunk: VlmMediaChunk | None) -> VlmAdapter:
        spread = self.spread
        if k is None or not 0 <= k < len(self.plan.owners):
            raise ValueError(
                f"encoder spread: the first stage's forward found microbatch {k!r}; expected a microbatch "
                f"0..{len(self.plan.owners) - 1} (stage the media with EncoderSpread.step, or pass them "
                f"pre-split with EncoderSpread.step(..., stage=False))"
            )
        self.takes.append(k)
        item = self.incoming.get(k)
        if item is None:  # a microbatch without media
            return _precomputed(spread.adapter, k, {}, {})
        if item.leaves is None:
            t0 = time.perf_counter()
            _wait_all(item.works)
            if self.plan.owners[k] == spread.rank:  # encoded here: ahead, on the lane, or now
                if k in self.step.later and self.step.claim(k):  # the lane has not started it: take it back
                    chunk_k, host = self.step.later[k]
                    spread._encode_one(self.plan, k, chunk_k, host, self.step, "EI")
                item.encoded.wait()
                if not item.buffers:
                    raise RuntimeError(f"encoder spread: encoding microbatch {k} failed on the lane") from spread._lane_error()
            spread._record("wait", k, t0, time.perf_counter())
            item.leaves = {name: t.requires_grad_(spread._needs_grad) for name, t in item.buffers.items()}
            if spread._needs_grad:
                self._watch(item)
        return _precomputed(spread.adapter, k, item.leaves, self.plan.rows[k])

    def _watch(self, item: _Incoming) -> None:
        """As soon as all of microbatch ``item.k``'s gradients are accumulated: send them back to its
        encoder, or (encoded here) hand them to this rank's backward lane."""
        assert item.leaves is not None
        pending = set(item.leaves)
        owner = self.plan.owners[item.k]

        def hook(name: str) -> Callable[[Tensor], None]:
            def filled(_: Tensor) -> None:
                pending.discard(name)
                if pending:
                    return
                if owner != self.spread.rank and not item.sent:
                    self.spread._send_gradients(item, owner)
                item.ready.set()

            return filled

        for name, leaf in item.leaves.items():
            leaf.register_post_accumulate_grad_hook(hook(name))


# --------------------------------------------------------------------------------------------------
# the spread


def _group_ranks(group: Any) -> list[int]:
    import torch.distributed as dist

    return list(dist.get_process_group_ranks(group)) if group is not None else list(range(dist.get_world_size()))


class EncoderSpread:
    """One pipeline rank's part of the encoder spread (see the module docstring).

    Build it on every rank of the pipeline group (collective: it makes a process group of its own),
    usually through ``make_pipeline_stages(..., encoder="spread")``, which hangs it on each stage
    module as ``encoder_spread`` (:func:`encoder_spread_of`). Then, on EVERY pipeline rank::

        staged = ppmedia.split_media(batch, n, images_per_sample=..., videos_per_sample=...)
        with spread.step(staged, batch["input_ids"]):     # replaces stage_media(first, staged)
            schedule.step(input_ids, attention_mask, target=labels, losses=losses)
        # the vision gradients are on stage 0's parameters now, as with encoder="stage0"

    Args:
        vision: the module the adapter encodes with: the first stage's :class:`StageModule` on the
            rank that holds stage 0, a :func:`vision_replica` elsewhere.
        adapter: the family adapter.
        first_stage: the rank's first ``PipelineStage`` (or its module) when it holds stage 0, else ``None``.
        group: the pipeline process group (default: the world); stage 0 is on its rank 0.
        assign: ``costs [n], ranks -> owners [n]`` (default :func:`default_assign`: interleaved
            with the background lane, contiguous blocks without).
        background: a background lane (:class:`~ppmedia.pipeline.lane.Lane`: a thread of the lowest
            CPU priority) encodes this rank's later microbatches and runs its vision backwards (each
            as soon as its gradients are there) in the time the schedule waits for its neighbours;
            ``False`` encodes everything before the schedule and runs the backwards after it.
            Default (``None``): on for CPU devices, where it was measured; off elsewhere (on CUDA
            the lane's kernels would queue on the same stream as the schedule's; not measured).
        ahead: with the lane, the share of this rank's microbatches (its first) encoded before the
            schedule (default :data:`AHEAD`); the lane encodes the rest.
        media_from_first_stage: only the rank holding stage 0 has the step's media (a
            :class:`ppmedia.data.ReplicaLoader` that reads them there; the other ranks' ``staged`` is
            the split of the token rows alone). Each step it then makes the plan alone, broadcasts it
            (one small object) and sends every other rank the chunks of its own microbatches (their
            tensors, nothing decoded twice); ``False`` (default): every rank holds the whole batch's
            media and plans for itself. An attribute of the same name; set it on every rank alike.
    """

    def __init__(
        self,
        vision: nn.Module,
        adapter: VlmAdapter,
        *,
        first_stage: Any = None,
        group: Any = None,
        assign: Callable[[Sequence[float], int], Sequence[int]] | None = None,
        background: bool | None = None,
        ahead: float = AHEAD,
        media_from_first_stage: bool = False,
    ) -> None:
        import torch.distributed as dist

        encoded_ahead(0, ahead)  # checks the share before anything collective

        self.vision, self.adapter, self.config = vision, adapter, vision.config
        self.first_stage = first_stage
        ranks = _group_ranks(group)
        # Any: torch 2.14 types new_group's result as ProcessGroup | GroupMember.NON_GROUP_MEMBER
        self.group: Any = dist.new_group(ranks, use_local_synchronization=True) if len(ranks) > 1 else group
        self.rank, self.size = ranks.index(dist.get_rank()), len(ranks)
        if (first_stage is not None) != (self.rank == 0):
            raise ValueError(
                f"EncoderSpread: pipeline rank {self.rank} {'holds' if first_stage is not None else 'lacks'} "
                f"the first stage; expected it on pipeline rank 0 (where every torch schedule places it)"
            )
        self.ahead = float(ahead)
        self.media_from_first_stage = bool(media_from_first_stage)
        self.params = _vision_parameters(vision)
        self.device = next((p.device for _, p in self.params), torch.device("cpu"))
        self._assign = assign
        self.set_background(self.device.type == "cpu" if background is None else bool(background))
        self.wire_dtype = next((p.dtype for _, p in self.params if p.is_floating_point()), torch.float32)
        self.hidden = _text_dims(self.config)[0]
        self.trace: list[tuple[str, int, float, float]] | None = None  # (kind, microbatch, t0, t1) when set
        self.last_plan: SpreadPlan | None = None
        self.last_encoded: list[int] = []
        self._needs_grad = False
        self._synced = False
        self._keep: list[Tensor] = []  # tensors in flight (a send's buffer must outlive it)
        self._grad_sends: list[Any] = []
        self._pending: list[Any] = []  # stage 0's background broadcasts
        self._current_lane: Lane | None = None
        #: with FSDP2 stages (:meth:`shard_over`): the data-parallel groups stage 0's vision gradients
        #: are summed over (the vision side stays whole, outside FSDP2's groups)
        self.replica_groups: tuple[Any, ...] = ()
        self._check_layout()

    def set_background(self, on: bool) -> None:
        """Turn the background lane on or off for the next steps; the assignment follows
        (:func:`default_assign`) unless one was given."""
        self.background = bool(on)
        self.assign = self._assign or default_assign(self.background)

    # -- small pieces --------------------------------------------------------------------------
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

    # -- the plan ------------------------------------------------------------------------------
    def plan(self, staged: Any, input_ids: Tensor) -> SpreadPlan:
        """This step's :class:`SpreadPlan` (the same on every rank for the same batch): one host read
        of each sample's placeholder counts; costs from the split's metadata (no read)."""
        from ..producer.balancing import sample_costs
        from ..planning.costs import vision_value

        if staged.batch_size != input_ids.shape[0]:
            raise ValueError(
                f"encoder spread: input_ids has {input_ids.shape[0]} samples, the staged media {staged.batch_size}; "
                f"expected the batch that was split"
            )
        config, adapter = self.config, self.adapter
        masks = adapter.placeholder_masks(input_ids, config)
        per_sample = read_host(masks, {}).placeholders  # the one host read
        rows = tuple({m: sum(per_sample[m][a:b]) for m in masks} for a, b in staged.samples)
        cost = functools.partial(adapter.image_costs, config=config)
        costs = sample_costs(staged, staged.tensors, cost, vision_value(config, "patch_size")) / 1e6
        owners = tuple(int(r) for r in self.assign([float(c) for c in costs], self.size))
        if len(owners) != len(rows) or any(not 0 <= r < self.size for r in owners):
            raise ValueError(f"encoder spread: assign returned {list(owners)}; expected {len(rows)} ranks in 0..{self.size - 1}")
        names = tuple(
            tuple((name, m) for m in masks if r.get(m) for name in adapter.encoder_output_names(config, m)) for r in rows
        )
        return SpreadPlan(owners, tuple(float(c) for c in costs), rows, names)

    def _plan_and_media(self, staged: Any, input_ids: Tensor) -> tuple[SpreadPlan, dict[int, VlmMediaChunk] | None]:
        """The step's plan and, on a rank without stage 0 when only stage 0's rank has the media
        (:attr:`media_from_first_stage`), the chunks of its own microbatches, sent from there."""
        import torch.distributed as dist

        if not self.media_from_first_stage or self.size == 1:
            return self.plan(staged, input_ids), None
        shared: list[Any] = [None]
        if self.rank == 0:
            plan = self.plan(staged, input_ids)
            layouts = {k: _chunk_layout(staged.chunk(k)) for k, owner in enumerate(plan.owners)
                       if owner != 0 and plan.names[k]}
            shared = [(plan, tuple(staged.samples), layouts)]
        dist.broadcast_object_list(shared, group_src=0, group=self.group, device=self.device)
        plan, samples, layouts = shared[0]
        if self.rank == 0:
            for k, layout in layouts.items():
                chunk = staged.chunk(k)
                for name, _, _ in layout:
                    tensor = _chunk_tensor(chunk, name).contiguous()
                    self._keep.append(tensor)
                    self._pending.append(dist.isend(tensor, group_dst=plan.owners[k], group=self.group, tag=_MEDIA_TAG))
            return plan, None
        if tuple(staged.samples) != tuple(samples):
            raise ValueError(
                f"encoder spread: this rank split its rows into microbatches {list(staged.samples)}, stage 0's rank "
                f"into {list(samples)}; expected the same rows (the same batch, split_media's bounds)"
            )
        received, works = {}, []
        for k in plan.encoded_by(self.rank):
            tensors = {}
            for name, shape, dtype in layouts[k]:
                tensors[name] = torch.empty(shape, dtype=dtype, device=self.device)
                works.append(dist.irecv(tensors[name], group_src=0, group=self.group, tag=_MEDIA_TAG))
            received[k] = _chunk_from(tensors)
        _wait_all(works)
        return plan, received

    # -- before the step -----------------------------------------------------------------------
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

    def _checked(self, plan: SpreadPlan, staged: Any, input_ids: Tensor,
                 received: Mapping[int, VlmMediaChunk] | None = None) -> list[tuple[int, VlmMediaChunk, HostValues]]:
        """This rank's microbatches with their chunks (``received`` from stage 0's rank, else the
        staged ones) and host values, every one checked (``check_counts``, as stage 0 would) before
        anything is encoded or sent."""
        found = []
        for k in plan.encoded_by(self.rank):
            a, b = staged.samples[k]
            chunk = received[k] if received is not None else staged.chunk(k)
            _, host = self.adapter.check_counts(input_ids[a:b], chunk, self.config)
            if chunk is None:  # placeholders without media: check_counts raised already; a guard
                raise ValueError(f"encoder spread: microbatch {k} has placeholders {plan.rows[k]} but no media")
            found.append((k, chunk, host))
        return found

    def _encode_one(self, plan: SpreadPlan, k: int, chunk: VlmMediaChunk, host: HostValues, step: "_Step",
                    kind: str = "E") -> None:
        """Encode microbatch ``k``; send its outputs to stage 0 (or, on stage 0's rank, hand them over)."""
        import torch.distributed as dist

        t0 = time.perf_counter()
        out = self.adapter.encoder_outputs(self.vision, chunk, host)
        kept = {}
        for name, m in plan.names[k]:
            tensor = out.get(name)
            want = [plan.rows[k][m], self.hidden]
            if tensor is None or list(tensor.shape) != want:
                seen = "missing" if tensor is None else f"shape {list(tensor.shape)}"
                raise ValueError(
                    f"{type(self.adapter).__name__}.encoder_outputs, microbatch {k}: {name!r} is {seen}; "
                    f"expected {want} (one row per {m} placeholder, the text hidden size)"
                )
            kept[name] = tensor
        step.outputs[k] = kept
        wire = {name: t.detach().to(self.wire_dtype).contiguous() for name, t in kept.items()}
        if self.rank == 0:
            step.incoming[k].buffers = wire
            step.incoming[k].encoded.set()
        else:
            step.sends += [dist.isend(t, group_dst=0, group=self.group, tag=_FEATURE_TAG) for t in wire.values()]
            self._keep += list(wire.values())
        self._record(kind, k, t0, time.perf_counter())

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

    # -- the step ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, staged: Any, input_ids: Tensor, *, stage: bool = True) -> Iterator[SpreadPlan]:
        """Spread the encoder over one ``schedule.step()``; enter it on every pipeline rank.

        On entry: refresh the copies, plan, encode this rank's share, send it to stage 0, and (on the
        rank holding stage 0) stage the media there (:func:`ppmedia.stage_media`: every forward takes
        its own chunk once; the shape-inference forward costs none). On a normal exit: gradients back,
        the share's backward, the vision gradients summed onto stage 0.

        Args:
            staged: the step's :class:`~ppmedia.StagedMedia` (every rank splits the same batch).
            input_ids: ``[B, S]`` the batch's token ids (the rows the schedule splits).
            stage: ``False`` when the step feeds pre-split microbatches
                (``schedule.step(**ppmedia.microbatch_inputs(staged, ...).step_kwargs())``): stage 0's
                forward then finds microbatch ``k``'s chunk in its ``media`` keyword input and nothing
                is staged.

        Yields:
            The step's :class:`SpreadPlan`.
        """
        from ..producer.staging import stage_media

        self._keep, self._grad_sends, self._pending = [], [], []
        self._follow_trainable()
        self._needs_grad = torch.is_grad_enabled() and any(p.requires_grad for _, p in self.params)
        t0 = time.perf_counter()
        self.refresh(everything=not self._synced)
        self._record("S", -1, t0, time.perf_counter())
        plan, received = self._plan_and_media(staged, input_ids)
        self.last_plan = plan
        work = self._checked(plan, staged, input_ids, received)
        incoming = self._post_receives(plan) if self.rank == 0 else {}
        mine = [k for k, _, _ in work]
        receives = self._post_gradient_receives(plan, mine) if self.rank != 0 and self._needs_grad else {}
        step = _Step(incoming, {}, [])
        ahead = encoded_ahead(len(work), self.ahead if self.background else 1.0)
        for k, chunk, host in work[:ahead]:
            self._encode_one(plan, k, chunk, host, step)
        self.last_encoded = mine
        lane = self._current_lane = self._lane(plan, work[ahead:], step, receives)
        incoming, outputs, sends = step.incoming, step.outputs, step.sends
        features = None
        try:
            if self.rank == 0:
                features = _StepFeatures(self, plan, step)
                module = self.first_stage if isinstance(self.first_stage, nn.Module) else self.first_stage.submod
                module.__dict__[FEATURES_ATTRIBUTE] = features
                try:
                    with stage_media(self.first_stage, staged) if stage else contextlib.nullcontext():
                        yield plan
                finally:
                    module.__dict__.pop(FEATURES_ATTRIBUTE, None)
            else:
                yield plan
        except BaseException:
            lane.cancel()  # the step failed: no backward (rank 0's lane waits on events; free it)
            for item in incoming.values():
                item.ready.set()
            raise
        self._finish(plan, features, outputs, sends, lane)

    def _lane_error(self) -> BaseException | None:
        return self._current_lane.error if self._current_lane is not None else None

    def _lane(self, plan: SpreadPlan, later: Sequence[tuple[int, VlmMediaChunk, HostValues]], step: "_Step",
              receives: dict[int, tuple[list[Any], dict[str, Tensor]]]) -> Lane:
        """This rank's background lane: the encodes not done ahead of the schedule, then the vision
        backwards, in microbatch order, each once its gradients are here (on stage 0's rank when its
        own backward has filled them, elsewhere when they have arrived)."""
        step.later.update((k, (chunk, host)) for k, chunk, host in later)
        jobs: list[Any] = [(_nothing, functools.partial(self._lane_encode, plan, k, step)) for k, _, _ in later]
        if self._needs_grad:
            for k in [k for k, names in enumerate(plan.names) if names and plan.owners[k] == self.rank]:
                if self.rank == 0:
                    item = step.incoming[k]
                    jobs.append((item.ready.wait, functools.partial(self._backward_from_leaves, k, step, item)))
                else:
                    works, grads = receives[k]
                    jobs.append((functools.partial(_wait_all, works), functools.partial(self._backward_from, k, step, grads)))

        def failed(_: BaseException) -> None:  # stage 0's forwards must not wait for what never comes
            for item in step.incoming.values():
                item.encoded.set()

        return Lane(jobs, name=f"ppmedia-vision-lane-{self.rank}", background=self.background, on_error=failed)

    def _lane_encode(self, plan: SpreadPlan, k: int, step: "_Step") -> None:
        if step.claim(k):  # else stage 0's forward took it back
            chunk, host = step.later[k]
            self._encode_one(plan, k, chunk, host, step, "LE")

    def _backward_from_leaves(self, k: int, step: "_Step", item: _Incoming) -> None:
        self._backward(k, step.outputs[k], {n: leaf.grad for n, leaf in (item.leaves or {}).items()})

    def _backward_from(self, k: int, step: "_Step", grads: Mapping[str, Tensor]) -> None:
        self._backward(k, step.outputs[k], grads)

    def _finish(self, plan: SpreadPlan, features: _StepFeatures | None, outputs: dict[int, dict[str, Tensor]],
                sends: list[Any], lane: Lane) -> None:
        if not self._needs_grad:
            lane.join()  # its encodes
            _wait_all(sends)
        if features is not None:
            missing = [k for k in features.incoming if k not in features.takes]
            if missing:
                raise ValueError(
                    f"encoder spread: the first stage never took the encoded outputs of microbatches {missing} "
                    f"(its forwards took {features.takes}); expected every microbatch once"
                )
        _wait_all(self._pending)  # stage 0's background broadcast
        if self._needs_grad:
            if features is not None:
                for item in features.incoming.values():
                    if plan.owners[item.k] != 0 and not item.sent:
                        self._send_gradients(item, plan.owners[item.k])
                    item.ready.set()  # whatever gradients there are (a leaf may have none)
                # the copies' sum travels while this rank's lane finishes its own share's backward
                reduction = self._start_reduction()
                lane.join()
                self._finish_reduction(reduction)
                self._reduce_over_replicas()
            else:
                lane.join()
                _wait_all(sends)  # the features' sends (stage 0 has its gradients: they arrived)
                self._finish_reduction(self._start_reduction())
            _wait_all(self._grad_sends)
        self._keep, self._grad_sends, self._pending = [], [], []

    def _backward(self, k: int, outputs: Mapping[str, Tensor], grads: Mapping[str, Tensor | None]) -> None:
        """The tower's backward for microbatch ``k``'s outputs, from their gradients on stage 0
        (traced as ``LV`` on the background lane, ``V`` otherwise)."""
        pairs = [(t, grads[n]) for n, t in outputs.items() if t.requires_grad and grads.get(n) is not None]
        if not pairs:
            return
        t0 = time.perf_counter()
        torch.autograd.backward([t for t, _ in pairs], [g.to(t.dtype) for t, g in pairs])  # type: ignore[union-attr]
        self._record("LV" if self.background else "V", k, t0, time.perf_counter())

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


def _nothing() -> None:
    return None


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


def _wait_all(works: Sequence[Any]) -> None:
    for work in works:
        work.wait()


def encoder_spread_of(stages: Sequence[Any]) -> EncoderSpread:
    """The :class:`EncoderSpread` that ``make_pipeline_stages(..., encoder="spread")`` hung on this
    rank's stages (``PipelineStage`` objects or their modules).

    Raises:
        ValueError: the stages were built without the spread.
    """
    for stage in stages:
        module = stage if isinstance(stage, nn.Module) else getattr(stage, "submod", None)
        spread = getattr(module, "__dict__", {}).get(SPREAD_ATTRIBUTE)
        if isinstance(spread, EncoderSpread):
            return spread
    raise ValueError("encoder_spread_of: these stages have no encoder spread; build them with "
                     "make_pipeline_stages(..., encoder=\"spread\")")
