"""Qwen2.5-VL adapter against the model's own full-batch forward (tiny seeded model, images + videos).

The reference for every microbatch is the full batch run through ``Qwen2_5_VLForConditionalGeneration``
itself: the ``inputs_embeds`` its language model receives (``ppmedia.testing.tiny_models.capture_merged_embeds``) and
the mrope positions of ``model.model.get_rope_index`` on the whole batch.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import ppmedia
from ppmedia import VlmMediaChunk, next_vlm_media_chunk
from ppmedia.testing.tiny_models import capture_merged_embeds
from ppmedia.testing.tiny_models import qwen2_5_vl as tiny

# Known layout of tiny.build_batch() (see its module docstring).
IMAGES_PER_SAMPLE = [1, 2, 0, 1, 0, 0, 1, 2]
VIDEOS_PER_SAMPLE = [0, 0, 1, 1, 0, 0, 0, 1]
IMAGE_TOKENS = 4 + 6 + 1 + 6 + 16 + 2 + 2
VIDEO_TOKENS = 8 + 4 + 4
ATOL = 1e-5


@pytest.fixture(scope="module")
def full_positions(model, batch) -> torch.Tensor:
    ref = tiny.reference_inputs(batch)
    positions, _ = model.model.get_rope_index(
        ref["input_ids"],
        ref["mm_token_type_ids"],
        image_grid_thw=ref["image_grid_thw"],
        video_grid_thw=ref["video_grid_thw"],
        attention_mask=ref["attention_mask"],
    )
    return positions


# -------------------------------------------------------------------------------------------------
# splitting the batch per microbatch


def _bounds(batch_size: int, n: int) -> list[tuple[int, int]]:
    parts = torch.tensor_split(torch.arange(batch_size), n)
    out, start = [], 0
    for part in parts:
        out.append((start, start + part.numel()))
        start += part.numel()
    return out


def _hand_chunks(batch: dict[str, torch.Tensor], n: int) -> list[VlmMediaChunk | None]:
    """Per-microbatch chunks sliced by hand (views), from the known per-sample counts."""
    grids = {"image": batch["image_grid_thw"], "video": batch["video_grid_thw"]}
    pixels = {"image": batch["pixel_values"], "video": batch["pixel_values_videos"]}
    counts = {"image": IMAGES_PER_SAMPLE, "video": VIDEOS_PER_SAMPLE}
    chunks = []
    for s0, s1 in _bounds(len(IMAGES_PER_SAMPLE), n):
        fields = {}
        for modality in ("image", "video"):
            i0, i1 = sum(counts[modality][:s0]), sum(counts[modality][:s1])
            rows = grids[modality].prod(-1).tolist()
            r0, r1 = sum(rows[:i0]), sum(rows[:i1])
            fields[modality] = (pixels[modality][r0:r1], grids[modality][i0:i1]) if i1 > i0 else (None, None)
        (pv, ig), (pvv, vg) = fields["image"], fields["video"]
        chunks.append(None if pv is None and pvv is None else VlmMediaChunk(pv, ig, pvv, vg))
    return chunks


def _chunks(adapter, model, batch, n: int) -> list[VlmMediaChunk | None]:
    """Per-microbatch chunks as the first stage sees them: ppmedia.split_media + stage_media +
    next_vlm_media_chunk, with the adapter's counts (hand-sliced when split_media is not there)."""
    split_media = getattr(ppmedia, "split_media", None)
    if split_media is None:
        return _hand_chunks(batch, n)
    images, videos = adapter.media_per_sample(batch["input_ids"], model.config)
    staged = split_media(dict(batch), n, images_per_sample=images, videos_per_sample=videos)
    carrier = torch.nn.Module()
    with ppmedia.stage_media(carrier, staged):
        return [next_vlm_media_chunk(carrier) for _ in range(n)]


def _same_chunk(a: VlmMediaChunk | None, b: VlmMediaChunk | None) -> bool:
    if a is None or b is None:
        return a is b
    for fa, fb in zip(dataclasses.astuple(a), dataclasses.astuple(b)):
        if (fa is None) != (fb is None) or (fa is not None and not torch.equal(fa, fb)):
            return False
    return True


# -------------------------------------------------------------------------------------------------
# token side


