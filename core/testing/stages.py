"""Stage splits in one process against the model itself: the check for state that crosses stage boundaries.

:func:`check_stage_splits` cuts a tiny family's model into pipeline stage modules
(:func:`ppmedia.pipeline.build_stage_modules`) for each requested ``layers_per_stage``, runs them one
after the other, microbatch by microbatch, on the staged batch (forward and backward, the loss
normalised by the whole batch's tokens), and compares the logits and EVERY parameter's gradient with
the model's own full-batch forward and loss (``model(**reference_inputs(batch), labels=...)``)::

    staged = split_media(batch, n, **adapter.media_counts(batch, config))
    with stage_media(stages[0], staged):
        for rows in microbatches:
            x = (input_ids[rows], attention_mask[rows])
            for stage in stages:
                x = stage(*x)            # hidden, mask, *wire tensors ... logits
            pipeline_loss(x, labels[rows], valid_tokens).backward()

No processes, no schedule: what it checks is the stage modules and the adapter's wire format (what
crosses each boundary, built and consumed by the model's own code). A split that puts a layer which
needs state from an earlier layer on a later stage fails here unless the adapter carries that state
(:meth:`ppmedia.adapters.base.VlmAdapter.wire_tensors`, :meth:`~ppmedia.adapters.base.VlmAdapter.stage_hooks`).
The multi-process schedules are :mod:`ppmedia.testing.parity`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import Tensor

from . import tiny_models
from .checks import AdapterMismatch, _resolve_adapter

__all__ = ["StageSplitCheck", "check_stage_splits", "held_twice", "reference_run", "stage_run"]


@dataclass(frozen=True)
class StageSplitCheck:
    """One split that matched the model.

    Attributes:
        layers_per_stage: the decoder layers of each stage.
        wire: per boundary, the names of the wire tensors that crossed it (besides hidden states and mask).
        max_logit_diff: max |stage logits - model logits|.
        max_grad_diff: max |stage gradient - model gradient| over every parameter.
        params_compared: parameters with a gradient in the model's run (all of them had one in the stages').
    """

    layers_per_stage: tuple[int, ...]
    wire: tuple[tuple[str, ...], ...]
    max_logit_diff: float
    max_grad_diff: float
    params_compared: int


def reference_run(model: torch.nn.Module, module: Any, batch: Mapping[str, Any], *,
                  adapter: Any = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The model's own full-batch forward and loss (transformers' mean token cross-entropy, the targets
    of :func:`ppmedia.pipeline.make_labels` with ``shift=False``), backward; returns ``(logits,
    {parameter: gradient})``. ``module`` is the tiny-family module (its ``reference_inputs``);
    ``adapter``: the family's (default: the registry's), whose placeholders the labels mask."""
    from ..pipeline import make_labels

    targets = make_labels(batch["input_ids"], model.config, adapter, attention_mask=batch.get("attention_mask"), shift=False)
    model.zero_grad(set_to_none=True)
    inputs = dict(module.reference_inputs(dict(batch)))
    inputs.setdefault("use_cache", False)
    out = model(**inputs, labels=targets)
    out.loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.logits.detach(), grads


def stage_run(
    model: torch.nn.Module,
    batch: Mapping[str, Any],
    layers_per_stage: Sequence[int],
    *,
    adapter: Any = None,
    n_microbatches: int = 4,
) -> tuple[Tensor, dict[str, Tensor], list[Any]]:
    """Stage modules of ``model`` run in sequence per microbatch, forward and backward.

    Returns:
        ``(logits [B, S, vocab], {parameter: gradient}, stage modules)``.
    """
    import ppmedia
    from ..pipeline import build_stage_modules, count_valid_tokens, make_labels, pipeline_loss

    resolved = _resolve_adapter(adapter, model)
    stages = build_stage_modules(model, len(layers_per_stage), layers_per_stage=layers_per_stage, adapter=resolved)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    staged = ppmedia.split_media(dict(batch), n_microbatches, **resolved.media_counts(batch, model.config))
    labels = make_labels(ids, model.config, resolved, attention_mask=mask)
    valid = count_valid_tokens(labels)
    model.zero_grad(set_to_none=True)
    outs = []
    with ppmedia.stage_media(stages[0], staged):
        for a, b in staged.samples:
            x: Any = (ids[a:b], mask[a:b])
            for stage in stages:
                x = stage(*x)
                x = x if isinstance(x, tuple) else (x,)
            pipeline_loss(x[0], labels[a:b], valid).backward()
            outs.append(x[0].detach())
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return torch.cat(outs), grads, stages


