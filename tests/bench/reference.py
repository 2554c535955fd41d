"""NeMo Automodel's PP media staging, the reference the benchmark compares ppmedia against.

``nemo-automodel==0.7.0`` is installed without dependencies into ``tests/bench/.ref`` (never into the
project's environment), and only one file is loaded from it, by path:
``nemo_automodel/components/datasets/vlm/pp_media.py``, which imports nothing but ``torch``. The
package's ``__init__`` modules are not run, so none of its heavy dependencies are needed.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["MODULE_PATH", "PACKAGE", "REF_DIR", "load_reference"]

PACKAGE = "nemo-automodel==0.7.0"
REF_DIR = Path(__file__).resolve().parent / ".ref"
MODULE_PATH = REF_DIR / "nemo_automodel" / "components" / "datasets" / "vlm" / "pp_media.py"


def _install() -> None:
    command = [
        sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
        "--no-deps", "--target", str(REF_DIR), PACKAGE,
    ]
    print(f"installing the reference: {' '.join(command)}", file=sys.stderr)
    subprocess.run(command, check=True)


def load_reference(install: bool = True) -> tuple[ModuleType | None, str]:
    """Load Automodel's ``pp_media`` module; install the package first when missing and allowed.

    Returns:
        ``(module, note)``: the module, or ``None`` with the reason in ``note``.
    """
    if not MODULE_PATH.is_file():
        if not install:
            return None, f"{MODULE_PATH} missing (run tests/bench/setup_reference.sh)"
        try:
            _install()
        except (OSError, subprocess.CalledProcessError) as error:
            return None, f"could not install {PACKAGE}: {error}"
        if not MODULE_PATH.is_file():
            return None, f"{PACKAGE} installed but {MODULE_PATH.relative_to(REF_DIR)} is missing"
    spec = importlib.util.spec_from_file_location("automodel_pp_media_ref", MODULE_PATH)
    if spec is None or spec.loader is None:
        return None, f"cannot load {MODULE_PATH}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, f"{PACKAGE}: {MODULE_PATH.relative_to(REF_DIR)}"
