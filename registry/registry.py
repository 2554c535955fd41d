"""Adapter lookup by ``config.model_type``: built-ins, entry-point plugins and run-time registrations.

The table maps each model type to an adapter, or to where one lives (``"module:Class"``, from a
plugin's ``ppmedia_adapter_paths`` hook): such a row is imported on the first lookup of its model type,
so looking up one family imports only that family's adapter module.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import inspect
import os
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Union

import pluggy

from ..adapters.base import SampleInput, VlmAdapter  # torch only: no family, no transformers
from ..producer.layouts import LayoutSet, MediaLayout, check_layout
from . import hookspecs
from .hookspecs import PROJECT

__all__ = [
    "BUILTIN_PROVIDER",
    "ENTRY_POINT_GROUP",
    "PLUGINS_ENV_VAR",
    "AdapterInfo",
    "AdapterRegistry",
    "PluginError",
    "UnknownModelTypeError",
]

#: entry-point group scanned (once, lazily) for third-party plugins.
ENTRY_POINT_GROUP = "ppmedia.adapters"
#: environment variable naming plugin modules to load too (comma-separated dotted names), for plugins
#: that are importable but not installed (a plugin's own test suite, spawned worker processes).
PLUGINS_ENV_VAR = "PPMEDIA_PLUGINS"
#: provider name of ppmedia's own adapters (``ppmedia.adapters.builtin``).
BUILTIN_PROVIDER = "ppmedia (built-in)"

_HOOKS = ("ppmedia_adapter_paths", "ppmedia_adapters", "ppmedia_media_layouts", "ppmedia_model_type_aliases")


class PluginError(RuntimeError):
    """A plugin could not be loaded, or gave something the registry cannot use.

    Attributes:
        provider: who provided the plugin or adapter (e.g. ``"llava (ppmedia-llava-plugin 0.1.0)"``).
        problem: what was wrong, in words.
        hook: the hook concerned (e.g. a misspelled ``"ppmedia_adapter"``), or ``None``.
        other_provider: for two providers claiming one model type, the one registered first.
    """

    def __init__(self, provider: str, problem: str, *, hook: str | None = None, other_provider: str | None = None) -> None:
        self.provider = provider
        self.problem = problem
        self.hook = hook
        self.other_provider = other_provider
        super().__init__(f"ppmedia plugin {provider}: {problem}")


class UnknownModelTypeError(KeyError, ValueError):
    """No adapter serves this model type; the message lists the known ones.

    Attributes:
        model_type: the type looked up.
        known: every model type and alias the registry knows, sorted.
    """

    def __init__(self, model_type: str, known: list[str]) -> None:
        self.model_type = model_type
        self.known = known
        super().__init__(
            f"no ppmedia adapter for model type {model_type!r}; known model types: {', '.join(known)}. "
            f"Add one with ppmedia.register_adapter(...) or a plugin in entry-point group {ENTRY_POINT_GROUP!r}"
        )

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


@dataclass(frozen=True)
class AdapterInfo:
    """One registered adapter: what ``ppmedia adapters`` lists."""

    name: str
    model_types: tuple[str, ...]
    layout: str
    provider: str
    adapter: VlmAdapter


@dataclass(frozen=True)
class _Lazy:
    """A table row not imported yet: ``path`` is ``"module:Class"`` (or ``"module:instance"``)."""

    path: str
    provider: str


_Entry = Union[AdapterInfo, _Lazy]


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


def _import_path(path: str) -> Any:
    module_name, _, attribute = path.partition(":")
    target: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    return target


def _path_of(adapter: VlmAdapter) -> str:
    cls = type(adapter)
    return f"{cls.__module__}:{cls.__qualname__}"


def _validated(adapter: Any, provider: str) -> AdapterInfo:
    """``adapter`` (a ``VlmAdapter`` subclass or instance) as an :class:`AdapterInfo`, or ``PluginError``."""
    if isinstance(adapter, type) and issubclass(adapter, VlmAdapter):
        try:
            adapter = adapter()
        except Exception as exc:
            raise PluginError(provider, f"{adapter.__name__}() failed: {exc}") from exc
    if not isinstance(adapter, VlmAdapter):
        raise PluginError(
            provider,
            f"got {type(adapter).__name__} {adapter!r}; expected a ppmedia.adapters.base.VlmAdapter subclass or instance",
        )
    cls = type(adapter).__name__
    name, types, layout = (getattr(adapter, a, None) for a in ("name", "model_types", "layout"))
    if not isinstance(name, str) or not name:
        raise PluginError(provider, f"{cls}.name is {name!r}; expected a non-empty str")
    if not isinstance(types, tuple) or not types or not all(isinstance(t, str) and t for t in types):
        raise PluginError(provider, f"{cls}.model_types is {types!r}; expected a non-empty tuple of model-type strings")
    if not isinstance(layout, str):
        raise PluginError(provider, f"{cls}.layout is {layout!r}; expected a str")
    _check_family_shape(adapter, cls, provider)
    return AdapterInfo(name, types, layout, provider, adapter)


def _check_family_shape(adapter: VlmAdapter, cls: str, provider: str) -> None:
    """``sample_inputs``, ``language_model_path`` and ``merge_path``: what the adapter declares about its family."""
    inputs = getattr(adapter, "sample_inputs", ())
    if not isinstance(inputs, tuple) or not all(isinstance(i, SampleInput) for i in inputs):
        raise PluginError(provider, f"{cls}.sample_inputs is {inputs!r}; expected a tuple of ppmedia.adapters.base.SampleInput")
    keys = [i.key for i in inputs]
    if len(set(keys)) != len(keys):
        raise PluginError(provider, f"{cls}.sample_inputs names a key twice: {keys}")
    for spec in inputs:
        problem = spec.problem()
        if problem is not None:
            raise PluginError(provider, f"{cls}.sample_inputs: {problem}")
    path = getattr(adapter, "language_model_path", None)
    if path is not None and (not isinstance(path, str) or not all(part.isidentifier() for part in path.split("."))):
        raise PluginError(provider, f"{cls}.language_model_path is {path!r}; expected None or a dotted module path such as 'language_model.model'")
    merge = getattr(adapter, "merge_path", None)
    if merge is not None and (not isinstance(merge, str) or not all(part.isidentifier() for part in merge.split("."))):
        raise PluginError(provider, f"{cls}.merge_path is {merge!r}; expected None or a dotted module path such as 'model.embed_tokens_extend'")


def _check_paths(paths: Any, provider: str) -> dict[str, str]:
    hook = "ppmedia_adapter_paths"
    if not isinstance(paths, Mapping):
        raise PluginError(provider, f"{hook} returned {type(paths).__name__}; expected a mapping of model type to 'module:Class'", hook=hook)
    for model_type, path in paths.items():
        module_name, colon, attribute = path.partition(":") if isinstance(path, str) else ("", "", "")
        if not (isinstance(model_type, str) and model_type and colon and module_name and attribute):
            raise PluginError(provider, f"{hook} row {model_type!r}: {path!r}; expected 'package.module:Class'", hook=hook)
    return dict(paths)


def _layout_clash(old: MediaLayout, new: MediaLayout) -> str | None:
    """How ``new`` collides with the registered ``old``, in words, or ``None``."""
    if old.name == new.name:
        return "has the name"
    if set(old.requires) == set(new.requires) and set(old.keys) & set(new.keys):
        return f"requires exactly the keys ({', '.join(new.requires) or 'none'})"
    return None


class AdapterRegistry:
    """A pluggy plugin manager plus the model-type table built from its plugins' hooks.

    Args:
        entry_point_group: the group scanned for plugins on first use (``None``: no scan).
        builtins: register ppmedia's own adapters (``ppmedia.adapters.builtin``).
        plugins_env: an environment variable naming more plugin modules to load on first use
            (comma-separated dotted names; ``None``: none).
    """

    def __init__(
        self,
        entry_point_group: str | None = ENTRY_POINT_GROUP,
        builtins: bool = True,
        plugins_env: str | None = PLUGINS_ENV_VAR,
    ) -> None:
        self._group = entry_point_group
        self._builtins = builtins
        self._plugins_env = plugins_env
        self._lock = threading.RLock()
        self.plugin_manager: pluggy.PluginManager
        self._loaded: bool
        self._by_type: dict[str, _Entry]
        self._imported: dict[str, AdapterInfo]  # path -> the adapter it gave (rows may share a path)
        self._aliases: dict[str, tuple[str, str]]  # alias -> (model type, provider)
        self._layouts: list[tuple[MediaLayout, str]]  # (layout, provider), registration order
        self._layout_set: LayoutSet | None
        self._reset()

    # ---------------------------------------------------------------- loading plugins
    def _ensure_loaded(self) -> None:
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            try:
                if self._builtins:
                    from ..adapters import builtin

                    self.register_plugin(builtin, BUILTIN_PROVIDER)
                if self._group is not None:
                    for plugin, provider in self._load_entry_points():
                        self.register_plugin(plugin, provider)
                for name in os.environ.get(self._plugins_env or "", "").split(","):
                    if name.strip():
                        self.register_module(name.strip(), f"{name.strip()} ({self._plugins_env})")
            except BaseException:
                self._reset()  # no half-loaded registry: the next use loads (and fails) again
                raise

    def _reset(self) -> None:
        self.plugin_manager = pluggy.PluginManager(PROJECT)
        self.plugin_manager.add_hookspecs(hookspecs)
        self._loaded = False
        self._by_type = {}
        self._imported = {}
        self._aliases = {}
        self._layouts = []
        self._layout_set = None

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
                        provider,
                        f"entry point {ep.name} = {ep.value} in group {self._group} failed to import: "
                        f"{type(exc).__name__}: {exc}",
                    ) from exc
                yield plugin, provider

    def register_module(self, name: str, provider: str | None = None) -> None:
        """Import the plugin module ``name`` (dotted) and :meth:`register_plugin` it (provider default: ``name``)."""
        provider = name if provider is None else provider
        try:
            plugin = importlib.import_module(name)
        except Exception as exc:
            raise PluginError(provider, f"module {name} failed to import: {type(exc).__name__}: {exc}") from exc
        self.register_plugin(plugin, provider)

    def register_plugin(self, plugin: Any, provider: str | None = None) -> None:
        """Register a pluggy plugin (a module or object with ``@ppmedia.hookimpl`` functions) and
        everything its hooks give. A plugin already registered is left as it is.

        Raises:
            PluginError: naming ``provider`` (default: the plugin's ``__name__``): a hook that is not a
                ppmedia hook (e.g. misspelled ``ppmedia_adapter``), a ``ppmedia_*`` function without
                ``@ppmedia.hookimpl``, no hooks at all, something that is not an adapter, or a model type
                another provider serves. Nothing of the plugin stays registered then.
        """
        self._ensure_loaded()  # the built-ins and installed plugins first, as for every later registration
        if provider is None:
            provider = str(getattr(plugin, "__name__", type(plugin).__name__))
        with self._lock:
            if self.plugin_manager.is_registered(plugin):
                return
            try:
                self.plugin_manager.register(plugin, name=provider)
            except (ValueError, pluggy.PluginValidationError) as exc:
                raise PluginError(provider, f"could not be registered: {exc}") from exc
            try:
                self._check_hooks(plugin, provider)
                aliases, table, layouts = self._collect(plugin, provider)
                for alias, target in aliases.items():
                    self._check_alias(alias, target, provider)
                self._aliases.update((a, (t, provider)) for a, t in aliases.items())
                self._by_type = table
                if layouts:
                    self._layouts = layouts
                    self._layout_set = None
            except BaseException:
                self.plugin_manager.unregister(plugin)
                raise

    def _check_hooks(self, plugin: Any, provider: str) -> None:
        """pluggy's ``check_pending`` (hooks without a spec), plus ``ppmedia_*`` functions left unmarked."""
        callers = self.plugin_manager.get_hookcallers(plugin) or []
        try:
            self.plugin_manager.check_pending()
        except pluggy.PluginValidationError as exc:
            hook = next((c.name for c in callers if not c.has_spec()), "?")
            close = difflib.get_close_matches(hook, _HOOKS, n=1)
            hint = f"; did you mean {close[0]}?" if close else f"; ppmedia's hooks are {', '.join(_HOOKS)}"
            raise PluginError(provider, f"hook {hook} is not a ppmedia hook{hint}", hook=hook) from exc
        marker = f"{PROJECT}_impl"
        for name, value in inspect.getmembers(plugin, inspect.isroutine):
            if name.startswith(f"{PROJECT}_") and not hasattr(value, marker):
                raise PluginError(provider, f"{name} is not marked with @ppmedia.hookimpl, so it is not a hook", hook=name)
        if not callers:
            raise PluginError(provider, f"provides no ppmedia hook (expected one of {', '.join(_HOOKS)})")

    def _collect(
        self, plugin: Any, provider: str
    ) -> tuple[dict[str, str], dict[str, _Entry], list[tuple[MediaLayout, str]] | None]:
        """The plugin's aliases, the table with its adapters added and the layouts with its layouts
        added (``None``: it brings none); nothing committed yet."""
        results: dict[str, Any] = {}
        for hook in _HOOKS:
            for impl in getattr(self.plugin_manager.hook, hook).get_hookimpls():
                if impl.plugin is plugin:
                    results[hook] = impl.function()
        aliases = results.get("ppmedia_model_type_aliases", {})
        if not isinstance(aliases, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
            raise PluginError(
                provider,
                f"ppmedia_model_type_aliases returned {type(aliases).__name__}; expected a mapping of str to str",
                hook="ppmedia_model_type_aliases",
            )
        table = dict(self._by_type)
        for model_type, path in _check_paths(results.get("ppmedia_adapter_paths", {}), provider).items():
            self._claim(table, model_type, _Lazy(path, provider), provider, override=False)
        adapters = results.get("ppmedia_adapters", [])
        if not isinstance(adapters, (list, tuple)):
            raise PluginError(
                provider,
                f"ppmedia_adapters returned {type(adapters).__name__}; expected a list of VlmAdapter subclasses or instances",
                hook="ppmedia_adapters",
            )
        for adapter in adapters:
            info = _validated(adapter, provider)
            for model_type in info.model_types:
                self._claim(table, model_type, info, provider, override=bool(getattr(info.adapter, "override", False)))
        layouts = self._with_layouts(results["ppmedia_media_layouts"], provider) if "ppmedia_media_layouts" in results else None
        return dict(aliases), table, layouts

    def _with_layouts(self, given: Any, provider: str) -> list[tuple[MediaLayout, str]]:
        """The registered layouts plus ``given`` (a plugin's hook result), checked as one :class:`LayoutSet`."""
        hook = "ppmedia_media_layouts"
        if not isinstance(given, (list, tuple)):
            raise PluginError(provider, f"{hook} returned {type(given).__name__} {given!r}; expected a list of ppmedia.producer.layouts.MediaLayout", hook=hook)
        new = list(self._layouts)
        for layout in given:
            try:
                check_layout(layout)
            except (TypeError, ValueError) as exc:
                raise PluginError(provider, f"{hook}: {exc}", hook=hook) from exc
            for other, other_provider in new:
                clash = _layout_clash(other, layout)
                if clash is not None:
                    raise PluginError(provider, f"{hook}: media layout {layout.name!r} {clash} of media layout "
                                      f"{other.name!r} from {other_provider}", hook=hook, other_provider=other_provider)
            new.append((layout, provider))
        try:
            LayoutSet(layout for layout, _ in new)
        except ValueError as exc:  # a guard: the clashes above are what LayoutSet refuses
            raise PluginError(provider, f"{hook}: {exc}", hook=hook) from exc
        return new

    def _check_alias(self, alias: str, target: str, provider: str) -> None:
        if alias in self._aliases and self._aliases[alias][0] != target:
            old_target, old_provider = self._aliases[alias]
            raise PluginError(
                provider,
                f"model type alias {alias!r}: maps it to {target!r} but {old_provider} already maps it to {old_target!r}",
                hook="ppmedia_model_type_aliases",
                other_provider=old_provider,
            )

    def _claim(self, table: dict[str, _Entry], model_type: str, entry: _Entry, provider: str, override: bool) -> None:
        """Put ``entry`` in ``table`` for ``model_type``; a row another adapter holds needs ``override``."""
        old = table.get(model_type)
        if old is None or old == entry or override:
            table[model_type] = entry
            return
        if isinstance(old, AdapterInfo) and isinstance(entry, AdapterInfo) and old.adapter is entry.adapter:
            return
        if isinstance(old, _Lazy) and isinstance(entry, AdapterInfo) and old.path == _path_of(entry.adapter):
            # the class a row names, now imported and returned by ppmedia_adapters: one adapter for all its rows
            for t, row in table.items():
                if row == old and t in entry.model_types:
                    table[t] = entry
            return
        old_name = self._describe(model_type, old)
        new_name = entry.name if isinstance(entry, AdapterInfo) else entry.path
        how = "set override = True on the one that should win" + (
            " (a ppmedia_adapter_paths row cannot override: return the class from ppmedia_adapters)"
            if isinstance(entry, _Lazy) else ""
        )
        raise PluginError(
            provider,
            f"model type {model_type!r} is claimed by two adapters: {old_name} from {old.provider} and "
            f"{new_name} from {provider}; {how}",
            other_provider=old.provider,
        )

    def _describe(self, model_type: str, entry: _Entry) -> str:
        """The adapter's name (importing a lazy row: only on the way to an error)."""
        if isinstance(entry, AdapterInfo):
            return entry.name
        try:
            return self._materialize(model_type, entry).name
        except PluginError:
            return entry.path

    def _materialize(self, model_type: str, lazy: _Lazy) -> AdapterInfo:
        """Import a lazy row; every row with the same path then holds the one adapter it gave."""
        with self._lock:
            info = self._imported.get(lazy.path)
            if info is None:
                hook = "ppmedia_adapter_paths"
                try:
                    target = _import_path(lazy.path)
                except Exception as exc:
                    raise PluginError(
                        lazy.provider,
                        f"{lazy.path} (model type {model_type!r}) failed to import: {type(exc).__name__}: {exc}",
                        hook=hook,
                    ) from exc
                info = _validated(target, lazy.provider)
                if model_type not in info.model_types:
                    raise PluginError(
                        lazy.provider,
                        f"{hook} maps {model_type!r} to {lazy.path}, whose model_types are {info.model_types!r}",
                        hook=hook,
                    )
                self._imported[lazy.path] = info
            for t, entry in self._by_type.items():
                if entry == lazy:
                    self._by_type[t] = info
            return info

    # ---------------------------------------------------------------- public
    def media_layouts(self) -> LayoutSet:
        """Every registered media layout (the built-ins' and the plugins'), as the set ``split_media`` selects from."""
        found = self._layout_set
        if found is not None and self._loaded:
            return found
        self._ensure_loaded()
        with self._lock:
            if self._layout_set is None:
                self._layout_set = LayoutSet(layout for layout, _ in self._layouts)
            return self._layout_set

    def list_layouts(self) -> list[tuple[MediaLayout, str]]:
        """``(layout, provider)`` of every registered media layout, in registration order."""
        self._ensure_loaded()
        return list(self._layouts)

    def register_adapter(self, adapter: Any, *, provider: str | None = None, override: bool = False) -> AdapterInfo:
        """Register ``adapter`` (a ``VlmAdapter`` subclass or instance) at run time.

        Raises:
            PluginError: not an adapter, or a model type another adapter serves (without ``override``).
        """
        self._ensure_loaded()
        if provider is None:
            cls = adapter if isinstance(adapter, type) else type(adapter)
            provider = f"register_adapter() from {cls.__module__}"
        info = _validated(adapter, provider)
        with self._lock:
            table = dict(self._by_type)
            for model_type in info.model_types:
                self._claim(table, model_type, info, provider, override)
            self._by_type = table
        return info

    def resolve_model_type(self, model_type: str) -> str:
        """Follow the alias table (at most a few hops) to the model type an adapter serves."""
        self._ensure_loaded()
        seen = [model_type]
        while model_type not in self._by_type and model_type in self._aliases:
            model_type, provider = self._aliases[model_type]
            if model_type in seen:
                raise PluginError(provider, f"model type aliases form a cycle: {' -> '.join(seen + [model_type])}")
            seen.append(model_type)
        return model_type

    def get(self, x: Any) -> VlmAdapter:
        """The adapter for ``x``: a model (``x.config.model_type``), a config, or a model-type string.

        Imports the adapter's module if this is the first lookup of its model type.

        Raises:
            UnknownModelTypeError: no adapter serves the type (the known ones are listed, nothing imported).
            TypeError: ``x`` has no model type.
            PluginError: the adapter's module failed to import.
        """
        model_type = _model_type_of(x)
        resolved = self.resolve_model_type(model_type)
        entry = self._by_type.get(resolved)
        if entry is None:
            raise UnknownModelTypeError(model_type, sorted(set(self._by_type) | set(self._aliases)))
        if isinstance(entry, _Lazy):
            entry = self._materialize(resolved, entry)
        return entry.adapter

    def model_types(self) -> list[str]:
        """Every model type served (aliases not included), without importing any adapter."""
        self._ensure_loaded()
        return list(self._by_type)

    def list(self) -> list[AdapterInfo]:
        """Every registered adapter once, in registration order (imports every lazy row)."""
        self._ensure_loaded()
        for model_type, entry in list(self._by_type.items()):
            if isinstance(entry, _Lazy):
                self._materialize(model_type, entry)
        out: list[AdapterInfo] = []
        for info in self._by_type.values():
            if isinstance(info, AdapterInfo) and all(info.adapter is not o.adapter for o in out):
                out.append(info)
        return out

    def aliases(self) -> dict[str, str]:
        """``{alias: model_type}`` of the alias table (the built-ins' and the plugins')."""
        self._ensure_loaded()
        return {a: t for a, (t, _) in self._aliases.items()}
