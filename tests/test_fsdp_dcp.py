"""FSDP2 + DCP through examples/train.py in real processes, the faults, and docs/fsdp-dcp.md's code.

* docs/fsdp-dcp.md's commands, run as written (from a scratch folder): train at pp=2 x dp=2 with FSDP2
  (its losses and held-out evaluation losses are the single-process model's within 1e-5), then resume
  its checkpoints at pp=1 x dp=2 (FSDP2) and pp=2 x dp=1 (replicated): the uninterrupted losses
  within 1e-5. The page's Python block runs too.
* A rank SIGKILLed mid-step: the others exit 1 within the process-group timeout naming the failure;
  ``--resume auto`` (pp=2 x dp=2, FSDP2) skips planted incomplete saves and continues the uninterrupted
  losses within 1e-5.
* A process SIGKILLed while saving leaves the previous checkpoint the newest complete one; a checkpoint
  of another family is refused with the names before anything is overwritten.

The parity of FSDP2 stages with the model (every schedule, gradients gathered) rides in
tests/test_stack_mp.py's 4-process spawn.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import ppmedia.testing.tiny_models as tiny
from ppmedia import pipeline
from train_helpers import model_adamw_run, train_py_groups

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "fsdp-dcp.md"
TORCHRUN = pathlib.Path(sys.executable).with_name("torchrun")
TRAIN = ROOT / "examples" / "train.py"
TOL = 1e-5
STEPS = 6
HELD_OUT_SEED = 1000  # examples/train.py's held-out batch
PG_TIMEOUT_S = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    return env


def _rows(path: pathlib.Path) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, path.read_text().splitlines())}


def _doc_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOCS.read_text(), flags=re.S)


def _doc_commands() -> list[list[str]]:
    (block,) = _doc_blocks("bash")
    return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


_REFERENCE: dict[str, dict[int, float]] = {}


def _reference() -> dict[str, dict[int, float]]:
    """The model itself, one process, full batches: AdamW(1e-3) after clipping to norm 1 (as train.py),
    and the held-out batch's loss at the weights each step trains from."""
    if not _REFERENCE:
        own = model_adamw_run("qwen2_5_vl", [step % 2 for step in range(STEPS)], clip=1.0, groups=train_py_groups,
                              held_out=HELD_OUT_SEED)
        _REFERENCE.update(train=dict(enumerate(own.losses)), eval=dict(enumerate(own.evals)))
    return _REFERENCE


