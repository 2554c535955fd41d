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
    # GLM-4.5V's MoE: the routed experts' entries (packed_colwise, moe_tp_experts) are left out (experts
    # replicated over tp); attention, shared experts and the dense first layers' MLP are split
    moe = check_tensor_parallel(_config("glm4v_moe"), 2)
    assert not [k for k in moe if ".experts" in k]
    assert moe["layers.*.mlp.shared_experts.down_proj"] == "rowwise" and moe["layers.*.mlp.gate_proj"] == "colwise"
    config = _config("glm4v_moe")
    config.get_text_config().base_model_tp_plan = {**moe, "layers.*.mlp.gate_proj": "packed_colwise"}
    with pytest.raises(ValueError, match=r"plan entry 'layers.\*.mlp.gate_proj' has style 'packed_colwise'; expected one of"):
        check_tensor_parallel(config, 2)  # a style ppmedia does not map, outside the routed experts


def test_a_tp_mesh_shards_the_plan_and_leaves_the_rest_whole(world_of_one):
    from torch.distributed.tensor import DTensor, Shard

    with pytest.raises(ValueError, match=r"pp 2 x dp 1 x cp 1 x tp 1 = 2; the world has 1 ranks"):
        pipeline_mesh(2)
    mesh = pipeline_mesh(1)
    assert mesh.mesh_dim_names == ("dp", "pp", "cp", "tp")
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

#: exports of the same step from tp and FSDP2 stages: AdamW's step on gradients equal within ~1e-7
#: (measured largest weight difference: see docs/tensor-parallel.md)
EXPORT_TOL = 1e-5


def _reference_losses(steps):
    """The model itself, one process, full batches, train.py's AdamW (1e-3, weight decay 0.01 but none
    on biases, 1-D norm weights and the embedding table) after clipping to norm 1: the losses ``--pp 2``
    and ``--pp 2 --dp 2 --fsdp`` reproduce within 1e-5 (tests/test_fsdp_dcp.py); (loss, norm) a step."""
    from train_helpers import model_adamw_run, train_py_groups

    own = model_adamw_run("qwen2_5_vl", [step % 2 for step in range(steps)], clip=1.0, groups=train_py_groups)
    return list(zip(own.losses, own.norms))


def documented_tp_lines() -> list[str]:
    """docs/tensor-parallel.md's two commands (tests/test_docs.py leaves them to the test below)."""
    from test_docs import DOCS, command_lines, read_blocks, section

    page = DOCS / "tensor-parallel.md"
    (block,) = [b for b in read_blocks(page, section(page.read_text(), "From the command line")) if b.lang == "sh"]
    return command_lines(block)


@pytest.mark.multiprocess
def test_train_with_tp_gives_the_losses_of_the_model_and_its_checkpoint_resumes_at_pp2_dp2_fsdp(tmp_path):
    """docs/tensor-parallel.md's commands as written (a user's shell, a sandbox of the repository):
    ``torchrun --nproc-per-node 4 examples/train.py --family qwen2_5_vl --pp 2 --tp 2``: every
    step's global loss within 1e-5 of the model's own run (which ``--pp 2`` matches too), and the
    global gradient norm (summed over the tp shards) within 1e-5 of it. Its DCP checkpoint of step 1
    (tp-sharded parameters and AdamW state) resumes at ``--pp 2 --dp 2 --fsdp`` (FSDP2 shards over
    dp instead of tp) with the same loss and norm."""
    import json

    from test_docs import command_key, run_documented

    tp, fsdp = documented_tp_lines()
    assert "--pp 2 --tp 2 --steps 2 --loss-log tp.jsonl --save-dir ckpt --save-every 1 --export tp-export" in command_key(tp), tp
    assert "--pp 2 --dp 2 --fsdp --steps 2 --resume ckpt/step1 --loss-log fsdp.jsonl --export fsdp-export" in command_key(fsdp), fsdp
    out = run_documented("docs/tensor-parallel.md: From the command line", [tp, fsdp], tmp_path)[1].stdout
    assert "saved at pp=2 x dp=1 x cp=1 x tp=2" in out, out
    rows = [json.loads(line) for line in (tmp_path / "tp.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for row, (loss, norm) in zip(rows, _reference_losses(2)):
        assert abs(row["loss"] - loss) <= 1e-5, (row, loss)
        assert abs(row["grad_norm"] - norm) <= 1e-5 * norm, (row, norm)  # clipping over tp shards
    (resumed,) = [json.loads(line) for line in (tmp_path / "fsdp.jsonl").read_text().splitlines()]
    assert resumed["step"] == 1 and abs(resumed["loss"] - rows[1]["loss"]) <= 1e-5, (resumed, rows[1])
    assert abs(resumed["grad_norm"] - rows[1]["grad_norm"]) <= 1e-5 * rows[1]["grad_norm"]
    # --export from the tp stages (DTensors gathered) reloads with from_pretrained; it equals the export
    # of the resumed FSDP2 run (both after step 1 from the same checkpoint)
    from transformers import Qwen2_5_VLForConditionalGeneration

    tp_model, fsdp_model = (Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / name).state_dict()
                            for name in ("tp-export", "fsdp-export"))
    assert set(tp_model) == set(fsdp_model)
    worst = max(float((tp_model[k] - fsdp_model[k]).abs().max()) for k in tp_model)
    assert worst <= EXPORT_TOL, worst
