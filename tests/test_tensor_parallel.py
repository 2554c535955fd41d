"""Tensor parallelism inside the stages, in one process: what is refused before anything is sharded,
and what a (one-rank) tp mesh shards. Parity at pp=2 x tp=2 and pp=1 x dp=2 x tp=2 runs in
tests/test_stack_mp.py's 4-process spawn."""

from __future__ import annotations

import copy

import pytest
import torch

from ppmedia.pipeline import (
    all_reduce_gradients,
    apply_fsdp,
    apply_tensor_parallel,
    build_stage_modules,
    check_tensor_parallel,
    pipeline_mesh,
    reduce_tensor_parallel_gradients,
    tensor_parallel_plan,
)
from ppmedia.testing import tiny_models

pytestmark = pytest.mark.usefixtures("one_thread")


def _config(family, **text):
    config = tiny_models.load(family).build_config()
    for key, value in text.items():
        setattr(config.get_text_config(), key, value)
    return config


def test_heads_kv_heads_and_vocabulary_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match=r"Qwen2_5_VLTextConfig.num_attention_heads = 4 does not divide by tp = 3"):
        check_tensor_parallel(_config("qwen2_5_vl"), 3)
    with pytest.raises(ValueError, match=r"LlamaConfig.num_key_value_heads = 1 does not divide by tp = 2"):
        check_tensor_parallel(_config("llava_next", num_key_value_heads=1), 2)
    with pytest.raises(ValueError, match=r"LlamaConfig.vocab_size = 129 does not divide by tp = 2"):
        check_tensor_parallel(_config("llava_next", vocab_size=129), 2)
    check_tensor_parallel(_config("llava_next", vocab_size=129), 2, shard_head=False)  # the head kept whole
    check_tensor_parallel(_config("gemma3", vocab_size=129), 2)  # tied head: kept whole, vocabulary not split


