"""docs/checkpoints.md runs: its Python blocks execute as they are (the one-process flow checks itself;
the training-script functions are then called in a one-rank process group), and its shell lines are
the real command lines (``examples/train.py``'s parser takes the arguments; the Python one-liner
the dataset writer's too). tests/test_train_data.py runs the same command (the README's quick start)."""

from __future__ import annotations

import pathlib
import re
import shlex

import pytest
import torch
import transformers
from train_helpers import train_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "checkpoints.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", PAGE, flags=re.S)


def test_the_pages_python_blocks_run(tmp_path, world_of_one):
    one_process, training = _blocks("python")
    transformers.logging.set_verbosity_error()
    namespace: dict = {}
    exec(compile(one_process, "docs/checkpoints.md (one process)", "exec"), namespace)
    functions: dict = {}
    exec(compile(training, "docs/checkpoints.md (training script)", "exec"), functions)
    stages, tied = functions["build_stages"](namespace["path"], 0, 1, world_of_one, "cpu", torch.float32)
    assert [s.stage_index for s in stages] == [0] and tied == []
    functions["export"](stages, tmp_path, world_of_one)
    back = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path)
    want = namespace["model"].state_dict()
    assert all(torch.equal(t, want[k]) for k, t in back.state_dict().items())


def test_the_pages_command_lines_are_real():
    (block,) = _blocks("bash")
    writer, runner = [shlex.split(line) for line in block.strip().splitlines()]
    assert writer[:3] == [".venv/bin/python", "-m", "ppmedia.testing.datasets"]
    from ppmedia.testing import datasets

    with pytest.raises(SystemExit) as exit_info:  # its parser takes the arguments (--help: nothing written)
        datasets.main([*writer[3:], "--help"])
    assert exit_info.value.code == 0
    assert runner[0] == ".venv/bin/torchrun" and runner[4] == "examples/train.py"
    train = train_script()
    args = train.build_parser().parse_args(runner[5:])  # the paths exist once the first line ran
    assert (args.model, args.data, args.pp, args.export) == ("hf-tiny", "hf-data/train.jsonl", 2, "hf-trained")
