"""Module surgery: cut a ``...ForConditionalGeneration`` model's module tree into per-stage trees.

The stage trees share parameters and children with the model (no data is copied): each stage's
language model keeps the decoder layers of its range under their ORIGINAL indices
(:class:`_KeptLayers`), so parameter names stay the full model's on every stage.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, Mapping, Sequence

from torch import nn

from .layer_split import default_layer_split, layer_split_problem  # default_layer_split: importable from here too

__all__ = ["LANGUAGE_MODEL_PATHS", "default_layer_split", "find_language_model", "find_merge_module", "find_output_head"]

#: where the language model sits inside a ``...ForConditionalGeneration`` model, tried in order when
#: the family's adapter does not say (``VlmAdapter.language_model_path``).
LANGUAGE_MODEL_PATHS: tuple[str, ...] = ("model.language_model", "language_model", "model.model")
_LANGUAGE_MODEL_PATHS = LANGUAGE_MODEL_PATHS



class _KeptLayers(nn.ModuleList):
    """A subset of a decoder-layer list, each layer registered under its ORIGINAL index.

    Iteration, ``len`` and positional indexing (``layers[0]`` is the first KEPT layer, slices give a
    plain ``ModuleList``) behave as for the list of kept layers, which is all a language model's
    ``forward`` does with ``self.layers``; ``named_parameters()`` keeps the full model's names.
    """

    def __init__(self, layers: Mapping[int, nn.Module] | Iterable[nn.Module] = ()) -> None:
        super().__init__()
        items = sorted(layers.items()) if isinstance(layers, Mapping) else enumerate(layers)
        for index, layer in items:
            self.add_module(str(index), layer)

    def __getitem__(self, idx: int | slice) -> Any:
        values = list(self._modules.values())
        if isinstance(idx, slice):
            return nn.ModuleList(values[idx])
        return values[idx]

    @property
    def original_indices(self) -> tuple[int, ...]:
        """The full model's indices of the kept layers, in order."""
        return tuple(int(k) for k in self._modules)


