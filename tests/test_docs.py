"""README.md and every page in docs/ against the code: what a user copies from them must be true.

Every fenced block of every page (README.md and docs/*.md, so a page added later is covered too) is
run or checked by its tag:

* ``python``: run as it is, in this process, as one process under ``torchrun`` would run it (in a
  temporary folder that links the repository's folders, so ``fixtures/...`` resolves and what the
  block writes stays there; ``RANK=0``, ``WORLD_SIZE=1``, a free ``MASTER_PORT``, one thread; a
  fresh adapter registry; the environment, working directory and process group restored after).
  An ``output`` block right after it is what it must print, exactly. A python block under a
  ``<!-- file: PATH -->`` comment is not run: it must equal that file (which the suite runs itself).
* ``sh`` / ``bash`` / ``shell``: every command line is parsed by the program it calls (``ppmedia``'s
  own parser, ``torchrun``'s, the ``argparse`` parser of a script or ``-m`` module), ``make`` targets
  must be in the Makefile, paths must exist; ``ppmedia adapters``, ``inspect`` and ``plan`` are run
  and must succeed.
* ``console``: a transcript; each ``$ ppmedia ...`` command is run (in that folder, which also holds
  the two bad batch files the command-line page shows) and must print exactly the lines after it
  and exit with 2 for a command-line error, 1 for another error, else 0; another program's command
  line is checked as in an ``sh`` block.
* ``toml``: parses. ``text``, ``output`` and other tags: not run (measured figures, diagrams); an
  untagged block that holds command lines is refused, so none goes unchecked.

Across pages: every ``ppmedia.x.y`` name exists, every relative link reaches a file and heading, every
page is listed in docs/index.md, headings that show a signature show the real one, and the tables of
adapters, chunk fields, adapter methods and schedules match the code. ``test_planted_*`` shows the
checks fail on planted errors.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fractions
import importlib
import importlib.util
import inspect
import io
import os
import pathlib
import re
import shlex
import socket
import sys
import tomllib

import pytest
import torch

import ppmedia
from ppmedia import pipeline
from ppmedia.adapters.base import VlmAdapter
from ppmedia.cli import build_parser, main

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def pages() -> list[pathlib.Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _rel(path: pathlib.Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


# ------------------------------------------------------------------------------------ reading pages
@dataclasses.dataclass(frozen=True)
class Block:
    page: pathlib.Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    file: str | None = None  # PATH of a `<!-- file: PATH -->` comment right above the fence
    output: Block | None = None  # the `output` block right after a python block

    @property
    def where(self) -> str:
        return f"{_rel(self.page)}:{self.line}"


_FENCE = re.compile(r"^( {0,3})(`{3,})\s*([^`\s]*)[^`]*$")
_FILE_MARKER = re.compile(r"^<!--\s*file:\s*(\S+)\s*-->$")


def read_blocks(page: pathlib.Path, text: str | None = None) -> list[Block]:
    """The fenced blocks of a page, in order, ``output`` blocks attached to the python block before."""
    lines = (page.read_text() if text is None else text).splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, lang = len(match.group(1)), match.group(2), match.group(3).lower()
        body, j = [], i + 1
        while j < len(lines) and not re.fullmatch(rf" {{0,3}}{fence}`*\s*", lines[j]):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        assert j < len(lines), f"{_rel(page)}:{i + 1}: the block opened here is never closed"
        above = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        marker = _FILE_MARKER.match(above)
        found.append(Block(page, i + 1, lang, "\n".join(body) + "\n" if body else "", marker and marker.group(1)))
        i = j + 1
    blocks: list[Block] = []
    for block in found:
        if block.lang == "output" and blocks and blocks[-1].lang == "python" and blocks[-1].output is None:
            blocks[-1] = dataclasses.replace(blocks[-1], output=block)
        else:
            blocks.append(block)
    return blocks


def prose(text: str) -> str:
    """The page with its fenced blocks blanked out (same length, so positions stay)."""
    out, inside = [], None
    for line in text.splitlines():
        match = _FENCE.match(line)
        if inside is None and match:
            inside = match.group(2)
            out.append(" " * len(line))
        elif inside is not None:
            if re.fullmatch(rf" {{0,3}}{inside}`*\s*", line):
                inside = None
            out.append(" " * len(line))
        else:
            out.append(line)
    return "\n".join(out)


def section(text: str, title: str) -> str:
    """From the heading ``title`` (any level) to the next heading of the same or a higher level."""
    match = re.search(rf"^(#+) {re.escape(title)}\s*$", text, flags=re.M)
    assert match, f"no heading {title!r}"
    level = len(match.group(1))
    rest = prose(text[match.end():])
    end = re.search(rf"^#{{1,{level}}} ", rest, flags=re.M)
    return text[match.start(): match.end() + (end.start() if end else len(rest))]


def table_after(text: str, anchor: str) -> list[list[str]]:
    """The body rows of the first markdown table at or after ``anchor``."""
    at = text.index(anchor)
    start = text.rfind("\n", 0, at) + 1
    table = text[start:] if text[start] == "|" else text[text.index("\n|", at) + 1:]
    rows = []
    for line in table.splitlines():
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows[2:]


def tables(text: str) -> list[list[list[str]]]:
    """Every markdown table of a page: header row first, the separator left out."""
    found, current = [], []
    for line in prose(text).splitlines() + [""]:
        stripped = line.strip()
        if stripped.startswith("|"):
            current.append([cell.strip() for cell in stripped.strip("|").split("|")])
        elif current:
            found.append([current[0], *current[2:]])
            current = []
    return found


# ------------------------------------------------------------------------------------ python blocks
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def as_a_script(cwd: pathlib.Path = ROOT):
    """Run code as ``torchrun --nproc-per-node 1`` would (one thread), then put this process back as it was."""
    import torch.distributed as dist

    import ppmedia.registry as registry

    environ, here, path = dict(os.environ), os.getcwd(), list(sys.path)
    threads, dtype, default = torch.get_num_threads(), torch.get_default_dtype(), registry._default
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    torch.set_num_threads(1)  # as torchrun's OMP_NUM_THREADS=1
    registry._default = None  # the block gets a registry of its own: what it registers stays there
    os.chdir(cwd)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.chdir(here)
        os.environ.clear()
        os.environ.update(environ)
        sys.path[:] = path
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
        registry._default = default


def run_python(block: Block, folder: pathlib.Path = ROOT) -> None:
    """Run a python block in ``folder``; compare what it prints with its ``output`` block."""
    code = compile("\n" * block.line + block.text, str(block.page), "exec")  # tracebacks give page lines
    out = io.StringIO()
    with as_a_script(folder), contextlib.redirect_stdout(out):
        try:
            exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
        except BaseException as exc:
            raise AssertionError(f"{block.where}: the python block raised {type(exc).__name__}: {exc}") from exc
    if block.output is not None and out.getvalue() != block.output.text:
        raise AssertionError(f"{block.where}: printed\n{out.getvalue()}but its output block ({block.output.where}) shows\n{block.output.text}")


def check_file_block(block: Block) -> None:
    path = ROOT / block.file
    assert path.is_file(), f"{block.where}: {block.file} does not exist"
    assert block.text == path.read_text(), f"{block.where}: the block is not {block.file} as it is"


# ------------------------------------------------------------------------------------ command lines
class _Parsed(Exception):
    pass


@contextlib.contextmanager
def _parse_only():
    """The outermost ``argparse`` parse of the program raises ``_Parsed`` instead of returning."""
    real = {name: getattr(argparse.ArgumentParser, name) for name in ("parse_args", "parse_known_args")}
    depth = [0]

    def wrap(fn):
        def parse(self, *args, **kwargs):
            depth[0] += 1
            try:
                result = fn(self, *args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                raise _Parsed(result)
            return result
        return parse

    for name, fn in real.items():
        setattr(argparse.ArgumentParser, name, wrap(fn))
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(argparse.ArgumentParser, name, fn)


def _parse_with(program: str, entry, argv: list[str]) -> None:
    err = io.StringIO()
    try:
        with _parse_only(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            entry(argv)
    except _Parsed:
        return
    except SystemExit as exc:
        assert exc.code in (0, None), f"{program} refuses {shlex.join(argv)}: {err.getvalue().strip()}"
        return
    raise AssertionError(f"{program} {shlex.join(argv)} returned without parsing its arguments with argparse")


#: ``ppmedia`` subcommands cheap enough to run for real (the others are parsed only)
RUN_SUBCOMMANDS = {"adapters", "inspect", "plan"}


def check_ppmedia(argv: list[str]) -> None:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = build_parser().parse_args(argv)
    except SystemExit as exc:
        assert exc.code == 0, f"ppmedia refuses {shlex.join(argv)}: {err.getvalue().strip()}"
        return
    if getattr(args, "command", argv[0] if argv else None) in RUN_SUBCOMMANDS:
        out = io.StringIO()
        with as_a_script(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = main(argv)
        assert code == 0, f"ppmedia {shlex.join(argv)} exited {code}: {out.getvalue().strip()}"


def _check_program(program: str, argv: list[str], *, module: bool) -> None:
    """A ``-m`` module or a script file: it exists; when it parses with argparse, ``argv`` parses."""
    if module:
        if program == "ppmedia":
            return check_ppmedia(argv)
        spec = importlib.util.find_spec(program)
        assert spec is not None and spec.origin, f"no module {program}"
        source, load = pathlib.Path(spec.origin).read_text(), lambda: importlib.import_module(program)
    else:
        path = ROOT / program
        assert path.is_file(), f"{program} does not exist"
        if path.suffix != ".py":
            return
        source = path.read_text()

        def load():
            spec = importlib.util.spec_from_file_location(f"_docs_{path.stem}", path)
            loaded = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(loaded)
            return loaded
    if "argparse" not in source:
        return
    with as_a_script():
        loaded = load()
        entry = getattr(loaded, "main", None) or getattr(loaded, "parse_args", None)
        assert entry is not None, f"{program} uses argparse but has no main(argv) or parse_args(argv)"
        _parse_with(program, entry, argv)


def _check_python(argv: list[str]) -> None:
    while argv and argv[0] in ("-u", "-O", "-B", "-s"):
        argv = argv[1:]
    assert argv, "python with no program"
    if argv[0] == "-m":
        return _check_program(argv[1], argv[2:], module=True)
    if argv[0] == "-c":
        compile(argv[1], "<python -c>", "exec")
        return
    _check_program(argv[0], argv[1:], module=False)


def _check_torchrun(argv: list[str]) -> None:
    from torch.distributed.run import get_args_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = get_args_parser().parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"torchrun refuses {shlex.join(argv)}: {err.getvalue().strip()}") from exc
    _check_program(args.training_script, list(args.training_script_args), module=args.module)


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), flags=re.M))


#: shell commands around the checked ones, taken as they are
SHELL_UTILITIES = {"cd", "export", "echo", "mkdir", "ls", "cat", "rm", "cp", "git", "unset"}


def check_command(line: str) -> None:
    """One shell command line of a page (continuations joined, comments removed)."""
    argv = shlex.split(line, comments=True)
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0]):  # VAR=value prefixes
        argv = argv[1:]
    if not argv:
        return
    program, rest = argv[0], argv[1:]
    if program.startswith((".venv/bin/", "$(BIN)/")):
        program = program.rsplit("/", 1)[1]
    if program in ("python", "python3") and rest[:2] == ["-m", "pytest"]:
        program, rest = "pytest", rest[2:]
    if program == "make":
        missing = [t for t in rest if not t.startswith("-") and t not in _make_targets()]
        assert not missing, f"make: no target {missing} in the Makefile"
    elif program == "ppmedia":
        check_ppmedia(rest)
    elif program in ("python", "python3"):
        _check_python(rest)
    elif program == "torchrun":
        _check_torchrun(rest)
    elif program in ("pip", "pytest"):
        paths = [a.split("::")[0] for a in rest if a.startswith((".", "/", "tests", "examples"))]
        missing = [p for p in paths if not (ROOT / p).exists()]
        assert not missing, f"{program}: {missing} do not exist"
    elif program not in SHELL_UTILITIES:
        raise AssertionError(f"no check for a {program!r} command (known: make, ppmedia, python, torchrun, pip, pytest)")


def command_lines(block: Block) -> list[str]:
    lines = []
    for line in block.text.replace("\\\n", " ").splitlines():
        if line.strip() and not line.strip().startswith("#"):
            lines.append(line.strip())
    return lines


def check_shell(block: Block) -> None:
    lines = command_lines(block)
    assert lines, f"{block.where}: an empty {block.lang} block"
    for line in lines:
        try:
            check_command(line)
        except AssertionError as exc:
            raise AssertionError(f"{block.where}: {line}\n  {exc}") from exc


# ------------------------------------------------------------------------------------ transcripts
def transcript(block: Block) -> list[tuple[str, str]]:
    """``(command, expected output)`` pairs of a console block."""
    pairs: list[tuple[str, list[str]]] = []
    for line in block.text.splitlines():
        if line.startswith("$ "):
            pairs.append((line[2:], []))
        else:
            assert pairs, f"{block.where}: a console block starts with a '$ ' command line"
            pairs[-1][1].append(line)
    return [(command, "".join(f"{line}\n" for line in out)) for command, out in pairs]


def sandbox(folder: pathlib.Path) -> pathlib.Path:
    """Where python blocks and transcripts run: a folder that looks like the repository root (its
    folders and files linked in, so ``fixtures/...`` resolves) and keeps what a block writes
    (checkpoints, ...), with the two bad batch files docs/cli.md shows the errors for."""
    for entry in ROOT.iterdir():
        if not entry.name.startswith(".") and not entry.name.endswith(".egg-info"):
            (folder / entry.name).symlink_to(entry)
    (folder / "notes.pt").write_text("hello world\n")
    torch.save({"input_ids": torch.zeros(2, 3, dtype=torch.int64), "f": fractions.Fraction(1, 3)}, folder / "untrusted.pt")
    return folder


def run_transcript(block: Block, folder: pathlib.Path) -> None:
    for command, expected in transcript(block):
        argv = shlex.split(command)
        if argv[:3] in (["python", "-m", "ppmedia"], ["python3", "-m", "ppmedia"]):
            argv = ["ppmedia", *argv[3:]]
        if argv[0] != "ppmedia":  # another program's transcript: its command line is checked, not run
            try:
                check_command(command)
            except AssertionError as exc:
                raise AssertionError(f"{block.where}: $ {command}\n  {exc}") from exc
            continue
        out, err = io.StringIO(), io.StringIO()
        with as_a_script(folder), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv[1:])
        if out.getvalue() + err.getvalue() != expected:
            raise AssertionError(f"{block.where}: $ {command}\nprints\n{out.getvalue() + err.getvalue()}but the page shows\n{expected}")
        status = 2 if "ppmedia: error: argument " in expected else 1 if "ppmedia: error: " in expected else 0
        assert code == status, f"{block.where}: $ {command} exited {code}; expected {status}"


# ------------------------------------------------------------------------------------ one block
SHELL = {"sh", "bash", "shell"}
UNCHECKED = {"text", "output", "diff", "json", "yaml"}
_LOOKS_LIKE_A_COMMAND = re.compile(r"^\s*(\$ |(python3?|torchrun|ppmedia|make|pip|pytest) )")


def check_block(block: Block, folder: pathlib.Path) -> None:
    if block.file is not None:
        check_file_block(block)
    elif block.lang == "python":
        run_python(block, folder)
    elif block.lang in SHELL:
        check_shell(block)
    elif block.lang == "console":
        run_transcript(block, folder)
    elif block.lang == "toml":
        tomllib.loads(block.text)
    elif block.lang == "output":
        raise AssertionError(f"{block.where}: an output block must follow a python block")
    elif block.lang == "":
        commands = [line for line in block.text.splitlines() if _LOOKS_LIKE_A_COMMAND.match(line)]
        assert not commands, f"{block.where}: an untagged block with command lines {commands}: tag it sh, console or text"


ALL_BLOCKS = [block for page in pages() for block in read_blocks(page)]


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=[f"{b.where}-{b.lang or 'untagged'}" for b in ALL_BLOCKS])
def test_code_block(block, tmp_path):
    check_block(block, sandbox(tmp_path))


def test_pages_have_the_blocks_they_should():
    by_lang: dict[str, int] = {}
    for block in ALL_BLOCKS:
        key = "file" if block.file else block.lang
        by_lang[key] = by_lang.get(key, 0) + 1
    # the README's training step and the pages' examples run; a shown file is compared; transcripts run
    assert by_lang.get("python", 0) >= 7 and by_lang.get("file", 0) >= 1 and by_lang.get("console", 0) >= 3, by_lang
    assert sum(1 for b in ALL_BLOCKS if b.output is not None) >= 6
    assert sum(len(command_lines(b)) for b in ALL_BLOCKS if b.lang in SHELL) >= 15


# ------------------------------------------------------------------------------------ across pages
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


#: file names that look like dotted names (``ppmedia.json``, a checkpoint's info file)
_FILE_SUFFIXES = frozenset({"json", "toml", "md", "txt", "yaml", "yml", "safetensors"})


def missing_names(text: str) -> list[str]:
    missing = []
    for name in sorted(set(re.findall(r"(?<![\w./])(ppmedia(?:\.[A-Za-z_]\w*)+)", text))):
        if name.rsplit(".", 1)[-1] in _FILE_SUFFIXES:
            continue
        try:
            _resolve(name)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{name}: {exc}")
    return missing


def test_every_ppmedia_name_exists():
    text = "\n".join(page.read_text() for page in pages())
    assert len(set(re.findall(r"(?<![\w./])(ppmedia(?:\.[A-Za-z_]\w*)+)", text))) >= 30
    assert missing_names(text) == []


def slugs(text: str) -> set[str]:
    """GitHub's heading anchors."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+?)\s*#*\s*$", prose(text), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def broken_links(page: pathlib.Path, text: str | None = None) -> list[str]:
    text = page.read_text() if text is None else text
    plain = re.sub(r"`[^`\n]*`", "", prose(text))
    broken = []
    for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", plain):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no {path}")
        elif anchor and file.suffix == ".md" and anchor not in slugs(file.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {_rel(file)}")
    return broken


@pytest.mark.parametrize("page", pages(), ids=_rel)
def test_links_reach_a_file_and_heading(page):
    assert broken_links(page) == []


def test_every_page_is_listed_in_the_index():
    index = (DOCS / "index.md").read_text()
    linked = {(DOCS / t.partition("#")[0]).resolve() for t in re.findall(r"\]\(([^)#\s]+\.md)[^)]*\)", index)}
    unlisted = [_rel(p) for p in DOCS.glob("*.md") if p.name != "index.md" and p.resolve() not in linked]
    assert unlisted == [], "docs/index.md must link every page"
    assert "docs/index.md" in README.read_text()


# ------------------------------------------------------------------------------------ README
def test_quick_start_is_make_demo_then_make_test():
    # then the three lines from a data file to an exported model (tests/test_train_data.py runs them)
    block, data = [b for b in read_blocks(README, section(README.read_text(), "Quick start")) if b.lang in SHELL]
    assert [line.split("#")[0].strip() for line in command_lines(block)] == ["make demo", "make test"]
    lines = command_lines(data)
    assert len(lines) == 3 and "examples/train.py --model" in lines[1] and "--data" in lines[1] and "--export" in lines[1]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo: .*\n\t\$\(BIN\)/ppmedia demo$", makefile, flags=re.M)
    assert re.search(r"^test: .*\n\t\$\(BIN\)/pytest$", makefile, flags=re.M)


def test_readme_is_short_and_points_to_every_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    where = section(text, "Where to go next")
    for page in ("training", "api", "adding-a-family", "testing-kit", "cli", "performance", "architecture"):
        assert f"(docs/{page}.md)" in where, page


def test_readme_training_step_is_a_runnable_python_block():
    blocks = [b for b in read_blocks(README) if b.lang == "python"]
    assert blocks and blocks[0].output is not None  # run by test_code_block, its output compared
    for call in ("split_media", "stage_media", "schedule.step", "make_pipeline_stages", "build_schedule"):
        assert call in blocks[0].text, call


# ------------------------------------------------------------------------------------ API and tables
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


def wrong_signatures(text: str) -> list[str]:
    """Headings such as ### `split_media(batch, ...) -> StagedMedia` that do not show the real signature."""
    wrong = []
    for name, shown in re.findall(r"^#{2,4} `(\w+)\((.*?)\)(?: -> [^`]+)?`", prose(text), flags=re.M):
        fn = getattr(ppmedia, name, None)
        if callable(fn) and not isinstance(fn, type) and shown != _signature_text(fn):
            wrong.append(f"{name}({shown}) is {name}({_signature_text(fn)})")
    return wrong


def test_signature_headings_are_the_real_ones():
    text = "\n".join(page.read_text() for page in pages())
    shown = re.findall(r"^#{2,4} `(\w+)\(", text, flags=re.M)
    assert {"split_media", "stage_media", "collate_for_pipeline", "next_vlm_media_chunk"} <= set(shown)
    assert wrong_signatures(text) == []


API = DOCS / "api.md"


def test_chunk_table_lists_every_field_in_order():
    rows = table_after(API.read_text(), "## `VlmMediaChunk`")
    assert [r[0].strip("`") for r in rows] == [f.name for f in dataclasses.fields(ppmedia.VlmMediaChunk)]


def test_staged_attributes_and_media_keys_are_all_named():
    text = API.read_text()
    consumer = section(text, "`next_vlm_media_chunk(module) -> VlmMediaChunk | None`")
    for attribute in (*ppmedia.STAGED_ATTRIBUTES.values(), ppmedia.CURSOR_ATTRIBUTE):
        assert attribute in consumer, attribute
    split = text[text.index("## `split_media(") : text.index("## `StagedMedia`")]
    for key in (*ppmedia.MEDIA_KEYS, *ppmedia.IMAGE_GRID_KEYS):
        assert f"`{key}`" in split, key


#: pages whose adapter table lists every built-in adapter; another page's may list some
COMPLETE_ADAPTER_TABLES = ("README.md", "docs/api.md")


def adapter_table_problems(name: str, text: str) -> list[str]:
    """Tables headed ``| adapter | model types | ...`` against the registry's built-in adapters."""
    builtin = {i.name: sorted(i.model_types) for i in ppmedia.list_adapters() if "built-in" in i.provider}
    problems = []
    for table in tables(text):
        if table[0][:2] != ["adapter", "model types"]:
            continue
        shown = {r[0].strip("`"): sorted(t.strip("` ") for t in r[1].split(",")) for r in table[1:]}
        if name in COMPLETE_ADAPTER_TABLES and set(shown) != set(builtin):
            problems.append(f"{name}: adapters {sorted(shown)}; the registry's built-ins are {sorted(builtin)}")
        for adapter, types in shown.items():
            if adapter in builtin and types != builtin[adapter]:
                problems.append(f"{name}: {adapter} serves {builtin[adapter]}, not {types}")
    return problems


def test_adapter_tables_match_the_registry():
    # the README's and the API page's tables list every built-in adapter; any other page's table
    # (a page about some families) gives each adapter it names the model types it really serves
    for name in COMPLETE_ADAPTER_TABLES:
        assert "| adapter | model types |" in (ROOT / name).read_text(), name
    assert [p for page in pages() for p in adapter_table_problems(_rel(page), page.read_text())] == []


def test_adapter_method_table_matches_vlm_adapter():
    rows = table_after(API.read_text(), "| method | what |")
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


def test_schedule_names_match_torch_and_the_demo():
    from ppmedia.demo import schedule_choices

    commands = section((DOCS / "cli.md").read_text(), "Subcommands")
    for name in schedule_choices():
        assert f"`{name}`" in commands, name
    schedules = section((DOCS / "training.md").read_text(), "Schedules")
    for name in pipeline.schedule_names():
        assert f"`{name}`" in schedules, name


def test_demo_names_every_family():
    from ppmedia.testing.tiny_models import FAMILIES

    commands = section((DOCS / "cli.md").read_text(), "Subcommands")
    for family in FAMILIES:
        assert f"`{family}`" in commands, family
    assert "runs every tiny model family through" in README.read_text()  # no count to go stale


def test_quoted_plan_figures_are_the_printed_ones():
    # the transcript's output is compared with `ppmedia plan` by test_code_block; the prose must agree with it
    text = (DOCS / "training.md").read_text()
    quoted = re.search(r"For that fixture: 1F1B ([\d.]+) → ([\d.]+) units \(([\d.]+)\), GPipe unchanged \(([\d.]+);", text)
    assert quoted, "the Planning section quotes the fixture's figures"
    (block,) = [b for b in read_blocks(DOCS / "training.md", section(text, "Planning: `ppmedia plan`")) if b.lang == "console"]
    ((command, printed),) = transcript(block)
    assert command.startswith("ppmedia plan fixtures/qwen2_5_vl/")
    rows = {row.split()[0]: row.split() for row in printed.splitlines() if row.split()[:1] in (["gpipe"], ["1f1b"])}
    assert (rows["1f1b"][1], rows["1f1b"][3], rows["1f1b"][5]) == quoted.group(1, 2, 3)
    assert rows["gpipe"][5] == quoted.group(4)


# ------------------------------------------------------------------------------------ planted errors
PLANTED = '''# A page with planted errors

```python
import ppmedia
print(ppmedia.split_media.__name__)
```

```output
split_media
```

```python
import ppmedia
print("two microbatches")
```

```output
three microbatches
```

```python
import torch
torch.zeros(2, 3) @ torch.zeros(2, 3)
```

```sh
ppmedia inspect fixtures/qwen2_5_vl/inputs.safetensors --microbatches 4 --no-such-flag
```

```sh
torchrun --standalone --nproc-per-node 2 examples/train.py --pp 2 --steps-typo 3
```

```sh
python -m ppmedia.testing.parity qwen2_5_vl --scenarios gpipe
```

```sh
make deploy
```

```console
$ ppmedia inspect batch.pt --microbatches 0
ppmedia: error: argument --microbatches: got 0; expected a positive integer
```

<!-- file: tests/plugin/tests/test_llava_plugin.py -->
```python
"""Not the plugin's test file."""
```

```
torchrun --nproc-per-node 2 train.py
```

```output
an output block after no python block
```

```console
$ torchrun --standalone --nproc-per-node 2 examples/train.py --bogus
step 0: ...
```

```bash
export PPMEDIA_PLUGINS=my_plugin
docker run ppmedia
```

See [the API](api.md#no-such-heading), [nothing](no-such-page.md) and `ppmedia.no_such_name`.

### `split_media(batch, n)`

| adapter | model types | layout |
|---|---|---|
| `llava_next` | `llava_next`, `llava_onevision` | a wrong model type |
| `no_such_family` | `x` | unknown here: not checked on a page that lists some families |
'''


def test_planted_errors_are_reported(tmp_path):
    page = tmp_path / "planted.md"
    page.write_text(PLANTED)
    blocks = read_blocks(page)
    (tmp_path / "run").mkdir()
    folder = sandbox(tmp_path / "run")
    expected = [
        None,  # the first python block prints what its output block shows: no error
        "printed\ntwo microbatches\nbut its output block",
        "the python block raised RuntimeError",
        "ppmedia refuses inspect",
        "unrecognized arguments: --steps-typo",
        "unrecognized arguments: --scenarios",
        "make: no target ['deploy']",
        "but the page shows\nppmedia: error: argument --microbatches: got 0; expected a positive integer",
        "the block is not tests/plugin/tests/test_llava_plugin.py as it is",
        "an untagged block with command lines",
        "an output block must follow a python block",
        "unrecognized arguments: --bogus",
        "no check for a 'docker' command",
    ]
    assert len(blocks) == len(expected)
    for block, message in zip(blocks, expected):
        if message is None:
            check_block(block, folder)
            continue
        with pytest.raises(AssertionError) as info:
            check_block(block, folder)
        assert message in str(info.value), (block.where, str(info.value))
        assert block.where in str(info.value), str(info.value)  # every report names the page and line
    assert broken_links(page) == ["api.md#no-such-heading: no api.md", "no-such-page.md: no no-such-page.md"]
    (tmp_path / "api.md").write_text(API.read_text())  # the page exists, the heading does not
    assert broken_links(page) == [f"api.md#no-such-heading: no heading #no-such-heading in {tmp_path / 'api.md'}",
                                  "no-such-page.md: no no-such-page.md"]
    assert [m.split(":")[0] for m in missing_names(PLANTED)] == ["ppmedia.no_such_name"]
    assert adapter_table_problems("docs/planted.md", PLANTED) == ["docs/planted.md: llava_next serves ['llava_next'], not ['llava_next', 'llava_onevision']"]
    assert adapter_table_problems("README.md", PLANTED) == [
        f"README.md: adapters ['llava_next', 'no_such_family']; the registry's built-ins are {sorted(i.name for i in ppmedia.list_adapters() if 'built-in' in i.provider)}",
        "README.md: llava_next serves ['llava_next'], not ['llava_next', 'llava_onevision']",
    ]
    assert wrong_signatures(PLANTED) == [
        "split_media(batch, n) is split_media(batch, n_microbatches, *, images_per_sample=None, "
        "videos_per_sample=None, audios_per_sample=None, batch_size=None, balance=False, counts=None, "
        "sample_inputs=None, layouts=None)"
    ]


def test_planted_python_block_runs_in_a_sandbox_with_a_fresh_registry_and_leaves_nothing_behind(tmp_path):
    import torch.distributed as dist

    page = tmp_path / "p.md"
    page.write_text(
        "```python\nimport os, torch.distributed as dist, ppmedia\n"
        "from ppmedia.adapters.qwen2_5_vl import Qwen2_5_VLAdapter\n"
        "class Mine(Qwen2_5_VLAdapter):\n    name = 'mine'\n    model_types = ('mine_vl',)\n"
        "ppmedia.register_adapter(Mine)\n"
        "dist.init_process_group('gloo')\nos.environ['PPMEDIA_PLUGINS'] = 'no.such.module'\n"
        "open('written_by_a_block.txt', 'w').write(str(len(open('fixtures/qwen2_5_vl/config.json').read()) > 0))\n"
        "print(dist.get_world_size(), ppmedia.get_adapter('mine_vl').name)\n```\n\n```output\n1 mine\n```\n"
    )
    (block,) = read_blocks(page)
    (tmp_path / "run").mkdir()
    run_python(block, sandbox(tmp_path / "run"))
    assert (tmp_path / "run" / "written_by_a_block.txt").read_text() == "True"  # it saw fixtures/, wrote here
    assert not (ROOT / "written_by_a_block.txt").exists()
    assert not dist.is_initialized() and "PPMEDIA_PLUGINS" not in os.environ
    assert "mine_vl" not in ppmedia.registry.default_registry().model_types()


def test_planted_parse_only_never_runs_the_program():
    ran = []

    def program(argv):
        parser = argparse.ArgumentParser()
        parser.add_argument("--steps", type=int)
        parser.parse_args(argv)
        ran.append(argv)

    _parse_with("prog", program, ["--steps", "3"])
    with pytest.raises(AssertionError, match="prog refuses --steps x"):
        _parse_with("prog", program, ["--steps", "x"])
    assert ran == []