@pytest.fixture(scope="module")
def docs_runs(tmp_path_factory):
    """docs/fsdp-dcp.md's three commands, run as written in a scratch folder (examples/ linked in)."""
    work = tmp_path_factory.mktemp("fsdp-docs")
    (work / "examples").symlink_to(ROOT / "examples")
    for argv in _doc_commands():
        assert argv[0] == "torchrun" and "examples/train.py" in argv, argv
        result = subprocess.run([str(TORCHRUN), *argv[1:]], cwd=work, env=_env(), capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return work


@pytest.mark.multiprocess
def test_fsdp_training_and_evaluation_match_the_model(docs_runs):
    straight = _rows(docs_runs / "straight.jsonl")
    reference = _reference()
    assert sorted(straight) == list(range(STEPS))
    for step, row in straight.items():
        assert abs(row["loss"] - reference["train"][step]) <= TOL, (step, row, reference["train"][step])
        assert row["grad_norm"] > 0
    evaluated = {s: row["eval_loss"] for s, row in straight.items() if "eval_loss" in row}
    assert sorted(evaluated) == [0, 2, 4]  # --eval-every 2
    for step, loss in evaluated.items():
        assert abs(loss - reference["eval"][step]) <= TOL, (step, loss, reference["eval"][step])
    assert evaluated[4] < evaluated[0]  # it trains
    assert sorted(p.name for p in (docs_runs / "ckpt").iterdir()) == ["step2", "step4", "step6"]
    files = sorted(p.name for p in (docs_runs / "ckpt" / "step2").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "ppmedia.json"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("log, start", [("pp1xdp2.jsonl", 2), ("pp2xdp1.jsonl", 4)])
def test_a_checkpoint_resumes_on_another_layout_with_the_same_losses(docs_runs, log, start):
    straight, resumed = _rows(docs_runs / "straight.jsonl"), _rows(docs_runs / log)
    assert sorted(resumed) == list(range(start, STEPS))
    for step, row in resumed.items():
        assert abs(row["loss"] - straight[step]["loss"]) <= TOL, (log, step, row, straight[step])
        assert abs(row["grad_norm"] - straight[step]["grad_norm"]) <= 1e-4 * straight[step]["grad_norm"]
        if "eval_loss" in row:
            assert abs(row["eval_loss"] - straight[step]["eval_loss"]) <= TOL


def test_the_docs_python_block_runs():
    (block,) = _doc_blocks("python")
    result = subprocess.run([sys.executable, "-c", block], env=_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert re.search(r"loss 4\.86\d+, grad norm [\d.]+, eval loss [\d.]+", result.stdout), result.stdout


# ------------------------------------------------------------------------------------------- faults
def _launch_ranks(args: list[str], out: pathlib.Path, world: int = 4) -> list[subprocess.Popen]:
    """``world`` train.py processes with environment rendezvous (what torchrun would set), each with
    its own stdout/stderr files, so every rank's exit status and message can be seen."""
    port = str(_free_port())
    procs = []
    for rank in range(world):
        env = dict(_env(), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port)
        with open(out / f"out{rank}.txt", "w") as stdout, open(out / f"err{rank}.txt", "w") as stderr:
            procs.append(subprocess.Popen([sys.executable, str(TRAIN), *args], cwd=ROOT, env=env, stdout=stdout,
                                          stderr=stderr))
    return procs


def _wait_for_step(log: pathlib.Path, step: int, procs: list[subprocess.Popen], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and f'"step": {step},' in log.read_text():
            return
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a rank exited before step {step}: {[p.poll() for p in procs]}")
        time.sleep(0.05)
    raise AssertionError(f"step {step} was not logged within {timeout} s")


@pytest.mark.multiprocess
def test_a_rank_killed_mid_step_fails_the_others_then_resume_auto_continues(docs_runs, tmp_path):
    save, log = tmp_path / "ckpt", tmp_path / "killed.jsonl"
    args = ["--family", "qwen2_5_vl", "--pp", "2", "--dp", "2", "--fsdp", "--steps", str(STEPS),
            "--save-dir", str(save), "--save-every", "2"]
    procs = _launch_ranks([*args, "--loss-log", str(log)], tmp_path)
    try:
        _wait_for_step(log, 2, procs)  # step 2 is done everywhere (its loss was all-reduced); step 3 runs
        os.kill(procs[3].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        codes = [p.wait(timeout=PG_TIMEOUT_S + 30) for p in procs]
        waited = time.monotonic() - killed_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes[3] == -signal.SIGKILL
    assert codes[:3] == [1, 1, 1], codes
    assert waited < PG_TIMEOUT_S, f"the other ranks took {waited:.1f} s to fail"
    # one line from the first rank to report (the store decides; a rank that cannot reach it, rank 0's
    # store gone with it, speaks too), each naming the step and where its traceback went
    lines = [line for rank in range(3) for line in (tmp_path / f"err{rank}.txt").read_text().splitlines()
             if line.startswith("train.py")]
    assert 1 <= len(lines) <= 3, lines
    for line in lines:
        found = re.match(r"train\.py: step \d+: RuntimeError: .*(peer|Connection).* \(rank \d; traceback: (\S+)\)$", line)
        assert found and pathlib.Path(found[2]).is_file(), line
    assert pipeline.latest_checkpoint(save) == save / "step2"

    # incomplete saves the resume must skip: an unpublished copy, and a folder without DCP's metadata
    (save / "step8.partial").mkdir()
    for f in (save / "step2").iterdir():
        (save / "step8.partial" / f.name).write_bytes(f.read_bytes())
    (save / "step9").mkdir()
    (save / "step9" / "__0_0.distcp").write_bytes((save / "step2" / "__0_0.distcp").read_bytes())
    resumed_log = tmp_path / "resumed.jsonl"
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "4", str(TRAIN), *args, "--resume", "auto",
           "--loss-log", str(resumed_log)]
    result = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert f"resumed from {save / 'step2'}" in result.stdout
    straight, resumed = _rows(docs_runs / "straight.jsonl"), _rows(resumed_log)
    assert sorted(resumed) == list(range(2, STEPS))
    for step, row in resumed.items():
        assert abs(row["loss"] - straight[step]["loss"]) <= TOL, (step, row, straight[step])


_SAVE_KILL_AND_REFUSE = r'''
import json, os, signal, sys
import torch
import ppmedia.testing.tiny_models as tiny
from ppmedia import pipeline
from ppmedia.pipeline import checkpoint

torch.set_num_threads(1)
save_dir = sys.argv[1]


def build(family):
    modules = pipeline.build_stage_modules(tiny.load(family).build_model(0), 1)
    return modules, pipeline.stage_optimizers(modules, lambda p: torch.optim.AdamW(p, lr=1e-3))


modules, optimizers = build("qwen2_5_vl")
for p in modules[0].parameters():
    p.grad = torch.ones_like(p)
optimizers[0].step()
step1 = pipeline.save_checkpoint(save_dir, 1, modules, optimizers)

other, other_optimizers = build("llava_next")  # another family: refused, nothing overwritten
before = {k: v.clone() for k, v in other[0].state_dict().items()}
try:
    pipeline.load_checkpoint(step1, other, other_optimizers)
    print("LOADED")
except ValueError as exc:
    print("REFUSED " + json.dumps(str(exc)))
print("UNCHANGED " + json.dumps(all(torch.equal(before[k], v) for k, v in other[0].state_dict().items())))


def killed(partial, final):  # DCP has written every file of the step; the rename has not happened
    print("KILLED " + json.dumps(sorted(p.name for p in partial.iterdir())), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


checkpoint._publish = killed
pipeline.save_checkpoint(save_dir, 2, modules, optimizers)
print("NOT REACHED")
'''


def test_a_save_killed_half_way_and_a_checkpoint_of_another_family(tmp_path):
    save = tmp_path / "ckpt"
    result = subprocess.run([sys.executable, "-c", _SAVE_KILL_AND_REFUSE, str(save)], env=_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    lines = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines()
             if line.split(" ", 1)[0] in {"REFUSED", "UNCHANGED", "KILLED"}}
    refused = lines["REFUSED"]
    assert "saved from a 'qwen2_5_vl' model, these stages are 'llava_next'" in refused
    assert "44 names these stages need that the checkpoint lacks: model.image_newline, model.multi_modal_projector" in refused
    assert "36 names in the checkpoint that this model lacks: model.language_model.layers.0.self_attn.k_proj.bias" in refused
    assert "model.visual.blocks.0.attn.proj.bias" in refused
    assert lines["UNCHANGED"] is True
    assert ".metadata" in lines["KILLED"] and "ppmedia.json" in lines["KILLED"]  # complete but unpublished
    assert sorted(p.name for p in save.iterdir()) == ["step1", "step2.partial"]
    assert pipeline.latest_checkpoint(save) == save / "step1"


# ------------------------------------------------------------------------------- no processes
def _one_stage(family: str = "qwen2_5_vl", **config_changes):
    module = tiny.load(family)
    config = module.build_config()
    for key, value in config_changes.items():
        setattr(config.text_config, key, value)
    model = type(module.build_model(0))(config)
    modules = pipeline.build_stage_modules(model, 1)
    return modules, pipeline.stage_optimizers(modules, lambda p: torch.optim.SGD(p, lr=0.1))


def test_latest_checkpoint_takes_the_highest_complete_step(tmp_path):
    assert pipeline.latest_checkpoint(tmp_path / "missing") is None
    modules, optimizers = _one_stage()
    for step in (3, 10):
        pipeline.save_checkpoint(tmp_path, step, modules, optimizers)
    (tmp_path / "step20.partial").mkdir()
    (tmp_path / "step30").mkdir()  # no .metadata, no ppmedia.json
    (tmp_path / "step40").mkdir()
    (tmp_path / "step40" / ".metadata").write_bytes(b"")  # DCP's file but never published by ppmedia
    (tmp_path / "notes").mkdir()
    assert pipeline.latest_checkpoint(tmp_path) == tmp_path / "step10"
    with pytest.raises(ValueError, match=r"step30: not a complete ppmedia checkpoint \(holds \[\]\)"):
        pipeline.load_checkpoint(tmp_path / "step30", modules, optimizers)
    pipeline.save_checkpoint(tmp_path, 10, modules, optimizers)  # saving a step again replaces it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "step10", "step20.partial", "step3", "step30", "step40"]


def test_a_checkpoint_of_another_shape_or_optimizer_is_refused_with_the_names(tmp_path):
    modules, optimizers = _one_stage()
    path = pipeline.save_checkpoint(tmp_path, 1, modules, optimizers)
    wider, wider_optimizers = _one_stage(intermediate_size=96)
    with pytest.raises(ValueError) as err:
        pipeline.load_checkpoint(path, wider, wider_optimizers)
    message = str(err.value)
    assert "nothing was loaded" in message and "shapes that differ" in message
    assert "model.language_model.layers.0.mlp.down_proj.weight: saved [64, 128], here [64, 96]" in message
    adam = pipeline.stage_optimizers(modules, lambda p: torch.optim.AdamW(p))
    with pytest.raises(ValueError, match=r"\d+ optimizer entries the checkpoint lacks \(another optimizer.*: "
                                         r"param_groups\.lm_head\.weight\.amsgrad"):
        pipeline.check_checkpoint(path, modules, adam)
    assert pipeline.check_checkpoint(path, modules)["step"] == 1  # weights only: fine


def test_a_tied_parameter_saved_on_one_stage_resumes_on_two(tmp_path):
    """Kimi-K2.5 ties its embedding to lm_head: at pp=1 one parameter has both names; the optimizer
    state is saved under both, so the two stages of pp=2 each find theirs."""
    model = tiny.load("kimi_vl").build_model(0)
    whole = pipeline.build_stage_modules(model, 1)
    optimizers = pipeline.stage_optimizers(whole, lambda p: torch.optim.AdamW(p, lr=1e-2))
    for p in whole[0].parameters():
        p.grad = torch.full_like(p, 0.5)
    optimizers[0].step()
    path = pipeline.save_checkpoint(tmp_path, 1, whole, optimizers)
    split = pipeline.build_stage_modules(tiny.load("kimi_vl").build_model(1), 2)  # other weights
    split_optimizers = pipeline.stage_optimizers(split, lambda p: torch.optim.AdamW(p, lr=1e-2))
    pipeline.load_checkpoint(path, split, split_optimizers)
    saved = dict(whole[0].named_parameters(remove_duplicate=False))["lm_head.weight"]
    head = dict(split[1].named_parameters())["lm_head.weight"]
    embed = dict(split[0].named_parameters())["model.language_model.embed_tokens.weight"]
    assert torch.equal(head, saved) and torch.equal(embed, saved)
    for optimizer, param in ((split_optimizers[1], head), (split_optimizers[0], embed)):
        assert torch.equal(optimizer.state[param]["exp_avg"], optimizers[0].state[saved]["exp_avg"])


def test_fsdp_refusals_name_the_problem():
    import types

    modules = pipeline.build_stage_modules(tiny.load("qwen2_5_vl").build_model(0), 2)
    with pytest.raises(TypeError, match="mixed_precision is a str; expected None, a torch.dtype"):
        pipeline.apply_fsdp(modules, mesh=None, mixed_precision="bf16")
    with pytest.raises(TypeError, match="got Linear; expected PipelineStage objects or StageModules"):
        pipeline.apply_fsdp([torch.nn.Linear(2, 2)], mesh=None)

    # stand-ins: an action list as torch's split-backward schedules have (F, I, W); the refusal of real
    # FSDP2 stages (torch's own fully_shard, read from its state) is in tests/test_faults.py
    def action(kind):
        return types.SimpleNamespace(stage_index=0, microbatch_index=0, computation_type=types.SimpleNamespace(value=kind))

    zero_bubble = types.SimpleNamespace(pipeline_order={0: [action("F"), action("I"), action("W"), None]})
    full = types.SimpleNamespace(pipeline_order={0: [action("F"), action("B")]})
    assert pipeline.splits_backward(zero_bubble) and not pipeline.splits_backward(full)
    pipeline.check_fsdp_schedule(zero_bubble, modules)  # unsharded stages run every schedule
    assert not any(pipeline.reshards_after_forward(m) for m in modules)
