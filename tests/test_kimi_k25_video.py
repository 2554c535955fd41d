"""Kimi-K2.5 videos with several frames per chunk (t > 1), which transformers 5.23's own
``get_video_features`` cannot run: the Kimi-VL adapter feeds the model's tower and projector itself.

The reference is the model with that one method replaced (``tiny_models.kimi_k25_video.VideoSplitFixed``:
the model's own tower and projector, one chunk per call); the adapter runs all chunks of one ``t`` per
call. (The Kimi-K2.5 video processor needs torchvision, which cannot be installed here.)
"""

from __future__ import annotations

import pytest
import torch

import ppmedia
from ppmedia.adapters.kimi_vl import KimiVLAdapter
from ppmedia.testing import check_adapter, check_stage_splits
from ppmedia.testing.tiny_models import kimi_k25_video as tiny

ATOL = 1e-5


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_transformers_own_forward_fails_on_these_videos(batch):
    from transformers import Kimi_K25ForConditionalGeneration

    plain = Kimi_K25ForConditionalGeneration(tiny.build_config()).eval()
    with pytest.raises(RuntimeError), torch.no_grad():
        plain(**tiny.reference_inputs(batch))


def test_chunks_per_sample(model, batch, adapter):
    assert isinstance(adapter, KimiVLAdapter)
    counts = adapter.media_counts(batch, model.config)
    assert counts["images_per_sample"].tolist() == [1, 0, 1, 1, 0, 0, 1, 0]
    assert counts["videos_per_sample"].tolist() == [1, 2, 0, 1, 0, 0, 1, 1]
    with pytest.raises(ValueError, match=r"num_chunks_per_video: \[2, 1, 1, 1, 1\]; sample 0 holds video chunks up to row 1"):
        adapter.media_counts(dict(batch, num_chunks_per_video=[2, 1, 1, 1, 1]), model.config)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_merge_matches_the_models_own_per_microbatch(model, batch, n):
    """Chunks of 2, 3 and 4 frames, several in one microbatch (n = 1, 2: one tower call per run of
    equal t), against the model's own merge with per-chunk features."""
    checks = check_adapter(tiny, microbatches=[n], model=model, batch=batch)
    assert len(checks) == n and max(c.max_abs_diff for c in checks) <= ATOL
    if n == 4:
        assert [c.has_media for c in checks] == [True, True, False, True]


def test_stage_split_matches_the_model(model, batch):
    (check,) = check_stage_splits(tiny, [(1, 1)], model=model, batch=batch)
    assert check.max_grad_diff <= ATOL


def test_video_grid_must_cover_the_patches(model, batch, adapter):
    staged = ppmedia.split_media(dict(batch), 4, **adapter.media_counts(batch, model.config))
    chunk = staged.chunk(0)
    ids = batch["input_ids"][:2]
    short = ppmedia.VlmMediaChunk(chunk.pixel_values, chunk.image_grid, chunk.pixel_values_videos[:-1], chunk.video_grid)
    with pytest.raises(ValueError, match=r"video_grid_thw \[3, 3\] covers 64 patches but pixel_values_videos \[63, 3, 4, 4\] has 63 patch rows"):
        adapter.merge(model, ids, model.get_input_embeddings()(ids), short)
