"""Every import path users and plugins have: the documented modules, the names in ``ppmedia.__all__``, the
entry points, and the old paths of the modules that moved into concern folders (issue 39)."""

from __future__ import annotations

import importlib
import importlib.metadata
import pathlib
import re

import pytest

import ppmedia

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: the modules plugins and users import (docs/plugin-hooks.md, docs/api.md, the README)
DOCUMENTED = ("ppmedia", "ppmedia.layouts", "ppmedia.balance", "ppmedia.testing", "ppmedia.data", "ppmedia.packing",
              "ppmedia.pipeline", "ppmedia.registry", "ppmedia.adapters", "ppmedia.train", "ppmedia.cli")


def _documented_paths() -> list[str]:
    """Every dotted ``ppmedia...`` path in the README and docs/, cut to its longest importable module prefix
    (``ppmedia.pipeline.apply_fsdp`` -> ``ppmedia.pipeline``; a name in a module is checked as an attribute)."""
    found = set()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        found.update(re.findall(r"\bppmedia(?:\.[A-Za-z_][A-Za-z_0-9]*)+", page.read_text()))
    return sorted(found)


def _resolve(path: str) -> object:
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(path)


@pytest.mark.parametrize("module", DOCUMENTED)
def test_documented_modules_import(module):
    assert importlib.import_module(module).__name__ == module


def test_every_path_the_docs_name_resolves():
    unresolved = []
    for path in _documented_paths():
        if path.endswith((".json", ".md", ".py", ".svg", ".yaml")) or path.split(".")[-1] in {"jsonl", "txt"}:
            continue  # a file name such as ppmedia.json, not a path
        try:
            _resolve(path)
        except (ModuleNotFoundError, AttributeError) as exc:
            unresolved.append(f"{path}: {exc}")
    assert not unresolved, "\n".join(unresolved)
    assert len(_documented_paths()) > 80  # the check sees the docs (97 paths when written)


def test_every_public_name_and_the_entry_points():
    for name in ppmedia.__all__:
        assert getattr(ppmedia, name) is not None, name
    entry = {(group, e.name): e.value for group in ("console_scripts", "pytest11")
             for e in importlib.metadata.entry_points(group=group) if e.value.startswith("ppmedia")}
    assert entry[("console_scripts", "ppmedia")] == "ppmedia.cli:main"
    assert callable(_resolve(entry[("console_scripts", "ppmedia")].replace(":", ".")))
    assert importlib.import_module(entry[("pytest11", "ppmedia")]).__name__ == "ppmedia.testing.pytest_plugin"


@pytest.mark.parametrize("old", sorted(ppmedia._MOVED))
def test_the_old_path_of_a_moved_module_is_the_new_module(old):
    new = importlib.import_module(f"ppmedia.{ppmedia._MOVED[old]}")
    assert importlib.import_module(f"ppmedia.{old}") is new
    assert new.__name__ == f"ppmedia.{ppmedia._MOVED[old]}" and new.__spec__.name == new.__name__
    # and ``from ppmedia.<old> import name`` gives the same objects
    public = getattr(new, "__all__", [n for n in vars(new) if not n.startswith("_")])[:3]
    namespace: dict[str, object] = {}
    if public:
        exec(f"from ppmedia.{old} import {', '.join(public)}", namespace)
        assert all(namespace[n] is getattr(new, n) for n in public)
