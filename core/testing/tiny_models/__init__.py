"""Built-in tiny seeded models and batches, one module per family.

They back the golden fixtures (``fixtures/generate.py``), the tests and ``ppmedia demo``. Nothing is
downloaded: every model is built from a config in code with a fixed seed.

Each family module defines:

* ``MODEL_TYPE``: the tiny model's ``config.model_type``;
* ``build_config()``: the tiny config;
* ``build_model(seed=0)``: the model, float32, in eval mode, weights drawn after
  ``torch.manual_seed(seed)``;
* ``build_batch(seed=0)``: a processor-style batch of 8 samples, ``input_ids`` ``[8, S]`` plus the
  media keys :func:`ppmedia.split_media` reads; split in 4 microbatches, microbatch 2 (samples 4 and
  5) is text-only;
* ``reference_inputs(batch)``: the keyword arguments of the model's own full-batch forward.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

__all__ = ["FAMILIES", "capture_merged_embeds", "load", "seeded"]

#: family name -> module name under ``ppmedia.tiny``.
FAMILIES: tuple[str, ...] = ("qwen2_5_vl", "llava_next", "step3", "kimi_vl")


def load(family: str) -> ModuleType:
    """Import the tiny module of ``family`` (one of :data:`FAMILIES`)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}; known: {', '.join(FAMILIES)}")
    return importlib.import_module(f"{__name__}.{family}")


def seeded(model_class: type, config: Any, seed: int) -> torch.nn.Module:
    """``model_class(config)`` with weights drawn after ``torch.manual_seed(seed)``, float32, eval mode."""
    torch.manual_seed(seed)
    return model_class(config).to(torch.float32).eval()


def capture_merged_embeds(model: torch.nn.Module, **inputs: Any) -> Tensor:
    """Run ``model(**inputs)`` and return the ``inputs_embeds`` ``[B, S, hidden]`` its language model got.

    The tensor is captured by a forward pre-hook on ``model.model.language_model``, i.e. after the
    model merged the image features itself: the reference for golden tests, independent of ppmedia.
    """
    captured: list[Tensor] = []

    def hook(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        captured.append(kwargs["inputs_embeds"].detach().clone())

    handle = model.model.language_model.register_forward_pre_hook(hook, with_kwargs=True)  # type: ignore[union-attr]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(f"expected one language-model call, saw {len(captured)}")
    return captured[0]
