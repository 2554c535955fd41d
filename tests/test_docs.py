"""README.md and every page in docs/ against the code: what a user copies from them must be true.

Every fenced block of every page (README.md and docs/*.md, so a page added later is covered too) is
run or checked by its tag. "A clean environment" is a user's shell: this process's environment without
torchrun's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``TORCHELASTIC_*``, ...: TORCHRUN_VARIABLES),
the virtual environment's ``bin`` first on ``PATH``; "the sandbox" is a temporary folder that looks like
the repository root (its folders linked, its files copied, ``.venv`` linked) and keeps what runs there writes.

* ``python`` that the paragraph above has the user save and run as a file (an inline ``python NAME.py``
  or ``torchrun ... NAME.py``; "save it as X" without such a command is refused): written to NAME.py in
  the sandbox and run with each command the page shows, in a subprocess, clean environment; what it prints
  must be its ``output`` block exactly.
* other ``python``: run in this process, as a plain script (none of torchrun's variables set, one
  thread, a fresh adapter registry; environment, working directory and process group restored after),
  in the sandbox; an ``output`` block right after it is what it must print, exactly. A python block
  under a ``<!-- file: PATH -->`` comment is not run: it must equal that file (which the suite runs).
* ``sh`` / ``bash`` / ``shell``: every command line runs as written, in order, in one sandbox, in a
  subprocess (``bash``), clean environment, and must exit 0. The same lines on two pages run once
  (``_RUNS``). The few that cannot run here are in ONE table, NOT_RUN, each with why and what runs or
  checks it instead (that check is asserted, and the line is parsed by its program's parser).
* ``console``: a transcript; each ``$ ppmedia ...`` command runs in this process (in the sandbox, which
  also holds the two bad batch files the command-line page shows) and must print exactly the lines after
  it and exit with 2 for a command-line error, 1 for another error, else 0; another program's command
  runs as an ``sh`` line and must print exactly the lines shown.
* ``toml``: parses. ``text``, ``output`` and other tags: not run (measured figures, diagrams); an
  untagged block that holds command lines is refused, so none goes unchecked.

Across pages: every ``ppmedia.x.y`` name exists, every relative link reaches a file and heading, every
page is listed in docs/index.md, headings that show a signature show the real one, and the tables of
adapters, chunk fields, adapter methods and schedules match the code. ``test_planted_*`` shows the
checks fail on planted errors, each reported with its page and line.
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
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable

import pytest
import torch

import ppmedia
from ppmedia import pipeline
from ppmedia.adapters.base import VlmAdapter
from ppmedia.cli import build_parser, main

ROOT = pathlib.Path(__file__).resolve().parents[1]
BIN = pathlib.Path(sys.executable).parent  # the virtual environment's bin (not resolved: a venv's python is a link)
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
    intro: str = ""  # the paragraph right above the fence, its lines joined by spaces

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
        paragraph, k = [], i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        while k >= 0 and lines[k].strip() and not _FENCE.match(lines[k]):
            paragraph.insert(0, lines[k].strip())
            k -= 1
        found.append(Block(page, i + 1, lang, "\n".join(body) + "\n" if body else "", marker and marker.group(1),
                           intro=" ".join(paragraph)))
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
#: what ``torchrun`` sets in its workers' environment; a user's shell has none of them, so the pages'
#: commands and blocks run without them (a block that needs one fails here as it fails for the user)
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE",
                      "OMP_NUM_THREADS")


def _torchrun_variable(name: str) -> bool:
    return name in TORCHRUN_VARIABLES or name.startswith("TORCHELASTIC_")


def clean_environment() -> dict[str, str]:
    """A user's shell in the project's environment: this process's variables without torchrun's, the
    virtual environment's ``bin`` first on ``PATH`` (``python``, ``torchrun``, ``ppmedia`` are its)."""
    env = {name: value for name, value in os.environ.items() if not _torchrun_variable(name)}
    env["PATH"] = os.pathsep.join([str(BIN), *([env["PATH"]] if env.get("PATH") else [])])
    return env


@contextlib.contextmanager
def as_a_script(cwd: pathlib.Path = ROOT):
    """Run code in this process as a plain ``python`` script would run (none of torchrun's variables set;
    one thread, to share the machine), then put this process back as it was."""
    import torch.distributed as dist

    import ppmedia.registry as registry

    environ, here, path = dict(os.environ), os.getcwd(), list(sys.path)
    threads, dtype, default = torch.get_num_threads(), torch.get_default_dtype(), registry._default
    for name in [name for name in os.environ if _torchrun_variable(name)]:
        del os.environ[name]
    torch.set_num_threads(1)
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


