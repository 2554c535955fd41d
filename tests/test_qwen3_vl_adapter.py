"""Qwen3-VL adapter (deepstack) against the model's own full-batch forward (tiny seeded models).

References are the model's own: the ``inputs_embeds``, ``visual_pos_masks`` and
``deepstack_visual_embeds`` its language model receives (captured by a forward pre-hook), its
``get_rope_index`` on the whole batch, and its logits and gradients. ppmedia's path: split_media ->
stage_media -> next_vlm_media_chunk -> adapter.first_stage, and pipeline stage modules run one after the
other in this process (the multi-process schedules are in test_pipeline_mp.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ppmedia
from ppmedia import VlmMediaChunk
from ppmedia.adapters.qwen3_vl import Qwen3VLAdapter
from ppmedia.pipeline import build_stage_modules
from ppmedia.testing.stages import reference_run, stage_run
from ppmedia.testing.tiny_models import qwen3_vl as tiny

IMAGES_PER_SAMPLE = [1, 2, 0, 1, 0, 0, 1, 2]
VIDEOS_PER_SAMPLE = [0, 0, 1, 1, 0, 0, 1, 1]
ATOL = 1e-5
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny.build_model(0)


@pytest.fixture(scope="module")
def batch():
    return tiny.build_batch(0)


@pytest.fixture(scope="module")
def adapter(model):
    return ppmedia.get_adapter(model)


def _capture(model, inputs) -> dict:
    """What the model's own language model receives on the full batch."""
    seen = {}

    def hook(_module, _args, kwargs):
        seen.update({k: kwargs[k] for k in ("inputs_embeds", "visual_pos_masks", "deepstack_visual_embeds", "position_ids")})

    handle = model.model.language_model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        handle.remove()
    return seen


@pytest.fixture(scope="module")
def reference(model, batch):
    seen = _capture(model, tiny.reference_inputs(batch))
    mask = seen["visual_pos_masks"]
    # each deepstack level scattered to its visual positions, [B, S, H]
    scattered = []
    for level in seen["deepstack_visual_embeds"]:
        full = torch.zeros_like(seen["inputs_embeds"])
        full[mask] = level
        scattered.append(full)
    seen["scattered"] = scattered
    return seen


def _staged_chunks(adapter, model, batch, n):
    staged = ppmedia.split_media(dict(batch), n, **adapter.media_counts(batch, model.config))
    module = torch.nn.Module()
    chunks = []
    with ppmedia.stage_media(module, staged):
        for _ in range(n):
            chunks.append(ppmedia.next_vlm_media_chunk(module))
    return staged, chunks


# -------------------------------------------------------------------------------------------------
# registry and counts


def test_every_model_type_resolves_to_this_adapter():
    for model_type in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"):
        assert isinstance(ppmedia.get_adapter(model_type), Qwen3VLAdapter)


def test_media_per_sample_needs_the_video_grid(adapter, model, batch):
    ids = batch["input_ids"]
    images, videos = adapter.media_per_sample(ids, model.config, media={"video_grid_thw": batch["video_grid_thw"]})
    assert images.tolist() == IMAGES_PER_SAMPLE and videos.tolist() == VIDEOS_PER_SAMPLE
    # 8 video blocks for 4 videos: the tokens alone would say 8 (or anything); refuse loudly
    with pytest.raises(ValueError, match=r"samples \[2, 3, 6, 7\] hold video token blocks.*n_videos_per_sample"):
        adapter.media_per_sample(ids, model.config)
    # image-only samples need no grid
    images, videos = adapter.media_per_sample(ids[[0, 1, 4]], model.config)
    assert images.tolist() == [1, 2, 0] and videos.tolist() == [0, 0, 0]
    # a grid whose temporal steps do not line up with the samples' blocks
    bad = batch["video_grid_thw"].clone()
    bad[[0, 1], 0] = bad[[1, 0], 0]  # (3, ...) first: its blocks would run into sample 3
    with pytest.raises(ValueError, match="video_grid_thw: its 4 videos span 8 temporal steps.*one sample"):
        adapter.media_per_sample(ids, model.config, media={"video_grid_thw": bad})
    too_many = torch.cat([batch["video_grid_thw"], torch.tensor([[1, 2, 2]])])
    with pytest.raises(ValueError, match="5 videos span 9 temporal steps"):
        adapter.media_per_sample(ids, model.config, media={"video_grid_thw": too_many})


