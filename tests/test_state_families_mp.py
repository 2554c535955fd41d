"""The later families through real 2-process pipelines (gloo on 127.0.0.1), ONE spawn for all of them:
Mistral Large 4, Mistral Small 4, LLaVA-1.5, Pixtral-backbone LLaVA, MiniMax-M3-VL, Inkling 2 and
Kimi-K2.5 with multi-frame videos, each under GPipe (shapes inferred), 1F1B (static shapes) and
Interleaved1F1B (4 stages over the 2 ranks), two training steps, loss and every gradient against the
model's own full-batch forward within 1e-5.

The splits cut through every cross-layer dependency: Mistral Large 4's default 2 + 2 split sends
layer 1's top-k indices and layers 0 and 1's latent KV to stage 1, the interleaved 1 + 1 + 1 + 1 split
sends KV through the middle stages; Inkling 2's block states cross every boundary
(test_mistral_large4_adapter.py and test_inkling2_adapter.py show what crosses each split, and that an
adapter dropping it fails).
"""

from __future__ import annotations

import pytest

from ppmedia.testing.parity import ParityError, run_parity

TOL = 1e-5
FAMILIES = ("mistral_large4", "mistral_small4", "llava", "llava_pixtral", "minimax_m3_vl", "inkling2", "kimi_k25_video")
SCENARIOS = ("gpipe/inferred", "1f1b/static", "interleaved/static")
#: decoder layers per stage of each family's tiny model under the 2-stage and the 4-stage schedules
LAYERS = {"mistral_large4": ([2, 2], [1, 1, 1, 1]), "inkling2": ([2, 2], [1, 1, 1, 1])}
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
    two, four = LAYERS.get(family, ([1, 1], [0, 1, 1, 0]))
    assert result.layers_per_stage == (four if scenario.startswith("interleaved") else two)
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
