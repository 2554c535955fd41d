"""The decoder layers' split over the stages, refused before anything is built (issue 40).

Issue 29 made "more stages than layers" a named error; a later change (``examples/train.py`` moved to
``stage_adamw``) lost it: the issue's command ended in torch's bare "optimizer got an empty parameter
list" on rank 1 and a gloo "Connection reset" on rank 2. Now the split is checked from the options
alone (the tiny family's config, or ``--model``'s ``config.json``: nothing built) on every rank, and by
the stage cutter itself. One torchrun run of the issue's exact command; the rest in this process
(``parse_args`` of the command a user types: the refusals come before the process group).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

from ppmedia import pipeline
from ppmedia.testing import tiny_models
from train_helpers import train_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
TORCHRUN = pathlib.Path(sys.executable).with_name("torchrun")
ISSUE_COMMAND = ["--standalone", "--nproc-per-node", "3", "examples/train.py", "--family", "qwen2_5_vl", "--pp", "3",
                 "--schedule", "interleaved", "--microbatches", "6", "--steps", "1"]
ISSUE_LINE = ("train.py: error: --pp 3 with --schedule interleaved (2 stages per rank): 6 pipeline stages for the 2 "
              "decoder layers of the tiny qwen2_5_vl model; expected at most 4 (one per layer besides the first and "
              "the last stage): stages 3, 4 would hold nothing to run; give --pp 2 or less (or a schedule with one "
              "stage per rank)")
BARE = ("optimizer got an empty parameter list", "Connection reset", "Traceback (most recent call last)\n  File",
        "failed: ")


def test_the_issues_command_refuses_before_anything_is_built_on_every_rank():
    """Failed before the fix: rank 1 ``step None failed: ValueError: optimizer got an empty parameter
    list``, rank 2 a gloo "Connection reset by peer"."""
    run = subprocess.run([str(TORCHRUN), *ISSUE_COMMAND], cwd=ROOT, capture_output=True, text=True, timeout=240)
    printed = run.stdout + run.stderr
    assert run.returncode != 0 and "exitcode: 2" in printed, printed[-3000:]
    assert ISSUE_LINE in printed, printed[-3000:]
    worker_lines = [line for line in printed.splitlines() if not line.startswith(("W", "E", "I", " ", "[", "*"))]
    assert not any(bare in printed for bare in BARE[:2]), printed[-3000:]
    assert not any("failed: " in line for line in worker_lines), worker_lines  # no rank got as far as a step


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        train_script().parse_args(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("train.py: error: ") or "error: " in last, err
    return last.split("error: ", 1)[1]


@pytest.mark.parametrize("argv, says", [
    (ISSUE_COMMAND[4:], ISSUE_LINE.removeprefix("train.py: error: ")),
    (["--pp", "5"], "--pp 5: 5 pipeline stages for the 2 decoder layers of the tiny qwen2_5_vl model; expected at "
                    "most 4 (one per layer besides the first and the last stage): stage 3 would hold nothing to run; "
                    "give --pp 4 or less"),
    (["--family", "gemma4", "--pp", "4", "--schedule", "ZBVZeroBubble"],
     "--pp 4 with --schedule ZBVZeroBubble (2 stages per rank): 8 pipeline stages for the 4 decoder layers of the tiny "
     "gemma4 model; expected at most 6"),
    (["--pp", "3", "--layers-per-stage", "1,0,1"],
     "--layers-per-stage: got 1,0,1: stage 1 of 3 would hold nothing to run (the 2 decoder layers of the tiny "
     "qwen2_5_vl model; only the first and the last stage may get 0)"),
    (["--pp", "2", "--layers-per-stage", "1,1,1"],
     "--layers-per-stage: got 1,1,1 for 2 pipeline stages (--pp 2); expected 2 counts >= 0 summing to 2 (the 2 "
     "decoder layers of the tiny qwen2_5_vl model)"),
    (["--pp", "2", "--schedule", "interleaved", "--layers-per-stage", "1,1"],
     "--layers-per-stage: got 1,1 for 4 pipeline stages (--pp 2 with --schedule interleaved (2 stages per rank)); "
     "expected 4 counts"),
    (["--pp", "2", "--layers-per-stage", "2,1"], "--layers-per-stage: got 2,1 for 2 pipeline stages (--pp 2); "
                                                 "expected 2 counts >= 0 summing to 2"),
])
def test_a_split_leaving_a_stage_empty_or_summing_wrong_is_one_line_exit_2(argv, says, capsys):
    assert _refused(argv, capsys).startswith(says)


@pytest.mark.parametrize("argv", [["--pp", "4"], ["--pp", "2", "--schedule", "interleaved"],
                                  ["--pp", "3", "--layers-per-stage", "0,2,0"], ["--pp", "1", "--layers-per-stage", "2"]])
def test_splits_whose_every_stage_holds_something_are_accepted(argv):
    train_script().parse_args(argv)  # 4 stages over 2 layers: [0, 1, 1, 0] (stage 0 embeds, stage 3 has the head)


@pytest.fixture(scope="module")
def qwen_config_dir(tmp_path_factory):
    """A ``--model`` folder holding only the tiny Qwen2.5-VL's config.json (2 decoder layers): the
    checks read it, nothing is loaded."""
    folder = tmp_path_factory.mktemp("hf")
    tiny_models.load("qwen2_5_vl").build_config().save_pretrained(folder)
    (folder / "train.jsonl").write_text("")
    return folder


def test_model_config_json_gives_the_layer_count(qwen_config_dir, capsys):
    argv = ["--model", str(qwen_config_dir), "--data", str(qwen_config_dir / "train.jsonl"), "--steps", "1"]
    says = _refused([*argv, "--pp", "6"], capsys)
    assert says.startswith(f"--pp 6: 6 pipeline stages for the 2 decoder layers of --model {qwen_config_dir}; "
                           f"expected at most 4"), says
    train_script().parse_args([*argv, "--pp", "4"])


@pytest.mark.parametrize("edit, says", [
    ({"model_type": "llava_next", "architectures": ["Qwen2_5_VLForConditionalGeneration"]}, "config.json: model_type 'llava_next' contradicts architectures"),
    ({"text_config": {"output_router_logits": True}}, "config.text_config.output_router_logits is True"),
])
def test_a_models_config_refused_by_the_loader_is_refused_before_anything_starts(qwen_config_dir, tmp_path, edit,
                                                                                 says, capsys):
    """Issue 29's relabelled model_type and MoE router loss through the training command: refused by
    the options (exit 2, every rank alike), not by each rank's loader after the process group."""
    config = json.loads((qwen_config_dir / "config.json").read_text())
    for key, value in edit.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = ["--model", str(tmp_path), "--data", str(qwen_config_dir / "train.jsonl"), "--steps", "1"]
    refused = _refused(argv, capsys)
    assert refused.startswith(f"--model {tmp_path}: ") and says in refused, refused


