"""The source folders never shadow the package; the public API is typed and exported."""

import importlib
import pathlib
import subprocess
import sys

import pytest

import ppmedia

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_core_folder_is_not_importable():
    # `pytest` (unlike `python -m pytest`) does not put the repository root on sys.path, so the tests
    # import the installed `ppmedia`, never the source folder under its folder name.
    with pytest.raises(ModuleNotFoundError, match="No module named 'core'"):
        importlib.import_module("core")
    assert pathlib.Path(ppmedia.__file__).parent.name == "core"  # editable install maps core/ -> ppmedia


def test_wheel_lists_packages_explicitly(tmp_path):
    # nothing named `core` (or `tests`) may land in site-packages
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr
    import zipfile

    (wheel,) = tmp_path.glob("ppmedia-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"ppmedia", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    names = zipfile.ZipFile(wheel).namelist()
    assert "ppmedia/py.typed" in names and "ppmedia/adapters/base.py" in names and "ppmedia/registry/__init__.py" in names
    for module in ("checks", "goldens", "kit", "parity", "pytest_plugin", "tiny_models/__init__"):
        assert f"ppmedia/testing/{module}.py" in names, module
    assert not [n for n in names if n.endswith(".safetensors")]  # goldens are test data, not package data
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[pytest11]\nppmedia = ppmedia.testing.pytest_plugin" in text
    assert "[console_scripts]\nppmedia = ppmedia.cli:main" in text


def test_import_ppmedia_and_its_registry_without_transformers():
    # transformers is imported by a tiny model or an adapter's module, never by the package or a lookup table
    code = (
        "import sys, ppmedia, ppmedia.testing, ppmedia.testing.pytest_plugin\n"
        "reg = ppmedia.registry.default_registry(); types = reg.model_types()\n"
        "assert 'qwen2_5_vl' in types, types\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_tests_folder_is_not_a_package():
    assert not (ROOT / "tests" / "__init__.py").exists()


def test_py_typed_and_package_mapping():
    assert (pathlib.Path(ppmedia.__file__).parent / "py.typed").exists()
    for name in ("ppmedia.registry", "ppmedia.adapters", "ppmedia.testing", "ppmedia.testing.tiny_models",
                 "ppmedia.testing.pytest_plugin"):
        importlib.import_module(name)


def test_all_is_sorted_and_complete():
    assert ppmedia.__all__ == sorted(ppmedia.__all__)
    public = {n for n in vars(ppmedia) if not n.startswith("_") and n not in {"annotations"}}
    modules = {n for n in public if isinstance(getattr(ppmedia, n), type(ppmedia))}
    assert public - modules - {"__version__"} <= set(ppmedia.__all__)
