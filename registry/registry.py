"""Adapter lookup by ``config.model_type``: built-ins, entry-point plugins and run-time registrations."""

from __future__ import annotations

import importlib.metadata
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import pluggy

from . import hookspecs
from .hookspecs import PROJECT

__all__ = [
    "ENTRY_POINT_GROUP",
    "MODEL_TYPE_ALIASES",
    "AdapterInfo",
    "AdapterRegistry",
    "PluginError",
    "UnknownModelTypeError",
]

#: entry-point group scanned (once, lazily) for third-party plugins.
ENTRY_POINT_GROUP = "ppmedia.adapters"

#: Explicit alias table: ``config.model_type`` strings seen on checkpoints -> the type an adapter serves.
MODEL_TYPE_ALIASES: dict[str, str] = {
    "qwen2_5_vl_text": "qwen2_5_vl",
    "qwen2_vl_text": "qwen2_vl",
    "llava-next": "llava_next",
    "kimi-vl": "kimi_vl",
    "kimi_k2_5": "kimi_k25",
    "step3v": "step3_vl",
}

BUILTIN_PROVIDER = "ppmedia (built-in)"


class PluginError(RuntimeError):
    """A plugin could not be loaded, or returned something that is not an adapter; names the plugin."""


class UnknownModelTypeError(KeyError, ValueError):
    """No adapter serves this model type; the message lists the known ones."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


@dataclass(frozen=True)
class AdapterInfo:
    """One registered adapter: what ``ppmedia adapters`` lists."""

    name: str
    model_types: tuple[str, ...]
    layout: str
    provider: str
    adapter: Any


def _model_type_of(x: Any) -> str:
    if isinstance(x, str):
        return x
    config = getattr(x, "config", None)
    for candidate in (x, config):
        model_type = getattr(candidate, "model_type", None) if candidate is not None else None
        if isinstance(model_type, str) and model_type:
            return model_type
    raise TypeError(
        f"get_adapter: got {type(x).__name__}; expected a model (with .config.model_type), a config "
        f"(with .model_type) or a model-type string"
    )


class AdapterRegistry:
    """A pluggy plugin manager plus the model-type table built from its plugins.

    Args:
        entry_point_group: the group scanned for plugins (``None``: no scan).
        builtins: register ppmedia's own adapters.
    """

    def __init__(self, entry_point_group: str | None = ENTRY_POINT_GROUP, builtins: bool = True) -> None:
        self.plugin_manager = pluggy.PluginManager(PROJECT)
        self.plugin_manager.add_hookspecs(hookspecs)
        self._group = entry_point_group
        self._builtins = builtins
        self._loaded = False
        self._lock = threading.RLock()
        self._by_type: dict[str, AdapterInfo] = {}
        self._aliases: dict[str, tuple[str, str]] = {a: (t, BUILTIN_PROVIDER) for a, t in MODEL_TYPE_ALIASES.items()}

    # ---------------------------------------------------------------- loading
    def _ensure_loaded(self) -> None:
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            if self._builtins:
                from ..adapters import builtin

                self.register_plugin(builtin, BUILTIN_PROVIDER)
            if self._group is not None:
                for plugin, provider in self._load_entry_points():
                    self.register_plugin(plugin, provider)

    def _load_entry_points(self) -> Iterable[tuple[Any, str]]:
        seen: set[tuple[str, str]] = set()
        for dist in importlib.metadata.distributions():
            for ep in dist.entry_points:
                if ep.group != self._group or (ep.name, ep.value) in seen:
                    continue
                seen.add((ep.name, ep.value))
                dist_name = dist.metadata["name"] if dist.metadata is not None else "?"
                provider = f"{ep.name} ({dist_name} {dist.version})"
                try:
                    plugin = ep.load()
                except Exception as exc:
                    raise PluginError(
                        f"ppmedia plugin {provider}: entry point {ep.name} = {ep.value} in group "
                        f"{self._group} failed to import: {type(exc).__name__}: {exc}"
                    ) from exc
                yield plugin, provider

    def register_plugin(self, plugin: Any, provider: str) -> None:
        """Register a pluggy plugin object and every adapter its hooks return."""
        with self._lock:
            try:
                self.plugin_manager.register(plugin, name=provider)
            except ValueError as exc:
                raise PluginError(f"ppmedia plugin {provider}: could not be registered: {exc}") from exc
            for impl in self.plugin_manager.hook.ppmedia_model_type_aliases.get_hookimpls():
                if impl.plugin_name == provider:
                    self._add_aliases(impl.function(), provider)
            for impl in self.plugin_manager.hook.ppmedia_adapters.get_hookimpls():
                if impl.plugin_name == provider:
                    returned = impl.function()
                    if not isinstance(returned, (list, tuple)):
                        raise PluginError(
                            f"ppmedia plugin {provider}: ppmedia_adapters returned {type(returned).__name__}; "
                            f"expected a list of VlmAdapter subclasses or instances"
                        )
                    for adapter in returned:
                        self._add(adapter, provider, override=bool(getattr(adapter, "override", False)))

    def _add_aliases(self, aliases: Any, provider: str) -> None:
        if not isinstance(aliases, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
            raise PluginError(
                f"ppmedia plugin {provider}: ppmedia_model_type_aliases returned {type(aliases).__name__}; "
                f"expected a mapping of str to str"
            )
        for alias, target in aliases.items():
            if alias in self._aliases and self._aliases[alias][0] != target:
                old_target, old_provider = self._aliases[alias]
                raise PluginError(
                    f"model type alias {alias!r}: {provider} maps it to {target!r} but {old_provider} "
                    f"already maps it to {old_target!r}"
                )
            self._aliases[alias] = (target, provider)

    def _add(self, adapter: Any, provider: str, override: bool) -> AdapterInfo:
        from ..adapters.base import VlmAdapter

        if isinstance(adapter, type) and issubclass(adapter, VlmAdapter):
            try:
                adapter = adapter()
            except Exception as exc:
                raise PluginError(f"ppmedia plugin {provider}: {adapter.__name__}() failed: {exc}") from exc
        if not isinstance(adapter, VlmAdapter):
            raise PluginError(
                f"ppmedia plugin {provider}: got {type(adapter).__name__} {adapter!r}; expected a "
                f"ppmedia.adapters.base.VlmAdapter subclass or instance"
            )
        name = getattr(adapter, "name", None)
        types = getattr(adapter, "model_types", None)
        layout = getattr(adapter, "layout", None)
        if not isinstance(name, str) or not name:
            raise PluginError(f"ppmedia plugin {provider}: {type(adapter).__name__}.name is {name!r}; expected a non-empty str")
        if not isinstance(types, tuple) or not types or not all(isinstance(t, str) and t for t in types):
            raise PluginError(
                f"ppmedia plugin {provider}: {type(adapter).__name__}.model_types is {types!r}; expected a "
                f"non-empty tuple of model-type strings"
            )
        if not isinstance(layout, str):
            raise PluginError(f"ppmedia plugin {provider}: {type(adapter).__name__}.layout is {layout!r}; expected a str")
        info = AdapterInfo(name, types, layout, provider, adapter)
        with self._lock:
            if not override:
                for t in types:
                    old = self._by_type.get(t)
                    if old is not None and old.adapter is not adapter:
                        raise PluginError(
                            f"model type {t!r} is claimed by two adapters: {old.name} from {old.provider} and "
                            f"{name} from {provider}; set override=True on the one that should win"
                        )
            for t in types:
                self._by_type[t] = info
        return info

    # ---------------------------------------------------------------- public
    def register_adapter(self, adapter: Any, *, provider: str | None = None, override: bool = False) -> AdapterInfo:
        """Register ``adapter`` (a ``VlmAdapter`` subclass or instance) at run time."""
        self._ensure_loaded()
        if provider is None:
            cls = adapter if isinstance(adapter, type) else type(adapter)
            provider = f"register_adapter() from {cls.__module__}"
        return self._add(adapter, provider, override)

    def resolve_model_type(self, model_type: str) -> str:
        """Follow the alias table (at most a few hops) to the model type an adapter serves."""
        self._ensure_loaded()
        seen = [model_type]
        while model_type not in self._by_type and model_type in self._aliases:
            model_type = self._aliases[model_type][0]
            if model_type in seen:
                raise PluginError(f"model type aliases form a cycle: {' -> '.join(seen + [model_type])}")
            seen.append(model_type)
        return model_type

    def get(self, x: Any) -> Any:
        """The adapter for ``x``: a model (``x.config.model_type``), a config, or a model-type string."""
        model_type = _model_type_of(x)
        info = self._by_type.get(self.resolve_model_type(model_type))
        if info is None:
            known = sorted(set(self._by_type) | set(self._aliases))
            raise UnknownModelTypeError(
                f"no ppmedia adapter for model type {model_type!r}; known model types: {', '.join(known)}. "
                f"Add one with ppmedia.register_adapter(...) or a plugin in entry-point group {ENTRY_POINT_GROUP!r}"
            )
        return info.adapter

    def list(self) -> list[AdapterInfo]:
        """Every registered adapter once, in registration order."""
        self._ensure_loaded()
        out: list[AdapterInfo] = []
        for info in self._by_type.values():
            if all(info is not o for o in out):
                out.append(info)
        return out

    def aliases(self) -> dict[str, str]:
        """``{alias: model_type}`` of the alias table, plugins' aliases included."""
        self._ensure_loaded()
        return {a: t for a, (t, _) in self._aliases.items()}
