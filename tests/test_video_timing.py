"""Video timing: a Qwen2.5-VL batch at fps 1 (``second_per_grid_ts`` = 2 s per temporal step) gives the
model's own mrope positions per microbatch.

``second_per_grid_ts`` is ``[videos]``: it must leave the batch and travel with its videos
(``VlmMediaChunk.second_per_grid_ts``): ``split_media`` pops it and splits it with its videos, and the
adapter passes the chunk's seconds to ``get_rope_index``.
"""

from __future__ import annotations

import pytest
import torch

import ppmedia
from ppmedia.testing.tiny_models import qwen2_5_vl as tiny


@pytest.fixture(scope="module")
def model():
    return tiny.build_model(0)


def _own_positions(model, batch, seconds):
    """The position ids the model's own forward hands its language model."""
    seen = {}

    def hook(_module, _args, kwargs):
        seen["position_ids"] = kwargs["position_ids"]

    handle = model.model.language_model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**tiny.reference_inputs(batch), second_per_grid_ts=seconds)
    finally:
        handle.remove()
    return seen["position_ids"]


@pytest.mark.parametrize("fps", [1.0, 0.5])
def test_qwen2_5_vl_positions_follow_the_videos_fps(model, fps):
    torch.set_num_threads(1)
    batch = tiny.build_batch(0)
    n_videos = batch["video_grid_thw"].shape[0]
    seconds = torch.full((n_videos,), tiny.TEMPORAL_PATCH_SIZE / fps)  # what the processor writes
    expected = _own_positions(model, batch, seconds)
    default = _own_positions(model, batch, None)
    # at fps 1 the temporal positions of a video's second step move by tokens_per_second (4 here)
    assert (expected - default).abs().max() >= 4

    adapter = ppmedia.get_adapter(model)
    # as the processor gives it: a list of floats, one per video (a [videos] tensor works the same)
    for given in (seconds.tolist(), seconds):
        work = dict(batch, second_per_grid_ts=given)
        staged = ppmedia.split_media(work, 4, **adapter.media_counts(work, model.config))
        assert "second_per_grid_ts" not in work  # per video: split with its videos, never left to the schedule
        B = batch["input_ids"].shape[0]
        assert all(v.shape[0] == B for v in work.values())  # only [B, ...] keys are left
        assert list(staged.videos) == [0, 2, 0, 1]
        for k, (a, b) in enumerate(staged.samples):
            chunk = staged.chunk(k)
            if chunk is not None and chunk.pixel_values_videos is not None:
                assert chunk.second_per_grid_ts is not None
                assert chunk.second_per_grid_ts.shape == (staged.videos[k],)
            ids, mask = batch["input_ids"][a:b], batch["attention_mask"][a:b]
            got = adapter.position_ids(model, ids, chunk, attention_mask=mask)
            assert torch.equal(got, expected[:, a:b]), k
