"""The fine-tuning pieces examples/train.py is a thin layer over, in one process (no process group).

* weight-decay groups: none on biases, norm weights and embeddings, also on the last stage's copy of
  a tied embedding (Gemma 3's ``lm_head``), decided per stage by name;
* the learning-rate schedules' values (warm-up, constant, linear, cosine);
* the parts ``--freeze`` names for every built-in family, and freezing them;
* activation checkpointing: same loss and gradients, fewer tensors kept for the backward;
* the per-step record, its JSON line, the plain line and the tqdm bar;
* the device refusal, the checkpoint's dtype, the processor files an export copies;
* train.py's command-line refusals (each one ``parser.error``, exit 2, naming the flags).
"""

from __future__ import annotations

import io
import json
import math
import pathlib

import pytest
import torch

import ppmedia.testing.tiny_models as tiny
from ppmedia import pipeline
from train_helpers import train_script

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _groups(module, weight_decay=0.1):
    groups = pipeline.decay_groups(module, weight_decay)
    ids = [{id(p) for p in g["params"]} for g in groups]
    named = dict(module.named_parameters())
    return {name for name, p in named.items() if id(p) in ids[0]}, {name for name, p in named.items() if id(p) in ids[1]}, groups


def test_no_weight_decay_on_norms_biases_and_embeddings_on_every_stage():
    stages = pipeline.build_stage_modules(tiny.load("gemma3").build_model(0), 2)
    first_decay, first_plain, groups = _groups(stages[0])
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert "model.language_model.embed_tokens.weight" in first_plain
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in first_decay
    assert all(dict(stages[0].named_parameters())[n].dim() >= 2 for n in first_decay)
    assert any(n.endswith("layernorm.weight") for n in first_plain) and any(n.endswith(".bias") for n in first_plain)
    last_decay, last_plain, _ = _groups(stages[1])
    # the tie: lm_head on the last stage is the embedding's copy, so it goes without decay too
    assert "lm_head.weight" in last_plain and "lm_head.weight" not in last_decay
    assert not pipeline.no_decay("lm_head.weight", dict(stages[1].named_parameters())["lm_head.weight"],
                                 torch.nn.Linear(1, 1))  # without the tie names it would decay: the check bites
    assert any("layers.1.mlp" in n for n in last_decay)
    total = sum(1 for _ in stages[1].parameters())
    assert len(last_decay) + len(last_plain) == total


def test_stage_adamw_applies_the_groups():
    (stage,) = pipeline.build_stage_modules(tiny.load("qwen2_5_vl").build_model(0), 1)
    (optimizer,) = pipeline.stage_adamw([stage], lr=0.5, weight_decay=0.1)
    named = dict(stage.named_parameters())
    for p in stage.parameters():
        p.grad = torch.zeros_like(p)
    embed, weight = named["model.language_model.embed_tokens.weight"], named["lm_head.weight"]
    before_embed, before_weight = embed.detach().clone(), weight.detach().clone()
    optimizer.step()  # zero gradients: only the decay moves a parameter, by lr * wd * p
    assert torch.equal(embed, before_embed)
    assert torch.allclose(weight, before_weight * (1 - 0.5 * 0.1))