def test_plans_come_from_transformers_or_the_adapter_and_unmapped_styles_are_refused():
    assert tensor_parallel_plan(_config("qwen2_5_vl"))["layers.*.mlp.down_proj"] == "rowwise"
    # Qwen3-VL's text config has no plan in transformers 5.23: its adapter's
    plan = tensor_parallel_plan(_config("qwen3_vl"))
    assert plan["layers.*.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    with pytest.raises(ValueError, match=r"Qwen2_5_VLTextConfig has no base_model_tp_plan and Qwen2_5_VLAdapter.tp_plan"):
        tensor_parallel_plan(_config("qwen2_5_vl", base_model_tp_plan=None))
    with pytest.raises(ValueError, match=r"plan entry 'layers.\*.mlp.experts.gate_up_proj' has style 'packed_colwise'"):
        check_tensor_parallel(_config("glm4v_moe"), 2)  # MoE experts: not mapped (expert parallelism is not built)


def test_a_tp_mesh_shards_the_plan_and_leaves_the_rest_whole(world_of_one):
    from torch.distributed.tensor import DTensor, Shard

    with pytest.raises(ValueError, match=r"pp 2 x dp 1 x tp 1 = 2; the world has 1 ranks"):
        pipeline_mesh(2)
    mesh = pipeline_mesh(1)
    assert mesh.mesh_dim_names == ("dp", "pp", "tp")
    model = tiny_models.load("qwen2_5_vl").build_model(0)
    modules = build_stage_modules(copy.deepcopy(model), 2)
    apply_tensor_parallel(modules, mesh["tp"])
    named = {n: p for m in modules for n, p in m.named_parameters()}
    layer = "model.language_model.layers.1"
    assert named[f"{layer}.self_attn.q_proj.weight"].placements == (Shard(0),)
    assert named[f"{layer}.self_attn.q_proj.bias"].placements == (Shard(0),)
    assert named[f"{layer}.self_attn.o_proj.weight"].placements == (Shard(1),)
    assert named[f"{layer}.mlp.down_proj.weight"].placements == (Shard(1),)
    assert named["lm_head.weight"].placements == (Shard(0),)  # untied: vocabulary split, logits gathered
    assert named["model.language_model.embed_tokens.weight"].placements == (Shard(0),)  # and the table
    whole = [n for n, p in named.items() if not isinstance(p, DTensor)]
    assert f"{layer}.input_layernorm.weight" in whole and "model.language_model.norm.weight" in whole
    assert any(n.startswith("model.visual.") for n in whole)
    with pytest.raises(ValueError, match="stage 0 is tensor-parallel already"):
        apply_tensor_parallel(modules, mesh["tp"])
    with pytest.raises(ValueError, match="is not tensor-parallel"):
        reduce_tensor_parallel_gradients(build_stage_modules(copy.deepcopy(model), 2))
    sharded = build_stage_modules(copy.deepcopy(model), 2)
    apply_fsdp(sharded, mesh["dp"])
    with pytest.raises(ValueError, match="sharded with FSDP2 already; apply tensor parallelism first"):
        apply_tensor_parallel(sharded, mesh["tp"])
    with pytest.raises(TypeError, match="sharded with FSDP2"):
        all_reduce_gradients(sharded)


def test_a_head_tied_to_the_embedding_stays_whole_and_so_does_the_embedding(world_of_one):
    from torch.distributed.tensor import DTensor

    modules = build_stage_modules(tiny_models.load("gemma3").build_model(0), 2)
    apply_tensor_parallel(modules, pipeline_mesh(1)["tp"])
    head = dict(modules[1].named_parameters())[f"{modules[1].head_name}.weight"]
    embedding = dict(modules[0].named_parameters())["model.language_model.embed_tokens.weight"]
    assert not isinstance(head, DTensor) and not isinstance(embedding, DTensor)
    q = dict(modules[1].named_parameters())["model.language_model.layers.1.self_attn.q_proj.weight"]
    assert isinstance(q, DTensor)


# -- examples/train.py --tp (4 processes under torchrun) ----------------------------------------------

def _reference_losses(steps):
    """The model itself, one process, full batches, train.py's AdamW (1e-3, weight decay 0.01 but none
    on biases, 1-D norm weights and the embedding table) after clipping to norm 1: the losses ``--pp 2``
    and ``--pp 2 --dp 2 --fsdp`` reproduce within 1e-5 (tests/test_fsdp_dcp.py)."""
    from ppmedia import pipeline

    module = tiny_models.load("qwen2_5_vl")
    model = module.build_model(0)
    plain = [p for n, p in model.named_parameters() if p.dim() < 2 or "embed_tokens" in n]
    decayed = [p for p in model.parameters() if all(p is not q for q in plain)]
    optimizer = torch.optim.AdamW([{"params": decayed, "weight_decay": 0.01}, {"params": plain, "weight_decay": 0.0}],
                                  lr=1e-3)
    losses = []
    for step in range(steps):
        batch = module.build_batch(step % 2)
        targets = pipeline.make_labels(batch["input_ids"], model.config, attention_mask=batch["attention_mask"], shift=False)
        loss = model(**{"use_cache": False, **module.reference_inputs(batch)}, labels=targets).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append((loss.item(), norm.item()))
    return losses


def _train(root, tmp_path, nproc, *args):
    import os
    import pathlib
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    cmd = [str(pathlib.Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", str(nproc),
           "--master-port", port, str(root / "examples" / "train.py"), "--family", "qwen2_5_vl", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


@pytest.mark.multiprocess
def test_train_with_tp_gives_the_losses_of_the_model_and_its_checkpoint_resumes_at_pp2_dp2_fsdp(tmp_path):
    """``torchrun --nproc-per-node 4 examples/train.py --family qwen2_5_vl --pp 2 --tp 2``: every
    step's global loss within 1e-5 of the model's own run (which ``--pp 2`` matches too), and the
    global gradient norm (summed over the tp shards) within 1e-5 of it. Its DCP checkpoint of step 1
    (tp-sharded parameters and AdamW state) resumes at ``--pp 2 --dp 2 --fsdp`` (FSDP2 shards over
    dp instead of tp) with the same loss and norm."""
    import json
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    _train(root, tmp_path, 4, "--pp", "2", "--tp", "2", "--steps", "2", "--loss-log", "tp.jsonl",
           "--save-dir", "ckpt", "--save-every", "1")
    out = _train(root, tmp_path, 4, "--pp", "2", "--dp", "2", "--fsdp", "--steps", "2", "--resume", "ckpt/step1",
                 "--loss-log", "fsdp.jsonl")
    assert "saved at pp=2 x dp=1 x tp=2" in out, out
    rows = [json.loads(line) for line in (tmp_path / "tp.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for row, (loss, norm) in zip(rows, _reference_losses(2)):
        assert abs(row["loss"] - loss) <= 1e-5, (row, loss)
        assert abs(row["grad_norm"] - norm) <= 1e-5 * norm, (row, norm)  # clipping over tp shards
    (resumed,) = [json.loads(line) for line in (tmp_path / "fsdp.jsonl").read_text().splitlines()]
    assert resumed["step"] == 1 and abs(resumed["loss"] - rows[1]["loss"]) <= 1e-5, (resumed, rows[1])
    assert abs(resumed["grad_norm"] - rows[1]["grad_norm"]) <= 1e-5 * rows[1]["grad_norm"]