def _shallow(module: nn.Module, *, keep_members: bool) -> nn.Module:
    """A new module object of ``module``'s class sharing its attributes, parameters and children.

    The registries (children, parameters, buffers) are new dicts, so entries can be replaced or
    removed without touching ``module``. With ``keep_members=False`` they start empty.

    Every hook dict (forward/backward pre/post hooks, their ``with_kwargs`` and ``always_call``
    flags, state-dict and load-state-dict hooks) is a new dict too: the hooks ``module`` had are
    carried over, but a hook registered later on the copy (FSDP, activation checkpointing, a user's
    probe) fires on the copy only, and one registered on ``module`` never reaches the copy.
    """
    new = copy.copy(module)  # shallow: a new __dict__ whose values are module's own
    state = new.__dict__
    for name, value in module.__dict__.items():
        if "hook" in name and isinstance(value, (dict, set)):
            state[name] = copy.copy(value)  # keeps OrderedDict / set type and current entries
    if keep_members:
        state["_modules"] = dict(module._modules)
        state["_parameters"] = dict(module._parameters)
        state["_buffers"] = dict(module._buffers)
        state["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
    else:
        state["_modules"] = {}
        state["_parameters"] = {}
        state["_buffers"] = {}
        state["_non_persistent_buffers_set"] = set()
    return new


def _get_path(root: nn.Module, path: str) -> nn.Module | None:
    module: Any = root
    for part in path.split("."):
        module = module._modules.get(part) if isinstance(module, nn.Module) else None
        if module is None:
            return None
    return module


def _declared_path(model: nn.Module, adapter: Any) -> tuple[str | None, str]:
    """``(language_model_path, who declares it)`` of the model's adapter (looked up when not given)."""
    if adapter is None:
        from ..registry import get_adapter

        try:
            adapter = get_adapter(model)
        except (TypeError, ValueError):  # no model type, or no adapter for it: the default paths
            return None, ""
    path = getattr(adapter, "language_model_path", None)
    return path, f"{type(adapter).__name__}.language_model_path"


def find_language_model(model: nn.Module, adapter: Any = None) -> tuple[str, Any]:
    """``(dotted path, module)`` of the decoder stack inside ``model``.

    The adapter's ``language_model_path`` when it declares one (``adapter``: default the registry's
    for ``model``); otherwise the first of :data:`LANGUAGE_MODEL_PATHS` (``model.language_model``,
    transformers 5 VLMs; ``language_model``; ``model.model``) that has a ``layers`` list.

    Raises:
        TypeError: no such module (the paths tried are named).
    """
    declared, who = _declared_path(model, adapter)
    if declared is not None:
        module = _get_path(model, declared)
        if module is None or not isinstance(getattr(module, "layers", None), nn.ModuleList):
            found = "nothing" if module is None else f"a {type(module).__name__} without a `layers` ModuleList"
            raise TypeError(
                f"{type(model).__name__}: {who} is {declared!r}, but the model holds {found} there; expected the "
                f"decoder stack (a module with a `layers` ModuleList)"
            )
        return declared, module
    for path in _LANGUAGE_MODEL_PATHS:
        module = _get_path(model, path)
        if module is not None and isinstance(getattr(module, "layers", None), nn.ModuleList):
            return path, module
    raise TypeError(
        f"{type(model).__name__}: no language model with a `layers` list at any of "
        f"{', '.join(_LANGUAGE_MODEL_PATHS)}; an adapter says where its family keeps it with language_model_path"
        f"{_sub_models_hint(model)}"
    )


def find_merge_module(model: nn.Module, adapter: Any = None) -> tuple[str | None, nn.Module | None]:
    """``(dotted path, module)`` of the module whose output is the merged embeddings, as the adapter
    declares it (``VlmAdapter.merge_path``; ``adapter``: default the registry's for ``model``), or
    ``(None, None)``: the merge is the decoder stack's input.

    Raises:
        TypeError: the declared path holds no module in ``model`` (the path and the declaration named).
    """
    if adapter is None:
        from ..registry import get_adapter

        try:
            adapter = get_adapter(model)
        except (TypeError, ValueError):
            return None, None
    path = getattr(adapter, "merge_path", None)
    if path is None:
        return None, None
    module = _get_path(model, path)
    if module is None:
        raise TypeError(
            f"{type(model).__name__}: {type(adapter).__name__}.merge_path is {path!r}, but the model holds no module "
            f"there; expected the module whose output is the merged embeddings [B, S, hidden]"
        )
    return path, module


def _drop_path(shell: nn.Module, path: str) -> None:
    """Remove the module at dotted ``path`` (relative to ``shell``) from ``shell``'s tree, replacing the
    modules on the way by shallow copies (the model keeps its own)."""
    head, _, rest = path.partition(".")
    child = shell._modules.get(head)
    if child is None:
        return
    if not rest:
        del shell._modules[head]
        return
    copy_ = _shallow(child, keep_members=True)
    shell._modules[head] = copy_
    _drop_path(copy_, rest)


def _sub_models_hint(model: nn.Module) -> str:
    """For a model holding its models as sub-models (the Qwen Omnis: thinker, talker), where their decoder
    stacks are and how to cut the one that is trained; ``""`` when it holds none."""
    stacks = [name for name, module in model.named_modules()
              if name and isinstance(getattr(module, "layers", None), nn.ModuleList)
              and isinstance(getattr(module, "embed_tokens", None), nn.Module)]  # text decoders, not towers
    tops = list(dict.fromkeys(name.split(".")[0] for name in stacks))
    if not tops:
        return ""
    return (
        f". It holds its model{'s' if len(tops) > 1 else ''} as {', '.join(tops)} (decoder stacks at {', '.join(stacks)}): "
        f"cut the one you train, e.g. build_stage_modules(model.{tops[0]}, ...), or stages_from_pretrained on a "
        f"checkpoint of it alone (model.{tops[0]}.save_pretrained(path))"
    )


def find_output_head(model: nn.Module, language_model_path: str) -> str:
    """Dotted path of ``model.get_output_embeddings()`` (the LM head), wherever it sits: a child of the
    model (``lm_head``) or deeper (Llama 4's ``language_model.lm_head``), never inside the decoder stack.

    Raises:
        TypeError: the model has no output head, or it is not among its modules.
    """
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if isinstance(head, nn.Module):
        for name, child in model._modules.items():
            if child is head:
                return name
        inside = language_model_path + "."
        for name, module in model.named_modules():
            if module is head and name and not name.startswith(inside):
                return name
    raise TypeError(f"{type(model).__name__}: cannot find its output head (lm_head) among its modules")


def _child_name(parent: nn.Module, child: nn.Module | None, what: str) -> str:
    for name, module in parent._modules.items():
        if module is child and child is not None:
            return name
    raise TypeError(f"{type(parent).__name__}: cannot find its {what} among its children")


def _layer_ranges(num_layers: int, n_stages: int, layers_per_stage: Sequence[int] | None) -> list[tuple[int, int]]:
    problem = layer_split_problem(n_stages, num_layers, layers_per_stage)
    if problem:  # before any stage is cut: a stage holding nothing would fail only at its optimizer
        raise ValueError(problem)
    sizes = list(layers_per_stage) if layers_per_stage is not None else default_layer_split(num_layers, n_stages)
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    return list(zip(bounds, bounds[1:]))


def _stage_language_config(config: Any, kept: Sequence[int], total: int) -> Any:
    """A shallow copy of the language model's config whose per-layer lists cover only ``kept``."""
    new = copy.copy(config)
    for name in ("layer_types",):
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)) and len(value) == total:
            setattr(new, name, [value[i] for i in kept])
    return new


