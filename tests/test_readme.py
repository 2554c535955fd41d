"""README.md against the code: what a new user copies from it must be true.

* the quick start is exactly ``make demo`` and ``make test``, both Makefile targets;
* every ``ppmedia.x.y`` name it mentions exists; the Python snippets parse, and every call they make
  into ``ppmedia``, ``ppmedia.pipeline`` or an adapter binds to the real signature;
* every command line it shows parses (``ppmedia ...``, ``torchrun -m ppmedia ...``,
  ``examples/train.py``);
* the quoted command-line errors and the quoted ``split_media`` error are the ones the code prints;
  the ``ppmedia plan`` figures quoted for the Qwen fixture are the ones it prints;
* the API headings and tables match the signatures, fields, keys, schedules and adapters.

(The plugin test file shown verbatim is checked in test_testing_kit.py; the Architecture and
Development sections in test_packaging.py.)
"""

from __future__ import annotations

import ast
import dataclasses
import fractions
import importlib
import importlib.util
import inspect
import pathlib
import re
import shlex

import pytest
import torch

import ppmedia
from ppmedia import pipeline
from ppmedia.adapters.base import VlmAdapter
from ppmedia.cli import build_parser, main

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end > 0 else None]


def _blocks(lang: str, text: str = README) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def _resolve(dotted: str):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            continue
    for part in parts[i:]:
        obj = getattr(obj, part)
    return obj


# ------------------------------------------------------------------------------------ quick start
def test_quick_start_is_make_demo_then_make_test():
    (block,) = _blocks("sh", _section("Quick start"))
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo: .*\n\t\$\(BIN\)/ppmedia demo$", makefile, flags=re.M)
    assert re.search(r"^test: .*\n\t\$\(BIN\)/pytest$", makefile, flags=re.M)


# ------------------------------------------------------------------------------------ names, snippets
def test_every_ppmedia_name_it_mentions_exists():
    names = set(re.findall(r"(?<![\w.])(ppmedia(?:\.[A-Za-z_]\w*)+)", README))
    assert len(names) >= 30
    missing = []
    for name in sorted(names):
        try:
            _resolve(name)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{name}: {exc}")
    assert missing == []


#: snippet variable -> what it is in the snippets (``adapter``: any VlmAdapter; methods unbound)
_ROOTS = {"ppmedia": ppmedia, "pipeline": pipeline, "adapter": VlmAdapter}


def _target(node: ast.expr):
    """The object an attribute chain rooted at a known name refers to, else None."""
    chain = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in _ROOTS or not chain:
        return None
    obj = _ROOTS[node.id]
    for attr in reversed(chain):
        assert hasattr(obj, attr), f"{ast.unparse(node)}.{'.'.join(reversed(chain))}: no {attr!r}"
        obj = getattr(obj, attr)
    return (obj, node.id == "adapter")


def test_python_snippets_parse_and_call_real_signatures():
    checked = 0
    for block in _blocks("python"):
        tree = ast.parse(block)  # every snippet is valid Python
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                _target(node)  # the attribute exists
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            found = _target(node.func)
            if found is None or not callable(found[0]):
                continue
            if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
                continue
            obj, unbound = found
            args = [None] * (len(node.args) + unbound)
            try:
                inspect.signature(obj).bind(*args, **{k.arg: None for k in node.keywords})
            except TypeError as exc:
                pytest.fail(f"README calls {ast.unparse(node)}: {exc}")
            checked += 1
    assert checked >= 20, checked


