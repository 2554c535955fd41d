"""``ppmedia train CONFIG.yaml``: the configuration file against the training parser (in this process),
the documented run against ``torchrun examples/train.py`` with the same options (one sandbox, two runs),
the failures' one line, and ``--dry-run`` on every recipe with a config-only folder."""

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
    assert "3 nodes do not divide the run's --pp x --dp x --tp" in _error(tmp_path, capsys, "pp: 2\nnnodes: 3\n")
    assert "expected --pp x --dp x --tp = 2" in _error(tmp_path, capsys, "pp: 2\nnproc_per_node: 4\n")
    assert "give rdzv_endpoint" in _error(tmp_path, capsys, "pp: 2\n", "--nnodes", "2")
    assert f"{f}: got a YAML list" in _error(tmp_path, capsys, "- pp\n")


def test_keys_follow_the_parser_and_the_command_line_wins(tmp_path, monkeypatch):
    from ppmedia.train import options

    def with_new_flag(parser_class=options.argparse.ArgumentParser):  # a flag another change adds
        parser = options.build_parser(parser_class)
        parser.add_argument("--lora-rank", type=int, default=0)
        return parser

    monkeypatch.setattr(train_config, "build_parser", with_new_flag)
    (tmp_path / "c.yaml").write_text("lora-rank: 8\nbatch_size: 4\nepochs: 3\nfreeze: [vision, projector]\n"
                                     f"model: {tmp_path}\ndata: {tmp_path / 'c.yaml'}\nfsdp: false\n")
    config = train_config.load_config(str(tmp_path / "c.yaml"), ["--steps", "2", "--batch-size", "8"])
    assert config.argv[:2] == ["--lora-rank", "8"] and "--epochs" not in config.argv and "--fsdp" not in config.argv
    assert config.args.steps == 2 and config.args.batch_size == 8 and config.args.freeze == ["vision", "projector"]
    assert config.world == 2 and config.launch == {"nproc_per_node": 2}
    command = launch.launcher_command(config)
    assert command[1:7] == ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", "-m"]
    assert command[7:9] == ["ppmedia.train", "--lora-rank"]
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


# ------------------------------------------------------------------------------ the documented run
def documented_lines() -> list[str]:
    """docs/train-command.md's first block (tests/test_docs.py leaves it to the test below)."""
    from test_docs import DOCS, command_lines, read_blocks

    block = [b for b in read_blocks(DOCS / "train-command.md") if b.lang == "sh"][0]
    return command_lines(block)


@pytest.mark.multiprocess
def test_ppmedia_train_runs_the_documented_lines_like_examples_train(tmp_path):
    """The page's lines as written (``ppmedia train recipes/demo.yaml --steps 5``: 2 processes, pp 2), then
    ``torchrun examples/train.py`` with the options the recipe's header names: the same losses; TensorBoard's
    ``train/loss`` equals the JSON log; the last step checkpointed; the final model evaluated; the plot."""
    from test_docs import run_documented

    lines = documented_lines()
    assert lines[1].split("#")[0].strip() == "ppmedia train recipes/demo.yaml --steps 5"
    results = run_documented("docs/train-command.md", lines, tmp_path)
    rows = _rows(tmp_path / "loss.jsonl")
    assert [r["step"] for r in rows] == list(range(5))
    assert all(len(r["peak_memory_gb"]) == 2 and min(r["peak_memory_gb"]) > 0.05 for r in rows)
    assert "mfu" not in rows[0]  # CPU: no peak FLOP/s to divide by
    assert [r.get("eval_loss") is not None for r in rows] == [True, False, True, False, True]
    assert rows[-1]["final_eval_loss"] < rows[-1]["eval_loss"]  # the final weights, after the last step
    assert sorted(p.name for p in (tmp_path / "runs").glob("step*")) == ["step2", "step4", "step5"]
    assert results[2].stdout.startswith("wrote loss.png: 5 steps, 4 eval points")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/padding_fraction",
            "eval/loss"} <= set(events.Tags()["scalars"])
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in rows]
    assert events.Scalars("eval/loss")[-1].step == 5

    # the same options through torchrun examples/train.py (W&B offline on the side): the same losses
    header = (ROOT / "recipes" / "demo.yaml").read_text().split("#   torchrun ", 1)[1].split("\nmodel:")[0]
    argv = [w for w in header.replace("\\\n#      ", " ").split() if w != "#"]
    assert argv[:3] == ["--standalone", "--nproc-per-node", "2"]
    argv = [w.replace("loss.jsonl", "ref.jsonl").replace("runs", "ref-runs") for w in argv
            if w not in ("--tensorboard", "tb")] + ["--steps", "5", "--wandb", "ppmedia-test"]
    del argv[argv.index("--epochs"):argv.index("--epochs") + 2]  # --steps 5 instead, as the page's line
    done = subprocess.run([str(TORCHRUN), *argv], cwd=tmp_path, env=_env(WANDB_MODE="offline"),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    reference = _rows(tmp_path / "ref.jsonl")
    assert [r["loss"] for r in reference] == [r["loss"] for r in rows]
    assert [r.get("eval_loss") for r in reference] == [r.get("eval_loss") for r in rows]
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))


