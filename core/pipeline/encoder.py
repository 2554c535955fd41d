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

The spread's pieces: :mod:`~ppmedia.pipeline.encoder_plan` (who encodes what: :class:`SpreadPlan`),
:mod:`~ppmedia.pipeline.encoder_exchange` (its traffic: broadcasts, sends, reductions),
:mod:`~ppmedia.pipeline.encoder_features` (the first stage's side: the outputs as leaves in place of
the tower), :mod:`~ppmedia.pipeline.encoder_replica` (the vision side on the other ranks); this module:
:class:`EncoderSpread` itself, a step and its background lane (every name above is importable from here).
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

from ..adapters.base import HostValues, VlmAdapter, read_host
from ..chunk import VlmMediaChunk
from .encoder_exchange import (_FEATURE_TAG, _MEDIA_TAG, _chunk_from, _chunk_layout, _chunk_tensor, _group_ranks,
                               _Incoming, _SpreadExchange, _Step, _wait_all)
from .encoder_features import _precomputed, _StepFeatures  # noqa: F401  (_precomputed: the tests take it from here)
from .encoder_plan import AHEAD, SpreadPlan, assign_encoders, default_assign, encoded_ahead, interleave_encoders
from .encoder_replica import _vision_parameters, vision_replica
from .lane import Lane
from .stages import FEATURES_ATTRIBUTE, _text_dims

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


class EncoderSpread(_SpreadExchange):
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


def _nothing() -> None:
    return None


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