def test_media_counts_for_split_media(adapter, model, batch):
    counts = adapter.media_counts(batch, model.config)  # reads the batch's video_grid_thw
    assert counts["images_per_sample"].tolist() == IMAGES_PER_SAMPLE
    assert counts["videos_per_sample"].tolist() == VIDEOS_PER_SAMPLE
    # counts the batch holds are split_media's to read: left out (and no grid needed for them)
    with_videos = dict(batch, n_videos_per_sample=torch.tensor(VIDEOS_PER_SAMPLE))
    del with_videos["video_grid_thw"]
    assert list(adapter.media_counts(with_videos, model.config)) == ["images_per_sample"]
    with_counts = dict(batch, n_images_per_sample=torch.tensor(IMAGES_PER_SAMPLE),
                       n_videos_per_sample=torch.tensor(VIDEOS_PER_SAMPLE))
    assert adapter.media_counts(with_counts, model.config) == {}
    staged = ppmedia.split_media(with_counts, 4, **adapter.media_counts(with_counts, model.config))
    assert list(staged.videos) == [0, 2, 0, 2] and list(staged.images) == [3, 1, 0, 3]
    assert set(with_counts) == {"input_ids", "attention_mask"}


def test_base_media_counts_leaves_batch_counts_to_split_media():
    from ppmedia.testing.tiny_models import qwen2_5_vl

    config = qwen2_5_vl.build_config()
    batch = qwen2_5_vl.build_batch(0)
    adapter = ppmedia.get_adapter(config)
    images, videos = adapter.media_per_sample(batch["input_ids"], config)
    counts = adapter.media_counts(batch, config)
    assert torch.equal(counts["images_per_sample"], images) and torch.equal(counts["videos_per_sample"], videos)
    assert list(adapter.media_counts(dict(batch, n_images_per_sample=images), config)) == ["videos_per_sample"]


def test_placeholders_and_feature_counts(adapter, model, batch):
    masks = adapter.placeholder_masks(batch["input_ids"], model.config)
    assert int(masks["image"].sum()) == 37 and int(masks["video"].sum()) == 19
    chunk = VlmMediaChunk(batch["pixel_values"], batch["image_grid_thw"], batch["pixel_values_videos"], batch["video_grid_thw"])
    _, host = adapter.check_counts(batch["input_ids"], chunk, model.config)  # grids read with the counts
    assert adapter.feature_counts(chunk, model.config, host) == {"image": 37, "video": 19} == dict(host.totals)


# -------------------------------------------------------------------------------------------------
# the first stage: merge, positions, deepstack


@pytest.mark.parametrize("n", [1, 2, 4])
def test_first_stage_matches_the_models_own_inputs(adapter, model, batch, reference, n):
    staged, chunks = _staged_chunks(adapter, model, batch, n)
    assert [c is None for c in chunks] == ([False, False, True, False] if n == 4 else [False] * n)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        for (a, b), chunk in zip(staged.samples, chunks):
            embeds = model.get_input_embeddings()(ids[a:b])
            hidden, wire = adapter.first_stage(model, ids[a:b], mask[a:b], embeds, chunk)
            assert (hidden - reference["inputs_embeds"][a:b]).abs().max() <= ATOL
            assert torch.equal(wire["position_ids"].transpose(0, 1), reference["position_ids"][:, a:b])
            assert torch.equal(wire["visual_pos_mask"].bool(), reference["visual_pos_masks"][a:b])
            assert sorted(wire) == ["deepstack_0", "deepstack_1", "position_ids", "visual_pos_mask"]
            for level, expected in enumerate(reference["scattered"]):
                assert (wire[f"deepstack_{level}"] - expected[a:b]).abs().max() <= ATOL, (n, a, level)
    # the deepstack levels differ from each other and from the merged features: the comparison is real
    s = reference["scattered"]
    assert (s[0] - s[1]).abs().max() > 1e-3
    assert (s[0] - reference["inputs_embeds"]).abs().max() > 1e-3


