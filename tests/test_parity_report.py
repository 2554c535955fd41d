"""The parity report's verdicts and text (no processes: reports built by hand as the workers' merge
would give them; the real runs' reports are read by tests/test_stack_mp.py and the family tests)."""

from __future__ import annotations

import pytest

from ppmedia.testing.parity import ParityReport, ScenarioResult, StepResult, run_parity


def _step(**more):
    values = dict(
        step=0, loss_pipeline=4.0, loss_reference=4.0, grad_diff_vision=1e-8, grad_diff_lm=2e-8, params_compared=40,
        vision_params_compared=12, reference_grad_max_vision=0.3, reference_grad_max_lm=0.5, wall_pipeline_s=0.1,
        wall_reference_s=0.1, first_stage_calls=4, expected_first_stage_calls=4,
        worst_param_vision="model.visual.blocks.0.attn.qkv.weight",
        worst_param_lm="model.language_model.layers.1.mlp.up_proj.weight",
    )
    values.update(more)
    return StepResult(**values)


def _report(*steps, fault=None, rtol=0.0, missing=()):
    from ppmedia.testing.parity import FamilyReport

    scenario = ScenarioResult(family="tiny", schedule="1f1b", shapes="static", fault=fault, n_stages=2,
                              layers_per_stage=[1, 1], steps=list(steps), missing_params=list(missing))
    family = FamilyReport(family="tiny", model_type="tiny", n_microbatches=4, batch_size=8, seq_len=20,
                          microbatches=[], scenarios=[scenario])
    return ParityReport(world_size=2, tolerance=1e-5, launcher="spawn", wall_s=1.0, families=[family], rtol=rtol)


def test_a_failing_row_names_its_worst_parameter():
    report = _report(_step(), _step(step=1, grad_diff_lm=0.52))
    text = report.format()
    assert not report.ok
    assert ("1f1b/static step 1 FAIL: grad LM 5.2e-01 > 1.0e-05 "
            "(worst model.language_model.layers.1.mlp.up_proj.weight)") in text
    assert "step 0 FAIL" not in text  # only the step that missed
    vision = report.format().replace("grad LM", "")
    assert "worst model.visual" not in vision  # the vision side passed: not blamed


def test_a_side_without_parameters_says_so_instead_of_zero():
    report = _report(_step(vision_params_compared=0, grad_diff_vision=0.0, worst_param_vision=None, loss_pipeline=4.0000004))
    text = report.format()
    assert "no parameters compared" in text and "0.0e+00" not in text
    assert report.families[0].scenarios[0].steps[0].lm_params_compared == 40


def test_relative_tolerance_beside_the_absolute_one():
    """Gradients of 2e4 (a conformer's, from transformers' init) rounded in float32: 3e-4 apart."""
    big = _step(reference_grad_max_lm=2e4, grad_diff_lm=3e-4)
    assert not _report(big).ok  # 3e-4 > 1e-5
    relaxed = _report(big, rtol=1e-6)  # 1e-5 + 1e-6 * 2e4 = 2.0e-2
    assert relaxed.ok and "rtol 1e-06" in relaxed.format()
    # the scale is the side's own: the same rtol does not excuse a vision difference of small gradients
    assert not _report(_step(reference_grad_max_lm=2e4, grad_diff_vision=3e-4), rtol=1e-6).ok
    # the loss is relative to the reference loss
    assert _report(_step(loss_pipeline=4.00002), rtol=1e-5).ok and not _report(_step(loss_pipeline=4.00002)).ok


def test_other_misses_are_named_too():
    report = _report(_step(first_stage_calls=5), missing=["model.visual.merger.weight"])
    text = report.format()
    assert "stage-0 calls 5, expected 4" in text
    assert "1f1b/static: parameters on no stage: model.visual.merger.weight" in text
    expected = _report(_step(grad_diff_vision=0.1), fault="stale_copies")
    assert expected.ok and "fails (expected): grad vision 1.0e-01" in expected.format()


def test_tolerances_must_be_numbers():
    with pytest.raises(ValueError, match=r"rtol -1; expected numbers >= 0"):
        run_parity("qwen2_5_vl", ["1f1b"], rtol=-1)


def test_a_report_written_before_rtol_existed_still_loads():
    data = _report(_step()).to_dict()
    del data["rtol"]
    for step in data["families"][0]["scenarios"][0]["steps"]:
        del step["worst_param_vision"], step["worst_param_lm"]
    again = ParityReport.from_dict(data)
    assert again.rtol == 0.0 and again.ok


def test_a_call_while_a_worker_imports_the_script_says_what_to_do(monkeypatch):
    """What a spawned worker meets when the script it imports calls run_parity at its top level
    (multiprocessing marks the process as inheriting while it imports the main module)."""
    import multiprocessing

    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    with pytest.raises(RuntimeError, match=r"put the call under `if __name__ == \"__main__\":`"):
        run_parity("qwen2_5_vl", ["1f1b"], steps=1)
