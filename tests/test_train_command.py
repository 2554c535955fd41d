"""``ppmedia train CONFIG.yaml`` in this process: the configuration file against the training parser, the
launcher's command, ``--dry-run`` on every recipe with a config-only folder, W&B offline. The documented
run (its losses against the README's ``torchrun examples/train.py`` run, TensorBoard, the plot) and the
failures' one line run in tests/test_train_data.py, in the README run's folder."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from ppmedia.cli import main
from ppmedia.train import config as train_config
from ppmedia.train import launch

ROOT = pathlib.Path(__file__).resolve().parents[1]
BIN = pathlib.Path(sys.executable).parent
TORCHRUN = BIN / "torchrun"


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **extra)
    env.pop("PYTHONPATH", None)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def _rows(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------------ the file, in this process
def _error(tmp_path, capsys, text: str, *cli: str) -> str:
    (tmp_path / "c.yaml").write_text(text)
    assert main(["train", str(tmp_path / "c.yaml"), *cli]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_config_errors_name_the_file_and_key_before_anything_starts(tmp_path, capsys):
    f = tmp_path / "c.yaml"
    assert f"{f}: unknown key 'bacth_size'; did you mean 'batch_size'?" in _error(tmp_path, capsys, "bacth_size: 4\n")
    assert f"{f}: key 'pp': got 'two'; expected an integer" in _error(tmp_path, capsys, "pp: two\n")
    assert f"{f}: key 'fsdp': got 3; expected true or false" in _error(tmp_path, capsys, "fsdp: 3\n")
    assert f"{f}: key 'schedule'" not in _error(tmp_path, capsys, "lr_schedule: wavy\n")
    assert "expected one of constant" in _error(tmp_path, capsys, "lr_schedule: wavy\n")
    err = _error(tmp_path, capsys, "bf16: true\n")
    assert f"{f}: --bf16 is FSDP2's mixed precision: give --fsdp too (key 'bf16' in the file)" in err
    assert "3 nodes do not divide the run's --pp x --dp x --tp x --cp" in _error(tmp_path, capsys, "pp: 2\nnnodes: 3\n")
    assert "expected --pp x --dp x --tp x --cp = 2" in _error(tmp_path, capsys, "pp: 2\nnproc_per_node: 4\n")
    assert "give rdzv_endpoint" in _error(tmp_path, capsys, "pp: 2\n", "--nnodes", "2")
    assert f"{f}: got a YAML list" in _error(tmp_path, capsys, "- pp\n")


def test_keys_follow_the_parser_and_the_command_line_wins(tmp_path, monkeypatch):
    from ppmedia.train import options

    def with_new_flag(parser_class=options.argparse.ArgumentParser):  # a flag another change adds
        parser = options.build_parser(parser_class)
        parser.add_argument("--new-flag", type=int, default=0)
        return parser

    monkeypatch.setattr(train_config, "build_parser", with_new_flag)
    (tmp_path / "c.yaml").write_text("new-flag: 8\nbatch_size: 4\nepochs: 3\nfreeze: [vision, projector]\n"
                                     f"model: {tmp_path}\ndata: {tmp_path / 'c.yaml'}\nfsdp: false\n")
    config = train_config.load_config(str(tmp_path / "c.yaml"), ["--steps", "2", "--batch-size", "8"])
    assert config.argv[:2] == ["--new-flag", "8"] and "--epochs" not in config.argv and "--fsdp" not in config.argv
    assert config.args.steps == 2 and config.args.batch_size == 8 and config.args.freeze == ["vision", "projector"]
    assert config.world == 2 and config.launch == {"nproc_per_node": 2}
    command = launch.launcher_command(config)
    assert command[1:7] == ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", "-m"]
    assert command[7:9] == ["ppmedia.train", "--new-flag"]
    config.launch.update(nnodes="2", nproc_per_node=1, rdzv_endpoint="node0:29500")
    command = launch.launcher_command(config)
    assert command[command.index("--rdzv-endpoint") + 1] == "node0:29500" and "--standalone" not in command


# ------------------------------------------------------------------------------ recipes: --dry-run
def test_every_recipe_dry_runs_on_a_config_only_folder(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import recipe_configs
    finally:
        sys.path.remove(str(ROOT / "tests"))
    recipes = sorted(p for p in (ROOT / "recipes").glob("*.yaml") if p.stem != "demo")
    assert sorted(p.stem for p in recipes) == sorted(recipe_configs.CONFIGS)
    for recipe in recipes:
        folder = recipe_configs.write_config(recipe.stem, tmp_path)
        assert main(["train", str(recipe), "--model", str(folder), "--dry-run"]) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        ranks = re.findall(r"^\s+(\d+)\s+\d+\s+\d+\s+\d+\s+\S+\s+[\d,]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+([\d.]+)$", out, flags=re.M)
        assert len(ranks) == 8, out  # one node of 8 GPUs
        largest = max(float(total) for _, total in ranks)
        assert 5 < largest < 60, (recipe.stem, out)  # weights, gradients and moments leave room in 80 GB
        assert f"largest: rank" in out and "bfloat16" in out


# ------------------------------------------------------------------------------ W&B, offline
def test_wandb_logs_the_steps_offline(tmp_path, monkeypatch):
    """``--wandb PROJECT`` with ``WANDB_MODE=offline``: no network, the run's file under ./wandb."""
    import argparse

    from ppmedia.train.sinks import Sinks

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sinks = Sinks(argparse.Namespace(tensorboard=None, wandb="ppmedia-test", lr=1e-3))
    for step in range(2):
        sinks.write({"step": step, "loss": 2.0 - step, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0,
                     "padding_fraction": 0.1, "peak_memory_gb": [0.5, 0.4]})
    sinks.final_eval(2, 0.5)
    sinks.close()
    (run,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    assert run.stat().st_size > 0


# ------------------------------------------------------------------ --export checked before training
def test_an_export_transformers_cannot_read_back_is_refused_before_anything_starts(tmp_path, capsys):
    """The tiny Kimi-VL trains, but transformers 5.23 cannot read back the checkpoint it would write
    (its rope permutation fails on the written shapes): ``--export`` is refused at the options, naming
    the option and the tensor, instead of after the last step; the same run without ``--export`` and a
    Qwen2.5-VL run with it pass the check."""
    from ppmedia.testing.datasets import save_tiny_checkpoint
    from ppmedia.train.options import parse_args

    kimi = save_tiny_checkpoint("kimi_vl", tmp_path / "kimi")
    data = tmp_path / "d.jsonl"
    data.write_text('{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}\n')
    argv = ["--model", str(kimi), "--data", str(data), "--steps", "1", "--batch-size", "2"]
    with pytest.raises(SystemExit) as info:
        parse_args([*argv, "--export", str(tmp_path / "out")])
    assert info.value.code == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "error:" in x]
    assert f"--export {tmp_path / 'out'}: the checkpoint would not load back with from_pretrained" in line, line
    assert "q_proj.weight" in line and "--save-dir" in line, line
    assert parse_args(argv).export is None
    qwen = save_tiny_checkpoint("qwen2_5_vl", tmp_path / "qwen")
    assert parse_args(["--model", str(qwen), "--data", str(data), "--steps", "1", "--batch-size", "2",
                       "--export", str(tmp_path / "out")]).export == str(tmp_path / "out")
