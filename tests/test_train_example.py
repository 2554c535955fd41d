"""examples/train.py under torchrun (pp=2 x dp=2, Qwen2.5-VL), and a pipeline across two torchrun
agents (two "nodes" on 127.0.0.1, c10d rendezvous).

* The training script's losses follow a single-process AdamW run of the model itself (same batches,
  same clipping): its first-stage forward passes the attention mask and computes the mrope positions.
* A run resumed from a checkpoint in fresh processes continues the uninterrupted run's losses exactly.
* ``--model``/``--export``: training from a ``save_pretrained`` checkpoint (each rank loads only its
  stages) and exporting a Hugging Face checkpoint that ``from_pretrained`` loads, equal to the trained
  stages.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch

import ppmedia.testing.tiny_models as tiny
from ppmedia import pipeline

ROOT = pathlib.Path(__file__).resolve().parents[1]
TORCHRUN = pathlib.Path(sys.executable).with_name("torchrun")
TRAIN = ROOT / "examples" / "train.py"
ARGS = ["--family", "qwen2_5_vl", "--pp", "2", "--dp", "2", "--schedule", "1f1b", "--steps", "4", "--lr", "1e-3",
        "--max-grad-norm", "1.0"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    return env


def _torchrun(*args: str, timeout: int = 300, nproc: int = 4) -> subprocess.CompletedProcess:
    port = str(_free_port())
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc), "--master-port", port, str(TRAIN), *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def _losses(path: pathlib.Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in map(json.loads, path.read_text().splitlines())}


def _reference_losses(steps: int) -> list[float]:
    """The model itself, one process, full batches: AdamW(1e-3) after clipping to norm 1."""
    module = tiny.load("qwen2_5_vl")
    torch.set_num_threads(1)
    model = module.build_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        batch = module.build_batch(step % 2)
        targets = pipeline.make_labels(batch["input_ids"], model.config, attention_mask=batch["attention_mask"], shift=False)
        inputs = {"use_cache": False, **module.reference_inputs(batch)}
        out = model(**inputs, labels=targets)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out.loss.item())
    return losses


@pytest.mark.multiprocess
def test_train_script_matches_the_model_and_resumes_exactly(tmp_path):
    straight, resumed, ckpt = tmp_path / "straight.jsonl", tmp_path / "resumed.jsonl", tmp_path / "ckpt"
    _torchrun(*ARGS, "--save-dir", str(ckpt), "--save-every", "2", "--loss-log", str(straight))
    assert sorted(p.name for p in (ckpt / "step2").iterdir()) == ["pp0.pt", "pp1.pt"]
    _torchrun(*ARGS, "--resume", str(ckpt / "step2"), "--loss-log", str(resumed))
    a, b = _losses(straight), _losses(resumed)
    assert sorted(a) == [0, 1, 2, 3] and sorted(b) == [2, 3]
    assert b[2] == a[2] and b[3] == a[3], f"resumed {b} vs straight {a}"  # bit for bit
    reference = _reference_losses(4)
    for step, loss in a.items():
        assert abs(loss - reference[step]) <= 1e-5, f"step {step}: script {loss} vs model {reference[step]}"
    assert a[2] < a[0] and a[3] < a[1]  # it trains (steps 0/2 and 1/3 see the same batch)


@pytest.mark.multiprocess
def test_pipeline_across_two_torchrun_agents_matches_the_model():
    """Two torchrun agents, --nnodes 2 --nproc-per-node 1, c10d rendezvous on 127.0.0.1: the
    multi-node command line of docs/training.md, on one machine."""
    port = str(_free_port())
    cmd = [str(TORCHRUN), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"ppmedia-{port}", "--local-addr", "127.0.0.1",
           "-m", "ppmedia.testing.parity", "qwen2_5_vl", "--scenario", "ZBVZeroBubble/static", "--steps", "1"]
    agents = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
              for _ in range(2)]
    outs = []
    try:
        for agent in agents:
            out, err = agent.communicate(timeout=300)
            outs.append((agent.returncode, out, err))
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    assert all(code == 0 for code, _, _ in outs), [err[-3000:] for _, _, err in outs]
    printed = "".join(out for _, out, _ in outs)
    assert printed.count("PASS: tolerance 1e-05, 2 processes (torchrun, 2 nodes)") == 1  # rank 0 reports
    assert "ZBVZeroBubble/static" in printed and "4/4" in printed


def _trained_stage_tensors(folder: pathlib.Path) -> dict[str, torch.Tensor]:
    """The stages' tensors as the script's own checkpoint of that step holds them (every pipeline rank's file)."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("pp*.pt")):
        for state in torch.load(file, weights_only=True)["stages"].values():
            tensors.update(state)
    return tensors


@pytest.mark.multiprocess
def test_train_from_a_checkpoint_and_export_one(tmp_path):
    """Gemma 3: its lm_head (last stage) is tied to the embedding (first stage), so each rank's load
    reads the tie from the checkpoint, and the export writes the embedding once."""
    import transformers

    source, export, saved = tmp_path / "source", tmp_path / "export", tmp_path / "saved"
    tiny.load("gemma3").build_model(0).save_pretrained(source, max_shard_size="40KB")
    _torchrun("--model", str(source), "--family", "gemma3", "--pp", "2", "--steps", "2", "--save-dir", str(saved),
              "--save-every", "2", "--export", str(export), nproc=2)
    assert len(list(export.glob("model-0000?-of-00002.safetensors"))) == 2  # one file per pipeline rank
    model, info = transformers.Gemma3ForConditionalGeneration.from_pretrained(export, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    exported, trained = model.state_dict(), _trained_stage_tensors(saved / "step2")
    assert exported.keys() == trained.keys()
    assert all(torch.equal(exported[k], trained[k]) for k in trained)
    initial = transformers.Gemma3ForConditionalGeneration.from_pretrained(source).state_dict()
    assert sum(not torch.equal(initial[k], exported[k]) for k in exported) > len(exported) // 2  # it trained