def test_learning_rate_schedules():
    lr = 1.0
    assert [pipeline.learning_rate(s, lr, warmup_steps=4) for s in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    linear = [pipeline.learning_rate(s, lr, schedule="linear", warmup_steps=2, total_steps=6) for s in range(7)]
    assert linear == [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0]
    cosine = [pipeline.learning_rate(s, lr, schedule="cosine", warmup_steps=0, total_steps=4) for s in range(5)]
    assert cosine[0] == 1.0 and abs(cosine[2] - 0.5) < 1e-12 and abs(cosine[4]) < 1e-12
    assert abs(cosine[1] - 0.5 * (1 + math.cos(math.pi / 4))) < 1e-12
    with pytest.raises(ValueError, match="'step'; expected one of constant, linear, cosine"):
        pipeline.learning_rate(0, lr, schedule="step")
    with pytest.raises(ValueError, match="decays to 0 at total_steps"):
        pipeline.learning_rate(3, lr, schedule="linear")
    optimizer = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))]},
                                 {"params": [torch.nn.Parameter(torch.zeros(1))]}], lr=1.0)
    pipeline.set_learning_rate([optimizer], 0.125)
    assert [g["lr"] for g in optimizer.param_groups] == [0.125, 0.125]


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_every_family_has_the_three_parts(family):
    (stage,) = pipeline.build_stage_modules(tiny.load(family).build_model(0), 1)
    parts = {}
    for name, _ in stage.named_parameters():
        parts.setdefault(pipeline.model_part(name, stage), []).append(name)
    # Inkling's encoders end at the text width: no projector module
    expected = {"vision", "language"} if family == "inkling" else {"vision", "projector", "language"}
    assert set(parts) == expected, {k: v[:3] for k, v in parts.items()}
    assert all("layers." in n or "embed" in n or "norm" in n or "head" in n or "lm_head" in n or "language" in n
               or "text_model" in n for n in parts["language"]), parts["language"][:5]


def test_freeze_vision_and_projector():
    stages = pipeline.build_stage_modules(tiny.load("llava_next").build_model(0), 2)
    frozen = pipeline.freeze(stages, ["vision", "projector"])
    named = dict(stages[0].named_parameters())
    assert not named["model.image_newline"].requires_grad  # the projector side's
    assert not named["model.multi_modal_projector.linear_1.weight"].requires_grad
    assert not any(p.requires_grad for n, p in named.items() if n.startswith("model.vision_tower."))
    assert all(p.requires_grad for n, p in named.items() if n.startswith("model.language_model."))
    assert frozen["vision"] > 0 and frozen["projector"] > 0 and frozen["language"] == 0
    with pytest.raises(ValueError, match=r"unknown part\(s\) \['audio'\]"):
        pipeline.freeze(stages, ["audio"])


def _saved_and_loss(model, batch, module):
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    labels = pipeline.make_labels(batch["input_ids"], model.config, attention_mask=batch["attention_mask"], shift=False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**{"use_cache": False, **module.reference_inputs(batch)}, labels=labels).loss
    loss.backward()
    return sum(saved), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_activation_checkpointing_same_gradients_fewer_saved_tensors():
    module = tiny.load("qwen2_5_vl")
    batch = module.build_batch(0)
    plain = module.build_model(0).train()
    checkpointed = module.build_model(0).train()
    assert pipeline.enable_activation_checkpointing([checkpointed]) >= 4  # decoder and vision layers
    saved_plain, loss_plain, grads_plain = _saved_and_loss(plain, batch, module)
    saved_ckpt, loss_ckpt, grads_ckpt = _saved_and_loss(checkpointed, batch, module)
    assert torch.allclose(loss_plain, loss_ckpt, atol=1e-6)
    assert grads_plain.keys() == grads_ckpt.keys()
    assert all(torch.allclose(grads_plain[k], grads_ckpt[k], atol=1e-6) for k in grads_plain)
    assert saved_ckpt < 0.8 * saved_plain, (saved_ckpt, saved_plain)


def test_step_record_log_line_and_bar(tmp_path):
    record = pipeline.step_record(3, loss=2.5, tokens=120, samples=8, skipped=1, lr=1e-4, grad_norm=0.75,
                                  step_time_s=0.5, padding_fraction=0.25, eval_loss=2.0)
    assert record == {"step": 3, "loss": 2.5, "tokens": 120, "samples": 8, "skipped": 1, "lr": 1e-4,
                      "grad_norm": 0.75, "step_time_s": 0.5, "tokens_per_s": 240.0, "padding_fraction": 0.25,
                      "eval_loss": 2.0}
    assert pipeline.format_step(record) == ("step 3: loss 2.500000 lr 0.0001 grad norm 0.7500 step 0.50 s "
                                            "240 tokens/s eval loss 2.000000")
    log = pipeline.LossLog(tmp_path / "loss.jsonl")
    log.write(record)
    log.write({**record, "step": 4})
    assert [json.loads(line)["step"] for line in (tmp_path / "loss.jsonl").read_text().splitlines()] == [3, 4]
    plain = io.StringIO()
    progress = pipeline.Progress(10, 3, stream=plain)  # not a terminal: plain lines
    progress.update(record)
    progress.close()
    assert plain.getvalue() == pipeline.format_step(record) + "\n"
    bar = io.StringIO()
    progress = pipeline.Progress(10, 3, stream=bar, bar=True)
    progress.update(record)
    progress.close()
    assert "4/10" in bar.getvalue() and "loss=2.5000" in bar.getvalue() and "tok/s=240" in bar.getvalue()


