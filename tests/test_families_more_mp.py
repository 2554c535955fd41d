"""Llama 4, InternVL, GLM-4.1V / 4.5V / 4.6V, ERNIE 4.5 VL MoE, Phi-4-multimodal and VideoLLaMA3 through real 2-process pipelines (gloo
on 127.0.0.1), ONE spawn for all of them: each family under GPipe (shapes inferred) and 1F1B (static
shapes), two training steps, loss and every gradient against the model's own full-batch forward within
1e-5.

What crosses the stage boundary besides hidden states and mask: nothing for Llama 4 and InternVL (each
stage computes its 1-D positions, Llama 4's chunked masks and NoPE scales itself); the mrope positions
for the GLM families; positions and ``moe_mm_token_type_ids`` for ERNIE (its MoE layer is on stage 1,
so token types lost there would change the loss: test_ernie4_5_vl_adapter.py shows it). The GLM video
path runs in ``glm4v_moe``'s batch; images with videos in one batch cannot run through transformers'
own forward, the reference here (test_glm4v_adapter.py checks that merge per modality). Phi-4-multimodal's
encoders sit inside its decoder stack (``merge_path``): stage 1 must hold none of them. VideoLLaMA3's
batch mixes merge sizes 1 and 2 and compresses video tokens: each microbatch's mask entries must be
its own videos' features.
"""

from __future__ import annotations

import pytest

from conftest import assert_pipeline_matches, parity_once

TOL = 1e-5
FAMILIES = ("llama4", "internvl", "glm4v", "glm4v_moe", "glm46v", "ernie4_5_vl_moe", "phi4_multimodal",
            "video_llama_3")
SCENARIOS = ("gpipe/inferred", "1f1b/static")
PACKED = "1f1b/static/packed"  # two samples a row (ppmedia.packing): GLM-4V's rope index per sample
_run = parity_once(FAMILIES, SCENARIOS, tolerance=TOL, family_scenarios={"glm4v": (PACKED,)})


@pytest.mark.multiprocess
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_matches_the_full_batch_model(family, scenario):
    assert_pipeline_matches(_run().family(family).scenario(scenario), family, scenario, TOL, [1, 1])


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", FAMILIES)
def test_microbatch_2_is_text_only(family):
    micro = _run().family(family).microbatches
    assert [m.text_only for m in micro] == [False, False, True, False]
    assert all(m.placeholder_tokens > 0 for k, m in enumerate(micro) if k != 2)


@pytest.mark.multiprocess
def test_glm4v_packed_rows_match_the_unpacked_model():
    result = _run().family("glm4v").scenario(PACKED)
    assert result.packed
    assert_pipeline_matches(result, "glm4v", PACKED, TOL, [1, 1])
