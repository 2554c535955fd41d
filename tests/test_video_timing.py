"""Video timing: a Qwen2.5-VL batch at fps 1 (``second_per_grid_ts`` = 2 s per temporal step) gives the
model's own mrope positions per microbatch.

``second_per_grid_ts`` is ``[videos]``: it must leave the batch and travel with its videos
(``VlmMediaChunk.second_per_grid_ts``). Here its per-microbatch slices are attached to the chunks by
hand (by the microbatch's video counts) so the test holds whether or not ``split_media`` pops the key
itself; the adapter's part is to pass the chunk's seconds to ``get_rope_index``.
"""

from __future__ import annotations

import dataclasses

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
    work = dict(batch, second_per_grid_ts=seconds)
    seconds_in_batch = work.pop("second_per_grid_ts")  # per video: never left for the schedule to cut
    staged = ppmedia.split_media(work, 4, **adapter.media_counts(batch, model.config))
    B = batch["input_ids"].shape[0]
    assert all(v.shape[0] == B for v in work.values())  # only [B, ...] keys are left
    starts = [0]
    for count in staged.videos:
        starts.append(starts[-1] + count)
    assert list(staged.videos) == [0, 2, 0, 1]
    for k, (a, b) in enumerate(staged.samples):
        chunk = staged.chunk(k)
        if chunk is not None:
            chunk = dataclasses.replace(chunk, second_per_grid_ts=seconds_in_batch[starts[k] : starts[k + 1]])
        ids, mask = batch["input_ids"][a:b], batch["attention_mask"][a:b]
        got = adapter.position_ids(model, ids, chunk, attention_mask=mask)
        assert torch.equal(got, expected[:, a:b]), k
