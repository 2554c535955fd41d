"""LoRA on pipeline stages in one process (no process group; the multi-process parity is test_lora_mp.py):

* the initial adapter depends only on the seed and each parameter's full name (pp1 and pp2 cuts agree),
  ``lora_B`` starts at zero, the base is frozen, only adapters reach the optimizer;
* the default targets (the language model's attention and MLP projections, not the vision tower's);
* the export: PEFT's file names and config with every stage's targets, ``PeftModel.from_pretrained``
  loads it with the stages' values; the merged export: every non-LoRA tensor byte for byte the base's;
* DCP checkpoints hold the adapters alone and refuse another LoRA configuration or a full model, naming it;
* train.py's refusals of bad LoRA options (``parser.error``, exit 2, one line naming the option).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import ppmedia.testing.tiny_models as tiny
from ppmedia import pipeline
from train_helpers import train_script

SETTINGS = pipeline.LoraSettings(rank=4, alpha=16.0, seed=3)


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _stages(family="qwen2_5_vl", n=2, settings=SETTINGS):
    modules = pipeline.build_stage_modules(tiny.load(family).build_model(0), n)
    pipeline.apply_lora(modules, settings)
    return modules


def _perturb(modules):
    """Stand-in for training: every adapter moved off its start (B non-zero), deterministically."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in modules:
            for name, p in module.named_parameters():
                if ".lora_" in name:
                    p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def test_initial_adapter_depends_only_on_seed_and_name():
    one, two = _stages(n=1), _stages(n=2)
    a = pipeline.lora_state_dict(one)
    b = pipeline.lora_state_dict(two)
    assert a.keys() == b.keys() and len(a) == 28
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(not v.any() for k, v in a.items() if ".lora_B." in k)
    assert all(v.abs().sum() > 0 for k, v in a.items() if ".lora_A." in k)
    other = pipeline.lora_state_dict(_stages(n=1, settings=pipeline.LoraSettings(4, 16.0, seed=4)))
    assert not any(torch.equal(a[k], other[k]) for k in a if ".lora_A." in k)


def test_base_frozen_and_only_adapters_in_the_optimizer():
    modules = _stages()
    for module in modules:
        trainable = [n for n, p in module.named_parameters() if p.requires_grad]
        assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
        assert all("visual" not in n for n in trainable)  # default: the language model only
    optimizers = pipeline.stage_adamw(modules, 1e-2, 0.01)
    held = {id(p) for o in optimizers for g in o.param_groups for p in g["params"]}
    assert held == {id(p) for m in modules for p in m.parameters() if p.requires_grad}
    frozen = pipeline.freeze(modules, ["language"])  # --freeze language freezes its adapters too
    assert frozen["language"] > 0 and not any(p.requires_grad for m in modules for p in m.parameters())


def test_vision_and_all_linear_targets():
    model = tiny.load("qwen2_5_vl").build_model(0)
    default = pipeline.lora_targets(model, SETTINGS)
    assert len(default) == 14 and all(".language_model.layers." in n for n in default)
    vision = pipeline.lora_targets(model, pipeline.LoraSettings(4, 8.0, vision=True))
    assert set(default) < set(vision) and any(n.startswith("model.visual.blocks.") for n in vision)
    every = pipeline.lora_targets(model, pipeline.LoraSettings(4, 8.0, targets=("all-linear",)))
    assert set(every) == set(default) and "lm_head" not in every
    with pytest.raises(ValueError, match=r"--lora-targets q_prj: matches no linear module .* did you mean q_proj"):
        pipeline.check_lora_targets(model, pipeline.LoraSettings(4, 8.0, targets=("q_prj",)))


def test_adapter_export_loads_in_peft_with_every_stages_layers(tmp_path):
    from peft import PeftModel, get_peft_model_state_dict

    family = "gemma3"
    modules = _stages(family)
    _perturb(modules)
    pipeline.save_pretrained_stages(modules, tmp_path / "adapter")
    written = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 16.0
    layers = {int(n.split(".layers.")[1].split(".")[0]) for n in config["target_modules"]}
    assert layers == {0, 1} and len(config["target_modules"]) == 14  # both stages' layers
    loaded = PeftModel.from_pretrained(tiny.load(family).build_model(0), tmp_path / "adapter")
    own = get_peft_model_state_dict(loaded)
    assert own.keys() == written.keys()
    assert all(torch.equal(own[k], written[k]) for k in own)
    assert next(iter(written)).startswith("base_model.model.model.language_model.layers.")