def test_media_per_sample_counts_without_host_reads(adapter, model, batch):
    from ppmedia.producer.hostreads import HostReadCounter

    with HostReadCounter() as reads:
        images, videos = adapter.media_per_sample(batch["input_ids"], model.config)
    assert reads.total == 0, reads.counts
    assert images.dtype == videos.dtype == torch.int64
    assert images.tolist() == IMAGES_PER_SAMPLE
    assert videos.tolist() == VIDEOS_PER_SAMPLE


def test_media_per_sample_without_vision_start_counts_runs(adapter, batch):
    config = SimpleNamespace(image_token_id=tiny.IMAGE_TOKEN_ID, video_token_id=tiny.VIDEO_TOKEN_ID)
    images, videos = adapter.media_per_sample(batch["input_ids"], config)
    assert images.tolist() == IMAGES_PER_SAMPLE
    assert videos.tolist() == VIDEOS_PER_SAMPLE


def test_placeholder_masks_and_feature_counts(adapter, model, batch):
    from ppmedia.producer.hostreads import HostReadCounter

    masks = adapter.placeholder_masks(batch["input_ids"], model.config)
    assert set(masks) == {"image", "video"}
    assert int(masks["image"].sum()) == IMAGE_TOKENS
    assert int(masks["video"].sum()) == VIDEO_TOKENS
    assert not (masks["image"] & masks["video"]).any()
    whole = VlmMediaChunk(
        batch["pixel_values"], batch["image_grid_thw"], batch["pixel_values_videos"], batch["video_grid_thw"]
    )
    with HostReadCounter() as reads:  # per-sample placeholders and both grids: one read
        _, host = adapter.check_counts(batch["input_ids"], whole, model.config)
    assert reads.total == 1, reads.counts
    assert host.values["image_grid"] == batch["image_grid_thw"].reshape(-1).tolist()
    with HostReadCounter() as reads:
        counts = adapter.feature_counts(whole, model.config, host)
        images_only = dataclasses.replace(whole, pixel_values_videos=None, video_grid=None)
        only_images = adapter.feature_counts(images_only, model.config, host)
    assert reads.total == 0, reads.counts
    assert counts == {"image": IMAGE_TOKENS, "video": VIDEO_TOKENS}
    assert only_images == {"image": IMAGE_TOKENS, "video": 0}


# -------------------------------------------------------------------------------------------------
# per-microbatch merge and positions against the full-batch model


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_merge_and_positions_match_full_batch(adapter, model, batch, reference, full_positions, n):
    chunks = _chunks(adapter, model, batch, n)
    assert len(chunks) == n
    if n == 4:
        # microbatch 0: images only; 1 and 3: images and videos; 2: text only
        assert chunks[0].pixel_values_videos is None and chunks[0].video_grid is None
        assert chunks[1].pixel_values is not None and chunks[1].pixel_values_videos is not None
        assert chunks[2] is None
        assert chunks[3].image_grid.shape[0] == 3 and chunks[3].video_grid.shape[0] == 1
    if n == 8:
        assert chunks[2].pixel_values is None and chunks[2].video_grid.shape[0] == 1  # video only
    embed = model.get_input_embeddings()
    for (s0, s1), chunk in zip(_bounds(8, n), chunks):
        ids, mask = batch["input_ids"][s0:s1], batch["attention_mask"][s0:s1]
        with torch.no_grad():
            text = embed(ids)
            merged = adapter.merge(model, ids, text, chunk)
        torch.testing.assert_close(merged, reference[s0:s1], atol=ATOL, rtol=0)
        media = (ids == tiny.IMAGE_TOKEN_ID) | (ids == tiny.VIDEO_TOKEN_ID)
        if chunk is None:
            assert merged is text
        else:
            assert torch.equal(merged[~media], text[~media])
            assert (merged[media] - text[media]).abs().amax() > 1e-3  # the features really went in
        positions = adapter.position_ids(model, ids, chunk, attention_mask=mask)
        assert positions.shape == (3, s1 - s0, ids.shape[1])
        assert torch.equal(positions, full_positions[:, s0:s1])