@pytest.mark.multiprocess
def test_a_failure_is_one_line_and_a_run_with_no_label_stops_before_step_0(tmp_path):
    """A bad record at pp 2: one line naming FILE:LINE and the traceback file, from one rank. Every sample
    over --max-length (one process, in place): stopped before step 0, naming why."""
    from ppmedia.testing.datasets import save_tiny_checkpoint, write_image_chat_dataset
    from ppmedia.testing.word_tokenizer import text_words

    import transformers

    ckpt = save_tiny_checkpoint("qwen2_5_vl", tmp_path / "ckpt")
    words = text_words(transformers.AutoProcessor.from_pretrained(ckpt).tokenizer)
    data = write_image_chat_dataset(tmp_path / "data", 8, words=words)
    lines = data.read_text().splitlines()
    lines[2] = lines[2].replace("img2.png", "missing.png")
    (tmp_path / "data" / "bad.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "c.yaml").write_text(f"model: {ckpt}\ndata: data/bad.jsonl\npp: 2\nbatch_size: 4\nmax_length: 64\n"
                                     "steps: 2\nno_shuffle: true\n")
    logs = tmp_path / "logs"
    failed = subprocess.run([str(BIN / "ppmedia"), "train", "c.yaml"], cwd=tmp_path, capture_output=True, text=True,
                            env=_env(PPMEDIA_LOG_DIR=str(logs)), timeout=600)
    assert failed.returncode == 1
    ours = [line for line in (failed.stdout + failed.stderr).splitlines() if line.startswith("train.py")]
    assert len(ours) == 1, failed.stderr
    found = re.fullmatch(r"train\.py: data/bad\.jsonl:3: image file '.*missing\.png' does not exist "
                         r"\(rank 0; traceback: (\S+)\)", ours[0])
    assert found and "DataError" in pathlib.Path(found[1]).read_text(), ours
    assert "step None" not in failed.stderr and failed.stderr.count("Traceback") == 1  # torchrun's own report

    nothing = subprocess.run([sys.executable, "-m", "ppmedia.train", "--model", str(ckpt), "--data", str(data),
                              "--pp", "1", "--batch-size", "4", "--max-length", "8", "--steps", "2"],
                             cwd=tmp_path, capture_output=True, text=True, env=_env(PPMEDIA_LOG_DIR=str(logs)), timeout=600)
    assert nothing.returncode == 1 and "step 0: loss" not in nothing.stdout
    (line,) = [line for line in nothing.stderr.splitlines() if line.startswith("train.py")]
    assert line.startswith("train.py: step 0: the global batch of 4 samples holds no label token: all were skipped "
                           "(4 samples skipped so far: longer than --max-length 8"), line