# ------------------------------------------------------------------------------------ parsing a command line
# Only for the commands of NOT_RUN (which cannot run here): the program's own parser takes the line.
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


def check_ppmedia(argv: list[str]) -> None:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as exc:
        assert exc.code == 0, f"ppmedia refuses {shlex.join(argv)}: {err.getvalue().strip()}"


def _check_program(program: str, argv: list[str], *, module: bool) -> None:
    """A ``-m`` module or a script file: it exists; when it parses with argparse, ``argv`` parses."""
    if module:
        if program == "ppmedia":
            return check_ppmedia(argv)
        spec = importlib.util.find_spec(program)
        assert spec is not None and spec.origin, f"no module {program}"
        origin = pathlib.Path(spec.origin)  # a package (``-m`` runs its __main__): the source of all its modules
        files = sorted(origin.parent.glob("*.py")) if spec.submodule_search_locations is not None else [origin]
        source, load = "".join(f.read_text() for f in files), lambda: importlib.import_module(program)
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


def _torchrun_parses(line: str) -> None:
    """torchrun's own flags (for a line whose program is a file the page has the user save)."""
    argv = shlex.split(line, comments=True)
    _check_torchrun([*argv[1:-1], "-m", "ppmedia", "adapters"])


def make_recipes() -> dict[str, list[str]]:
    """The Makefile's targets and their recipe lines."""
    recipes: dict[str, list[str]] = {}
    target = None
    for line in (ROOT / "Makefile").read_text().splitlines():
        match = re.match(r"^([\w.-]+):", line)
        if match:
            target = recipes.setdefault(match.group(1), [])
        elif line.startswith("\t") and target is not None:
            target.append(line.strip())
        elif not line.strip():
            target = None
    return recipes


def check_command(line: str) -> None:
    """Parse one command line with the program's own parser (``ppmedia``'s, ``torchrun``'s, a script's or
    ``-m`` module's ``argparse``), ``make`` targets in the Makefile: for the lines that do not run here."""
    argv = shlex.split(line, comments=True)
    program, rest = argv[0].rsplit("/", 1)[-1], argv[1:]
    if program == "make":
        missing = [t for t in rest if not t.startswith("-") and t not in make_recipes()]
        assert not missing, f"make: no target {missing} in the Makefile"
    elif program == "ppmedia":
        check_ppmedia(rest)
    elif program in ("python", "python3"):
        _check_python(rest)
    elif program == "torchrun":
        _check_torchrun(rest)
    else:
        raise AssertionError(f"no parser for a {program!r} command (known: make, ppmedia, python, torchrun)")


# ------------------------------------------------------------------------------------ running commands
def command_lines(block: Block) -> list[str]:
    lines = []
    for line in block.text.replace("\\\n", " ").splitlines():
        if line.strip() and not line.strip().startswith("#"):
            lines.append(line.strip())
    return lines


def command_key(line: str) -> str:
    """A command line as the shell reads it: comment dropped, spaces normalised."""
    return shlex.join(shlex.split(line, comments=True))


#: how long one documented command may take (a 4-process examples/train.py run: ~90 s on the busy 2-core VM)
COMMAND_TIMEOUT_S = 600

#: a line whose effect on the shell (not on the folder) the block's later lines need
_SHELL_STATE = re.compile(r"^(cd|export|unset|source|\.)\s|^[A-Za-z_]\w*=\S*$")