def test_positions_follow_the_chunks_video_timing(adapter, model, batch):
    """A chunk's second_per_grid_ts [videos] reaches get_rope_index: positions equal the full batch's
    with the same timing, per microbatch, and differ from the default timing."""
    ref = tiny.reference_inputs(batch)
    seconds = torch.tensor([3.0, 0.5, 2.0])[: batch["video_grid_thw"].shape[0]]
    timed, _ = model.model.get_rope_index(
        ref["input_ids"], ref["mm_token_type_ids"], image_grid_thw=ref["image_grid_thw"],
        video_grid_thw=ref["video_grid_thw"], second_per_grid_ts=seconds, attention_mask=ref["attention_mask"],
    )
    video_at = [0, *torch.cumsum(torch.tensor(VIDEOS_PER_SAMPLE), 0).tolist()]
    differs = False
    for (s0, s1), chunk in zip(_bounds(8, 4), _chunks(adapter, model, batch, 4)):
        ids, mask = batch["input_ids"][s0:s1], batch["attention_mask"][s0:s1]
        if chunk is not None and chunk.video_grid is not None:
            chunk = dataclasses.replace(chunk, second_per_grid_ts=seconds[video_at[s0] : video_at[s1]])
            default = adapter.position_ids(model, ids, dataclasses.replace(chunk, second_per_grid_ts=None), attention_mask=mask)
            differs |= not torch.equal(default, timed[:, s0:s1])
        assert torch.equal(adapter.position_ids(model, ids, chunk, attention_mask=mask), timed[:, s0:s1])
    assert differs


def test_split_media_gives_the_hand_sliced_chunks(adapter, model, batch):
    if getattr(ppmedia, "split_media", None) is None:
        pytest.skip("ppmedia.split_media not available")
    for n in (1, 2, 4, 8):
        got, want = _chunks(adapter, model, batch, n), _hand_chunks(batch, n)
        assert all(_same_chunk(a, b) for a, b in zip(got, want)), n


def test_pipeline_forward_matches_model_logits(adapter, model, batch):
    """Merged embeddings + adapter positions through the language model give the model's own logits."""
    with torch.no_grad():
        full = model(**tiny.reference_inputs(batch)).logits
        chunks = _chunks(adapter, model, batch, 4)
        for (s0, s1), chunk in zip(_bounds(8, 4), chunks):
            ids, mask = batch["input_ids"][s0:s1], batch["attention_mask"][s0:s1]
            embeds = adapter.merge(model, ids, model.get_input_embeddings()(ids), chunk)
            positions = adapter.position_ids(model, ids, chunk, attention_mask=mask)
            out = model(inputs_embeds=embeds, position_ids=positions, attention_mask=mask, use_cache=False)
            logits = out.logits
            valid = mask.bool()
            torch.testing.assert_close(logits[valid], full[s0:s1][valid], atol=ATOL, rtol=0)


def test_two_column_image_grid_is_t_equals_one(adapter, model, batch, reference, full_positions):
    chunks = _chunks(adapter, model, batch, 4)
    embed = model.get_input_embeddings()
    for (s0, s1), chunk in zip(_bounds(8, 4), chunks):
        if chunk is None or chunk.image_grid is None:
            continue
        assert (chunk.image_grid[:, 0] == 1).all()
        hw = dataclasses.replace(chunk, image_grid=chunk.image_grid[:, 1:])
        ids = batch["input_ids"][s0:s1]
        with torch.no_grad():
            merged = adapter.merge(model, ids, embed(ids), hw)
        torch.testing.assert_close(merged, reference[s0:s1], atol=ATOL, rtol=0)
        positions = adapter.position_ids(model, ids, hw, attention_mask=batch["attention_mask"][s0:s1])
        assert torch.equal(positions, full_positions[:, s0:s1])


# -------------------------------------------------------------------------------------------------
# errors


@pytest.fixture
def encoder_calls(model):
    calls = []
    handle = model.model.visual.register_forward_pre_hook(lambda mod, args: calls.append(1))
    yield calls
    handle.remove()


