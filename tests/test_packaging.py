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
    for module in ("checks", "goldens", "kit", "parity/__init__", "parity/__main__", "pytest_plugin", "tiny_models/__init__"):
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


def test_import_ppmedia_and_the_pytest_plugin_without_torch():
    # the pytest plugin loads in every pytest run of an environment with ppmedia installed: it, and
    # `import ppmedia` (lazy names, PEP 562), import no torch until a name is used
    code = (
        "import sys, ppmedia, ppmedia.testing, ppmedia.testing.pytest_plugin\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "from ppmedia import split_media, hookimpl\n"
        "assert split_media.__module__ == 'ppmedia.producer.split' and 'torch' in sys.modules\n"
        "assert ppmedia.pipeline.__name__ == 'ppmedia.pipeline' and ppmedia.testing.FamilyKit.__name__ == 'FamilyKit'\n"
        "assert set(ppmedia.__all__) <= set(dir(ppmedia))\n"
        "try:\n    ppmedia.no_such_name\nexcept AttributeError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "module 'ppmedia' has no attribute 'no_such_name'"


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


def _architecture_section(title):
    # docs/architecture.md: "Who calls whom" (the call tree) and "Development" (the layout table)
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def test_architecture_page_names_what_exists():
    import re

    section = _architecture_section("Who calls whom")
    modules = {"registry": "ppmedia.registry", "producer/split": "ppmedia.producer.split",
               "producer/hostreads": "ppmedia.producer.hostreads", "producer/staging": "ppmedia.producer.staging",
               "pipeline": "ppmedia.pipeline", "chunk": "ppmedia.chunk", "adapters/base": "ppmedia.adapters.base",
               "producer/collate": "ppmedia.producer.collate", "producer/planners": "ppmedia.producer.planners",
               "balance": "ppmedia.balance", "producer/presplit": "ppmedia.producer.presplit"}
    tags = set(re.findall(r"\[([a-z/]+)\]", section))
    assert tags == set(modules), tags
    for name, module in [("get_adapter", "registry"), ("split_media", "producer/split"), ("StagedMedia", "producer/split"),
                         ("HostReader", "producer/hostreads"), ("stage_media", "producer/staging"),
                         ("StageModule", "pipeline"), ("next_vlm_media_chunk", "chunk"),
                         ("collate_for_pipeline", "producer/collate"), ("HostReader", "producer/planners"),
                         ("balanced_split", "balance"), ("balance_microbatches", "balance"),
                         ("microbatch_inputs", "producer/presplit"), ("MicrobatchMedia", "producer/presplit"),
                         ("presplit_batch", "pipeline")]:
        assert name in section and hasattr(importlib.import_module(modules[module]), name), name
    base = importlib.import_module("ppmedia.adapters.base").VlmAdapter
    for method in ("media_per_sample", "merge", "placeholder_masks", "feature_counts", "encode", "scatter", "position_ids",
                   "first_stage", "decoder_kwargs"):
        assert f"{method}" in section and hasattr(base, method), method
    for attribute in ("_vlm_chunk_idx",):
        assert attribute in section and attribute == ppmedia.CURSOR_ATTRIBUTE
    # every file the section names exists (bare names live in core/ or core/testing/)
    for name in set(re.findall(r"`([a-z_/<>]+\.py)`", section)) - {"adapters/<family>.py"}:
        candidates = [ROOT / name, ROOT / "core" / name, ROOT / "core" / "testing" / name]
        assert any(c.is_file() for c in candidates), name
    for command in ("demo", "inspect", "plan", "train", "plot"):
        assert f"`{command}`" in section
    assert {c.name for c in importlib.import_module("ppmedia.cli").COMMANDS} == {"demo", "adapters", "inspect", "plan", "train", "plot"}


def test_layout_table_names_files_that_exist():
    import re

    section = _architecture_section("Development")
    table = section[section.index("| folder |") : section.index("Tests run with")]
    rows = [row.strip().strip("|").split("|") for row in table.splitlines()[2:] if row.strip()]
    checked = []
    for cells in rows:
        folder = cells[0].strip().strip("`")
        assert (ROOT / folder).is_dir(), folder
        for name in re.findall(r"`([a-z_0-9]+\.py|[a-z_]+/)`", cells[2]):
            assert (ROOT / folder / name).exists(), (folder, name)
            checked.append(folder + name)
    assert len(rows) == 15 and len(checked) >= 60, checked
    # and every module of the package is named (a new module needs its row entry)
    for folder in ("core", "core/producer", "core/planning", "core/cli", "core/train", "core/pipeline", "core/data",
                   "core/packing", "registry", "adapters", "core/testing", "core/testing/parity"):
        for path in (ROOT / folder).glob("*.py"):
            if path.name not in {"__init__.py", "__main__.py"}:
                assert f"{folder}/{path.name}" in checked, f"docs/architecture.md 'Development' does not name {folder}/{path.name}"


def test_no_function_body_over_80_lines():
    # readability guard for the package (docstrings not counted): split long functions, don't grow them
    import ast

    long = []
    for folder in ("core", "registry", "adapters"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    body = node.body[1:] if isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant) else node.body
                    if body and body[-1].end_lineno - body[0].lineno + 1 > 80:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert long == []