def test_video_timing_is_in_the_text(adapter, model, batch, reference):
    """Qwen3-VL's get_rope_index takes no second_per_grid_ts: positions follow the timestamp tokens;
    a chunk's second_per_grid_ts changes nothing."""
    staged, chunks = _staged_chunks(adapter, model, batch, 4)
    a, b = staged.samples[1]
    chunk = chunks[1]
    timed = VlmMediaChunk(chunk.pixel_values, chunk.image_grid, chunk.pixel_values_videos, chunk.video_grid,
                          second_per_grid_ts=torch.tensor([2.0, 0.5]))
    ids, mask = batch["input_ids"][a:b], batch["attention_mask"][a:b]
    assert torch.equal(adapter.position_ids(model, ids, timed, mask), reference["position_ids"][:, a:b])


def test_image_only_and_two_column_grids(adapter, model, batch, reference):
    staged, chunks = _staged_chunks(adapter, model, batch, 4)
    a, b = staged.samples[0]
    chunk = chunks[0]
    assert chunk.pixel_values_videos is None
    hw = VlmMediaChunk(chunk.pixel_values, chunk.image_grid[:, 1:], None, None)  # [n, 2]: t = 1
    ids, mask = batch["input_ids"][a:b], batch["attention_mask"][a:b]
    with torch.no_grad():
        hidden, wire = adapter.first_stage(model, ids, mask, model.get_input_embeddings()(ids), hw)
    assert (hidden - reference["inputs_embeds"][a:b]).abs().max() <= ATOL
    assert torch.equal(wire["position_ids"].transpose(0, 1), reference["position_ids"][:, a:b])


def test_bad_media_raise_before_the_encoder(adapter, model, batch):
    staged, chunks = _staged_chunks(adapter, model, batch, 4)
    a, b = staged.samples[1]
    ids, mask = batch["input_ids"][a:b], batch["attention_mask"][a:b]
    embeds = model.get_input_embeddings()(ids)
    chunk = chunks[1]
    calls = []
    handle = model.model.visual.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        dropped = VlmMediaChunk(chunk.pixel_values, chunk.image_grid, None, None)
        with pytest.raises(ValueError, match=r"video: the microbatch has 14 placeholder tokens but its media give 0 feature rows; placeholders per sample: \["):
            adapter.first_stage(model, ids, mask, embeds, dropped)
        with pytest.raises(ValueError, match=r"image: the microbatch has 6 placeholder tokens but its media give 0 feature rows \(no media: a text-only chunk\); placeholders per sample: \[0, 6\]"):
            adapter.first_stage(model, ids, mask, embeds, None)
        short_grid = VlmMediaChunk(chunk.pixel_values, chunk.image_grid, chunk.pixel_values_videos, chunk.video_grid[:1])
        with pytest.raises(ValueError, match=r"video: the grid \[1, 3\] covers 32 patches but the chunk has 56 patch rows"):
            adapter.first_stage(model, ids, mask, embeds, short_grid)
        odd = VlmMediaChunk(chunk.pixel_values[:-1], chunk.image_grid, chunk.pixel_values_videos, chunk.video_grid)
        with pytest.raises(ValueError, match=r"image: the grid \[\d+, 3\] covers \d+ patches but the chunk has 23 patch rows"):
            adapter.first_stage(model, ids, mask, embeds, odd)
        cubes = VlmMediaChunk(chunk.pixel_values.reshape(-1, 3, 512), chunk.image_grid, None, None)
        with pytest.raises(ValueError, match=r"image: patch rows of shape \[24, 3, 512\]; expected \[patches, D\]"):
            adapter.first_stage(model, ids, mask, embeds, cubes)
    finally:
        handle.remove()
    assert calls == []  # every error came before the tower ran