def test_the_cutter_refuses_before_cutting_and_the_planner_never_recommends_an_empty_stage():
    model = tiny_models.load("qwen2_5_vl").build_model(0)
    with pytest.raises(ValueError, match=r"^layers_per_stage: got 1,0,1: stage 1 of 3 would hold nothing to run"):
        pipeline.build_stage_modules(model, 3, layers_per_stage=[1, 0, 1])
    with pytest.raises(ValueError, match=r"^n_stages: 6 pipeline stages for the 2 decoder layers of the model; "
                                         r"expected at most 4"):
        pipeline.build_stage_modules(model, 6)
    assert [m.num_layers for m in pipeline.build_stage_modules(model, 4)] == [0, 1, 1, 0]
    assert pipeline.layer_split_problem(5, 4, [0, 1, 1, 1, 1]) is None
    assert pipeline.layer_split_problem(5, 4, [1, 1, 0, 1, 1]) is not None
    from ppmedia.planning.stepmodel import OpCosts, best_layer_split

    costs = OpCosts(layer_forward=1.0, vision_forward=6.0)
    best = best_layer_split("1f1b", costs, [1.0] * 4, n_ranks=3, num_layers=2)
    assert pipeline.layer_split_problem(3, 2, best.layers_per_stage) is None, best.layers_per_stage
    with pytest.raises(ValueError, match="5 pipeline stages for the 2 decoder layers"):
        best_layer_split("1f1b", costs, [1.0] * 4, n_ranks=5, num_layers=2)
