"""docs/state-families.md: its python blocks run (in order, one namespace) and it names every family
it documents as the code has them."""

from __future__ import annotations

import pathlib
import re

import torch

import ppmedia

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "state-families.md"
TEXT = DOC.read_text()


def test_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", TEXT, flags=re.S)
    assert len(blocks) == 3
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        namespace: dict = {}
        for block in blocks:
            exec(compile(block, str(DOC), "exec"), namespace)
    finally:
        torch.set_num_threads(before)


def test_family_table_matches_the_registry():
    from ppmedia.testing import tiny_models

    rows = [line.split("|")[1:-1] for line in TEXT.splitlines() if line.startswith("| ") and "(`" in line]
    assert len(rows) == 7
    for cells in rows:
        family = re.search(r"\(`(\w+)`\)", cells[0]).group(1)
        adapter = cells[1].strip().strip("`")
        model = tiny_models.load(family)
        assert family in tiny_models.FAMILIES
        assert ppmedia.get_adapter(model.build_config()).name == adapter, family