def _command_lines() -> list[str]:
    lines = []
    for block in _blocks("sh"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def _train_module():
    spec = importlib.util.spec_from_file_location("readme_train_example", ROOT / "examples" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_command_lines_parse():
    train = _train_module()
    parsed = {"ppmedia": 0, "train": 0}
    for line in _command_lines():
        argv = shlex.split(line)
        if "examples/train.py" in argv:
            train.parse_args(argv[argv.index("examples/train.py") + 1 :])
            parsed["train"] += 1
        elif argv[0] == "ppmedia" or "-m" in argv and argv[argv.index("-m") + 1] == "ppmedia":
            rest = argv[1:] if argv[0] == "ppmedia" else argv[argv.index("-m") + 2 :]
            build_parser().parse_args(rest)  # SystemExit(2) on a wrong flag
            parsed["ppmedia"] += 1
    assert parsed["train"] >= 2 and parsed["ppmedia"] >= 4, parsed


# ------------------------------------------------------------------------------------ quoted output
def _quoted_cli_errors() -> list[tuple[str, str]]:
    start = README.index("```\n$ ppmedia inspect") + 4
    block = README[start : README.index("```", start)]
    lines = block.strip().splitlines()
    pairs = list(zip(lines[::2], lines[1::2]))
    assert len(pairs) >= 5 and all(c.startswith("$ ppmedia ") and e.startswith("ppmedia: error: ") for c, e in pairs)
    return pairs


def test_quoted_cli_errors_are_the_real_ones(tmp_path, monkeypatch, capsys):
    (tmp_path / "fixtures").symlink_to(ROOT / "fixtures")
    (tmp_path / "notes.pt").write_text("hello world\n")
    torch.save({"input_ids": torch.zeros(2, 3, dtype=torch.int64), "f": fractions.Fraction(1, 3)}, tmp_path / "untrusted.pt")
    monkeypatch.chdir(tmp_path)
    for command, expected in _quoted_cli_errors():
        code = main(shlex.split(command)[2:])
        out, err = capsys.readouterr()
        assert (out, err) == ("", expected + "\n"), command
        assert code == (2 if expected.startswith("ppmedia: error: argument ") else 1), command


def test_quoted_plan_figures_are_the_printed_ones(monkeypatch, capsys):
    quoted = re.search(r"For that fixture: 1F1B ([\d.]+) → ([\d.]+) units \(([\d.]+)\), GPipe unchanged \(([\d.]+);", README)
    assert quoted, "the Planning section quotes the fixture's figures"
    (line,) = [line for line in _command_lines() if line.startswith("ppmedia plan ")]
    monkeypatch.chdir(ROOT)
    assert main(shlex.split(line)[1:]) == 0
    out = capsys.readouterr().out
    rows = {row.split()[0]: row.split() for row in out.splitlines() if row.split()[:1] in (["gpipe"], ["1f1b"])}
    one_f, gpipe = rows["1f1b"], rows["gpipe"]
    assert (one_f[1], one_f[3], one_f[5]) == quoted.group(1, 2, 3), one_f
    assert gpipe[5] == quoted.group(4), gpipe


def test_inspect_example_runs(monkeypatch, capsys):
    command = re.search(r"Try\s+`(ppmedia inspect [^`]+)`", README).group(1)
    monkeypatch.chdir(ROOT)
    assert main(shlex.split(command)[1:]) == 0
    assert "4 microbatches of 8 samples; text-only: [2]" in capsys.readouterr().out


def test_quoted_split_error_is_the_real_one():
    quoted = re.search(r"`(image_grid_thw: row 1 \(sample 1, microbatch 1\) is \[1, 0, 4\]; expected positive entries)`", README)
    assert quoted
    grid = torch.tensor([[1, 2, 2], [1, 0, 4], [1, 2, 2], [1, 2, 2]])
    batch = {"input_ids": torch.zeros(4, 5, dtype=torch.int64), "pixel_values": torch.zeros(12, 8), "image_grid_thw": grid}
    before = dict(batch)
    with pytest.raises(ValueError) as info:
        ppmedia.split_media(batch, 4)
    assert str(info.value) == quoted.group(1)
    assert batch.keys() == before.keys() and all(batch[k] is before[k] for k in batch)  # all or nothing


# ------------------------------------------------------------------------------------ API tables
def _heading_signature(name: str) -> str:
    match = re.search(rf"^### `{name}\((.*?)\)(?: -> [^`]+)?`", README, flags=re.M)
    assert match, name
    return match.group(1)


def _signature_text(fn) -> str:
    parts, star = [], False
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        else:
            parts.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return ", ".join(parts)


@pytest.mark.parametrize("name", ["split_media", "stage_media", "collate_for_pipeline", "next_vlm_media_chunk"])
def test_api_headings_show_the_real_signatures(name):
    assert _heading_signature(name) == _signature_text(getattr(ppmedia, name))


def _table_after(anchor: str) -> list[list[str]]:
    at = README.index(anchor)
    line_start = README.rfind("\n", 0, at) + 1
    table = README[line_start:] if README[line_start] == "|" else README[README.index("\n|", at) + 1 :]
    rows = []
    for line in table.splitlines():
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows[2:]


def test_chunk_table_lists_every_field_in_order():
    rows = _table_after("### `VlmMediaChunk`")
    assert [r[0].strip("`") for r in rows] == [f.name for f in dataclasses.fields(ppmedia.VlmMediaChunk)]


def test_staged_attributes_and_media_keys_are_all_named():
    consumer = README[README.index("### `next_vlm_media_chunk(") : README.index("### `split_media(")]
    for attribute in (*ppmedia.STAGED_ATTRIBUTES.values(), ppmedia.CURSOR_ATTRIBUTE):
        assert attribute in consumer, attribute
    split = README[README.index("### `split_media(") : README.index("### `StagedMedia`")]
    for key in (*ppmedia.MEDIA_KEYS, *ppmedia.IMAGE_GRID_KEYS):
        assert f"`{key}`" in split, key


def test_builtin_adapter_table_matches_the_registry():
    rows = _table_after("Built in:")
    table = {r[0].strip("`"): sorted(t.strip("` ") for t in r[1].split(",")) for r in rows}
    builtin = {i.name: sorted(i.model_types) for i in ppmedia.list_adapters() if "built-in" in i.provider}
    assert table == builtin


def test_schedule_names_match_torch_and_the_demo():
    from ppmedia.demo import schedule_choices

    commands = _section("Command line")
    for name in schedule_choices():
        assert f"`{name}`" in commands, name
    for name in pipeline.schedule_names():
        assert f"`{name}`" in _section("Pipelines"), name


def test_demo_names_every_family():
    from ppmedia.testing.tiny_models import FAMILIES

    commands = _section("Command line")
    for family in FAMILIES:
        assert f"`{family}`" in commands, family
    assert f"the {['one', 'two', 'three', 'four', 'five', 'six', 'seven', 'eight', 'nine', 'ten', 'eleven', 'twelve'][len(FAMILIES) - 1]} tiny model families" in README


def test_adapter_method_table_matches_vlm_adapter():
    rows = _table_after("| method | what |")
    assert len(rows) >= 13
    for cells in rows:
        match = re.fullmatch(r"`(\w+)\((.*?)\)(?: -> [^`]+)?`(?: \*abstract\*)?", cells[0])
        assert match, cells[0]
        name, params = match.groups()
        params = re.sub(r"\[[^\]]*\]", "", params)  # shapes such as [B, S]
        shown = [p.strip().split("=")[0] for p in params.split(",") if p.strip()]
        real = _signature_text(getattr(VlmAdapter, name)).split(", ")
        assert shown == [p.split("=")[0] for p in real if p != "self"], name
        assert ("*abstract*" in cells[0]) == (name in VlmAdapter.__abstractmethods__), name
