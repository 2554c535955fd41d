"""What a parity worker watches during a step: which chunk each first-stage forward consumed and which
rows of the global batch its media views cover, how often the decoder and vision layers ran, which
microbatches the encoder spread encoded on this rank, and (packed rows) whether positions restart at
each sample."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Sequence

import torch

from .groups import _Groups
from .scenarios import Scenario

if TYPE_CHECKING:
    from .build import _Built


def _microbatch_of(ids: torch.Tensor, input_ids: torch.Tensor, samples: Sequence[tuple[int, int]]) -> int:
    """Which microbatch's rows ``ids`` are (-1: none)."""
    for k, (a, b) in enumerate(samples):
        rows = input_ids[a:b]
        if rows.shape == ids.shape and torch.equal(rows, ids):
            return k
    return -1


class _PositionCheck:
    """Packed stages: records where a stage's language model got positions that do not restart per
    sample (a sample's first position must equal its row's first: 0, PaliGemma 1, mrope (0, 0, 0))."""

    def __init__(self, modules: Sequence[Any]) -> None:
        self.problems: list[str] = []
        self.handles = []
        for module in modules:
            self.handles.append(module.register_forward_pre_hook(self._segments))
            self.handles.append(module.stage_language_model.register_forward_pre_hook(
                functools.partial(self._positions, module.stage_index), with_kwargs=True))
        self.segments: torch.Tensor | None = None

    def _segments(self, module: Any, args: tuple[Any, ...]) -> None:
        self.segments = args[1] if len(args) > 1 else None

    def _positions(self, stage: int, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        positions, segments = kwargs.get("position_ids"), self.segments
        if positions is None or segments is None:
            self.problems.append(f"stage {stage}: no positions for packed rows")
            return
        p = positions if positions.dim() == 3 else positions[None]  # [axes, b, S]
        p = p.expand(p.shape[0], *segments.shape)
        starts = torch.zeros_like(segments, dtype=torch.bool)
        starts[:, 1:] = (segments[:, 1:] != segments[:, :-1]) & (segments[:, 1:] != 0)
        wrong = (p != p[:, :, :1]).any(dim=0) & starts
        if bool(wrong.any()):
            r, t = (int(v) for v in wrong.nonzero()[0])
            self.problems.append(f"stage {stage}: row {r}'s sample starting at token {t} has position "
                                 f"{p[:, r, t].tolist()}, its row's first token {p[:, r, 0].tolist()}")

    def take(self) -> list[str]:
        out, self.problems = self.problems, []
        return out

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class _Probe:
    """Hooks that watch one step: which chunk each first-stage forward takes (and which rows of the
    global batch's media it covers), and how often the decoder and vision layers run."""

    def __init__(self, built: _Built) -> None:
        from ...chunk import CURSOR_ATTRIBUTE, STAGED_ATTRIBUTES

        self.trace: list[tuple[int | None, int]] = []
        self.views: list[tuple[int, str, torch.Tensor]] = []
        self.layer_calls = 0
        self.vision_calls = 0
        self.layers = 0
        self.current: dict[str, Any] = {}
        self.handles: list[Any] = []

        def record(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            media = kwargs.get("media")  # pre-split: the microbatch's own input; else the staged lists
            cursor = module.__dict__.get(CURSOR_ATTRIBUTE) if media is None else media.index
            self.trace.append((cursor, _microbatch_of(args[0], self.current["input_ids"], self.current["samples"])))
            for name, attribute in STAGED_ATTRIBUTES.items():
                if media is not None:
                    view = None if media.chunk is None else getattr(media.chunk, name)
                    if view is not None:
                        self.views.append((media.index, name, view))
                    continue
                staged = module.__dict__.get(attribute)
                if cursor is not None and staged is not None and cursor < len(staged) and staged[cursor].numel():
                    self.views.append((cursor, name, staged[cursor]))

        def count(attr: str) -> Any:
            def hook(*_: Any) -> None:
                setattr(self, attr, getattr(self, attr) + 1)

            return hook

        if built.first is not None:
            self.handles.append(built.first.submod.register_forward_pre_hook(record, with_kwargs=True))
        for module in built.modules:
            decoder = list(module.stage_language_model.layers)
            self.layers += len(decoder)
            ids = {id(layer) for layer in decoder}
            for sub in module.modules():
                if isinstance(sub, _checkpoint_layer_class()):
                    child = next(iter(sub.children()), None)
                    if child is not None:
                        attr = "layer_calls" if id(sub) in ids else "vision_calls"
                        self.handles.append(child.register_forward_pre_hook(count(attr)))

    def reset(self, input_ids: torch.Tensor, samples: Any) -> None:
        self.current.update(input_ids=input_ids, samples=samples)
        self.trace.clear()
        self.views.clear()
        self.layer_calls = self.vision_calls = 0

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _checkpoint_layer_class() -> type[torch.nn.Module]:
    """transformers' checkpointable layer class (decoder layers and vision blocks)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return GradientCheckpointingLayer


def _media_rows(probe: _Probe, media_batch: dict[str, Any], global_split: Any, g: _Groups, n: int, where: str) -> list[list[Any]]:
    """Locate every consumed media view in the GLOBAL batch's tensor and check that it covers exactly
    the rows of this replica's microbatch (so no replica's media ever reach another)."""
    rows = []
    for chunk, name, view in probe.views:
        whole = media_batch[global_split.sources[name]]
        if view.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr():
            raise AssertionError(f"{where}: staged {name} of chunk {chunk} is not a view of the batch's tensor")
        stride = whole.stride(0) if whole.dim() else 1
        start = (view.storage_offset() - whole.storage_offset()) // max(stride, 1)
        expected = global_split.ranges[name][g.dp_rank * n + chunk]
        if (start, start + view.shape[0]) != tuple(expected):
            raise AssertionError(
                f"{where}: replica {g.dp_rank} chunk {chunk} staged {name} rows {start}:{start + view.shape[0]} "
                f"of the global batch; its own samples' rows are {expected[0]}:{expected[1]}"
            )
        rows.append([g.dp_rank, chunk, name, int(start), int(start + view.shape[0])])
    return rows


def _encoded_rows(built: _Built, scenario: Scenario, staged: Any, g: _Groups, where: str) -> list[list[int]]:
    """Spread: ``[dp_rank, pp_rank, microbatch]`` per chunk this rank encoded; checks that it encoded
    exactly its share of the plan and that the plan gives every microbatch with media an encoder."""
    if scenario.encoder != "spread":
        return []
    from ...pipeline import encoder_spread_of

    spread = encoder_spread_of(built.stages)
    plan = spread.last_plan
    assert plan is not None
    for k in range(staged.n_microbatches):
        chunk = staged.chunk(k)  # per-sample inputs alone (PaliGemma's token types) are no media to encode
        if bool(plan.names[k]) != (chunk is not None and chunk.has_media):
            raise AssertionError(f"{where}: microbatch {k}: plan {plan.names[k]} but chunk {staged.chunk(k)!r:.60}")
    if spread.last_encoded != plan.encoded_by(spread.rank):
        raise AssertionError(f"{where}: rank {spread.rank} encoded {spread.last_encoded}; its share is {plan.encoded_by(spread.rank)}")
    return [[g.dp_rank, spread.rank, k] for k in spread.last_encoded]


def _check_calls(probe: _Probe, built: _Built, scenario: Scenario, step: int, n: int, where: str) -> tuple[int, int]:
    """Stage 0 ran once per microbatch (plus the shape-inference forward) on its own chunk; returns
    the decoder layers' calls and the expected number."""
    # varlen: every schedule step has another S than the previous one, so shapes are inferred again;
    # eval: every step follows an eval() (a switch from training and back)
    inference = scenario.shapes == "inferred" and (step == 0 or scenario.variant in ("varlen", "eval"))
    expected_calls = n + inference
    if built.first is not None:
        if len(probe.trace) != expected_calls:
            raise AssertionError(f"{where}: stage 0's forward ran {len(probe.trace)} times; expected {expected_calls}")
        for cursor, microbatch in probe.trace:
            if cursor != microbatch or microbatch < 0:
                raise AssertionError(
                    f"{where}: stage 0 consumed chunk {cursor} for the rows of microbatch {microbatch} (trace {probe.trace})"
                )
    if scenario.checkpointing and (inference or _splits_backward(built.schedule)):
        # not a fixed count: torch's shape inference and its split backward (backward_input, then
        # backward_weight per parameter group) each re-run checkpointed layers; reported, not checked
        return expected_calls, -1
    expected_layers = probe.layers * (n * (2 if scenario.checkpointing else 1) + inference)
    return expected_calls, expected_layers


def _splits_backward(schedule: Any) -> bool:
    """Whether the schedule runs backward_input and backward_weight separately (zero-bubble ones)."""
    order = getattr(schedule, "pipeline_order", None) or {}
    return any(
        getattr(getattr(a, "computation_type", None), "value", None) == "I" for actions in order.values() for a in actions
    )
