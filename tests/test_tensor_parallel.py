"""Tensor parallelism inside the stages, in one process: what is refused before anything is sharded,
and what a (one-rank) tp mesh shards. Parity at pp=2 x tp=2 and pp=1 x dp=2 x tp=2 runs in
tests/test_stack_mp.py's 4-process spawn."""

from __future__ import annotations

import copy

import pytest

from ppmedia.pipeline import (
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
    whole = [n for n, p in named.items() if not isinstance(p, DTensor)]
    assert "model.language_model.embed_tokens.weight" in whole and f"{layer}.input_layernorm.weight" in whole
    assert any(n.startswith("model.visual.") for n in whole)
    with pytest.raises(ValueError, match="stage 0 is tensor-parallel already"):
        apply_tensor_parallel(modules, mesh["tp"])
    with pytest.raises(ValueError, match="is not tensor-parallel"):
        reduce_tensor_parallel_gradients(build_stage_modules(copy.deepcopy(model), 2))
    sharded = build_stage_modules(copy.deepcopy(model), 2)
    apply_fsdp(sharded, mesh["dp"])
    with pytest.raises(ValueError, match="sharded with FSDP2 already; apply tensor parallelism first"):
        apply_tensor_parallel(sharded, mesh["tp"])


def test_a_head_tied_to_the_embedding_stays_whole(world_of_one):
    from torch.distributed.tensor import DTensor

    modules = build_stage_modules(tiny_models.load("gemma3").build_model(0), 2)
    apply_tensor_parallel(modules, pipeline_mesh(1)["tp"])
    head = dict(modules[1].named_parameters())[f"{modules[1].head_name}.weight"]
    assert not isinstance(head, DTensor)
    q = dict(modules[1].named_parameters())["model.language_model.layers.1.self_attn.q_proj.weight"]
    assert isinstance(q, DTensor)
