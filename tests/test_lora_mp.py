"""LoRA under pipeline parallelism in real processes (gloo on 127.0.0.1), against Hugging Face PEFT's own model:

* ONE spawned group of 4 processes (``ppmedia.testing.lora_parity``) trains Qwen2.5-VL, Gemma 3 and
  LLaVA-NeXT with LoRA (rank 4, alpha 16) for 3 AdamW steps at lr 1e-2 at pp2, pp1 x dp2, pp2 x dp2 with
  FSDP2, pp2 x tp2 and pp2 resumed from pp1 x dp2's DCP checkpoint; each writes its PEFT adapter.
  Every layout's losses and final adapter equal PEFT's model trained in one process with torch's AdamW
  from the same initial adapter (within 1e-4); ``PeftModel.from_pretrained`` loads every adapter with
  every stage's layers, and its loss on a held-out batch is the trained pipeline's. Qwen2.5-VL also runs
  with activation checkpointing + ``--freeze vision`` + pre-split microbatches, and with the encoder
  spread: the same losses.
* docs/lora.md's lines as written (``python -m ppmedia.testing.datasets``, ``torchrun ... examples/train.py
  --model demo-ckpt --data ... --pp 2 --lora-rank 8 --export out``, the PEFT load) in a scratch folder.
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest
import torch
from safetensors.torch import load_file

import ppmedia.testing.tiny_models as tiny
from ppmedia.testing import lora_parity

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOL = 1e-4
LAYOUTS = lora_parity.LAYOUTS
COMPOSED = lora_parity.COMPOSED


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora-parity")
    lora_parity.run_lora_parity(str(out))
    return out


_REFERENCE: dict[str, tuple] = {}


def _reference(family: str):
    if family not in _REFERENCE:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            _REFERENCE[family] = lora_parity.peft_reference(family)
        finally:
            torch.set_num_threads(threads)
    return _REFERENCE[family]


def _run(trained, family, layout):
    folder = trained / family / layout
    return folder, json.loads((folder / "losses.json").read_text()), load_file(folder / "adapter_model.safetensors")


CASES = [(f, l) for f in lora_parity.FAMILIES for l in LAYOUTS] + [("qwen2_5_vl", l) for l in COMPOSED]


@pytest.mark.parametrize("family, layout", CASES)
def test_losses_and_adapters_equal_peft_trained_in_one_process(trained, family, layout):
    losses, adapter, _ = _reference(family)
    _, run, written = _run(trained, family, layout)
    got = run["losses"]
    assert len(got) == len(losses) - run["start"]
    assert max(abs(a - b) for a, b in zip(got, losses[run["start"]:])) < TOL, (got, losses)
    assert written.keys() == adapter.keys()
    worst = max(float((written[k] - adapter[k]).abs().max()) for k in adapter)
    assert worst < TOL, worst
    assert any(float(adapter[k].abs().max()) > 1e-3 for k in adapter if ".lora_B." in k)  # it did train


@pytest.mark.parametrize("family", lora_parity.FAMILIES)
def test_peft_loads_every_stages_layers_and_gives_the_pipelines_loss(trained, family):
    from peft import PeftModel

    from ppmedia import pipeline
    from ppmedia.registry import get_adapter

    folder, run, written = _run(trained, family, "pp2")
    config = json.loads((folder / "adapter_config.json").read_text())
    module = tiny.load(family)
    want = pipeline.lora_targets(module.build_model(0), lora_parity.SETTINGS)
    assert sorted(config["target_modules"]) == sorted(want)  # both stages' layers, not one stage's
    loaded = PeftModel.from_pretrained(module.build_model(0), str(folder)).eval()
    batch = dict(module.build_batch(lora_parity.STEPS))
    labels = pipeline.make_labels(batch["input_ids"], loaded.config, get_adapter(loaded.config),
                                  attention_mask=batch["attention_mask"], shift=False)
    inputs = dict(module.reference_inputs(batch))
    inputs.setdefault("use_cache", False)
    with torch.no_grad():
        loss = float(loaded(**inputs, labels=labels).loss)
    assert abs(loss - run["held_out"]) < TOL, (loss, run["held_out"])


def lines() -> list[str]:
    """docs/lora.md's quick-start lines (its first ``sh`` block)."""
    from test_docs import command_lines, read_blocks

    page = ROOT / "docs" / "lora.md"
    blocks = [b for b in read_blocks(page, page.read_text()) if b.lang == "sh"]
    return command_lines(blocks[0])


def test_the_pages_lines_train_and_export_an_adapter_peft_loads(tmp_path):
    from test_docs import run_documented

    made, train, check = run_documented("docs/lora.md: LoRA", lines(), tmp_path)
    assert re.search(r"step 1: loss \d", train.stdout + train.stderr), train.stdout
    assert check.stdout.split() == ["14", "0,1"], check.stdout  # 14 modules of layers 0 and 1 (both stages)
