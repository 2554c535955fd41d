"""What several test files need of training: ``examples/train.py`` loaded as a module (its parser and
functions, without a launch), and the reference every training test compares with: the tiny model
itself in one process, AdamW on full batches.
"""

from __future__ import annotations

import importlib.util
import pathlib
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

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


def model_adamw_run(family: str, seeds: Sequence[int], *, clip: float | None = None,
                    groups: Callable[[torch.nn.Module], Any] | None = None, held_out: int | None = None,
                    lr: float = 1e-3) -> tuple[list[float], list[float]]:
    """The tiny ``family``'s model itself (``build_model(0)``), one process, one thread: step ``k`` takes
    the loss of ``build_batch(seeds[k])`` (labels from ``pipeline.make_labels``), its backward, clipping
    to the global norm ``clip`` (none by default), ``AdamW(lr)`` on ``groups(model)`` (default: every
    parameter, torch's weight decay 0.01).

    Returns:
        (the training loss of every step, and with ``held_out`` the loss of ``build_batch(held_out)``
        at the weights each step trains from, else ``[]``).
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
        train, evals = [], []
        for seed in seeds:
            if held is not None:
                with torch.no_grad():
                    evals.append(loss_of(held).item())
            loss = loss_of(module.build_batch(seed))
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            train.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    return train, evals