# -------------------------------------------------------------------------------------------------
# deepstack across stage boundaries: stage modules run in sequence, forward and backward
# (ppmedia.testing.stages.stage_run), against the model's own forward and loss (reference_run)


@pytest.fixture(scope="module")
def deep():
    """4 decoder layers, 3 deepstack levels: room for boundaries before, inside and after them."""
    model = tiny.build_variant("qwen3_vl", 0, num_layers=4, deepstack_levels=3)
    model.train(False)
    return model, tiny.build_batch(0), reference_run(model, tiny, tiny.build_batch(0))


@pytest.mark.parametrize("split", [(1, 3), (3, 1), (2, 2), (4, 0), (0, 1, 3), (1, 1, 1, 1)])
def test_stages_match_the_model_for_any_layer_split(deep, split):
    model, batch, (ref_logits, ref_grads) = deep
    adapter = ppmedia.get_adapter(model)
    logits, grads, stages = stage_run(model, batch, split, adapter=adapter)
    assert (logits - ref_logits).abs().max() <= ATOL
    assert set(grads) == set(ref_grads)
    for name, grad in ref_grads.items():
        assert (grads[name] - grad).abs().max() <= ATOL, name
    # each deepstack merger got a real gradient: through the wire when its layer is on a later stage
    for level in range(3):
        assert ref_grads[f"model.visual.deepstack_merger_list.{level}.linear_fc2.weight"].abs().max() > 1e-4
    # what crosses each boundary: positions, and the levels still ahead
    start = 0
    for module, size in zip(stages, split):
        start += size
        names = [w.name for w in module.wire_out]
        ahead = [f"deepstack_{i}" for i in range(start, 3)]
        if module.is_last:
            assert names == []
        else:
            assert names == ["position_ids"] + (["visual_pos_mask"] + ahead if ahead else [])


def test_deepstack_that_does_not_cross_changes_the_result(deep):
    """The check can fail: an adapter that drops the deepstack levels at the boundary gives other logits
    and no gradient to the mergers of the levels on stage 1."""

    class Dropping(Qwen3VLAdapter):
        def wire_tensors(self, config, first_layer):
            return super().wire_tensors(config, 99)  # positions only

        def decoder_kwargs(self, stage, layers, hidden, attention_mask, wire):
            if "visual_pos_mask" not in wire:
                return {"position_ids": wire["position_ids"].transpose(0, 1)}
            return super().decoder_kwargs(stage, layers, hidden, attention_mask, wire)

    model, batch, (ref_logits, ref_grads) = deep
    logits, grads, _ = stage_run(model, batch, (1, 3), adapter=Dropping())
    assert (logits - ref_logits).abs().max() > 1e-3
    for level in (1, 2):  # their layers are on stage 1
        assert f"model.visual.deepstack_merger_list.{level}.linear_fc2.weight" not in grads
    assert "model.visual.deepstack_merger_list.0.linear_fc2.weight" in grads


def test_static_stage_args_follow_the_wire(deep):
    model, *_ = deep
    from ppmedia.pipeline import static_stage_args

    stages = build_stage_modules(model, 2, layers_per_stage=[1, 3])
    (ins0, outs0), (ins1, outs1) = (static_stage_args(m, 2, 34) for m in stages)
    shapes = [list(t.shape) for t in outs0]
    assert shapes == [[2, 34, 32], [2, 34], [2, 3, 34], [2, 34], [2, 34, 32], [2, 34, 32]]
    assert [t.requires_grad for t in outs0] == [True, False, False, False, True, True]
    assert [list(t.shape) for t in ins1] == shapes
    with pytest.raises(TypeError, match=r"stage 1 takes 6 tensors from the previous stage \(hidden_states, "
                                        r"attention_mask, position_ids, visual_pos_mask, deepstack_1, deepstack_2\); got 3"):
        stages[1](*ins1[:3])


