"""The pipeline simulator against closed forms, and its calibration against known costs."""

from __future__ import annotations

import pytest

from ppmedia.planning.simulate import Calibration, fit_calibration, predict, schedule_order, simulate


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,n", [(2, 4), (4, 4), (3, 8), (1, 3)])
def test_uniform_costs_give_the_textbook_step_and_bubble(schedule, stages, n):
    f, b = 1.0, 2.0
    sim = simulate(schedule, [[f] * n] * stages, [[b] * n] * stages)
    assert sim.step_time == pytest.approx((n + stages - 1) * (f + b))
    assert sim.bubble == pytest.approx((stages - 1) / (n + stages - 1))


def test_orders_follow_torch():
    # torch 2.13 Schedule1F1B: stage s runs min(n, P - s) warmup forwards
    assert schedule_order("1f1b", 2, 4, 0) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
    assert schedule_order("1f1b", 2, 4, 1) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]
    assert schedule_order("gpipe", 2, 2, 1) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    with pytest.raises(ValueError, match="schedule"):
        schedule_order("zb", 2, 2, 0)


def test_every_operation_respects_its_dependencies():
    fwd = [[5, 1, 1, 1], [1, 1, 1, 1]]
    sim = simulate("1f1b", fwd, latency=0.5)
    end = {(op, s, m): e for s, ops in enumerate(sim.timeline) for op, m, _, e in ops}
    for s, ops in enumerate(sim.timeline):
        last = 0.0
        for op, m, start, stop in ops:
            assert start >= last - 1e-12
            last = stop
            if op == "F" and s > 0:
                assert start >= end[("F", s - 1, m)] + 0.5 - 1e-12
            if op == "B" and s == 0:
                assert start >= end[("B", 1, m)] + 0.5 - 1e-12


def test_a_skewed_first_stage_costs_more_than_a_spread_one_under_1f1b():
    cal = Calibration([20.0, 20.0], 10.0, [2.0, 2.0])
    skewed = predict("1f1b", [8, 0, 0, 0], cal)
    spread = predict("1f1b", [2, 2, 2, 2], cal)
    assert spread.step_time < skewed.step_time and spread.bubble < skewed.bubble
    assert predict("1f1b", [4, 4, 0, 0], cal).step_time < predict("1f1b", [0, 0, 4, 4], cal).step_time  # heavy first


def test_fit_calibration_recovers_known_costs_and_latency():
    truth = Calibration([10.0, 12.0], 3.0, [2.0, 1.5], latency=0.7)
    loads = [6.0, 1.0, 0.0, 2.0]
    fwd, bwd = truth.costs(loads)
    measured = simulate("1f1b", fwd, bwd, latency=0.7).step_time
    fitted = fit_calibration(fwd, bwd, loads, step_time=measured)
    assert fitted.text_forward == pytest.approx([10.0, 12.0])
    assert fitted.vision_per_unit == pytest.approx(3.0)
    assert fitted.backward_ratio == pytest.approx([2.0, 1.5])
    assert fitted.latency == pytest.approx(0.7, abs=1e-6)


def test_bad_costs_are_refused():
    with pytest.raises(ValueError, match=r"backward: shape \[1, 2\]; expected \[2, 2\]"):
        simulate("1f1b", [[1, 1], [1, 1]], [[1, 1]])
    with pytest.raises(ValueError, match="finite"):
        simulate("gpipe", [[1, -1]])


def test_plan_command_prints_loads_and_both_predictions(capsys, tmp_path):
    import json
    import pathlib

    from ppmedia.cli import main

    path = pathlib.Path(__file__).resolve().parent.parent / "fixtures/qwen2_5_vl/inputs.safetensors"
    assert main(["plan", str(path), "--microbatches", "4", "--stages", "2", "--schedule", "all"]) == 0
    out = capsys.readouterr().out
    assert "qwen2_5_vl encoder cost" in out and "1f1b" in out and "gpipe" in out and "uncalibrated" in out
    row = next(line for line in out.splitlines() if line.startswith("1f1b"))
    ratio = float(row.split()[-1])
    assert ratio < 1.0  # the fixture batch has a text-only microbatch: balancing shortens the 1F1B step
    calibration = tmp_path / "cal.json"
    calibration.write_text(json.dumps({"text_forward": [10.0, 30.0], "vision_per_unit": 5.0,
                                       "backward_ratio": [2.0, 2.0], "latency": 0.5}))
    assert main(["plan", str(path), "--microbatches", "4", "--stages", "2", "--calibration", str(calibration)]) == 0
    assert "step (ms)" in capsys.readouterr().out
    assert main(["plan", str(path), "--microbatches", "4", "--stages", "3", "--calibration", str(calibration)]) == 1
    assert "calibrated for 2 stages" in capsys.readouterr().err
    assert main(["plan", str(tmp_path / "missing.pt"), "--microbatches", "4", "--stages", "2"]) == 1
    assert capsys.readouterr().err.count("\n") == 1


def test_plan_command_refuses_bad_arguments_like_inspect(capsys, tmp_path):
    import pathlib

    from ppmedia.cli import main

    path = pathlib.Path(__file__).resolve().parent.parent / "fixtures/qwen2_5_vl/inputs.safetensors"
    assert main(["plan", str(path), "--microbatches", "9", "--stages", "2"]) == 2  # 8 samples
    assert capsys.readouterr().err == (
        f"ppmedia: error: argument --microbatches: got 9 for a batch of 8 samples in {path}; expected 1..8 (the "
        "schedule's split gives at most one microbatch per sample) (see 'ppmedia plan --help')\n"
    )
    assert main(["plan", str(path), "--microbatches", "4", "--stages", "0"]) == 2
    assert capsys.readouterr().err.startswith("ppmedia: error: argument --stages: got 0; expected an integer >= 1")
    bad = tmp_path / "cal.json"
    bad.write_text("[1, 2]")
    assert main(["plan", str(path), "--microbatches", "4", "--stages", "2", "--calibration", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"ppmedia: error: argument --calibration: {bad}: not a calibration JSON object") and err.count("\n") == 1
