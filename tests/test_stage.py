"""stage_media: set, check, always clear; and the shape-inference forward does not cost a chunk."""

import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from ppmedia import CURSOR_ATTRIBUTE, STAGED_ATTRIBUTES, next_vlm_media_chunk, split_media, stage_media


def _staged(n=4, B=8):
    pv = torch.arange(float(B)).reshape(B, 1)
    return split_media({"input_ids": torch.zeros(B, 3), "pixel_values": pv, "image_grid_thw": torch.ones(B, 3, dtype=torch.long)}, n)


def _attrs(module):
    return {name for name in (*STAGED_ATTRIBUTES.values(), CURSOR_ATTRIBUTE) if name in vars(module)}


def test_sets_lists_and_cursor_then_clears(first_stage):
    staged = _staged()
    with stage_media(first_stage, staged) as s:
        assert s is staged
        assert first_stage._vlm_chunk_idx == 0
        assert first_stage._vlm_pixel_values_chunks == staged.chunks["pixel_values"]
        assert first_stage._vlm_pixel_values_videos_chunks is None
        for _ in range(4):
            next_vlm_media_chunk(first_stage)
    assert _attrs(first_stage) == set()


@pytest.mark.parametrize("calls, consumed", [(3, 3), (0, 0)])
def test_too_few_consumed_raises_and_clears(first_stage, calls, consumed):
    with pytest.raises(ValueError, match=rf"consumed {consumed} of 4 staged microbatches"):
        with stage_media(first_stage, _staged()):
            for _ in range(calls):
                next_vlm_media_chunk(first_stage)
    assert _attrs(first_stage) == set()


def test_too_many_consumed_raises_from_the_consumer(first_stage):
    with pytest.raises(ValueError, match="has 4 entries but microbatch 4"):
        with stage_media(first_stage, _staged()):
            for _ in range(5):
                next_vlm_media_chunk(first_stage)
    assert _attrs(first_stage) == set()


def test_exception_in_step_still_clears(first_stage):
    with pytest.raises(RuntimeError, match="boom"):
        with stage_media(first_stage, _staged()):
            next_vlm_media_chunk(first_stage)
            raise RuntimeError("boom")
    assert _attrs(first_stage) == set()


def test_refuses_to_stage_twice(first_stage):
    with stage_media(first_stage, _staged(n=1)):
        with pytest.raises(ValueError, match="already staged"):
            with stage_media(first_stage, _staged(n=1)):
                pass
        next_vlm_media_chunk(first_stage)
    first_stage._vlm_chunk_idx = 3  # left over by someone else's staging
    with pytest.raises(ValueError, match="already staged"):
        with stage_media(first_stage, _staged()):
            pass


def test_type_errors(first_stage):
    with pytest.raises(TypeError, match="expected ppmedia.StagedMedia"):
        with stage_media(first_stage, [torch.ones(1)]):
            pass
    with pytest.raises(TypeError, match="expected the first PipelineStage"):
        with stage_media(object(), _staged()):
            pass


class _Recorder(torch.nn.Module):
    """First (and only) stage: records which image each forward got."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(1, 1)
        self.seen = []

    def forward(self, x):
        chunk = next_vlm_media_chunk(self)
        self.seen.append(None if chunk is None else chunk.pixel_values[:, 0].tolist())
        return self.lin(x) + (0 if chunk is None else chunk.pixel_values.sum())


def _world_of_one(rank, port, out_path):
    """In a spawned child: a one-rank gloo group and a real ScheduleGPipe without static shapes.

    The child records what each first-stage forward got and writes it to ``out_path``; the tests
    assert in the parent. It ends with ``exit_worker`` (no interpreter teardown after gloo).
    """
    import json

    from ppmedia.testing.parity import exit_worker

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    results = {}
    try:
        module = _Recorder()
        stage = PipelineStage(module, 0, 1, torch.device("cpu"))
        schedule = ScheduleGPipe(stage, 4, loss_fn=lambda out, target: out.sum())
        steps = []
        for _ in range(2):
            with stage_media(stage, _staged()):
                schedule.step(torch.zeros(8, 1), target=torch.zeros(8, 1))
            steps.append({"seen": module.seen[:], "patched": "_prepare_forward_infra" in vars(stage)})
            module.seen.clear()
        results["stage"] = steps

        module = _Recorder()
        stage = PipelineStage(module, 0, 1, torch.device("cpu"))
        schedule = ScheduleGPipe(stage, 4, loss_fn=lambda out, target: out.sum())
        try:
            with stage_media(module, _staged()):
                schedule.step(torch.zeros(8, 1), target=torch.zeros(8, 1))
            results["bare"] = {"raised": None}
        except RuntimeError as exc:  # the schedule wraps the stage's error
            cause = exc.__cause__
            results["bare"] = {"raised": type(exc).__name__, "message": str(exc),
                               "cause": type(cause).__name__, "cause_message": str(cause),
                               "left": sorted(_attrs(module))}
    finally:
        dist.destroy_process_group()
    with open(out_path, "w") as fh:
        json.dump(results, fh)
    exit_worker(0)


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory):
    import json

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path_factory.mktemp("world_of_one") / "results.json"
    mp.spawn(_world_of_one, args=(port, str(out)), nprocs=1, join=True)
    return json.loads(out.read_text())


def test_shape_inference_forward_does_not_cost_a_chunk(world_of_one):
    """A real schedule without static shapes calls the first stage 5 times on its first step."""
    expected = [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]
    first, second = world_of_one["stage"]
    # step 0: the shape-inference forward saw microbatch 0's media, then every microbatch its own
    assert first["seen"] == [expected[0]] + expected
    assert second["seen"] == expected
    assert not first["patched"] and not second["patched"]  # the stage is left as it was


def test_bare_module_loses_a_chunk_and_says_why(world_of_one):
    bare = world_of_one["bare"]
    assert bare["raised"] == "RuntimeError" and "failed to run forward" in bare["message"]
    assert bare["cause"] == "ValueError"
    assert "microbatch 4" in bare["cause_message"] and "shape-inference forward" in bare["cause_message"]
    assert bare["left"] == []


def test_text_only_batch_needs_no_consumption(first_stage):
    staged = split_media({"input_ids": torch.zeros(4, 3)}, 2)
    with stage_media(first_stage, staged):
        assert next_vlm_media_chunk(first_stage) is None
        assert first_stage._vlm_chunk_idx == 0
    assert _attrs(first_stage) == set()
