"""Adapter registry: pluggy hook specs, entry-point plugins, lookup by ``config.model_type``.

The module-level functions use one process-wide :class:`AdapterRegistry`, built on first use
(built-in adapters first, then the plugins of entry-point group ``ppmedia.adapters``, scanned once).
"""

from __future__ import annotations

from typing import Any

from .hookspecs import hookimpl, hookspec
from .registry import (
    ENTRY_POINT_GROUP,
    MODEL_TYPE_ALIASES,
    AdapterInfo,
    AdapterRegistry,
    PluginError,
    UnknownModelTypeError,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "MODEL_TYPE_ALIASES",
    "AdapterInfo",
    "AdapterRegistry",
    "PluginError",
    "UnknownModelTypeError",
    "default_registry",
    "get_adapter",
    "hookimpl",
    "hookspec",
    "list_adapters",
    "register_adapter",
]

_default: AdapterRegistry | None = None


def default_registry() -> AdapterRegistry:
    """The process-wide registry (created on first use)."""
    global _default
    if _default is None:
        _default = AdapterRegistry()
    return _default


def get_adapter(x: Any) -> Any:
    """The adapter for a model, a config or a ``model_type`` string.

    Raises:
        UnknownModelTypeError: (a ``ValueError``) no adapter serves the type; lists the known ones.
        TypeError: ``x`` has no model type.
    """
    return default_registry().get(x)


def register_adapter(adapter: Any, *, provider: str | None = None, override: bool = False) -> AdapterInfo:
    """Register an adapter at run time; a model type another provider serves needs ``override=True``."""
    return default_registry().register_adapter(adapter, provider=provider, override=override)


def list_adapters() -> list[AdapterInfo]:
    """Every registered adapter with its model types, layout and provider."""
    return default_registry().list()
