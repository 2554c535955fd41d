"""The audio families through real 2-process pipelines (gloo on 127.0.0.1), ONE spawn for all of them:
Gemma 4, the Qwen2.5-Omni and Qwen3-Omni thinkers and Inkling, each under GPipe (shapes inferred),
1F1B (static shapes) and Interleaved1F1B (4 stages over the 2 ranks), two training steps, loss and every gradient (vision and audio towers included)
against the model's own full-batch forward within 1e-5; 1F1B on stages each rank loads from a
checkpoint of the model (``stages_from_pretrained``); and a batch with other media, which the
comparison must catch.

The default splits cut through every cross-layer dependency: Gemma 4's 2 + 2 split sends layers 2-3's
per-layer inputs and both layer types' shared KV to stage 1 (``Gemma4Adapter.stage_hooks``), and its
interleaved 1 + 1 + 1 + 1 split passes the KV through a middle stage that neither makes nor reads it;
the Omni thinkers' 1 + 1 splits send the 3-D positions with audio (Qwen3-Omni's as float32, and its
deepstack features), their interleaved 0 + 1 + 1 + 0 split sends them from a first stage without a
layer. Every other split of these families runs in process (test_gemma4_adapter.py,
test_qwen_omni_adapter.py).
"""

from __future__ import annotations

import pytest

from conftest import assert_pipeline_matches, parity_once
from ppmedia.testing.parity import Scenario, microbatch_table

TOL = 1e-5
FAMILIES = ("gemma4", "qwen2_5_omni", "qwen3_omni", "inkling")
SCENARIOS = ("gpipe/inferred", "1f1b/static", "interleaved/static")
WRONG_BATCH = Scenario("1f1b", "static", "wrong_batch")
PRETRAINED = Scenario("1f1b", "static", pretrained=True)
#: the encoder spread (issue 19): both ranks encode a share of the microbatches' media, clips included
SPREAD = Scenario("1f1b", "static", encoder="spread")
#: decoder layers per stage of each family's tiny model under the 2-stage and the 4-stage schedules
LAYERS = {"gemma4": ([2, 2], [1, 1, 1, 1])}
#: two samples a row (ppmedia.packing): Gemma 4's audio and sliding windows, Qwen2.5-Omni's 3-D positions per sample
PACKED = Scenario("1f1b", "static", packed=True)
PACKED_FAMILIES = ("gemma4", "qwen2_5_omni")
_run = parity_once(FAMILIES, [*SCENARIOS, WRONG_BATCH, PRETRAINED, SPREAD], tolerance=TOL,
                   family_scenarios={f: (PACKED,) for f in PACKED_FAMILIES})


def _layers(family: str, scenario: str) -> list[int]:
    two, four = LAYERS.get(family, ([1, 1], [0, 1, 1, 0]))
    return four if scenario.startswith("interleaved") else two


@pytest.mark.multiprocess
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_matches_the_full_batch_model(family, scenario):
    result = _run().family(family).scenario(scenario)
    assert result.n_stages == (4 if scenario.startswith("interleaved") else 2)
    assert_pipeline_matches(result, family, scenario, TOL, _layers(family, scenario))


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", FAMILIES)
def test_a_pipeline_loaded_from_a_checkpoint_matches_the_model(family):
    """Each rank reads only its stages from the checkpoint (Gemma 4: the PLE tables on stage 0 only)."""
    result = _run().family(family).scenario(PRETRAINED.name)
    assert result.name == "1f1b/static/pretrained"
    assert_pipeline_matches(result, family, result.name, TOL, _layers(family, result.name))


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", FAMILIES)
def test_the_encoder_spread_matches_the_model(family):
    """Qwen3-Omni: deepstack sets for the vision modalities only, none for its audio."""
    result = _run().family(family).scenario(SPREAD.name)
    assert result.name == "1f1b/static/spread"
    assert_pipeline_matches(result, family, result.name, TOL, _layers(family, result.name))


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", FAMILIES)
def test_media_of_another_batch_fail_the_comparison(family):
    """Same layout, other pixels and clips: nothing raises, but the harness sees the losses and grads differ."""
    report = _run()
    result = report.family(family).scenario(WRONG_BATCH.name)
    assert not result.passed(TOL)
    for st in result.steps:
        assert st.loss_diff > 1e-4 and st.grad_diff_vision > 1e-4
    assert report.ok  # a deliberate fault does not count against the run


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", FAMILIES)
def test_microbatch_2_is_text_only_and_the_clips_are_counted(family):
    micro = _run().family(family).microbatches
    assert micro == microbatch_table(family, 4)
    assert [m.text_only for m in micro] == [False, False, True, False]
    assert all(m.placeholder_tokens > 0 for k, m in enumerate(micro) if k != 2)
    assert micro[2].audios == 0 and sum(m.audios for m in micro) > 0


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", PACKED_FAMILIES)
def test_packed_rows_match_the_unpacked_model(family):
    result = _run().family(family).scenario(PACKED.name)
    assert result.packed
    assert_pipeline_matches(result, family, PACKED.name, TOL, _layers(family, PACKED.name))
