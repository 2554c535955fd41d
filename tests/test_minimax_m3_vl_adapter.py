"""MiniMax-M3-VL against transformers' own model (tiny seeded): flat patch rows, videos in chunks, and the
1-D positions every sparse layer's indexer reads, on every stage.

(MiniMax-M3's image and video processors need torchvision, which cannot be installed here: the tiny
batch follows their layout, tokens as ``MiniMaxM3VLProcessor`` writes them.)
"""

from __future__ import annotations

import pytest
import torch

import ppmedia
from ppmedia.adapters.minimax_m3_vl import MiniMaxM3VLAdapter
from ppmedia.testing import check_adapter, check_stage_splits
from ppmedia.testing.stages import reference_run, stage_run
from ppmedia.testing.tiny_models import constant_parameters
from ppmedia.testing.tiny_models import minimax_m3_vl as tiny

ATOL = 1e-5
IMAGES = [1, 2, 0, 1, 0, 0, 1, 2]
CHUNKS = [0, 0, 2, 1, 0, 0, 2, 1]


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_found_by_model_type_and_every_parameter_distinct(model):
    assert isinstance(ppmedia.get_adapter(model), MiniMaxM3VLAdapter)
    assert constant_parameters(model) == []  # the (1 + w) norm weights start at 0 in transformers
    assert model.config.text_config.layer_types == ["minimax_m3_sparse"] * 2


def test_images_and_video_chunks_per_sample(model, batch, adapter):
    counts = adapter.media_counts(batch, model.config)
    assert counts["images_per_sample"].tolist() == IMAGES and counts["videos_per_sample"].tolist() == CHUNKS
    staged = ppmedia.split_media(dict(batch), 4, **counts)
    assert list(staged.videos) == [0, 3, 0, 3] and list(staged.images) == [3, 1, 0, 3]
    local = dict(batch)
    ppmedia.split_media(local, 4, **counts)
    assert set(local) == {"input_ids", "attention_mask"}  # num_chunks_per_video popped with the media


def test_num_chunks_per_video_is_checked(model, batch, adapter):
    with pytest.raises(ValueError, match=r"num_chunks_per_video: \[2, 1, 2\] adds up to 5 chunks but video_grid_thw has 6 rows"):
        adapter.media_counts(dict(batch, num_chunks_per_video=torch.tensor([2, 1, 2])), model.config)
    with pytest.raises(ValueError, match=r"sample 2 holds video chunks up to row 2 of video_grid_thw, which ends inside a video"):
        adapter.media_counts(dict(batch, num_chunks_per_video=[1, 2, 1, 1, 1]), model.config)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_merge_matches_the_models_own_per_microbatch(model, batch, n):
    checks = check_adapter(tiny, microbatches=[n], model=model, batch=batch)
    assert len(checks) == n and max(c.max_abs_diff for c in checks) <= ATOL
    if n == 4:
        assert [c.has_media for c in checks] == [True, True, False, True]


def test_stage_splits_match_the_model(model, batch):
    checks = check_stage_splits(tiny, [(1, 1), (2, 0), (0, 2)], model=model, batch=batch)
    assert all(c.max_grad_diff <= ATOL and c.wire == ((),) for c in checks)


def _indexer_positions(model):
    """A hook on every layer's lightning indexer recording the positions it reads: {layer: [tensors]}."""
    seen: dict[int, list[torch.Tensor]] = {}
    handles = []
    for i, layer in enumerate(model.model.language_model.layers):
        def hook(_m, args, i=i):
            seen.setdefault(i, []).append(args[3].detach().clone())
        handles.append(layer.self_attn.indexer.register_forward_pre_hook(hook))
    return seen, handles


def test_every_stage_indexer_reads_the_models_positions(model, batch):
    """Both stages' indexers read, per microbatch, the rows of the positions the full model's indexers
    read; and they matter: other positions (stage 1 handed positions - 2) change the result."""
    seen, handles = _indexer_positions(model)
    try:
        reference_run(model, tiny, batch)
        full = {i: p[0] for i, p in seen.items()}
        seen.clear()
        stage_run(model, batch, (1, 1))
    finally:
        for h in handles:
            h.remove()
    assert sorted(seen) == [0, 1] and all(len(p) == 4 for p in seen.values())  # each stage, each microbatch
    for layer, per_microbatch in seen.items():
        for k, positions in enumerate(per_microbatch):
            assert torch.equal(positions, full[layer].expand(8, -1)[2 * k : 2 * k + 2]), (layer, k)

    class Shifted(MiniMaxM3VLAdapter):
        def decoder_kwargs(self, stage, layers, hidden, attention_mask, wire):
            S = hidden.shape[1]
            shifted = (torch.arange(S) - 2).clamp(min=0).expand(hidden.shape[0], -1)
            return {"position_ids": shifted} if layers.start == 1 else {}

    ref_logits, _ = reference_run(model, tiny, batch)
    logits, _, _ = stage_run(model, batch, (1, 1), adapter=Shifted())
    assert (logits - ref_logits).abs().max() > 1e-3


def test_video_chunk_without_grid_is_refused(model, batch, adapter):
    staged = ppmedia.split_media(dict(batch), 4, **adapter.media_counts(batch, model.config))
    chunk = staged.chunk(1)
    broken = ppmedia.VlmMediaChunk(chunk.pixel_values, chunk.image_grid, chunk.pixel_values_videos, chunk.video_grid[:1])
    ids = batch["input_ids"][2:4]
    with pytest.raises(ValueError, match=r"video: the grid \[1, 3\] covers 32 patches but the chunk has 56 patch rows"):
        adapter.merge(model, ids, model.get_input_embeddings()(ids), broken)


def test_split_media_refuses_a_malformed_num_chunks_per_video(batch):
    for bad, match in ((torch.tensor([[2, 1, 2, 1]]), r"num_chunks_per_video: shape \[1, 4\], dtype torch.int64; expected a 1-D"),
                       (torch.tensor([2.0, 1.0]), r"dtype torch.float32"), ("2121", r"got str")):
        broken = dict(batch, num_chunks_per_video=bad)
        with pytest.raises(TypeError, match=match):
            ppmedia.split_media(broken, 4, images_per_sample=IMAGES, videos_per_sample=CHUNKS)
        assert set(broken) == set(batch)  # nothing popped
