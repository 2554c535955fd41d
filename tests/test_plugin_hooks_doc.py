"""docs/plugin-hooks.md against the code: every python block runs and prints its ``output`` block
exactly; every hook spec and every family-level adapter attribute is documented there."""

from __future__ import annotations

import contextlib
import inspect
import io
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "plugin-hooks.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", PAGE, flags=re.S)
PYTHON = [(code, BLOCKS[i + 1][1] if i + 1 < len(BLOCKS) and BLOCKS[i + 1][0] == "output" else None)
          for i, (lang, code) in enumerate(BLOCKS) if lang == "python"]


def test_the_page_has_runnable_blocks_with_outputs():
    assert len(PYTHON) >= 5 and all(output is not None for _, output in PYTHON)
    assert {lang for lang, _ in BLOCKS} <= {"python", "output"}


@pytest.mark.parametrize("index", range(len(PYTHON)))
def test_a_block_runs_and_prints_its_output(index, tmp_path, monkeypatch):
    code, output = PYTHON[index]
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, f"docs/plugin-hooks.md block {index}", "exec"), {"__name__": f"doc_block_{index}"})
    assert printed.getvalue() == output


def test_every_hook_and_family_attribute_is_documented():
    from ppmedia.adapters.base import SampleInput, VlmAdapter
    from ppmedia.registry import hookspecs

    hooks = [n for n, f in vars(hookspecs).items() if inspect.isfunction(f) and hasattr(f, "ppmedia_spec")]
    for name in [*hooks, "sample_inputs", "language_model_path", "sample_input_values", "item_layout", "sample_layout"]:
        assert f"`{name}`" in PAGE or f"{name}(" in PAGE or f".{name}`" in PAGE, name
    assert hasattr(VlmAdapter, "language_model_path") and SampleInput("x").problem() is None
