"""The tested stack (torch 2.14.1 with torchvision 0.29.1, transformers 5.23.0) and what ppmedia does
about torch's behaviour on it."""

from __future__ import annotations

import pytest
import torch

from ppmedia import pipeline
from ppmedia.testing.tiny_models import llava_next as tiny


def test_shape_inference_cleanup_leaves_unchanged_buffers_at_their_version(world_of_one):
    """torch 2.14 copies every stage buffer back after an inferred schedule's shape inference, which
    bumps its autograd version: a vision encode that saved CLIP's ``position_ids`` before the schedule
    (the encoder spread encodes ahead) then failed its backward. Only changed buffers are restored."""
    torch.manual_seed(0)
    model = tiny.build_model(seed=0)
    (stage,) = pipeline.make_pipeline_stages(model, 1, [0], "cpu")
    ids = dict(stage.submod.named_buffers())
    name = next(n for n, b in ids.items() if b.dtype == torch.int64)  # CLIP's position_ids [1, 17]
    fixed, moved = ids[name], next(b for b in ids.values() if b.is_floating_point())
    from torch.distributed.pipelining.stage import InferenceMode

    stage._inference_mode = InferenceMode.DYNAMIC  # what an inferred schedule's first step sets
    stage._pre_metadata_inference_backup()
    before = fixed._version
    with torch.no_grad():
        moved.add_(1.0)  # the inference changed this one: it must come back
    saved = moved.clone()
    stage._post_metadata_inference_cleanup()
    assert fixed._version == before
    assert not torch.equal(moved, saved)  # restored to its value before the inference


def test_the_pinned_stack_is_installed():
    import torchvision
    import transformers

    assert torch.__version__.split("+")[0] == "2.14.1"
    assert torchvision.__version__.split("+")[0] == "0.29.1"
    assert transformers.__version__ == "5.23.0"
    # with torchvision importable, transformers gives its torchvision image processors by default
    from transformers.utils import is_torchvision_available

    assert is_torchvision_available()


def test_the_gpu_check_runs_on_the_cpu(tmp_path):
    """tests/gpu/check.py (run on a lent accelerator by tests/gpu/check.sh) on the CPU, so it cannot rot:
    the same step and figures, the loss equal to the CPU run's, the host-read limits held."""
    import json
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    out = tmp_path / "gpu-check.json"
    run = subprocess.run([sys.executable, str(root / "tests/gpu/check.py"), "--device", "cpu", "--repeats", "2", "--out", str(out)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0 and "gpu check: PASS" in run.stdout, run.stdout + run.stderr
    figures = json.loads(out.read_text())
    assert figures["loss_diff"] == 0.0 and figures["producer_host_reads"] == 1 and figures["consumer_host_reads"] == 0
    assert {"staging_ms", "transfer_gb_s", "consumer_us_per_call"} <= set(figures)
