"""Module surgery: cut a ``...ForConditionalGeneration`` model's module tree into per-stage trees.

The stage trees share parameters and children with the model (no data is copied): each stage's
language model keeps the decoder layers of its range under their ORIGINAL indices
(:class:`_KeptLayers`), so parameter names stay the full model's on every stage.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, Mapping, Sequence

from torch import nn

__all__ = ["LANGUAGE_MODEL_PATHS", "default_layer_split", "find_language_model"]

#: where the language model sits inside a ``...ForConditionalGeneration`` model, tried in order.
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


def find_language_model(model: nn.Module) -> tuple[str, Any]:
    """``(dotted path, module)`` of the decoder stack inside ``model``.

    The first of ``model.language_model`` (transformers 5 VLMs), ``language_model``, ``model.model``
    that has a ``layers`` list.

    Raises:
        TypeError: none of them exists.
    """
    for path in _LANGUAGE_MODEL_PATHS:
        module = _get_path(model, path)
        if module is not None and isinstance(getattr(module, "layers", None), nn.ModuleList):
            return path, module
    raise TypeError(
        f"{type(model).__name__}: no language model with a `layers` list at any of "
        f"{', '.join(_LANGUAGE_MODEL_PATHS)}"
    )


def _child_name(parent: nn.Module, child: nn.Module | None, what: str) -> str:
    for name, module in parent._modules.items():
        if module is child and child is not None:
            return name
    raise TypeError(f"{type(parent).__name__}: cannot find its {what} among its children")


def default_layer_split(num_layers: int, n_stages: int) -> list[int]:
    """Decoder layers per stage: as even as possible, extra layers to the stages after the first.

    The first stage already runs the vision encoder, so it is the last to get a remainder layer.
    With fewer layers than stages some stages hold none (2 layers, 4 stages: ``[0, 1, 1, 0]``).
    """
    if n_stages < 1:
        raise ValueError(f"n_stages: got {n_stages}; expected >= 1")
    base, extra = divmod(num_layers, n_stages)
    sizes = [base] * n_stages
    order = list(range(1, n_stages)) + [0]
    for i in range(extra):
        sizes[order[i]] += 1
    return sizes


def _layer_ranges(num_layers: int, n_stages: int, layers_per_stage: Sequence[int] | None) -> list[tuple[int, int]]:
    sizes = list(layers_per_stage) if layers_per_stage is not None else default_layer_split(num_layers, n_stages)
    if len(sizes) != n_stages or any(s < 0 for s in sizes) or sum(sizes) != num_layers:
        raise ValueError(
            f"layers_per_stage: got {sizes}; expected {n_stages} non-negative counts summing to "
            f"{num_layers} (the model's decoder layers)"
        )
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


def _stage_tree(
    model: nn.Module,
    lm: nn.Module,
    lm_path: str,
    layer_range: tuple[int, int],
    *,
    first: bool,
    last: bool,
    embed_name: str,
    norm_name: str | None,
) -> nn.Module:
    """The stage's copy of ``model``'s first child on the way to the language model (``model.model``).

    The language model keeps its layers in ``layer_range``, its embedding (first stage), norm (last
    stage) and rotary embedding (always); the modules between the root and the language model keep
    everything else (the vision side) only on the first stage.
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

    path = lm_path.split(".")
    node: nn.Module = lm_shell
    for depth in range(len(path) - 1, 0, -1):
        parent = _get_path(model, ".".join(path[:depth]))
        assert parent is not None
        shell = _shallow(parent, keep_members=first)
        shell._modules[path[depth]] = node
        node = shell
    return node
