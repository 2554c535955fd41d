"""Lazy package attributes (PEP 562), so that importing a package costs nothing until a name is used, and the
old import paths of moved modules.

``import ppmedia`` (and the pytest plugin, which every pytest run in an environment with ppmedia
loads) must not import torch or transformers: each public name is imported from its module on first
access, and submodules are imported when reached as attributes (``ppmedia.pipeline``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, Callable, Mapping


def lazy_attributes(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``.

    Args:
        package: the package's ``__name__``.
        exports: public name -> the submodule (relative to ``package``) that defines it.
    """
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is not None:
            value = getattr(importlib.import_module(f"{package}.{module}"), name)
        else:
            try:
                value = importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        namespace[name] = value  # the next access is a plain attribute
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__


class _AliasLoader(importlib.abc.Loader):
    """Loads an old module path as the module that now holds its code (the same module object)."""

    #: what the import system writes onto the module it is given: put back, so the module keeps its own
    _OWN = ("__spec__", "__loader__", "__package__", "__name__")

    def __init__(self, target: str) -> None:
        self.target = target
        self.saved: dict[str, Any] = {}

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(self.target)
        self.saved = {name: getattr(module, name) for name in self._OWN if hasattr(module, name)}
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        for name, value in self.saved.items():  # already executed under its new name: only restore it
            setattr(module, name, value)


class _MovedModules(importlib.abc.MetaPathFinder):
    """Finds ``package.<old>`` for every entry of ``moved`` and hands back ``package.<new>``."""

    def __init__(self, package: str, moved: Mapping[str, str]) -> None:
        self.names = {f"{package}.{old}": f"{package}.{new}" for old, new in moved.items()}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        new = self.names.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new))


def moved_modules(package: str, moved: Mapping[str, str]) -> None:
    """Keep old import paths of moved modules working: ``import package.<old>`` (and ``from package.<old>
    import name``) gives the module now at ``package.<new>``, imported on first use (nothing is imported
    here). Idempotent per package.

    Args:
        package: the package's ``__name__``.
        moved: old submodule path -> new submodule path, both relative to ``package``.
    """
    for finder in sys.meta_path:
        if isinstance(finder, _MovedModules) and set(finder.names) == {f"{package}.{o}" for o in moved}:
            return
    sys.meta_path.append(_MovedModules(package, moved))
