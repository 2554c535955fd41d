"""Llama 4, InternVL, GLM-4.1V / 4.5V / 4.6V and ERNIE 4.5 VL MoE through real 2-process pipelines (gloo
on 127.0.0.1), ONE spawn for all of them: each family under GPipe (shapes inferred) and 1F1B (static
shapes), two training steps, loss and every gradient against the model's own full-batch forward within
1e-5.

What crosses the stage boundary besides hidden states and mask: nothing for Llama 4 and InternVL (each
stage computes its 1-D positions, Llama 4's chunked masks and NoPE scales itself); the mrope positions
for the GLM families; positions and ``moe_mm_token_type_ids`` for ERNIE (its MoE layer is on stage 1,
so token types lost there would change the loss: test_ernie4_5_vl_adapter.py shows it). The GLM video
path runs in ``glm4v_moe``'s batch; images with videos in one batch cannot run through transformers'
own forward, the reference here (test_glm4v_adapter.py checks that merge per modality).
"""

from __future__ import annotations

import pytest

from ppmedia.testing.parity import ParityError, run_parity

TOL = 1e-5
FAMILIES = ("llama4", "internvl", "glm4v", "glm4v_moe", "glm46v", "ernie4_5_vl_moe")
SCENARIOS = ("gpipe/inferred", "1f1b/static")
_report: list[object] = []


def _run():
    if not _report:
        try:
            _report.append(run_parity(FAMILIES, SCENARIOS, steps=2, n_microbatches=4, tolerance=TOL))
        except ParityError as exc:  # one spawn for the module, failure included
            _report.append(exc)
    if isinstance(_report[0], Exception):
        raise _report[0]
    return _report[0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_matches_the_full_batch_model(family, scenario):
    result = _run().family(family).scenario(scenario)
    assert result.missing_params == [], "every parameter on some stage"
    assert result.layers_per_stage == [1, 1]
    for st in result.steps:
        where = f"{family} {scenario} step {st.step}"
        assert st.loss_diff <= TOL, f"{where}: loss {st.loss_pipeline} vs {st.loss_reference}"
        assert st.grad_diff_vision <= TOL and st.grad_diff_lm <= TOL, f"{where}: {st.grad_diff_vision}, {st.grad_diff_lm}"
        assert st.vision_params_compared > 0 and st.reference_grad_max_vision > 1e-4 and st.reference_grad_max_lm > 1e-4
        inference = scenario.endswith("inferred") and st.step == 0
        assert st.first_stage_calls == st.expected_first_stage_calls == 4 + inference
        assert st.chunk_trace == [0] * inference + [0, 1, 2, 3]
    assert result.steps[0].loss_reference != result.steps[1].loss_reference  # the SGD step happened
    assert result.passed(TOL)


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", FAMILIES)
def test_microbatch_2_is_text_only(family):
    micro = _run().family(family).microbatches
    assert [m.text_only for m in micro] == [False, False, True, False]
    assert all(m.placeholder_tokens > 0 for k, m in enumerate(micro) if k != 2)
