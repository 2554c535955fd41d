"""The first stage's side of the encoder spread: its forward takes each microbatch's encoded outputs
(received, or encoded on its own rank) as leaf tensors in place of running the tower
(:class:`_StepFeatures`, an adapter that hands them over), and their gradients go back to the encoder
as soon as the schedule's backward has filled them.
"""

from __future__ import annotations

import copy
import time
from typing import TYPE_CHECKING, Any, Callable

from torch import Tensor, nn

from ..adapters.base import HostValues, VlmAdapter
from ..chunk import VlmMediaChunk
from .encoder_exchange import _Incoming, _Step, _wait_all
from .encoder_plan import SpreadPlan

if TYPE_CHECKING:
    from .encoder import EncoderSpread


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
                elif spread._current_lane is not None:
                    spread._current_lane.boost(unless=item.encoded)  # the lane runs it: at the schedule's priority now
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
