"""Built-in tiny seeded models and batches, one module per family; :func:`load` also takes a plugin's own.

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
* ``reference_inputs(batch)``: the keyword arguments of the model's own full-batch forward;
* optionally ``ADAPTER``: the name of the adapter serving the model, when it is not the family's name
  (a variant: ``mistral_small4`` is served by ``mistral3``, ``llava_pixtral`` by ``llava``,
  ``kimi_k25_video`` by ``kimi_vl``);
* optionally ``build_processor(image_backend="torchvision")``: the family's real processor around a
  tiny tokenizer (:func:`ppmedia.testing.processors.build_tiny_processor`);
* optionally ``build_batches(seed=0)``: more batches, each of another structure than ``build_batch``'s
  (media per sample permuted, other sizes or merge sizes, one modality alone), which ``check_adapter``
  and ``FamilyKit.check_adapter`` check as well (:func:`more_batches`); a bug that one structure hides
  (a merge size hard-coded to the one batch's) shows in another;
* optionally ``MAX_PARITY_LR``: the largest SGD step the parity harness takes on the model (Gemma 4's
  tiny model is so curved that a larger one turns float32 rounding into gradient differences above
  the tolerance, in its own microbatched forward too).

A plugin's own tiny-family module follows the same protocol (:data:`PROTOCOL`); the parity harness
needs its ``build_batch`` to hold 8 samples, like the built-ins'.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "FAMILIES",
    "PROTOCOL",
    "REFERENCE_LANGUAGE_MODELS",
    "capture_merged_embeds",
    "capture_reference",
    "constant_parameters",
    "family_name",
    "load",
    "more_batches",
    "seeded",
    "seeded_distinct",
]

#: family name -> module name under ``ppmedia.testing.tiny_models``.
FAMILIES: tuple[str, ...] = (
    "qwen2_5_vl",
    "llava_next",
    "step3",
    "kimi_vl",
    "qwen3_vl",
    "gemma3",
    "mistral3",
    "mistral_large4",
    "mistral_small4",
    "llava",
    "llava_pixtral",
    "minimax_m3_vl",
    "inkling2",
    "kimi_k25_video",
    "gemma4",
    "qwen2_5_omni",
    "qwen3_omni",
    "inkling",
    "llava_onevision",
    "idefics3",
    "smolvlm",
    "paligemma",
    "aya_vision",
    "llama4",
    "internvl",
    "glm4v",
    "glm4v_moe",
    "glm46v",
    "ernie4_5_vl_moe",
    "phi4_multimodal",
    "video_llama_3",
)


#: what a tiny-family module must define (see the module docstring).
PROTOCOL: tuple[str, ...] = ("MODEL_TYPE", "build_config", "build_model", "build_batch", "reference_inputs")


def more_batches(module: ModuleType, seed: int = 0) -> list[dict[str, Tensor]]:
    """The tiny-family module's optional ``build_batches(seed)`` as a list (``[]`` without one).

    Raises:
        TypeError: it returned something other than a list or tuple of batches (dicts with ``input_ids``).
    """
    build = getattr(module, "build_batches", None)
    if build is None:
        return []
    batches = build(seed)
    if not isinstance(batches, (list, tuple)) or not all(isinstance(b, dict) and "input_ids" in b for b in batches):
        raise TypeError(f"{module.__name__}.build_batches({seed}) returned {type(batches).__name__}; expected a list "
                        f"of batches (dicts holding input_ids)")
    return list(batches)


def load(family: str | ModuleType) -> ModuleType:
    """The tiny module of ``family``: a built-in name (one of :data:`FAMILIES`), the dotted name of a
    plugin's own tiny-family module (``"my_plugin.tiny"``), or that module itself.

    A dotted name is what crosses into spawned worker processes (the parity harness imports it there).

    Raises:
        ValueError: an unknown built-in name, or a dotted name that cannot be imported.
        TypeError: the module lacks part of :data:`PROTOCOL` (the missing names are listed).
    """
    if isinstance(family, ModuleType):
        module = family
    elif not isinstance(family, str):
        raise TypeError(f"tiny family: got {type(family).__name__}; expected a family name, a dotted module name or a module")
    elif family in FAMILIES:
        module = importlib.import_module(f"{__name__}.{family}")
    elif "." in family:
        try:
            module = importlib.import_module(family)
        except ImportError as exc:
            raise ValueError(f"tiny family {family!r}: cannot import it: {exc}") from exc
    else:
        raise ValueError(
            f"unknown family {family!r}; expected a built-in tiny family ({', '.join(FAMILIES)}) or the "
            f"dotted name of a module defining {', '.join(PROTOCOL)}"
        )
    missing = [name for name in PROTOCOL if not hasattr(module, name)]
    if missing:
        raise TypeError(f"tiny family module {module.__name__} lacks {', '.join(missing)}; expected {', '.join(PROTOCOL)}")
    return module


def family_name(family: str | ModuleType) -> str:
    """How results name ``family``: a built-in's name, else the module's dotted name."""
    module = load(family)
    prefix = f"{__name__}."
    return module.__name__[len(prefix):] if module.__name__.startswith(prefix) else module.__name__


def seeded(model_class: type, config: Any, seed: int) -> torch.nn.Module:
    """``model_class(config)`` with weights drawn after ``torch.manual_seed(seed)``, float32, eval mode.

    Only floating-point tensors are cast: ``Module.to(torch.float32)`` would also cast complex buffers
    to real, dropping their imaginary part (Llama 4's vision rotary table ``freqs_ci`` is complex).
    """
    torch.manual_seed(seed)
    model: torch.nn.Module = model_class(config)
    return model._apply(lambda t: t.float() if t.is_floating_point() else t).eval()


def constant_parameters(model: torch.nn.Module) -> list[str]:
    """Names of ``model``'s parameters whose entries all hold one value (norm weights initialised to
    ones, query scalings and block-state queries to zeros): a golden or parity test cannot tell
    their entries apart, so a bug that mixes them up would go unnoticed."""
    names = []
    for name, param in model.named_parameters():
        flat = param.detach().reshape(-1)
        if flat.numel() and bool((flat == flat[0]).all()):
            names.append(name)
    return names


def seeded_distinct(model_class: type, config: Any, seed: int) -> torch.nn.Module:
    """:func:`seeded`, then every parameter of :func:`constant_parameters` redrawn from the seed:
    ``c + 0.1 * max(1, |c|) * N(0, 1)`` entry by entry (``c`` its constant). transformers initialises
    several parameters to constants that checkpoints overwrite (Mistral Large 4's query scaling,
    Inkling 2's block-state queries, MiniMax's norm weights start at zero); drawn, every entry is
    distinct and every test can see them."""
    model = seeded(model_class, config, seed)
    gen = torch.Generator().manual_seed(seed + 7919)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in constant_parameters(model):
            param = params[name]
            c = float(param.reshape(-1)[0])
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            param.copy_((c + 0.1 * max(1.0, abs(c)) * noise).to(param.dtype))
    return model


#: where :func:`capture_reference` hooks the model's language model (the module its own forward hands the
#: merged ``inputs_embeds``), tried in order: transformers 5 VLMs' ``model.language_model``; Llama 4's
#: ``language_model`` (a ``Llama4ForCausalLM`` at the top level). Fixed paths, not ppmedia's lookup.
REFERENCE_LANGUAGE_MODELS: tuple[str, ...] = ("model.language_model", "language_model")


def _reference_language_model(model: torch.nn.Module) -> Any:
    for path in REFERENCE_LANGUAGE_MODELS:
        module: Any = model
        for part in path.split("."):
            module = getattr(module, part, None)
        if isinstance(module, torch.nn.Module):
            return module
    raise TypeError(f"{type(model).__name__}: no language model at {' or '.join(REFERENCE_LANGUAGE_MODELS)}")


def capture_merged_embeds(model: torch.nn.Module, *, adapter: Any = None, **inputs: Any) -> Tensor:
    """Run ``model(**inputs)`` and return the merged embeddings ``[B, S, hidden]`` the model made itself.

    Captured where the family merges (:func:`capture_reference`): by default the ``inputs_embeds`` its
    decoder stack gets (``model.model.language_model``; Idefics3's ``model.model.text_model``, Llama 4's
    ``model.language_model.model``: the adapter's ``language_model_path``; without an adapter the first
    of :data:`REFERENCE_LANGUAGE_MODELS`); with the adapter's ``merge_path`` the output of that module
    (Phi-4-multimodal's ``model.embed_tokens_extend``, inside the decoder stack). The reference for
    golden tests, independent of ppmedia's merge.
    """
    return capture_reference(model, adapter=adapter, **inputs)[0]


def _first_tensor(value: Any) -> Any:
    """A module's output as a tensor: itself, ``.last_hidden_state``, or its first element."""
    if isinstance(value, Tensor):
        return value
    if hasattr(value, "last_hidden_state"):
        return value.last_hidden_state
    return value[0] if isinstance(value, (tuple, list)) and value else None


def capture_reference(model: torch.nn.Module, *, adapter: Any = None, **inputs: Any) -> tuple[Tensor, Tensor | None]:
    """Run ``model(**inputs)``; return the merged embeddings ``[B, S, hidden]`` and the ``position_ids``
    its language model got (e.g. Qwen's mrope ``[3, B, S]``; ``None`` when the model leaves positions
    to the language model).

    ``adapter`` (default: the registry's for ``model``; the testing kit passes the one under test, so
    a plugin given as ``plugins=`` is used as an installed one) says where the family merges: without
    a ``merge_path``, the ``inputs_embeds`` the decoder stack (its ``language_model_path``) gets; with
    one, the output of that module.

    Raises:
        RuntimeError: the language model (or the merge module) ran other than once, or the decoder
            stack got no ``inputs_embeds`` (its family merges inside it: the message says to declare
            ``merge_path``).
    """
    from ...pipeline.surgery import find_language_model, find_merge_module

    calls: list[dict[str, Any]] = []
    merged: list[Any] = []

    def before(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        calls.append({k: kwargs.get(k) for k in ("inputs_embeds", "position_ids")})

    def after(_module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        merged.append(_first_tensor(output))

    try:
        language_model: Any = find_language_model(model, adapter)[1]
    except TypeError:  # no adapter registered for it: the usual places
        language_model = _reference_language_model(model)
    merge_path, merge = find_merge_module(model, adapter)
    handles = [language_model.register_forward_pre_hook(before, with_kwargs=True)]
    if merge is not None:
        handles.append(merge.register_forward_hook(after))
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    if len(calls) != 1 or (merge is not None and len(merged) != 1):
        raise RuntimeError(f"expected one language-model call, saw {len(calls)}"
                           + (f", and one call of {merge_path}, saw {len(merged)}" if merge is not None else ""))
    embeds, positions = merged[0] if merge is not None else calls[0]["inputs_embeds"], calls[0]["position_ids"]
    if not isinstance(embeds, Tensor):
        where = f"{merge_path} returned {type(embeds).__name__}" if merge is not None else (
            f"{type(language_model).__name__} got no inputs_embeds (the model merges inside it: declare where "
            f"with the adapter's merge_path, the module whose output is the merged embeddings)")
        raise RuntimeError(f"{type(model).__name__}: cannot capture the merged embeddings: {where}")
    return embeds.detach().clone(), None if positions is None else positions.detach().clone()
