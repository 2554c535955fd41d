"""The composition table (``ppmedia.train.composition``): every pair of features has a cell, every proof
names a test that exists, every refused cell is train.py's one line with exit 2 before anything starts,
and docs/composition.md's matrix is the one the table generates. (The runs that prove the cells are the
tests the table names; tests/test_composition_mp.py holds the ones made for it.)"""

from __future__ import annotations

import pathlib
import re

import pytest

from ppmedia.testing.tiny_models import qwen2_5_vl
from ppmedia.train import composition
from ppmedia.train.options import parse_args

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "composition.md"
BEGIN = "<!-- generated from ppmedia.train.composition.markdown(); tests/test_composition.py compares -->\n"
END = "<!-- end of the generated matrix -->"


def _argv(flag: str, tmp: pathlib.Path) -> list[str]:
    """A command line turning ``flag`` on, with what the options themselves require next to it."""
    if not (tmp / "config.json").exists():  # the options read --model's config.json (its decoder layers)
        qwen2_5_vl.build_config().save_pretrained(tmp)
    data = ["--model", str(tmp), "--data", str(ROOT / "README.md"), "--steps", "2"]
    return {
        "--data": data,
        "--pack": [*data, "--pack"],
        "--presplit": ["--presplit"],
        "--fsdp": ["--fsdp"],
        "--bf16": ["--fsdp", "--bf16"],
        "--tp": ["--tp", "2"],
        "--ep": ["--ep", "2", "--dp", "2", "--family", "glm4v_moe"],
        "--lora-rank": ["--lora-rank", "4"],
        "--cp": ["--cp", "2"],
        "--encoder spread": ["--encoder", "spread"],
        "--activation-checkpointing": ["--activation-checkpointing"],
        "--freeze": ["--freeze", "vision"],
        "--eval-data": [*data, "--eval-data", str(ROOT / "README.md"), "--eval-every", "1"],
        "--resume": ["--resume", str(tmp)],
    }[flag]


def _config_dir(folder: pathlib.Path, family: str = "qwen2_5_vl") -> pathlib.Path:
    """A ``--model`` folder whose config.json is the tiny ``family``'s (the options read it; nothing is built)."""
    from ppmedia.testing import tiny_models

    folder.mkdir(parents=True, exist_ok=True)
    tiny_models.load(family).build_config().save_pretrained(folder)
    return folder


def _merged(*argvs: list[str]) -> list[str]:
    """The command lines joined, each option once (``--model`` and ``--data`` may come twice)."""
    out: list[str] = []
    for argv in argvs:
        i = 0
        while i < len(argv):
            takes = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            if argv[i] not in out:
                out += argv[i: i + 1 + takes]
            i += 1 + takes
    return out


def test_the_docs_matrix_is_the_tables():
    text = PAGE.read_text()
    assert BEGIN in text and END in text, f"{PAGE}: the generated matrix's markers are missing"
    shown = text[text.index(BEGIN) + len(BEGIN): text.index(END)]
    assert shown == composition.markdown(), (
        "docs/composition.md is not the table's matrix: paste composition.markdown() between the markers")


def test_every_pair_has_a_cell_and_every_proof_names_a_test():
    cells = composition.pairs()
    n = len(composition.FEATURES)
    assert len(cells) == n * (n - 1) // 2
    for a, b, cell in cells:
        assert cell.text.strip(), (a, b)
        if cell.status != "works":
            continue
        path, _, name = cell.text.partition("::")
        source = ROOT / path
        assert source.is_file(), f"({a}, {b}): {path} does not exist"
        assert re.search(rf"^def {re.escape(name.split('[')[0])}\(", source.read_text(), re.M), (
            f"({a}, {b}): no test {name} in {path}")


def test_each_feature_is_seen_on_its_command_line(tmp_path):
    from ppmedia.train.options import build_parser

    _config_dir(tmp_path)
    known = build_parser()._option_string_actions
    for flag in composition.FEATURES:
        assert flag.split()[0] in known, f"{flag}: the table declares a feature train.py has no option for"
        on = composition.active(parse_args(_argv(flag, tmp_path)))
        assert flag in on, (flag, on)


#: a feature that needs another on its command line (``_argv`` gives both): where the needed one is refused with
#: the partner too, that pair (earlier in the matrix) is the line the user sees
NEEDS = {"--bf16": "--fsdp"}


@pytest.mark.parametrize("a, b", [(a, b) for a, b, c in composition.pairs() if c.status == "refused"])
def test_a_refused_pair_is_one_line_and_exit_2(a, b, tmp_path, capsys):
    _config_dir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(_merged(_argv(a, tmp_path), _argv(b, tmp_path)))
    assert exit_info.value.code == 2
    for x, y in ((a, b), (b, a)):
        if x in NEEDS and composition.cell(NEEDS[x], y).status == "refused":
            a, b = NEEDS[x], y
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "error:" in x]
    reason = composition.cell(a, b).reason
    assert line.endswith(f": {reason} (docs/composition.md); drop one of them"), line
    assert f" with {b.split()[0]}" in line or f" with {a.split()[0]}" in line, line


def test_declaring_a_pair_twice_or_an_unknown_feature_is_refused():
    with pytest.raises(ValueError, match="declared twice"):
        composition.works("--data", "--pack", "tests/x.py::test_y")
    with pytest.raises(ValueError, match="unknown feature --nope"):
        composition.refused("--data", "--nope", "no")


def test_the_spawned_runs_hold_the_pairs_they_prove(tmp_path):
    """A cell proven by tests/test_composition_mp.py: one of the scenarios its test reads turns both
    features on (parsed as train.py parses them)."""
    from test_composition_mp import MOE, SCENARIOS_OF, _scenarios

    _config_dir(tmp_path / "ckpt")
    _config_dir(tmp_path / "moe-ckpt", MOE)
    for path in ("tp/step2", "data"):
        (tmp_path / path).mkdir(parents=True)
    for name in ("train.jsonl", "with_bad.jsonl", "eval.jsonl"):
        (tmp_path / "data" / name).write_text("")
    on = {name: composition.active(parse_args(argv)) for name, argv in _scenarios(tmp_path)}
    for a, b, cell in composition.pairs():
        if cell.proof and cell.proof.startswith("tests/test_composition_mp.py::"):
            test = cell.proof.split("::")[1]
            assert any(a in on[s] and b in on[s] for s in SCENARIOS_OF[test]), (a, b, test, on)