def test_dropped_image_raises_before_the_encoder(adapter, model, batch, encoder_calls):
    chunk = _chunks(adapter, model, batch, 4)[0]  # samples 0, 1: images of 4 + 6 + 1 tokens
    last_rows = int(chunk.image_grid[-1].prod())
    dropped = dataclasses.replace(
        chunk, pixel_values=chunk.pixel_values[:-last_rows], image_grid=chunk.image_grid[:-1]
    )
    ids = batch["input_ids"][0:2]
    with pytest.raises(ValueError, match=r"image.*\b11\b.*\b10\b"):
        adapter.merge(model, ids, model.get_input_embeddings()(ids), dropped)
    assert encoder_calls == []


def test_dropped_video_raises_before_the_encoder(adapter, model, batch, encoder_calls):
    chunk = _chunks(adapter, model, batch, 4)[1]  # samples 2, 3: videos of 8 + 4 tokens
    no_video = dataclasses.replace(chunk, pixel_values_videos=None, video_grid=None)
    ids = batch["input_ids"][2:4]
    with pytest.raises(ValueError, match=r"video.*\b12\b.*\b0\b"):
        adapter.merge(model, ids, model.get_input_embeddings()(ids), no_video)
    assert encoder_calls == []


def test_missing_chunk_for_placeholders_raises(adapter, model, batch, encoder_calls):
    ids = batch["input_ids"][0:2]
    with pytest.raises(ValueError, match=r"image.*\b11\b.*\b0\b"):
        adapter.merge(model, ids, model.get_input_embeddings()(ids), None)
    assert encoder_calls == []


def test_grid_not_covering_rows_raises_before_the_tower(adapter, model, batch, encoder_calls):
    chunk = _chunks(adapter, model, batch, 4)[0]
    # Rows still give 11 features (so the count check passes) but the grid lost an image.
    bad = dataclasses.replace(chunk, image_grid=chunk.image_grid[:-1])
    ids = batch["input_ids"][0:2]
    with pytest.raises(ValueError, match=r"grid \[2, 3\] covers 40 patches.*44 patch rows"):
        adapter.merge(model, ids, model.get_input_embeddings()(ids), bad)
    assert encoder_calls == []


def test_text_only_microbatch_is_unchanged(adapter, model, batch, full_positions, encoder_calls):
    ids = batch["input_ids"][4:6]
    text = model.get_input_embeddings()(ids)
    assert adapter.merge(model, ids, text, None) is text
    assert encoder_calls == []
    positions = adapter.position_ids(model, ids, None, attention_mask=batch["attention_mask"][4:6])
    assert torch.equal(positions, full_positions[:, 4:6])


# -------------------------------------------------------------------------------------------------
# the qwen2_vl alias: same adapter on a tiny Qwen2-VL (no window attention, different merger)


def test_qwen2_vl_model_type(adapter, batch):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        text_config={
            "vocab_size": 128,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]},
            "pad_token_id": tiny.PAD_TOKEN_ID,
        },
        vision_config={
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": tiny.PATCH_SIZE,
            "temporal_patch_size": tiny.TEMPORAL_PATCH_SIZE,
            "spatial_merge_size": tiny.MERGE,
        },
        image_token_id=tiny.IMAGE_TOKEN_ID,
        video_token_id=tiny.VIDEO_TOKEN_ID,
        vision_start_token_id=tiny.VISION_START_TOKEN_ID,
        vision_end_token_id=tiny.VISION_END_TOKEN_ID,
    )
    assert config.model_type in adapter.model_types
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).eval()
    ref_inputs = tiny.reference_inputs(batch)
    reference = capture_merged_embeds(model, **ref_inputs)
    full_positions, _ = model.model.get_rope_index(
        ref_inputs["input_ids"],
        ref_inputs["mm_token_type_ids"],
        image_grid_thw=ref_inputs["image_grid_thw"],
        video_grid_thw=ref_inputs["video_grid_thw"],
        attention_mask=ref_inputs["attention_mask"],
    )
    embed = model.get_input_embeddings()
    for (s0, s1), chunk in zip(_bounds(8, 4), _chunks(adapter, model, batch, 4)):
        ids = batch["input_ids"][s0:s1]
        with torch.no_grad():
            merged = adapter.merge(model, ids, embed(ids), chunk)
        torch.testing.assert_close(merged, reference[s0:s1], atol=ATOL, rtol=0)
        positions = adapter.position_ids(model, ids, chunk, attention_mask=batch["attention_mask"][s0:s1])
        assert torch.equal(positions, full_positions[:, s0:s1])
