"""Adapter registry: pluggy hook specs, entry-point plugins, lookup by ``config.model_type``.

The module-level functions use one process-wide :class:`AdapterRegistry`, built on first use: the
built-ins (``ppmedia.adapters.builtin``, a lazy ``{model_type: "module:Class"}`` table), then the
plugins of entry-point group ``ppmedia.adapters`` (scanned once), then the modules named in the
``PPMEDIA_PLUGINS`` environment variable.
"""

from __future__ import annotations

from typing import Any

from ..adapters.base import VlmAdapter
from .hookspecs import hookimpl, hookspec
from .registry import (
    BUILTIN_PROVIDER,
    ENTRY_POINT_GROUP,
    PLUGINS_ENV_VAR,
    AdapterInfo,
    AdapterRegistry,
    PluginError,
    UnknownModelTypeError,
)

__all__ = [
    "BUILTIN_PROVIDER",
    "ENTRY_POINT_GROUP",
    "PLUGINS_ENV_VAR",
    "AdapterInfo",
    "AdapterRegistry",
    "PluginError",
    "UnknownModelTypeError",
    "default_registry",
    "get_adapter",
    "hookimpl",
    "hookspec",
    "list_adapters",
    "media_layouts",
    "register_adapter",
]

_default: AdapterRegistry | None = None


def default_registry() -> AdapterRegistry:
    """The process-wide registry (created on first use)."""
    global _default
    if _default is None:
        _default = AdapterRegistry()
    return _default


def get_adapter(x: Any) -> VlmAdapter:
    """The adapter for a model, a config or a ``model_type`` string (aliases followed).

    Only the module of the adapter found is imported (on its first lookup).

    Raises:
        UnknownModelTypeError: (a ``ValueError``) no adapter serves the type; lists the known ones.
        TypeError: ``x`` has no model type.
        PluginError: a plugin failed to load, or the adapter's module failed to import.
    """
    return default_registry().get(x)


def register_adapter(adapter: Any, *, provider: str | None = None, override: bool = False) -> AdapterInfo:
    """Register an adapter at run time; a model type another provider serves needs ``override=True``."""
    return default_registry().register_adapter(adapter, provider=provider, override=override)


def list_adapters() -> list[AdapterInfo]:
    """Every registered adapter with its model types, layout and provider (imports them all)."""
    return default_registry().list()


def media_layouts() -> Any:
    """The process-wide registry's media layouts (:class:`ppmedia.producer.layouts.LayoutSet`): ppmedia's and every plugin's."""
    return default_registry().media_layouts()
