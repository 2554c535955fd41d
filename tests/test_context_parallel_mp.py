"""Context parallelism against the model's own single-process run (ppmedia.testing.parity.context): one spawned
group of 4 gloo processes runs pp2 x cp2 and pp1 x cp2 under 1F1B, GPipe, ZBV and Interleaved for Qwen2.5-VL
(images and videos whose token runs straddle a shard boundary; also with the tower frame-sharded over cp),
Qwen3-VL (deepstack), Gemma 3 (sliding window 8 on longer rows), PaliGemma, LLaVA-NeXT and packed rows: loss,
every gradient and the gathered logits within 1e-5."""

from __future__ import annotations

import pytest

from ppmedia.testing.parity.context import CP_SCENARIOS, run_context_parity

TOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_context_parity(str(tmp_path_factory.mktemp("cp")))


@pytest.mark.multiprocess
@pytest.mark.parametrize("index", range(len(CP_SCENARIOS)), ids=[sc.name for sc in CP_SCENARIOS])
def test_cp_matches_the_models_own_run(results, index):
    rows = [per_rank[index] for per_rank in results]
    with_loss = [row for row in rows if "loss" in row]
    assert len(with_loss) >= 2  # the last stage's two cp ranks
    for row in rows:
        assert row["compared"] > 0, row
        assert row["grad"] <= TOL, row
    for row in with_loss:
        assert abs(row["loss"] - row["ref_loss"]) <= TOL, row
        if "logits" in row:
            assert row["logits"] <= TOL, row


@pytest.mark.multiprocess
def test_media_runs_straddle_the_shard_boundary(results):
    by_name = {row["scenario"]: row for row in results[0]}
    assert by_name["qwen2_5_vl pp2xcp2 1f1b"]["straddles"] and by_name["qwen3_vl pp2xcp2 ZBVZeroBubble"]["straddles"]


@pytest.mark.multiprocess
def test_frame_sharding_divides_the_towers_items(results):
    """With --cp-vision shard, stage 0's two cp ranks each encode a share of the patch rows the replicated
    tower encodes on both (whole items: together exactly all of them)."""
    def encoded(name):
        return [next(row["encoded"] for row in per_rank if row["scenario"] == name) for per_rank in results[:2]]

    replicated, sharded = encoded("qwen2_5_vl pp2xcp2 1f1b"), encoded("qwen2_5_vl pp2xcp2 1f1b vision-shard")
    assert replicated[0] == replicated[1] > 0
    assert sum(sharded) == replicated[0] and 0 < min(sharded) and max(sharded) < replicated[0], sharded