def _stage_children(
    model: nn.Module,
    lm: nn.Module,
    lm_path: str,
    head_path: str,
    layer_range: tuple[int, int],
    *,
    first: bool,
    last: bool,
    embed_name: str,
    norm_name: str | None,
    merge_path: str | None = None,
) -> dict[str, nn.Module]:
    """The stage's copies of ``model``'s children: what a :class:`StageModule` holds.

    The language model keeps its layers in ``layer_range``, its embedding (first stage), norm (last
    stage) and rotary embedding (always); the output head (``head_path``, at any depth) is kept on the
    last stage; the modules on the way to either are shells; everything else (the vision side) is
    kept only on the first stage. The merge module (``merge_path``) is the vision side's wherever it
    sits: inside the language model too, it is on the first stage only.
    """
    start, stop = layer_range
    layers: Any = lm.layers
    num_layers = len(layers)
    lm_shell = _shallow(lm, keep_members=True)
    lm_shell._modules["layers"] = _KeptLayers({i: layers[i] for i in range(start, stop)})
    if not first:
        del lm_shell._modules[embed_name]
    if norm_name is not None and not last:
        lm_shell._modules[norm_name] = nn.Identity()
    lm_shell.__dict__["config"] = _stage_language_config(lm.config, range(start, stop), num_layers)
    if merge_path is not None and merge_path.startswith(lm_path + ".") and not first:
        _drop_path(lm_shell, merge_path[len(lm_path) + 1 :])
    keep = _Keep(lm_path, head_path, lm_shell, first, last)
    children: dict[str, nn.Module] = {}
    for name, child in model._modules.items():
        pruned = keep.prune(child, name) if child is not None else None
        if pruned is not None:
            children[name] = pruned
    return children


class _Keep:
    """What one stage keeps of a module tree (see :func:`_stage_children`)."""

    def __init__(self, lm_path: str, head_path: str, lm_shell: nn.Module, first: bool, last: bool) -> None:
        self.lm_path, self.head_path, self.lm_shell = lm_path, head_path, lm_shell
        self.first, self.last = first, last

    def prune(self, module: nn.Module, path: str) -> nn.Module | None:
        if path == self.lm_path:
            return self.lm_shell
        if path == self.head_path:
            return module if self.last else None
        inside = path + "."
        if not (self.lm_path.startswith(inside) or self.head_path.startswith(inside)):
            return module if self.first else None  # off the language side: the vision side
        shell = _shallow(module, keep_members=self.first)
        for name, child in module._modules.items():
            if child is None:  # an optional submodule set to None: reads as None on every stage
                shell._modules[name] = None
                continue
            pruned = self.prune(child, inside + name)
            if pruned is None:
                shell._modules.pop(name, None)
            else:
                shell._modules[name] = pruned
        return shell
