"""examples/train.py ``--profile DIR`` (issue 42): a torch profiler trace of a few steps, one JSON file
per rank that TensorBoard's profiler plugin and Perfetto load, with ppmedia's step phases and torch's
per-action schedule ranges in it. One rank in this process (the tiny stand-in model, pp 1)."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from datetime import timedelta

import pytest

from ppmedia import pipeline
from train_helpers import ROOT, train_script

pytestmark = pytest.mark.usefixtures("one_thread")


def test_profile_writes_a_trace_of_steps_that_parses(tmp_path):
    sys.path.insert(0, str(ROOT / "tests"))
    from test_docs import as_a_script

    script = train_script()
    folder = tmp_path / "prof"
    args = script.parse_args(["--pp", "1", "--dp", "1", "--steps", "3", "--profile", str(folder)])
    printed = io.StringIO()
    with as_a_script(), contextlib.redirect_stdout(printed):
        pipeline.init_distributed("gloo", timeout=timedelta(seconds=60))
        script.run(args, {"step": None})
    files = sorted(folder.glob("rank0.*.pt.trace.json"))
    assert len(files) == 1, list(folder.iterdir())
    events = json.loads(files[0].read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    for phase in ("ppmedia:data", "ppmedia:schedule", "ppmedia:optimizer", "ProfilerStep#2"):
        assert phase in names, sorted(n for n in names if n and "ppmedia" in n)
    assert {"PP:0F0", "PP:0F1", "PP:0B1"} <= names  # every stage call labelled: stage, kind, microbatch
    assert f"wrote the profiler trace of steps 2..2 to {folder}" in printed.getvalue()


def test_profile_into_an_existing_file_is_refused(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    with pytest.raises(SystemExit) as exit_:
        train_script().parse_args(["--profile", str(tmp_path / "f")])
    assert exit_.value.code == 2 and f"--profile {tmp_path / 'f'}: an existing file" in capsys.readouterr().err