def test_device_and_dtype(tmp_path):
    assert pipeline.resolve_device("cpu") == (torch.device("cpu"), "gloo")
    if torch.cuda.is_available():
        device, backend = pipeline.resolve_device("cuda", local_rank=0)
        assert device.type == "cuda" and backend == "nccl"
    else:
        with pytest.raises(ValueError, match="--device cuda: torch.cuda.is_available\\(\\) is False"):
            pipeline.resolve_device("cuda")
    with pytest.raises(ValueError, match="expected 'cpu' or 'cuda'"):
        pipeline.resolve_device("tpu")
    for config, dtype in (({"dtype": "bfloat16"}, torch.bfloat16), ({"torch_dtype": "float16"}, torch.float16),
                          ({"text_config": {"dtype": "bfloat16"}}, torch.bfloat16), ({}, torch.float32)):
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert pipeline.checkpoint_dtype(tmp_path) == dtype, config
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "int8"}))
    with pytest.raises(ValueError, match="dtype 'int8'; expected a floating torch dtype"):
        pipeline.checkpoint_dtype(tmp_path)


def test_copy_processor_files_takes_the_processor_not_the_weights(tmp_path):
    source, export = tmp_path / "source", tmp_path / "export"
    source.mkdir()
    processor = ["chat_template.jinja", "preprocessor_config.json", "processor_config.json", "special_tokens_map.json",
                 "tokenizer.json", "tokenizer_config.json", "video_preprocessor_config.json"]
    for name in [*processor, "config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json"]:
        (source / name).write_text(name)
    assert pipeline.copy_processor_files(source, export) == processor
    assert sorted(p.name for p in export.iterdir()) == processor


_train_script = train_script


@pytest.mark.parametrize("argv, message", [
    (["--data", str(ROOT / "README.md"), "--steps", "2"], "--data is processed with --model's own processor: give --model"),
    (["--epochs", "2"], "--epochs counts passes over --data"),
    (["--steps", "2", "--epochs", "2"], "argument --epochs: not allowed with argument --steps"),
    (["--freeze", "vision,audio"], "argument --freeze: got ['audio']; expected some of vision,projector,language"),
    (["--layers-per-stage", "1,x"], "argument --layers-per-stage: got '1,x'; expected comma-separated integers"),
    (["--lr-schedule", "step"], "argument --lr-schedule: invalid choice: 'step'"),
])
def test_train_py_refuses_bad_flags(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _train_script().parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_train_py_refuses_cuda_where_there_is_none(capsys):
    if torch.cuda.is_available():
        assert _train_script().parse_args(["--device", "cuda"]).device == "cuda"
        return
    with pytest.raises(SystemExit) as exit_info:
        _train_script().parse_args(["--device", "cuda"])
    assert exit_info.value.code == 2
    assert "--device cuda: torch.cuda.is_available() is False here" in capsys.readouterr().err


def test_the_demo_ends_with_a_fine_tune_whose_loss_falls():
    """``make demo``'s ending: the tiny Qwen2.5-VL with its real processor on generated images, through
    ppmedia.data's loader and pipeline.train_step (2 stages in this process)."""
    from ppmedia.cli import demo

    losses = demo.finetune(steps=4)
    assert len(losses) == 4 and all(b < a for a, b in zip(losses, losses[1:])), losses
    assert 4.0 < losses[0] < 6.0  # about ln(128) = 4.85 from a random tiny model
