"""An adapter against the model itself: split -> stage -> consume -> merge, for several microbatch counts.

:func:`check_adapter` builds a tiny family's model and batch, takes the model's OWN full-batch merged
embeddings as the reference (:func:`~ppmedia.testing.tiny_models.capture_merged_embeds`), then runs
the batch the way a pipeline's first stage sees it::

    staged = split_media(batch, n, **adapter.media_counts(batch, config))
    with stage_media(model, staged):         # the model stands in for the first stage
        for k in range(n):                     # rows torch.tensor_split(range(B), n)[k]
            chunk = next_vlm_media_chunk(model)
            merged = adapter.merge(model, input_ids[rows], embed(input_ids[rows]), chunk)
            # merged must equal reference[rows] within atol

Any difference, or any error on the way, is an :class:`AdapterMismatch` naming the family, the
microbatch count, the microbatch and its samples.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping

import torch
from torch import Tensor

from . import tiny_models
from .tiny_models import capture_reference

if TYPE_CHECKING:
    from ..adapters.base import VlmAdapter
    from ..producer.layouts import LayoutSet

__all__ = ["AdapterMismatch", "MicrobatchCheck", "capture_reference", "check_adapter", "check_merges"]


class AdapterMismatch(AssertionError):
    """The adapter's merged embeddings differ from the model's own (or the path raised).

    Attributes:
        family: the family as results name it (``"llava_next"``, ``"my_plugin.tiny"``).
        n_microbatches: the microbatch count of the failing split.
        microbatch: the failing microbatch (``None``: the split or staging itself failed).
    """

    def __init__(self, message: str, family: str, n_microbatches: int, microbatch: int | None) -> None:
        super().__init__(message)
        self.family = family
        self.n_microbatches = n_microbatches
        self.microbatch = microbatch


@dataclass(frozen=True)
class MicrobatchCheck:
    """One microbatch that matched: ``max_abs_diff`` between merged and reference embeddings."""

    n_microbatches: int
    microbatch: int
    samples: tuple[int, int]
    has_media: bool
    max_abs_diff: float


def _resolve_adapter(adapter: Any, model: torch.nn.Module) -> VlmAdapter:
    if adapter is None:
        from ..registry import get_adapter

        return get_adapter(model)
    return adapter() if isinstance(adapter, type) else adapter


def _worst(diff: Tensor, rows: Tensor, masks: Mapping[str, Tensor]) -> str:
    """Where ``diff`` ``[b, S, H]`` is largest: sample, token, and what the token is."""
    per_token = diff.amax(dim=-1)
    flat = int(per_token.argmax())
    i, t = divmod(flat, per_token.shape[1])
    kinds = [m for m, mask in masks.items() if bool(mask[i, t])]
    what = f"a {'/'.join(kinds)} placeholder" if kinds else "a text token"
    bad = int((per_token > 0).sum())
    return f"worst at sample {int(rows[i])}, token {t} ({what}); {bad} of {per_token.numel()} tokens differ"


@dataclass
class _Split:
    """What every microbatch of one split is checked against."""

    name: str  # the family
    where: str  # family, adapter, microbatch count: the start of every message
    n: int
    adapter: VlmAdapter
    model: torch.nn.Module
    batch: Mapping[str, Tensor]
    reference: Tensor  # [B, S, hidden]
    positions: Tensor | None  # [k, B, S] or [B, S], compared when the adapter computes positions
    atol: float


def check_merges(
    name: str,
    adapter: VlmAdapter,
    model: torch.nn.Module,
    batch: Mapping[str, Tensor],
    reference: Tensor,
    n: int,
    atol: float = 1e-5,
    positions: Tensor | None = None,
    layouts: LayoutSet | None = None,
) -> list[MicrobatchCheck]:
    """One split of ``batch`` in ``n`` microbatches, each merged and compared with ``reference[rows]``
    (and, when ``positions`` is given and the adapter overrides ``position_ids``, its positions with
    the model's own). ``name`` names the family in messages; ``layouts``: the media layouts to split
    by (default: the process-wide registry's). The model itself is staged as the first stage. Raises
    :class:`AdapterMismatch` at the first difference.
    """
    from ..producer.split import split_media
    from ..producer.staging import stage_media

    split = _Split(name, f"{name} (adapter {adapter.name}), {n} microbatches", n, adapter, model, batch, reference, positions, atol)
    input_ids = batch["input_ids"]
    results: list[MicrobatchCheck] = []
    with _blame(split, None):
        staged = split_media(dict(batch), n, **adapter.media_counts(batch, model.config), layouts=layouts)
        # stage_media's exit checks that every staged chunk was consumed exactly once; staged on the
        # model itself, whose cursor then names the microbatch in merge's own errors
        with stage_media(model, staged):
            for k, rows in enumerate(torch.tensor_split(torch.arange(input_ids.shape[0]), n)):
                results.append(_check_one(split, model, k, rows))
    return results


def _check_one(split: _Split, stage: torch.nn.Module, k: int, rows: Tensor) -> MicrobatchCheck:
    from ..adapters.base import VlmAdapter
    from ..chunk import next_vlm_media_chunk

    a, b = (int(rows[0]), int(rows[-1]) + 1) if len(rows) else (0, 0)
    here = f"{split.where}, microbatch {k} (samples {a}..{b - 1})"
    ids, model, adapter = split.batch["input_ids"][a:b], split.model, split.adapter
    with _blame(split, k, here), torch.no_grad():
        chunk = next_vlm_media_chunk(stage)
        embed = getattr(model, "get_input_embeddings")()  # a transformers model's token embedding
        merged = adapter.merge(model, ids, embed(ids), chunk)
    expected = split.reference[a:b]
    if merged.shape != expected.shape:
        raise AdapterMismatch(f"{here}: merged embeddings are {list(merged.shape)}; expected {list(expected.shape)}", split.name, split.n, k)
    diff = (merged.detach().float() - expected.float()).abs()
    worst = float(diff.max()) if diff.numel() else 0.0
    if not worst <= split.atol:  # also catches NaN
        masks = adapter.placeholder_masks(ids, model.config)
        raise AdapterMismatch(
            f"{here}: merged embeddings differ from the model's own by {worst:.3g} (atol {split.atol:g}); "
            f"{_worst(diff, rows, masks)}",
            split.name, split.n, k,
        )
    if split.positions is not None and type(adapter).position_ids is not VlmAdapter.position_ids:
        _check_positions(split, here, k, rows, chunk)
    return MicrobatchCheck(split.n, k, (a, b), chunk is not None and chunk.has_media, worst)


def _check_positions(split: _Split, here: str, k: int, rows: Tensor, chunk: Any) -> None:
    """The adapter's positions for the microbatch equal the model's own full-batch ones (exactly)."""
    assert split.positions is not None
    a, b = (int(rows[0]), int(rows[-1]) + 1) if len(rows) else (0, 0)
    mask = split.batch.get("attention_mask")
    with _blame(split, k, here), torch.no_grad():
        got = split.adapter.position_ids(split.model, split.batch["input_ids"][a:b], chunk, None if mask is None else mask[a:b])
    expected = split.positions[:, a:b] if split.positions.dim() == 3 else split.positions[a:b]
    if got is None or got.shape != expected.shape or not torch.equal(got.to(expected.dtype), expected):
        seen = "None" if got is None else f"{list(got.shape)}"
        detail = ""
        if got is not None and got.shape == expected.shape:
            where = (got.to(expected.dtype) != expected).nonzero()[0].tolist()
            *component, i, t = where
            at = (f"component {component[0]}, " if component else "") + f"sample {a + i}, token {t}"
            detail = f"; first difference at {at}: {int(got[tuple(where)])} instead of {int(expected[tuple(where)])}"
        raise AdapterMismatch(
            f"{here}: position_ids {seen} differ from the model's own {list(expected.shape)}{detail}",
            split.name, split.n, k,
        )


@contextlib.contextmanager
def _blame(split: _Split, k: int | None, where: str | None = None) -> Iterator[None]:
    """Re-raise an error of the adapter or the staging path as :class:`AdapterMismatch` saying where."""
    try:
        yield
    except AdapterMismatch:
        raise
    except Exception as exc:
        raise AdapterMismatch(f"{where or split.where}: {type(exc).__name__}: {exc}", split.name, split.n, k) from exc


def check_adapter(
    family: str | ModuleType,
    *,
    adapter: Any = None,
    microbatches: Iterable[int] = (1, 2, 4),
    seed: int = 0,
    atol: float = 1e-5,
    model: torch.nn.Module | None = None,
    batch: Mapping[str, Tensor] | None = None,
    reference: Tensor | None = None,
    positions: Tensor | None = None,
    layouts: LayoutSet | None = None,
) -> list[MicrobatchCheck]:
    """Check an adapter against the model's own merge on a tiny family's batch, for each microbatch count.

    Args:
        family: a built-in tiny family name, a plugin's tiny-family module or its dotted name
            (see :func:`ppmedia.testing.tiny_models.load`).
        adapter: the adapter (instance or class); default: the registry's for the model.
        microbatches: microbatch counts to split the batch into (each a real split, stage and merge).
        seed: model and batch seed. ``model``, ``batch``, ``reference``, ``positions`` replace what
            the family builds (e.g. a golden file's inputs and expected embeddings ``[B, S, hidden]``).
            Without ``batch``, the batches of the family's optional ``build_batches(seed)`` are checked
            too, each against the model's own merge of it (microbatch counts above a batch's samples
            skipped for it).
            Without ``reference``, both come from the model's own forward (:func:`capture_reference`);
            positions are compared (exactly) for adapters that override ``position_ids``.
        atol: largest absolute difference accepted per element.
        layouts: the media layouts to split by (default: the process-wide registry's; a
            :class:`~ppmedia.testing.kit.FamilyKit` passes its registry's, plugins included).

    Returns:
        One :class:`MicrobatchCheck` per microbatch of every split.

    Raises:
        AdapterMismatch: (an ``AssertionError``) naming the family, microbatch count, microbatch and
            samples, and where the embeddings differ most (sample, token, placeholder or text).
    """
    module = tiny_models.load(family)
    name = tiny_models.family_name(module)
    model = module.build_model(seed) if model is None else model
    extra = tiny_models.more_batches(module, seed) if batch is None else []
    batch = module.build_batch(seed) if batch is None else batch
    resolved = _resolve_adapter(adapter, model)
    if reference is None:
        reference, positions = capture_reference(model, adapter=resolved, **module.reference_inputs(dict(batch)))
    counts = list(microbatches)
    out: list[MicrobatchCheck] = []
    for n in counts:
        out += check_merges(name, resolved, model, batch, reference, n, atol, positions, layouts)
    for k, more in enumerate(extra):  # the family's batches of other structures, each against its own reference
        ref, pos = capture_reference(model, adapter=resolved, **module.reference_inputs(dict(more)))
        for n in counts:
            if n > more["input_ids"].shape[0]:
                continue
            try:
                out += check_merges(name, resolved, model, more, ref, n, atol, pos, layouts)
            except AdapterMismatch as exc:
                raise AdapterMismatch(f"batch {k + 1} of build_batches: {exc}", exc.family, exc.n_microbatches,
                                      exc.microbatch) from exc
    return out
