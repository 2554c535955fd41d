"""A pipeline across two torchrun agents (two "nodes" on 127.0.0.1, c10d rendezvous).

examples/train.py itself (its losses against a single-process AdamW run of the model, DCP checkpoints
resumed on other layouts, faults) is tested in tests/test_fsdp_dcp.py, with the commands of
docs/fsdp-dcp.md; fine-tuning a ``save_pretrained`` checkpoint on data (``--model``, ``--data``,
``--export`` from FSDP2 stages) in tests/test_train_data.py.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest



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
    outs = _two_agents(cmd, env=_env(), cwd=ROOT)
    printed = "".join(out for _, out, _ in outs)
    assert printed.count("PASS: tolerance 1e-05, 2 processes (torchrun, 2 nodes)") == 1  # rank 0 reports
    assert "ZBVZeroBubble/static" in printed and "4/4" in printed


@pytest.mark.multiprocess
def test_ppmedia_train_across_two_agents(tmp_path):
    """``ppmedia train CONFIG.yaml`` on two "nodes" (two agents on 127.0.0.1, one rank each): the YAML's
    nnodes / rdzv_endpoint / local_addr keys become torchrun's c10d rendezvous (recipes/sbatch.sh's form);
    the pipeline trains the tiny model's stand-in batches; rank 0 logs both steps."""
    port = _free_port()
    (tmp_path / "two.yaml").write_text(f"family: qwen2_5_vl\npp: 2\nsteps: 2\nloss_log: two.jsonl\nnnodes: 2\n"
                                       f"rdzv_endpoint: 127.0.0.1:{port}\nlocal_addr: 127.0.0.1\n")
    ppmedia = pathlib.Path(sys.executable).with_name("ppmedia")
    env = dict(_env(), PATH=f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    outs = _two_agents([str(ppmedia), "train", "two.yaml"], env=env, cwd=tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "two.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and len(rows[0]["peak_memory_gb"]) == 2
    assert "".join(out for _, out, _ in outs).count("step 1: loss") == 1  # rank 0 reports


def _two_agents(cmd: list[str], env: dict[str, str], cwd: pathlib.Path) -> list[tuple[int, str, str]]:
    """``cmd`` started twice (two torchrun agents of one rendezvous); each one's (return code, stdout,
    stderr) once both ended, asserted 0; a still-running agent is killed."""
    agents = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
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
    return outs
