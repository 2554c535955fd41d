"""The planner against a recorded encoder-spread benchmark run (issue 40).

``fixtures/bench/stage0-amd-2core.json.gz``: ``python tests/bench/run.py --stage0`` on a quiet 2-core
AMD EPYC (other processes 0.00 cores), trimmed to what the analysis reads (the probe, the loads, every
arm's step walls, the per-action timestamps of the baseline and the spread arms). The planner once
predicted the spread's ratio 0.762 against the measured 0.873: its lanes had a core per rank, each
working only in its own rank's idle time. On that machine both ranks and both lanes share two cores
(a lane runs only while some rank idles, and the two lanes halve that core), and a lane gets about
three quarters of a free core (the schedule's own Python, sends and receives between the operations).
"""

from __future__ import annotations

import gzip
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "bench"))

import stage0_bench  # noqa: E402

RUN = ROOT / "fixtures" / "bench" / "stage0-amd-2core.json.gz"
STATIC_TOLERANCE = 0.03  # the goal, met by the static arms
SPREAD_TOLERANCE = 0.065  # what the model reaches on the spread arm of this run (the goal 0.03 is not met)


@pytest.fixture(scope="module")
def recorded() -> dict:
    with gzip.open(RUN, "rt") as fh:
        return json.load(fh)


def errors(results: dict) -> dict[str, float]:
    analysis = stage0_bench.analyse(results)
    return {arm: a["predicted_ratio"] - a["ratio"] for arm, a in analysis["arms"].items()}


def test_the_lanes_got_three_quarters_of_a_free_core(recorded):
    assert recorded["cores"] == 2
    assert 0.70 <= stage0_bench.lane_share_of_run(recorded) <= 0.78


def test_the_planner_replays_the_recorded_run(recorded):
    results = {**recorded, "probe": {**recorded["probe"], "lane_share": stage0_bench.lane_share_of_run(recorded)}}
    found = errors(results)
    for arm in ("stage0/1+3", "stage0/0+4"):
        assert abs(found[arm]) <= STATIC_TOLERANCE, found
    assert abs(found["spread/nolane"]) <= 0.035, found  # the median of per-pair ratios: 0.903; of walls: 0.880
    assert abs(found["spread"]) <= SPREAD_TOLERANCE, found
    # the model before issue 40 (a core per rank, a lane in its own rank's idle time) missed by -0.111
    before = {**recorded, "cores": None}
    assert errors(before)["spread"] < -0.1
