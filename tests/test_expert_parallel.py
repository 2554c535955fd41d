"""Expert parallelism in one process: what is refused before anything starts (train.py's options, the
mesh, the families), and the dispatch on an ``ep`` mesh of one rank against the model's own experts
(the multi-rank parity is in tests/test_expert_parallel_mp.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from ppmedia import pipeline
from ppmedia.testing import tiny_models
from ppmedia.train.options import parse_args


def _exit_2(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_bad_ep_options_exit_2_with_one_line_naming_ep_and_the_model_type(capsys):
    line = _exit_2(["--family", "glm4v_moe", "--dp", "2", "--ep", "3"], capsys)
    assert "--ep 3 does not divide --dp 2" in line, line
    line = _exit_2(["--family", "qwen2_5_vl", "--dp", "2", "--ep", "2"], capsys)
    assert "--ep 2: model type qwen2_5_vl has no routed experts" in line, line
    line = _exit_2(["--family", "llama4", "--dp", "2", "--ep", "2"], capsys)
    assert "--ep 2: model type llama4 is refused" in line and "every expert on every token" in line, line
    line = _exit_2(["--family", "glm4v_moe", "--dp", "2", "--ep", "2", "--fsdp", "--bf16"], capsys)
    assert "--bf16 with --ep 2: FSDP2's mixed precision" in line and "docs/composition.md" in line, line
    assert "--ep must be a finite number > 0 (got 0)" in _exit_2(["--ep", "0"], capsys)
    args = parse_args(["--family", "glm4v_moe", "--dp", "2", "--ep", "2", "--fsdp"])
    assert args.ep == 2


def test_the_families_table_says_built_or_refused_and_the_tiny_models_agree():
    assert pipeline.EP_FAMILIES["llama4"][0] == "refused"
    for family, model_type in [("glm4v_moe", "glm4v_moe"), ("ernie4_5_vl_moe", "ernie4_5_vl_moe"),
                               ("qwen3_omni", "qwen3_omni_moe_thinker"), ("kimi_vl", "kimi_k25"),
                               ("mistral_small4", "mistral3"), ("mistral_large4", "mistral_large4"),
                               ("minimax_m3_vl", "minimax_m3_vl"), ("inkling", "inkling_mm_model")]:
        config = tiny_models.load(family).build_config()
        assert config.model_type == model_type and pipeline.EP_FAMILIES[model_type][0] == "built"
        assert pipeline.expert_parallel_problem(config, 2) is None, family
        assert "not divisible by 8" in pipeline.expert_parallel_problem(config, 8)
    dense = tiny_models.load("glm46v").build_config()  # the tiny GLM-4.6V is dense (glm4v text)
    assert pipeline.expert_parallel_problem(dense, 2) == "--ep 2: model type glm46v has no routed experts " \
                                                        "(expected a mixture-of-experts model)"


def test_the_mesh_refuses_ep_that_does_not_divide_dp(world_of_one):
    with pytest.raises(ValueError, match=r"--ep 2 does not divide --dp 1"):
        pipeline.pipeline_mesh(1, 1, 1, ep=2)


def test_the_dispatch_on_one_rank_is_the_models_own_experts(world_of_one):
    """An ``ep`` mesh of one rank: the whole dispatch path (sort by expert, counts, all-to-all, the
    module's own experts forward on the received rows, the combine) gives the model's loss and
    gradients; a planted ``ep_order`` combine does not."""
    from torch.distributed.device_mesh import init_device_mesh

    from ppmedia.pipeline.expert_parallel import is_expert_shard, set_expert_fault
    from ppmedia.testing.tiny_models import qwen3_vl_moe

    torch.manual_seed(0)
    model = qwen3_vl_moe.build_model(0).train()
    ep_model = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    assert pipeline.apply_expert_parallel([ep_model.model.language_model], mesh) == 2
    assert sum(is_expert_shard(p) for p in ep_model.parameters()) == 4
    batch = qwen3_vl_moe.build_batch(0)
    labels = batch["input_ids"].clone()

    def run(m):
        m.zero_grad(set_to_none=True)
        out = m(**{"use_cache": False, **qwen3_vl_moe.reference_inputs(batch)}, labels=labels)
        out.loss.backward()
        return out.loss.item(), {n: p.grad for n, p in m.named_parameters()}

    loss, grads = run(model)
    ep_loss, ep_grads = run(ep_model)
    assert abs(loss - ep_loss) < 1e-6
    worst = max(float((grads[n] - (g.full_tensor() if is_expert_shard(g) else g)).abs().max()) for n, g in ep_grads.items())
    assert worst < 1e-6, worst
    set_expert_fault([ep_model], "ep_order")
    assert abs(run(ep_model)[0] - loss) > 1e-4
