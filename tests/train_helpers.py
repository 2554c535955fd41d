"""What several test files need of training: ``examples/train.py`` loaded as a module (its parser and
functions, without a launch), and the reference every training test compares with: the tiny model
itself in one process, AdamW on full batches.
"""

from __future__ import annotations

import importlib.util
import pathlib
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, NamedTuple

import torch

from ppmedia import pipeline
from ppmedia.testing import tiny_models

ROOT = pathlib.Path(__file__).resolve().parents[1]


def train_script() -> ModuleType:
    """``examples/train.py`` as a fresh module (``parse_args``, ``build_parser``, ...: nothing runs)."""
    spec = importlib.util.spec_from_file_location("ppmedia_train_example", ROOT / "examples" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_py_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """examples/train.py's AdamW groups: weight decay 0.01, none on biases, 1-D norm weights and the
    embedding table."""
    plain = [p for n, p in model.named_parameters() if p.dim() < 2 or "embed_tokens" in n]
    decayed = [p for p in model.parameters() if all(p is not q for q in plain)]
    return [{"params": decayed, "weight_decay": 0.01}, {"params": plain, "weight_decay": 0.0}]


class OwnRun(NamedTuple):
    """:func:`model_adamw_run`'s figures, one per step."""

    losses: list[float]  # the training loss
    evals: list[float]  # the held-out batch's loss at the weights the step trains from ([] without held_out)
    norms: list[float]  # the global gradient norm before clipping (nan without clip)


def model_adamw_run(family: str, seeds: Sequence[int], *, clip: float | None = None,
                    groups: Callable[[torch.nn.Module], Any] | None = None, held_out: int | None = None,
                    lr: float = 1e-3) -> OwnRun:
    """The tiny ``family``'s model itself (``build_model(0)``), one process, one thread: step ``k`` takes
    the loss of ``build_batch(seeds[k])`` (labels from ``pipeline.make_labels``), its backward, clipping
    to the global norm ``clip`` (none by default), ``AdamW(lr)`` on ``groups(model)`` (default: every
    parameter, torch's weight decay 0.01).

    Returns:
        :class:`OwnRun`: per step its loss, with ``held_out`` the loss of ``build_batch(held_out)`` at
        the weights the step trains from, and with ``clip`` the gradient norm before clipping.
    """
    module = tiny_models.load(family)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = module.build_model(0)
        optimizer = torch.optim.AdamW(model.parameters() if groups is None else groups(model), lr=lr)

        def loss_of(batch: dict[str, Any]) -> torch.Tensor:
            targets = pipeline.make_labels(batch["input_ids"], model.config, attention_mask=batch["attention_mask"],
                                           shift=False)
            return model(**{"use_cache": False, **module.reference_inputs(batch)}, labels=targets).loss

        held = None if held_out is None else module.build_batch(held_out)
        train, evals, norms = [], [], []
        for seed in seeds:
            if held is not None:
                with torch.no_grad():
                    evals.append(loss_of(held).item())
            loss = loss_of(module.build_batch(seed))
            loss.backward()
            norms.append(float("nan") if clip is None else torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            train.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    return OwnRun(train, evals, norms)


def model_loss(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """The model's own loss on a ``ppmedia.data`` loader batch: its labels (shifted by the loader, the
    first label marked ``SHIFTED_MARK``) put back in transformers' unshifted form."""
    from ppmedia.pipeline.loss import SHIFTED_MARK

    labels = batch["labels"]
    unshifted = torch.full_like(labels, pipeline.IGNORE_INDEX)
    unshifted[:, 1:] = labels[:, :-1]
    unshifted[unshifted == SHIFTED_MARK] = pipeline.IGNORE_INDEX
    inputs = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and k != "labels"}
    return model(**inputs, labels=unshifted, use_cache=False).loss
