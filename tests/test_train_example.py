"""A pipeline across two torchrun agents (two "nodes" on 127.0.0.1, c10d rendezvous).

examples/train.py itself (its losses against a single-process AdamW run of the model, DCP checkpoints
resumed on other layouts, faults) is tested in tests/test_fsdp_dcp.py, with the commands of
docs/fsdp-dcp.md. Here also ``--model``/``--export``: training pp=2 x dp=2 with FSDP2 from a
``save_pretrained`` checkpoint (each rank loads only its stages) and exporting, from the sharded
stages, a Hugging Face checkpoint that ``from_pretrained`` loads, equal to the trained stages.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch

from ppmedia import pipeline
import ppmedia.testing.tiny_models as tiny


ROOT = pathlib.Path(__file__).resolve().parents[1]
TORCHRUN = pathlib.Path(sys.executable).with_name("torchrun")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    return env


@pytest.mark.multiprocess
def test_pipeline_across_two_torchrun_agents_matches_the_model():
    """Two torchrun agents, --nnodes 2 --nproc-per-node 1, c10d rendezvous on 127.0.0.1: the
    multi-node command line of the README, on one machine."""
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


def _torchrun(*args: str, timeout: int = 300, nproc: int = 4) -> subprocess.CompletedProcess:
    port = str(_free_port())
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc), "--master-port", port,
           str(ROOT / "examples" / "train.py"), *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def _trained_stage_tensors(folder: pathlib.Path) -> dict[str, torch.Tensor]:
    """The trained model's tensors as the script's own DCP checkpoint of that step holds them (read in
    this process, without a process group, into the whole model as one stage)."""
    modules = pipeline.build_stage_modules(tiny.load("gemma3").build_model(1), 1)
    pipeline.load_checkpoint(str(folder), modules, None)
    return {k: v.detach() for k, v in modules[0].state_dict().items()}


@pytest.mark.multiprocess
def test_train_from_a_checkpoint_with_fsdp_and_export_one(tmp_path):
    """Gemma 3: its lm_head (last stage) is tied to the embedding (first stage), so each rank's load
    reads the tie from the checkpoint, and the export writes the embedding once; with FSDP2 over two
    replicas the export gathers the sharded parameters."""
    import transformers

    source, export, saved = tmp_path / "source", tmp_path / "export", tmp_path / "saved"
    tiny.load("gemma3").build_model(0).save_pretrained(source, max_shard_size="40KB")
    _torchrun("--model", str(source), "--family", "gemma3", "--pp", "2", "--dp", "2", "--fsdp", "--steps", "2",
              "--save-dir", str(saved), "--save-every", "2", "--export", str(export), nproc=4)
    assert len(list(export.glob("model-0000?-of-00002.safetensors"))) == 2  # one file per pipeline rank
    model, info = transformers.Gemma3ForConditionalGeneration.from_pretrained(export, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    exported, trained = model.state_dict(), _trained_stage_tensors(saved / "step2")
    assert exported.keys() == trained.keys()
    assert all(torch.equal(exported[k], trained[k]) for k in trained)
    initial = transformers.Gemma3ForConditionalGeneration.from_pretrained(source).state_dict()
    assert sum(not torch.equal(initial[k], exported[k]) for k in exported) > len(exported) // 2  # it trained