def run_command(line: str, folder: pathlib.Path, state: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``line`` as a user types it into ``bash`` in ``folder``: the clean environment, after the block's
    earlier ``cd`` / ``export`` lines (``state``)."""
    script = "\n".join(["set -e", *state, line])
    try:
        return subprocess.run(["bash", "-c", script], cwd=folder, env=clean_environment(), capture_output=True,
                              text=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{line}\n  did not finish within {COMMAND_TIMEOUT_S} s") from exc


#: results of command lines run from a fresh sandbox, keyed by the lines run there before and the line:
#: the same commands on two pages (README.md and docs/training.md show the same two) run once
_RUNS: dict[tuple[str, ...], subprocess.CompletedProcess] = {}


def _failure(where: str, line: str, result: subprocess.CompletedProcess) -> str:
    tail = (result.stdout[-1500:] + result.stderr[-3000:]).rstrip()
    return f"{where}: {line}\n  exited {result.returncode} (run in a clean environment, from the sandbox):\n{tail}"


def run_lines(where: str, lines: list[str], folder: pathlib.Path) -> list[subprocess.CompletedProcess]:
    """Run ``lines`` in order in ``folder`` (a fresh sandbox); each must exit 0. A line whose result is
    cached for the same earlier lines is not run again, unless a later uncached line needs its files."""
    done: list[str] = []
    state: list[str] = []
    skipped: list[tuple[tuple[str, ...], str]] = []  # cached lines not run in this folder yet
    results = []
    for line in lines:
        key = (*done, command_key(line))
        result = _RUNS.get(key)
        if result is None:
            for earlier_state, earlier in skipped:  # the folder as the cached run had it
                run_command(earlier, folder, earlier_state)
            skipped = []
            result = _RUNS[key] = run_command(line, folder, tuple(state))
        else:
            skipped.append((tuple(state), line))
        if result.returncode != 0:
            raise AssertionError(_failure(where, line, result))
        results.append(result)
        done.append(command_key(line))
        if _SHELL_STATE.match(line):
            state.append(line)
    return results


@dataclasses.dataclass(frozen=True)
class NotRun:
    """A documented command the suite cannot run as written: why, and what runs or checks it instead
    (``check`` asserts that other check is in place, given the line)."""

    why: str
    instead: str
    check: Callable[[str], None]


def _recipe_is(target: str, recipe: str) -> Callable[[str], None]:
    def check(line: str) -> None:
        check_command(line)
        assert make_recipes().get(target) == [recipe], f"the Makefile's {target} target is not {recipe!r}"
    return check


def _test_source_has(path: str, *fragments: str) -> Callable[[str], None]:
    def check(line: str) -> None:
        check_command(line)
        source = (ROOT / path).read_text()
        missing = [f for f in fragments if f not in source]
        assert not missing, f"{path} no longer has {missing}: the check named for this command is gone"
    return check


def _every_family_in(*paths: str) -> Callable[[str], None]:
    def check(line: str) -> None:
        from ppmedia.testing.tiny_models import FAMILIES

        check_command(line)
        text = "".join((ROOT / p).read_text() for p in paths)
        assert [f for f in FAMILIES if f'"{f}"' not in text] == [], f"a family's parity is in none of {paths}"
    return check


def _test_module(name: str):
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "tests"))


def _run_by_fsdp_tests(line: str) -> None:
    fsdp = _test_module("test_fsdp_dcp")
    assert shlex.split(line, comments=True) in fsdp._doc_commands(), "tests/test_fsdp_dcp.py does not run it"
    assert "for argv in _doc_commands():" in inspect.getsource(fsdp.docs_runs)
    assert "subprocess.run([str(TORCHRUN), *argv[1:]]" in inspect.getsource(fsdp.docs_runs)


def run_documented(where: str, lines: list[str], folder: pathlib.Path) -> list[subprocess.CompletedProcess]:
    """``lines`` of a page run as written (a user's shell, in order, each exiting 0) in a fresh sandbox
    made in ``folder``: for a test elsewhere that runs a page's command itself and checks what it did
    (NOT_RUN's :func:`_run_as_written_by` entries point to it)."""
    return run_lines(where, lines, sandbox(folder))


def _run_as_written_by(module: str, lines: str) -> Callable[[str], None]:
    """The check of a line that ``tests/<module>.py`` runs as written with :func:`run_documented`, reading
    it from the page with its function ``lines()``, and checks what it did."""
    def check(line: str) -> None:
        check_command(line)
        tests = _test_module(module)
        assert command_key(line) in [command_key(l) for l in getattr(tests, lines)()], f"tests/{module}.py does not run it"
        assert "run_documented(" in inspect.getsource(tests), f"tests/{module}.py no longer runs the page's lines"
    return check


_PARITY_SPAWNS = ("tests/test_pipeline_mp.py", "tests/test_families18_mp.py", "tests/test_families_more_mp.py",
                  "tests/test_state_families_mp.py", "tests/test_audio_families_mp.py")
_DEMO = NotRun(
    "every family through a 2-process pipeline: over a minute of the suite's CPU",
    "the demo's path runs as docs/cli.md writes it for one family (`ppmedia demo --family llava_next "
    "--schedule DualPipeV --steps 1`, run by tests/test_cli.py); every family's pipeline parity runs in the shared spawns of "
    + ", ".join(_PARITY_SPAWNS), _every_family_in(*_PARITY_SPAWNS))
_BENCH = NotRun("the benchmarks take minutes; `make bench` is their own target, not part of the suite",
                "the line is parsed by tests/bench/run.py's own parser; the Makefile's bench target runs it",
                lambda line: (check_command(line), _recipe_is("bench", "$(BIN)/python tests/bench/run.py")("make bench")))
_FSDP_DCP = NotRun("4 + 2 + 2 processes of 6 steps: the suite's longest commands, run once already",
                   "tests/test_fsdp_dcp.py's docs_runs fixture runs them as written (read from the page) in a "
                   "scratch folder and checks their losses against the model's", _run_by_fsdp_tests)

_SPREAD_RUN = NotRun(
    "run once already: tests/test_encoder_spread.py runs the page's line as written and checks it",
    "test_train_script_with_the_spread_matches_the_model_and_traces_the_schedules_order: its losses against the "
    "model's own AdamW run, the trace's bars in torch's order per rank, the vision backwards on their lane",
    _run_as_written_by("test_encoder_spread", "documented_spread_lines"))
_QUICK_START = NotRun(
    "run once already: tests/test_train_data.py runs the README's three lines as written and checks them",
    "its trained fixture (test_shuffled_run_resumed_at_another_layout_continues_identically, "
    "test_the_export_reloads_with_the_processor_and_the_dtype): step 0's loss is the model's own, the loss "
    "falls, the export reloads with its processor in float32, the last line prints torch.float32",
    _run_as_written_by("test_train_data", "_readme_lines"))
_CLI_DEMO = NotRun(
    "run once already: tests/test_cli.py runs the page's line as written and checks what it prints",
    "test_demo_runs_a_real_pipeline_and_prints_parity: the batch line, inferred and static shapes, the "
    "shape-inference forward costing no chunk (5/5), a text-only microbatch, the closing parity line",
    _run_as_written_by("test_cli", "documented_demo_lines"))


def _parity_line_covered(family: str, scenario: str, spawn: str) -> Callable[[str], None]:
    """A parity command line whose family and scenario a shared spawn runs (the same harness, run_parity)."""
    def check(line: str) -> None:
        check_command(line)
        words = shlex.split(line, comments=True)
        assert words[words.index("ppmedia.testing.parity") + 1] == family and scenario in words, line
        source = (ROOT / spawn).read_text()
        assert f'"{family}"' in source and f'"{scenario}' in source, f"{spawn} no longer runs {family} {scenario}"
    return check


#: The ONE table of documented commands not run as written here (keys: ``command_key`` of the line).
#: Every other command line of every page runs.
NOT_RUN: dict[str, NotRun] = {
    "make test": NotRun("the suite itself: running it from the suite recurses",
                        "the Makefile's test target is `$(BIN)/pytest`, this suite", _recipe_is("test", "$(BIN)/pytest")),
    "make demo": dataclasses.replace(_DEMO, check=lambda line: (_DEMO.check(line), _recipe_is("demo", "$(BIN)/ppmedia demo")(line))),
    "ppmedia demo": _DEMO,
    "python tests/bench/run.py": _BENCH,
    "python tests/bench/run.py --pack": _BENCH,
    "python tests/bench/run.py --video": _BENCH,
    "python tests/bench/run.py --e2e": _BENCH,
    command_key("torchrun --standalone --nproc-per-node 2 examples/train.py --model demo-ckpt --data demo-data/train.jsonl "
                "--pp 2 --batch-size 32 --max-length 256 --epochs 1 --pack --loss-log loss.jsonl"): NotRun(
        "it shows the flags on placeholder folders (demo-ckpt, demo-data)",
        "tests/test_pack_data.py runs examples/train.py with --data and --pack (one rank) and compares its losses "
        "with the run without --pack", _test_source_has("tests/test_pack_data.py", '"--pack"')),
    "make fixtures": NotRun(
        "it rewrites the committed goldens",
        "tests/test_goldens.py::test_goldens_regenerate runs fixtures/generate.py (the target's program) into a "
        "temporary folder and compares every file with the committed one",
        lambda line: (_recipe_is("fixtures", "$(BIN)/python fixtures/generate.py")(line),
                      _test_source_has("tests/test_goldens.py", '_generator().main(["--out", str(tmp_path)])')(line))),
    "torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:29500 -m ppmedia demo": NotRun(
        "HOST stands for the first node's address: it takes two machines (or two agents)",
        "tests/test_train_example.py::test_pipeline_across_two_torchrun_agents_matches_the_model runs two "
        "torchrun agents with these flags on 127.0.0.1 (the parity harness in place of the demo)",
        _test_source_has("tests/test_train_example.py", '"--nnodes", "2", "--nproc-per-node", "1", '
                         '"--rdzv-backend", "c10d"')),
    "torchrun --standalone --nproc-per-node 4 step.py": NotRun(
        "4 processes, and the page's output block is the one-process run's (the page states what the 4 print)",
        "`python step.py` runs here, its output compared; pp x dp = 2 x 2 with the same calls (shard_batch, "
        "all_reduce_gradients, clip_grad_norm) is examples/train.py's (through core/pipeline/step.py), which "
        "tests/test_fsdp_dcp.py runs on 4 processes",
        lambda line: (_torchrun_parses(line), _test_source_has("core/pipeline/step.py", "shard_batch", "all_reduce_gradients",
                                                              "clip_grad_norm")("python examples/train.py"))),
    command_key("torchrun --standalone --nproc-per-node 4 examples/train.py --model demo-ckpt --data demo-data/train.jsonl "
                "--pp 2 --dp 2 --fsdp --batch-size 8 --max-length 512 --epochs 3 --lr 2e-5 --weight-decay 0.01 "
                "--warmup-steps 10 --lr-schedule cosine --freeze vision --activation-checkpointing "
                "--save-dir runs --save-every 50 --loss-log loss.jsonl --export trained"): NotRun(
        "it shows every flag on placeholder folders (demo-ckpt, demo-data) and 3 epochs on 4 processes",
        "tests/test_train_data.py runs the README's data lines as "
        "written (checkpoint, data file, export) and --data runs at pp2 x dp2 with FSDP2",
        _test_source_has("tests/test_train_data.py", "--data")),
    "python -m ppmedia.testing.parity llava_next --scenario ZBVZeroBubble/static/dp2 --world-size 4 --steps 1": NotRun(
        "4 processes for a scenario the shared 4-process spawn runs already (the page's first line runs the "
        "module's command line as written)",
        "tests/test_stack_mp.py's pp2 x dp2 spawn runs llava_next ZBVZeroBubble/static/dp2 through the same "
        "harness (run_parity), 2 steps, and asserts loss and gradients within 1e-5",
        _parity_line_covered("llava_next", "ZBVZeroBubble/static/dp2", "tests/test_stack_mp.py")),
    "torchrun --standalone --nproc-per-node 2 -m ppmedia.testing.parity qwen2_5_vl --scenario gpipe --steps 1": NotRun(
        "the module under torchrun's rendezvous runs already, as two agents",
        "tests/test_train_example.py runs `-m ppmedia.testing.parity qwen2_5_vl` under two torchrun agents "
        "(the workers are torchrun's, as here) and checks its parity line; qwen2_5_vl's gpipe parity runs in "
        "tests/test_pipeline_mp.py's shared spawn",
        _test_source_has("tests/test_train_example.py", '"-m", "ppmedia.testing.parity", "qwen2_5_vl"')),
    "ppmedia demo --family llava_next --schedule DualPipeV --steps 1": _CLI_DEMO,
    **{command_key(line): NotRun(
        "run once already: tests/test_train_data.py runs the page's lines as written, in the README run's folder",
        "test_ppmedia_train_from_the_demo_recipe_repeats_the_readme_run: its losses equal the README's torchrun "
        "examples/train.py run's, TensorBoard's train/loss equals the JSON log, the last step's checkpoint, the plot",
        _run_as_written_by("test_train_data", "documented_train_command_lines")) for line in [
        "ppmedia train recipes/demo.yaml --steps 5", "ppmedia plot demo-loss.jsonl --out loss.png"]},
    command_key("ppmedia train recipes/qwen2_5_vl_7b.yaml --model /path/to/Qwen2.5-VL-7B-Instruct --dry-run"): NotRun(
        "it points at a placeholder folder: the checkpoint is not here",
        "tests/test_train_command.py runs --dry-run on every recipe with a config-only folder shaped as the checkpoint",
        _test_source_has("tests/test_train_command.py", '"--dry-run"')),
    **{command_key(line): _QUICK_START for line in [
        "python -m ppmedia.testing.datasets demo-ckpt demo-data",
        "torchrun --standalone --nproc-per-node 2 examples/train.py --model demo-ckpt --data demo-data/train.jsonl "
        "--batch-size 4 --max-length 64 --epochs 2 --save-dir runs --save-every 4 --loss-log loss.jsonl --export trained",
        "python -c \"import transformers as t; print(t.AutoModelForImageTextToText.from_pretrained('trained').dtype)\""]},
    **{command_key(line): NotRun(
        "run once already: tests/test_lora_mp.py runs docs/lora.md's lines as written and checks them",
        "test_the_pages_lines_train_and_export_an_adapter_peft_loads: the run trains at pp2 with --lora-rank 8 and "
        "PeftModel.from_pretrained loads its adapter with both stages' layers",
        _run_as_written_by("test_lora_mp", "lines")) for line in [
        "torchrun --standalone --nproc-per-node 2 examples/train.py --model demo-ckpt --data demo-data/train.jsonl "
        "--pp 2 --batch-size 4 --max-length 64 --steps 2 --lora-rank 8 --export out",
        "python -c \"import peft, transformers as t; m = peft.PeftModel.from_pretrained("
        "t.AutoModelForImageTextToText.from_pretrained('demo-ckpt'), 'out'); c = m.peft_config['default']; "
        "print(len(c.target_modules), ','.join(sorted({n.split('.layers.')[1].split('.')[0] for n in c.target_modules})))\""]},
    "python tests/bench/run.py --lora-memory": _BENCH,
    "python tests/bench/run.py --cp-memory": _BENCH,
    **{command_key(line): _SPREAD_RUN for line in [
        "torchrun --standalone --nproc-per-node 2 examples/train.py --family qwen2_5_vl --pp 2 --schedule ZBVZeroBubble "
        "--microbatches 4 --steps 2 --encoder spread --trace step.svg --loss-log loss.jsonl"]},
    **{command_key(line): NotRun(
        "run once already: tests/test_tensor_parallel.py runs the page's two lines as written and checks them",
        "test_train_with_tp_gives_the_losses_of_the_model_and_its_checkpoint_resumes_at_pp2_dp2_fsdp: every "
        "step's loss and gradient norm against the model's own run, the checkpoint resumed at pp2 x dp2 with FSDP2",
        _run_as_written_by("test_tensor_parallel", "documented_tp_lines")) for line in [
        "torchrun --standalone --nproc-per-node 4 examples/train.py --family qwen2_5_vl --pp 2 --tp 2 --steps 2 "
        "--loss-log tp.jsonl --save-dir ckpt --save-every 1 --export tp-export",
        "torchrun --standalone --nproc-per-node 4 examples/train.py --family qwen2_5_vl --pp 2 --dp 2 --fsdp --steps 2 "
        "--resume ckpt/step1 --loss-log fsdp.jsonl --export fsdp-export"]},
    **{command_key(line): NotRun(
        "run once already: tests/test_expert_parallel_mp.py runs the page's three lines as written and checks them",
        "test_train_with_ep_gives_the_models_losses_resumes_without_ep_and_exports: every step's loss and gradient "
        "norm against the model's own AdamW run, the checkpoint resumed without --ep, the export reloaded",
        _run_as_written_by("test_expert_parallel_mp", "documented_ep_lines")) for line in [
        "python -m ppmedia.testing.datasets moe-ckpt moe-data --family ppmedia.testing.tiny_models.qwen3_vl_moe --samples 8",
        "torchrun --standalone --nproc-per-node 4 examples/train.py --model moe-ckpt --data moe-data/train.jsonl --pp 2 "
        "--dp 2 --ep 2 --batch-size 4 --max-length 64 --steps 2 --no-shuffle --save-dir ckpt --save-every 1 "
        "--loss-log ep.jsonl --export ep-export",
        "torchrun --standalone --nproc-per-node 4 examples/train.py --model moe-ckpt --data moe-data/train.jsonl --pp 2 "
        "--dp 2 --batch-size 4 --max-length 64 --steps 2 --no-shuffle --resume ckpt/step1 --loss-log plain.jsonl"]},
    **{command_key(line): NotRun(
        "it shows the flags on placeholder folders (demo-ckpt, demo-data)",
        "tests/test_composition_mp.py runs examples/train.py's loop at --pp 2 --tp 2 --pack on a checkpoint and a "
        "data file (the model's own losses within 1e-5) and resumes its checkpoint at --pp 2 --dp 2 --fsdp",
        _test_source_has("tests/test_composition_mp.py", '"--pp", "2", "--tp", "2", "--pack"')) for line in [
        "torchrun --standalone --nproc-per-node 4 examples/train.py --model demo-ckpt --data demo-data/train.jsonl "
        "--pp 2 --tp 2 --pack --batch-size 4 --max-length 256 --steps 4 --save-dir tpckpt --save-every 2",
        "torchrun --standalone --nproc-per-node 4 examples/train.py --model demo-ckpt --data demo-data/train.jsonl "
        "--pp 2 --dp 2 --fsdp --batch-size 4 --max-length 256 --steps 4 --resume tpckpt/step2"]},
    **{command_key(line): _FSDP_DCP for line in [
        "torchrun --standalone --nproc-per-node 4 examples/train.py --family qwen2_5_vl --pp 2 --dp 2 --fsdp "
        "--steps 6 --save-dir ckpt --save-every 2 --eval-every 2 --loss-log straight.jsonl",
        "torchrun --standalone --nproc-per-node 2 examples/train.py --family qwen2_5_vl --pp 1 --dp 2 --fsdp "
        "--steps 6 --resume ckpt/step2 --eval-every 2 --loss-log pp1xdp2.jsonl",
        "torchrun --standalone --nproc-per-node 2 examples/train.py --family qwen2_5_vl --pp 2 --dp 1 "
        "--steps 6 --resume ckpt/step4 --eval-every 2 --loss-log pp2xdp1.jsonl"]},
}


def check_not_run(where: str, line: str) -> bool:
    """True for a NOT_RUN line (its check done instead), False for a line to run."""
    entry = NOT_RUN.get(command_key(line))
    if entry is None:
        return False
    try:
        entry.check(line)
    except AssertionError as exc:
        raise AssertionError(f"{where}: {line}\n  (not run here: {entry.why}) {exc}") from exc
    return True


def check_shell(block: Block, folder: pathlib.Path) -> None:
    """Every line of an ``sh`` / ``bash`` block, in order, in one sandbox (NOT_RUN lines checked instead)."""
    lines = command_lines(block)
    assert lines, f"{block.where}: an empty {block.lang} block"
    run_lines(block.where, [line for line in lines if not check_not_run(block.where, line)], folder)


# ------------------------------------------------------------------------------------ python files
#: an inline ``python NAME.py`` / ``torchrun ... NAME.py`` in the paragraph above a python block
_RUN_AS = re.compile(r"`((?:python3?|torchrun)(?:\s[^`]*?)?\s([\w-]+\.py))`")
_SAVE_AS = re.compile(r"\bsave (?:it|this|the block) as `([^`]+)`", flags=re.I)


def script_commands(block: Block) -> tuple[str, list[str]] | None:
    """``(NAME.py, commands)`` when the paragraph above the block has the user run it as a file, else None."""
    intro = re.sub(r"\s+", " ", block.intro)
    runs = _RUN_AS.findall(intro)
    saved = _SAVE_AS.findall(intro)
    if not runs:
        assert not saved, f"{block.where}: the page says to save the block as {saved[0]} but shows no command running it"
        return None
    names = sorted({name for _, name in runs})
    assert len(names) == 1, f"{block.where}: the paragraph above runs {names}: one file per block"
    assert saved in ([], names), f"{block.where}: the page saves the block as {saved[0]} but runs {names[0]}"
    return names[0], [command for command, _ in runs]


def run_script(block: Block, name: str, commands: list[str], folder: pathlib.Path) -> None:
    """Save the block as ``name`` in the sandbox and run it with each command the page shows (clean
    environment: no torchrun variables); what it prints must be its ``output`` block, exactly."""
    (folder / name).write_text(block.text)
    for command in commands:
        if check_not_run(block.where, command):
            continue
        result = run_command(command, folder)
        if result.returncode != 0:
            raise AssertionError(_failure(f"{block.where} (saved as {name})", command, result))
        if block.output is not None and result.stdout != block.output.text:
            raise AssertionError(f"{block.where}: {command} printed\n{result.stdout}but its output block "
                                 f"({block.output.where}) shows\n{block.output.text}")


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
    """Where blocks, command lines and transcripts run: a folder that looks like the repository root (its
    folders linked in, so ``fixtures/...`` resolves, its files copied, ``.venv`` the running one) and keeps what a block writes
    (checkpoints, ...), with the two bad batch files docs/cli.md shows the errors for."""
    for entry in ROOT.iterdir():
        if entry.name.startswith(".") or entry.name.endswith(".egg-info"):
            continue
        if entry.is_dir():
            (folder / entry.name).symlink_to(entry)
        else:  # a copy: a command writing plan.svg there must not write the repository's
            shutil.copy(entry, folder / entry.name)
    (folder / ".venv").symlink_to(sys.prefix)  # `.venv/bin/python ...` lines
    (folder / "notes.pt").write_text("hello world\n")
    torch.save({"input_ids": torch.zeros(2, 3, dtype=torch.int64), "f": fractions.Fraction(1, 3)}, folder / "untrusted.pt")
    return folder


def run_transcript(block: Block, folder: pathlib.Path) -> None:
    """Each ``$ `` command in ``folder``, printing exactly the lines after it: ``ppmedia`` in this process
    (as a plain script: no torchrun variables), another program as a user's shell runs it (exit 0)."""
    for command, expected in transcript(block):
        argv = shlex.split(command)
        if argv[:3] in (["python", "-m", "ppmedia"], ["python3", "-m", "ppmedia"]):
            argv = ["ppmedia", *argv[3:]]
        if argv[0] != "ppmedia":
            if check_not_run(block.where, command):
                continue
            (result,) = run_lines(f"{block.where}: $", [command], folder)
            printed = result.stdout + result.stderr
        else:
            out, err = io.StringIO(), io.StringIO()
            with as_a_script(folder), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(argv[1:])
            printed = out.getvalue() + err.getvalue()
        if printed != expected:
            raise AssertionError(f"{block.where}: $ {command}\nprints\n{printed}but the page shows\n{expected}")
        if argv[0] == "ppmedia":
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
        script = script_commands(block)
        if script is None:
            run_python(block, folder)
        else:
            run_script(block, *script, folder)
    elif block.lang in SHELL:
        check_shell(block, folder)
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


def _runs_programs(block: Block) -> bool:
    return block.lang in SHELL or (block.lang == "python" and block.file is None and script_commands(block) is not None)


@pytest.mark.parametrize("block", [pytest.param(b, marks=[pytest.mark.multiprocess] if _runs_programs(b) else [])
                                   for b in ALL_BLOCKS], ids=[f"{b.where}-{b.lang or 'untagged'}" for b in ALL_BLOCKS])
def test_code_block(block, tmp_path):
    check_block(block, sandbox(tmp_path))


def test_every_not_run_command_is_on_a_page():
    shown = {command_key(line) for b in ALL_BLOCKS if b.lang in SHELL for line in command_lines(b)}
    shown |= {command_key(command) for b in ALL_BLOCKS if b.lang == "console" for command, _ in transcript(b)}
    shown |= {command_key(command) for b in ALL_BLOCKS if b.lang == "python" and b.file is None
              for command in (script_commands(b) or ("", []))[1]}
    assert sorted(set(NOT_RUN) - shown) == [], "NOT_RUN lists commands no page shows any more"


def test_a_command_shown_on_two_pages_runs_once(tmp_path):
    log = tmp_path / "log"
    first, again, more = (tmp_path / name for name in ("first", "again", "more"))
    for folder in (first, again, more):
        folder.mkdir()
    lines = [f"echo ran >> {log}", "touch made"]
    run_lines("a.md:1", lines, first)
    run_lines("b.md:9", lines, again)  # the same lines from a fresh folder: their results are reused
    assert log.read_text() == "ran\n" and not (again / "made").exists()
    run_lines("c.md:5", [*lines, "test -f made"], more)  # a new line after them: they run there first
    assert log.read_text() == "ran\nran\n"
    with pytest.raises(AssertionError, match=r"d.md:2: test -f made\n  exited 1"):
        run_lines("d.md:2", ["test -f made"], first.parent)


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
    for call in ("presplit_batch", "schedule.step(**inputs.step_kwargs()", "make_pipeline_stages", "build_schedule"):
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
    from ppmedia.pipeline.schedules import schedule_choices

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
python -c "import sys; sys.exit(3)"
```

Save it as `step.py` and run `python step.py`, as a user would: no torchrun, no RANK.

```python
import torch.distributed as dist
dist.init_process_group("gloo")
```

Save it as `forgotten.py`.

```python
print("a file the page never runs")
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
$ python -c "print('two')"
three
```

```bash
export GREETING=hello
cd docs
test "$GREETING" = hello && test -f index.md && test -z "$RANK$MASTER_PORT"
no-such-program --version
```

See [the API](api.md#no-such-heading), [nothing](no-such-page.md) and `ppmedia.no_such_name`.

### `split_media(batch, n)`

| adapter | model types | layout |
|---|---|---|
| `llava_next` | `llava_next`, `llava_onevision` | a wrong model type |
| `no_such_family` | `x` | unknown here: not checked on a page that lists some families |
'''


def test_planted_errors_are_reported(tmp_path, monkeypatch):
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                        "TORCHELASTIC_RUN_ID": "x"}.items():
        monkeypatch.setenv(name, value)  # as if pytest ran under torchrun: a page's commands must not see them
    page = tmp_path / "planted.md"
    page.write_text(PLANTED)
    blocks = read_blocks(page)
    (tmp_path / "run").mkdir()
    folder = sandbox(tmp_path / "run")
    expected = [
        None,  # the first python block prints what its output block shows: no error
        "printed\ntwo microbatches\nbut its output block",
        "the python block raised RuntimeError",
        'python -c "import sys; sys.exit(3)"\n  exited 3 (run in a clean environment',
        "environment variable RANK expected, but not set",  # saved as step.py, run as python step.py
        "the page says to save the block as forgotten.py but shows no command running it",
        "make deploy\n  exited 2",
        "but the page shows\nppmedia: error: argument --microbatches: got 0; expected a positive integer",
        "the block is not tests/plugin/tests/test_llava_plugin.py as it is",
        "an untagged block with command lines",
        "an output block must follow a python block",
        "prints\ntwo\nbut the page shows\nthree",
        "no-such-program --version\n  exited 127",  # after the lines before it ran (cd, export) in its shell
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
        "assert 'RANK' not in os.environ and 'MASTER_PORT' not in os.environ  # as under plain python\n"
        "ppmedia.pipeline.init_distributed('gloo')\nos.environ['PPMEDIA_PLUGINS'] = 'no.such.module'\n"
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

