"""LLaVA-OneVision, Idefics3, SmolVLM, PaliGemma 2 and Aya Vision through real 2-process pipelines (gloo
on 127.0.0.1), ONE spawn for all of them: GPipe (shapes inferred on the first step) and 1F1B (static
shapes), two training steps, loss and every gradient against the model's own full-batch forward within
1e-5, every staged chunk consumed exactly once.

What crosses the stage boundary besides the hidden states: PaliGemma's prefix-LM ``token_type_ids``
(``tests/test_paligemma_adapter.py`` shows a later stage given wrong ones fails); Idefics3 and SmolVLM
run their language model at ``model.text_model``; their text-only microbatch 2 carries padding crops
that never reach the encoder (SmolVLM's own would invent a crop). In the same spawn, PaliGemma with
pre-split microbatches under the V-shaped ZBVZeroBubble: its ``token_type_ids`` reach stage 0 per
microbatch in the ``media`` keyword (a per-sample input) and every later stage over the wire.
"""

from __future__ import annotations

import pytest

from conftest import assert_pipeline_matches, parity_once

TOL = 1e-5
FAMILIES = ("llava_onevision", "idefics3", "smolvlm", "paligemma", "aya_vision")
SCENARIOS = ("gpipe/inferred", "1f1b/static")
PRESPLIT = "ZBVZeroBubble/static/presplit"
PACKED = "1f1b/static/packed"  # two samples a row (ppmedia.packing): each prefix bidirectional within its sample
_run = parity_once(FAMILIES, SCENARIOS, tolerance=TOL, family_scenarios={"paligemma": (PRESPLIT, PACKED)})


@pytest.mark.multiprocess
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_matches_the_full_batch_model(family, scenario):
    assert_pipeline_matches(_run().family(family).scenario(scenario), family, scenario, TOL, [1, 1])


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", FAMILIES)
def test_microbatch_2_has_no_placeholders(family):
    micro = _run().family(family).microbatches
    assert [m.placeholder_tokens > 0 for m in micro] == [True, True, False, True]
    # samples on axis 0 (Idefics3, SmolVLM): microbatch 2 still stages its samples' padding crops
    assert micro[2].text_only == (family not in ("idefics3", "smolvlm"))


@pytest.mark.multiprocess
def test_paligemma_presplit_carries_its_token_type_ids_per_microbatch():
    """Stages 0 and 3 on rank 0 both get each microbatch's ``media`` keyword (stage 3 ignores it); the
    loss and every gradient match the model's own run and the staging path's loss."""
    report = _run().family("paligemma")
    result = report.scenario(PRESPLIT)
    assert result.presplit and result.stage_indices == [[0, 3], [1, 2]]
    assert result.passed(TOL) and result.missing_params == []
    for st, staged in zip(result.steps, report.scenario("1f1b/static").steps):
        assert st.chunk_trace == [0, 1, 2, 3] and st.media_rows
        assert abs(st.loss_pipeline - staged.loss_pipeline) <= TOL


@pytest.mark.multiprocess
def test_paligemma_packed_rows_match_the_unpacked_model():
    result = _run().family("paligemma").scenario(PACKED)
    assert result.packed
    assert_pipeline_matches(result, "paligemma", PACKED, TOL, [1, 1])