def held_twice(stages: Sequence[Any]) -> dict[str, list[int]]:
    """``{parameter name: stage indices}`` of every parameter (full-model name) that more than one of
    ``stages`` holds: a module copied to a stage that does not run it (a tied parameter has another
    name on each stage, so it is not one of them)."""
    holders: dict[str, list[int]] = {}
    for stage in stages:
        for name, _ in stage.named_parameters(remove_duplicate=False):
            holders.setdefault(name, []).append(int(stage.stage_index))
    return {name: where for name, where in holders.items() if len(set(where)) > 1}


def _duplicates_message(twice: Mapping[str, list[int]], stages: Sequence[Any]) -> str:
    names = sorted(twice)
    held = {n for stage in stages for n, _ in stage.named_parameters(remove_duplicate=False)}
    modules: list[str] = []
    for name in names:  # the outermost modules all of whose parameters are held twice
        parts = name.split(".")
        top = next((".".join(parts[:i]) for i in range(1, len(parts))
                    if all(n in twice for n in held if n.startswith(".".join(parts[:i]) + "."))), name)
        if top not in modules:
            modules.append(top)
    return (
        f"{len(names)} parameters are on more than one stage: those of {', '.join(modules[:4])}"
        f"{f' and {len(modules) - 4} more modules' if len(modules) > 4 else ''} (e.g. {names[0]} on stages "
        f"{sorted(set(twice[names[0]]))}): a later stage holds a copy of what one stage runs. An encoder or merge "
        f"inside the decoder stack: declare the module whose output is the merged embeddings as the adapter's "
        f"merge_path; a module only the last stage runs: replace it in the adapter's prune_stage"
    )


def check_stage_splits(
    family: str | ModuleType,
    splits: Iterable[Sequence[int]],
    *,
    adapter: Any = None,
    n_microbatches: int = 4,
    seed: int = 0,
    atol: float = 1e-5,
    model: torch.nn.Module | None = None,
    batch: Mapping[str, Any] | None = None,
) -> list[StageSplitCheck]:
    """Each split of ``splits`` (decoder layers per stage, e.g. ``(2, 2)``, ``(1, 1, 2)``) against the
    model's own forward and gradients (see the module docstring).

    Args:
        family: a built-in tiny family name, a plugin's tiny-family module or its dotted name.
        adapter: the adapter (instance or class); default: the registry's for the model.
        n_microbatches: microbatches per run. seed: model and batch seed; ``model`` / ``batch`` replace
            what the family builds (the model is trained on in place: its gradients are cleared).
        atol: the largest difference accepted, logits and gradients.

    Returns:
        One :class:`StageSplitCheck` per split.

    Raises:
        AdapterMismatch: a split's logits or a gradient differ, a parameter got no gradient in the
            stages, or a parameter is on more than one stage (:func:`held_twice`: the stages share
            parameters with the model, so a copy does not change the gradients here, but it does
            across processes); the message names the family, the split and the parameter. An error inside
            the stages (a model that needs state it did not get) is re-raised as it is.
    """
    module = tiny_models.load(family)
    name = tiny_models.family_name(module)
    model = module.build_model(seed) if model is None else model
    batch = module.build_batch(seed) if batch is None else batch
    from ..pipeline import build_stage_modules

    resolved = _resolve_adapter(adapter, model)
    ref_logits, ref_grads = reference_run(model, module, batch, adapter=resolved)
    out = []
    for split in splits:
        split = tuple(int(n) for n in split)
        where = f"{name}, layers per stage {list(split)}, {n_microbatches} microbatches"
        built = build_stage_modules(model, len(split), layers_per_stage=split, adapter=resolved)
        twice = held_twice(built)
        if twice:  # before running: the copies share the model's parameters, so no gradient shows them here
            raise AdapterMismatch(f"{where}: {_duplicates_message(twice, built)}", name, n_microbatches, None)
        logits, grads, stages = stage_run(model, batch, split, adapter=resolved, n_microbatches=n_microbatches)
        missing = sorted(set(ref_grads) - set(grads))
        if missing:
            raise AdapterMismatch(f"{where}: no gradient reached {len(missing)} parameters, e.g. {missing[:3]}", name, n_microbatches, None)
        logit_diff = float((logits - ref_logits).abs().max())
        diffs = {k: float((grads[k] - g).abs().max()) for k, g in ref_grads.items()}
        worst = max(diffs, key=lambda k: diffs[k])
        if not (logit_diff <= atol and diffs[worst] <= atol):
            raise AdapterMismatch(
                f"{where}: logits differ from the model's by {logit_diff:.3g}, gradients by up to "
                f"{diffs[worst]:.3g} ({worst}); atol {atol:g}", name, n_microbatches, None,
            )
        wire = tuple(tuple(w.name for w in stage.wire_out) for stage in stages[:-1])
        out.append(StageSplitCheck(split, wire, logit_diff, diffs[worst], len(ref_grads)))
    return out
