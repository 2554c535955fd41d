"""The type check: mypy over the whole package (core/, registry/, adapters/) with pyproject's config."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The package's directories are mapped (core/ is ppmedia, registry/ is ppmedia.registry, ...), which mypy
# cannot follow: it checks a tree of links laid out as the installed package.
LAYOUT = {"ppmedia": "core", "ppmedia/registry": "registry", "ppmedia/adapters": "adapters"}


def _package_tree(cache: Path) -> Path:
    tree = cache / "ppmedia-tree"
    shutil.rmtree(tree, ignore_errors=True)
    for package, source in LAYOUT.items():
        (tree / package).mkdir(parents=True, exist_ok=True)
        for entry in (ROOT / source).iterdir():
            target = tree / package / entry.name
            if entry.name != "__pycache__" and not target.exists():
                target.symlink_to(entry, target_is_directory=entry.is_dir())
    return tree


def _source_path(line: str) -> str:
    for package, source in sorted(LAYOUT.items(), reverse=True):
        if line.startswith(package + "/"):
            return source + line[len(package):]
    return line


def test_mypy_is_clean() -> None:
    cache = ROOT / ".mypy_cache"
    tree = _package_tree(cache)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(cache),
         "--no-error-summary", "-p", "ppmedia"],
        cwd=tree, env={**os.environ, "MYPYPATH": str(tree)}, capture_output=True, text=True, timeout=600,
    )
    errors = [_source_path(line) for line in result.stdout.splitlines() if line.strip()]
    assert result.returncode == 0 and not errors, "mypy found:\n" + "\n".join(errors) + result.stderr