def test_first_stage_wire_shapes_are_checked(model, batch):
    class Wrong(Qwen3VLAdapter):
        def first_stage(self, *args):
            hidden, wire = super().first_stage(*args)
            wire["deepstack_1"] = wire["deepstack_1"][:, :-1]
            return hidden, wire

    (first, _) = build_stage_modules(model, 2, adapter=Wrong())
    staged = ppmedia.split_media(dict(batch), 4, **Wrong().media_counts(batch, model.config))
    with ppmedia.stage_media(first, staged), torch.no_grad():
        with pytest.raises(ValueError, match=r"wire tensor 'deepstack_1' is shape \[2, 33, 32\]; expected \[2, 34, 32\]"):
            first(batch["input_ids"][:2], batch["attention_mask"][:2])
        first._vlm_chunk_idx = 4  # the step is over; let stage_media's exit check pass


# -------------------------------------------------------------------------------------------------
# the other model types served by the adapter


@pytest.mark.parametrize("model_type", ["qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"])
def test_other_model_types_through_stages(model_type):
    model = tiny.build_variant(model_type, 0)
    assert model.config.model_type == model_type
    batch = tiny.build_batch(0)
    ref_logits, ref_grads = reference_run(model, tiny, batch)
    logits, grads, stages = stage_run(model, batch, (1, 1))
    assert (logits - ref_logits).abs().max() <= ATOL
    assert max((grads[k] - g).abs().max().item() for k, g in ref_grads.items()) <= ATOL
    crossing = [w.name for w in stages[0].wire_out]
    assert crossing == (["position_ids", "visual_pos_mask", "deepstack_1"] if model_type == "qwen3_vl_moe" else ["position_ids"])


# -------------------------------------------------------------------------------------------------
# real processor output


def test_real_image_processor_output(adapter, model):
    """Qwen2VLImageProcessorPil configured as Qwen3-VL uses it (patch 16, merge 2) on synthetic images of
    varied sizes -> split -> stage -> first_stage equals the model's own merged embeddings."""
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                         size={"shortest_edge": 32 * 32, "longest_edge": 96 * 96})
    rng = np.random.default_rng(0)
    sizes = [(40, 60), (64, 64), (33, 90), (100, 50), (32, 32), (70, 45)]
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    out = processor(images=images, return_tensors="pt")
    grid = out["image_grid_thw"]
    assert out["pixel_values"].shape == (int(grid.prod(-1).sum()), tiny.PATCH_DIM)
    per_sample = [2, 0, 1, 3]
    tokens = (grid.prod(-1) // 4).tolist()
    rows, k = [], 0
    for n in per_sample:
        ids = [tiny.BOS_TOKEN_ID, 20]
        for _ in range(n):
            ids += [tiny.VISION_START_TOKEN_ID] + [tiny.IMAGE_TOKEN_ID] * tokens[k] + [tiny.VISION_END_TOKEN_ID, 21]
            k += 1
        rows.append(ids + [tiny.EOS_TOKEN_ID])
    S = max(map(len, rows))
    input_ids = torch.tensor([r + [tiny.PAD_TOKEN_ID] * (S - len(r)) for r in rows])
    attention_mask = (torch.arange(S) < torch.tensor([len(r) for r in rows])[:, None]).long()
    batch = {"input_ids": input_ids, "attention_mask": attention_mask,
             "pixel_values": out["pixel_values"], "image_grid_thw": grid}
    ref = _capture(model, {**batch, "mm_token_type_ids": (input_ids == tiny.IMAGE_TOKEN_ID).long(), "use_cache": False})
    assert adapter.media_per_sample(input_ids, model.config)[0].tolist() == per_sample
    staged, chunks = _staged_chunks(adapter, model, batch, 2)
    with torch.no_grad():
        for (a, b), chunk in zip(staged.samples, chunks):
            assert chunk.pixel_values.data_ptr() >= out["pixel_values"].data_ptr()  # a view of the batch
            ids = input_ids[a:b]
            hidden, wire = adapter.first_stage(model, ids, attention_mask[a:b], model.get_input_embeddings()(ids), chunk)
            assert (hidden - ref["inputs_embeds"][a:b]).abs().max() <= ATOL
            assert torch.equal(wire["position_ids"].transpose(0, 1), ref["position_ids"][:, a:b])
