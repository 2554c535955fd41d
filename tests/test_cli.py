"""The ppmedia command line: adapters, inspect, and one-line errors for bad input."""

import pathlib
import subprocess
import sys

import pytest
import torch

from ppmedia.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_adapters_lists_builtins_with_layouts_and_providers(capsys):
    code, out, _ = run(capsys, "adapters")
    assert code == 0
    for name, types in [("qwen2_5_vl", "qwen2_5_vl, qwen2_vl"), ("llava_next", "llava_next"),
                        ("step3", "step3_vl, step3p7"), ("kimi_vl", "kimi_vl, kimi_k25"),
                        ("qwen3_vl", "qwen3_vl, qwen3_vl_moe, qwen3_5, qwen3_5_moe")]:
        line = next(l for l in out.splitlines() if l.startswith(name + " "))
        assert types in line and "ppmedia (built-in)" in line
    assert "flat patch rows" in out and "qwen2_5_vl_text -> qwen2_5_vl" in out


def test_inspect_fixture_prints_per_microbatch_table(capsys):
    code, out, _ = run(capsys, "inspect", str(FIXTURES / "qwen2_5_vl" / "inputs.safetensors"), "--microbatches", "4")
    assert code == 0
    lines = out.splitlines()
    assert "images [1, 2, 0, 1, 0, 0, 1, 2], videos [0, 0, 1, 1, 0, 0, 0, 1]" in out
    table = lines[lines.index(next(l for l in lines if l.startswith("mb "))) + 2:][:4]
    assert [l.split() for l in table] == [
        ["0", "0..1", "3", "0", "44", "0", "0", "11", "0"],
        ["1", "2..3", "1", "2", "24", "48", "0", "6", "12"],
        ["2", "4..5", "0", "0", "0", "0", "0", "0", "0"],
        ["3", "6..7", "3", "1", "80", "16", "0", "20", "4"],
    ]
    assert "text-only: [2]" in out


def test_inspect_torch_save_batch_with_model_type(capsys, tmp_path):
    path = tmp_path / "batch.pt"
    torch.save({"input_ids": torch.zeros(3, 4, dtype=torch.long), "pixel_values": torch.randn(3, 3, 8, 8)}, path)
    code, out, _ = run(capsys, "inspect", str(path), "--microbatches", "2", "--model-type", "step3p7")
    assert code == 0 and "adapter step3 (step3p7); no config.json" in out
    assert "text-only: none" in out


@pytest.mark.parametrize("argv, message", [
    (["inspect", "missing.pt", "--microbatches", "2"], "missing.pt: no such file"),
    (["inspect", str(FIXTURES / "qwen2_5_vl" / "config.json"), "--microbatches", "2"], "cannot read a batch"),
    (["inspect", str(FIXTURES / "kimi_vl" / "inputs.safetensors"), "--microbatches", "0"], "n_microbatches: got 0"),
    (["inspect", str(FIXTURES / "kimi_vl" / "inputs.safetensors"), "--microbatches", "2", "--model-type", "gpt2"],
     "no ppmedia adapter for model type 'gpt2'; known model types:"),
])
def test_bad_input_is_one_line_and_nonzero(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 1
    assert len(err.strip().splitlines()) == 1 and err.startswith("ppmedia: error: ") and message in err


def test_inspect_reports_the_split_error(capsys, tmp_path):
    path = tmp_path / "batch.pt"
    torch.save({"input_ids": torch.zeros(3, 4, dtype=torch.long), "pixel_values": torch.randn(5, 6),
                "image_grid_thw": torch.tensor([[1, 1, 5]])}, path)
    code, _, err = run(capsys, "inspect", str(path), "--microbatches", "2")
    assert code == 1 and "pixel_values: 1 images for a batch of 3 samples" in err


def test_console_script_bad_arguments_no_traceback():
    exe = pathlib.Path(sys.executable).with_name("ppmedia")
    result = subprocess.run([str(exe), "demo", "--schedule", "zigzag"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "invalid choice: 'zigzag'" in result.stderr


@pytest.mark.multiprocess
def test_demo_runs_a_real_pipeline_and_prints_parity():
    exe = pathlib.Path(sys.executable).with_name("ppmedia")
    result = subprocess.run([str(exe), "demo", "--family", "kimi_vl", "--steps", "1", "--schedule", "gpipe"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "kimi_vl (kimi_k25): 8 samples x 24 tokens, 4 microbatches" in out
    assert "text-only" in out and "gpipe/inferred" in out and "gpipe/static" in out
    assert "5/5" in out  # the shape-inference forward ran and did not cost a chunk
    assert "all 1 families match the single-process run within 1e-5" in out


def test_demo_bad_microbatches_is_one_line(capsys):
    code, _, err = run(capsys, "demo", "--family", "kimi_vl", "--microbatches", "3")
    assert code == 1 and err.strip().splitlines()[-1].startswith("ppmedia: error: ValueError: n_microbatches: got 3")