def test_merged_export_is_the_base_with_the_scaled_update(tmp_path):
    from transformers import AutoModelForImageTextToText

    family = "qwen2_5_vl"
    base = tiny.load(family).build_model(0)
    base.save_pretrained(tmp_path / "base")
    modules = _stages(family)
    _perturb(modules)
    adapters = pipeline.lora_state_dict(modules)
    pipeline.save_pretrained_stages(modules, tmp_path / "merged", lora="merged")
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged").state_dict()
    want = AutoModelForImageTextToText.from_pretrained(tmp_path / "base").state_dict()
    assert merged.keys() == want.keys()
    changed = set()
    for name, tensor in want.items():
        module = name.removesuffix(".weight")
        a = adapters.get(f"base_model.model.{module}.lora_A.weight")
        if a is None:
            assert torch.equal(merged[name], tensor), name  # byte for byte
            continue
        b = adapters[f"base_model.model.{module}.lora_B.weight"]
        assert torch.allclose(merged[name], tensor + (b @ a) * (16.0 / 4), atol=1e-6)
        changed.add(name)
    assert len(changed) == 14


def _save(modules, path):
    optimizers = pipeline.stage_adamw(modules, 1e-2, 0.0)
    return pipeline.save_checkpoint(path, 1, modules, optimizers), optimizers


def test_checkpoint_holds_adapters_only_and_refuses_another_lora_config(tmp_path):
    modules = _stages()
    _perturb(modules)
    folder, _ = _save(modules, tmp_path)
    info = json.loads((folder / pipeline.CHECKPOINT_INFO).read_text())
    assert info["lora"] == SETTINGS.record()
    assert info["names"] and all(".lora_" in n for n in info["names"])
    fresh = _stages()
    pipeline.load_checkpoint(folder, fresh, pipeline.stage_adamw(fresh, 1e-2, 0.0))
    saved, loaded = pipeline.lora_state_dict(modules), pipeline.lora_state_dict(fresh)
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    other = _stages(settings=pipeline.LoraSettings(rank=8, alpha=16.0, seed=3))
    with pytest.raises(ValueError, match=r"--lora-rank: saved 4, this run 8"):
        pipeline.load_checkpoint(folder, other)
    full = pipeline.build_stage_modules(tiny.load("qwen2_5_vl").build_model(0), 2)
    with pytest.raises(ValueError, match=r"holds LoRA adapters .* this run trains the full model"):
        pipeline.load_checkpoint(folder, full)
    full_folder, _ = _save(full, tmp_path / "full")
    with pytest.raises(ValueError, match=r"trained without LoRA"):
        pipeline.load_checkpoint(full_folder, _stages())


@pytest.mark.parametrize("argv, message", [
    (["--lora-rank", "-1"], "--lora-rank -1: expected a rank > 0"),
    (["--lora-alpha", "16"], "--lora-rank 0: expected a rank > 0 with --lora-alpha"),
    (["--export-merged", "m"], "--lora-rank 0: expected a rank > 0 with --export-merged"),
    (["--lora-rank", "8", "--lora-alpha", "0"], "--lora-alpha 0.0: expected a finite number > 0"),
    (["--lora-rank", "8", "--lora-dropout", "1"], "--lora-dropout 1.0: expected a probability in [0, 1)"),
    (["--lora-rank", "8", "--lora-targets", "q_prj"], "--lora-targets q_prj: matches no linear module of the "
                                                       "language model; did you mean q_proj"),
    (["--lora-rank", "8", "--lora-vision", "--encoder", "spread"], "--lora-vision with --encoder spread: not supported"),
    (["--lora-rank", "8", "--lora-vision", "--tp", "2"], "--lora-vision with --tp 2: not supported"),
])
def test_bad_lora_options_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        train_script().parse_args(["--family", "qwen2_5_vl", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err, err


def test_resume_of_a_checkpoint_trained_otherwise_exits_2(tmp_path, capsys):
    folder = tmp_path / "step4"
    folder.mkdir()
    (folder / pipeline.CHECKPOINT_INFO).write_text(json.dumps({"lora": None}))
    with pytest.raises(SystemExit):
        train_script().parse_args(["--lora-rank", "8", "--resume", str(folder)])
    assert "trained without LoRA" in capsys.readouterr().err
    (folder / pipeline.CHECKPOINT_INFO).write_text(json.dumps({"lora": SETTINGS.record()}))
    with pytest.raises(SystemExit):
        train_script().parse_args(["--lora-rank", "4", "--lora-alpha", "8", "--resume", str(folder)])
    assert "--lora-alpha: saved 16.0, this run 8.0" in capsys.readouterr().err
    assert train_script().parse_args(["--lora-rank", "4", "--lora-alpha", "16", "--resume", str(folder)]).lora_rank == 4
