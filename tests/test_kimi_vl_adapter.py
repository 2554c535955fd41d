"""Kimi-VL adapter against transformers' own Kimi-K2.5 merge, on the tiny seeded model.

Each microbatch's media are split with ``ppmedia.split_media`` (images per sample from the
adapter's ``media_per_sample``), staged with ``ppmedia.stage_media``, taken with
``next_vlm_media_chunk`` and merged by the adapter; the result must equal the matching rows of the
``inputs_embeds`` the full model hands its language model.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from ppmedia import VlmMediaChunk, next_vlm_media_chunk, split_media, stage_media
from ppmedia.adapters.base import VlmAdapter
from ppmedia.adapters.kimi_vl import KimiVLAdapter
from ppmedia.testing.tiny_models import capture_merged_embeds
from ppmedia.testing.tiny_models import kimi_vl as tiny
from conftest import text_embeds

ATOL = 1e-5
IMAGES_PER_SAMPLE = [1, 2, 1, 1, 0, 0, 2, 1]
TOKENS_PER_SAMPLE = [4, 4, 1, 6, 0, 0, 7, 6]


def _grid(batch, columns: int) -> torch.Tensor:
    hws = batch["image_grid_hws"]
    if columns == 2:
        return hws
    return torch.cat([torch.ones_like(hws[:, :1]), hws], dim=1)


def _split(batch, n: int, images_per_sample: torch.Tensor, columns: int = 2):
    """``ppmedia.split_media`` on a copy of the batch, its grid as ``image_grid_hws`` [images, 2] or
    ``image_grid_thw`` [images, 3]; checks the sample ranges against ``torch.tensor_split``."""
    media = {k: v for k, v in batch.items() if k != "image_grid_hws"}
    media["image_grid_hws" if columns == 2 else "image_grid_thw"] = _grid(batch, columns)
    staged = split_media(media, n, images_per_sample=images_per_sample)
    rows = torch.tensor_split(torch.arange(len(images_per_sample)), n)
    expected = [(int(r[0]), int(r[-1]) + 1) for r in rows]
    assert list(staged.samples) == expected
    return staged


class _CountCalls:
    def __init__(self, module: torch.nn.Module):
        self.calls = 0
        self._handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        self.calls += 1

    def close(self):
        self._handle.remove()


def test_adapter_identity(adapter):
    assert isinstance(adapter, VlmAdapter)
    assert adapter.name == "kimi_vl"
    assert adapter.model_types == ("kimi_vl", "kimi_k25")
    assert tiny.MODEL_TYPE in adapter.model_types
    assert "[patches, C, ph, pw]" in adapter.layout


def test_tiny_batch_layout(model, batch):
    config = model.config
    pixels, hws = batch["pixel_values"], batch["image_grid_hws"]
    assert batch["input_ids"].shape == (8, tiny.SEQ_LEN)
    assert pixels.shape[1:] == (3, config.vision_config.patch_size, config.vision_config.patch_size)
    assert hws.shape == (sum(IMAGES_PER_SAMPLE), 2) and hws.dtype == torch.int64
    assert pixels.shape[0] == int(hws.prod(-1).sum())
    assert len({tuple(g) for g in hws.tolist()}) == hws.shape[0] - 1  # one repeated grid, rest distinct
    assert bool((hws % 2 == 0).all())
    # samples 4 and 5 (microbatch 2 of 4) are text-only; padding is on the right
    ids = batch["input_ids"]
    assert not bool((ids[4:6] == config.image_token_id).any())
    mask = batch["attention_mask"]
    assert bool((mask[:, :-1] >= mask[:, 1:]).all())
    assert bool((ids[mask == 0] == tiny.PAD_TOKEN_ID).all())
    # deterministic
    again = tiny.build_batch(seed=0)
    assert all(torch.equal(batch[k], again[k]) for k in batch)


def test_media_per_sample(adapter, model, batch):
    images, videos = adapter.media_per_sample(batch["input_ids"], model.config)
    assert images.dtype == torch.int64 and videos.dtype == torch.int64
    assert images.tolist() == IMAGES_PER_SAMPLE
    assert videos.tolist() == [0] * 8


def test_media_per_sample_counts_runs():
    # two images back to back, each framed by its start/end tokens, and one image at the last position
    config = tiny.build_config()
    i, s, e, t = tiny.IMAGE_TOKEN_ID, tiny.VISION_START_TOKEN_ID, tiny.VISION_END_TOKEN_ID, 20
    ids = torch.tensor([[s, i, i, e, s, i, e, t], [t, t, t, t, t, s, i, i], [i, i, e, t, t, t, t, t]])
    images, videos = KimiVLAdapter().media_per_sample(ids, config)
    assert images.tolist() == [2, 1, 1]
    assert videos.tolist() == [0, 0, 0]


def _back_to_back(batch):
    """The batch with everything between two images of a sample removed (samples 1 and 6: the end,
    text and start tokens), so their placeholders form one run; rows keep their length (right pad)."""
    img, rows, masks = tiny.IMAGE_TOKEN_ID, [], []
    seq = batch["input_ids"].shape[1]
    for row, length in zip(batch["input_ids"].tolist(), batch["attention_mask"].sum(1).tolist()):
        row = row[:length]
        at = [i for i, t in enumerate(row) if t == img]
        kept = [t for i, t in enumerate(row) if t == img or not (at and at[0] < i < at[-1])]
        rows.append(kept + [tiny.PAD_TOKEN_ID] * (seq - len(kept)))
        masks.append([1] * len(kept) + [0] * (seq - len(kept)))
    out = dict(batch)
    out["input_ids"], out["attention_mask"] = torch.tensor(rows), torch.tensor(masks, dtype=batch["attention_mask"].dtype)
    return out


@pytest.mark.parametrize("key", ["image_grid_hws", "image_grid_thw"])
def test_back_to_back_images_split_by_grid(adapter, model, batch, first_stage, key):
    b2b = _back_to_back(batch)
    ids = b2b["input_ids"]
    if key == "image_grid_thw":
        b2b[key] = _grid(b2b, 3)
        del b2b["image_grid_hws"]
    assert adapter.media_per_sample(ids, model.config)[0].tolist() == [1, 1, 1, 1, 0, 0, 1, 1]  # one run each
    images, videos = adapter.media_per_sample(ids, model.config, media=b2b)
    assert images.tolist() == IMAGES_PER_SAMPLE and videos.tolist() == [0] * 8
    reference = capture_merged_embeds(model, **tiny.reference_inputs(_back_to_back(batch)))
    staged = split_media(dict(b2b), 2, images_per_sample=images)
    with stage_media(first_stage, staged):
        for b0, b1 in staged.samples:
            chunk = next_vlm_media_chunk(first_stage)
            with torch.no_grad():
                merged = adapter.merge(model, ids[b0:b1], text_embeds(model, ids[b0:b1]), chunk)
            torch.testing.assert_close(merged, reference[b0:b1], atol=ATOL, rtol=0)
    wrong = dict(b2b)
    wrong[key] = b2b[key].flip(0)  # sample 0's run of 4 tokens is not the last image's 6
    with pytest.raises(ValueError, match=rf"sample 0 has a run of 4 .* of {key} .*n_images_per_sample"):
        adapter.media_per_sample(ids, model.config, media=wrong)


def test_placeholder_masks_and_feature_counts(adapter, model, batch):
    masks = adapter.placeholder_masks(batch["input_ids"], model.config)
    assert set(masks) == {"image", "video"}
    assert masks["image"].sum(-1).tolist() == TOKENS_PER_SAMPLE
    assert not bool(masks["video"].any())
    chunk = VlmMediaChunk(batch["pixel_values"], batch["image_grid_hws"], None, None)
    _, host = adapter.check_counts(batch["input_ids"], chunk, model.config)
    assert host.values["image_grid"] == batch["image_grid_hws"].reshape(-1).tolist()
    counts = adapter.feature_counts(chunk, model.config, host)
    assert counts == {"image": sum(TOKENS_PER_SAMPLE)}
    assert isinstance(counts["image"], int)


@pytest.mark.parametrize("columns", [2, 3])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_merge_matches_model(adapter, model, batch, reference, n, columns):
    ids = batch["input_ids"]
    images, _ = adapter.media_per_sample(ids, model.config)
    staged = _split(batch, n, images, columns)
    stage = torch.nn.Module()
    with stage_media(stage, staged):
        for k, (b0, b1) in enumerate(staged.samples):
            chunk = next_vlm_media_chunk(stage)
            embeds = text_embeds(model, ids[b0:b1])
            with torch.no_grad():
                merged = adapter.merge(model, ids[b0:b1], embeds, chunk)
            if sum(IMAGES_PER_SAMPLE[b0:b1]) == 0:
                assert chunk is None and merged is embeds
            else:
                assert chunk.image_grid.shape == (sum(IMAGES_PER_SAMPLE[b0:b1]), columns)
                # the chunk is a view of the batch's pixels, untouched by the adapter
                storage = chunk.pixel_values.untyped_storage().data_ptr()
                assert storage == batch["pixel_values"].untyped_storage().data_ptr()
                assert merged is not embeds
            torch.testing.assert_close(merged, reference[b0:b1], atol=ATOL, rtol=0)
    if n == 4:
        assert staged.samples[2] == (4, 6) and staged.images[2] == 0


def test_mismatch_raises_before_encoder(adapter, model, batch):
    ids = batch["input_ids"][0:2]  # 8 image placeholders (4 + 2 + 2)
    hws = batch["image_grid_hws"]
    # only the first image's 16 patches: 4 feature rows
    chunk = VlmMediaChunk(batch["pixel_values"][:16], hws[:1], None, None)
    counter = _CountCalls(model.model.vision_tower)
    try:
        with pytest.raises(ValueError, match=r"\b8\b.*\b4\b"):
            adapter.merge(model, ids, text_embeds(model, ids), chunk)
        # the other direction: a text-only microbatch handed one image
        text_ids = batch["input_ids"][4:6]
        with pytest.raises(ValueError, match=r"\b0\b.*\b4\b"):
            adapter.merge(model, text_ids, text_embeds(model, text_ids), chunk)
        # placeholders but no media at all
        with pytest.raises(ValueError, match=r"\b8\b.*\b0\b"):
            adapter.merge(model, ids, text_embeds(model, ids), None)
    finally:
        counter.close()
    assert counter.calls == 0


def test_chunk_none_returns_inputs_embeds(adapter, model, batch, reference):
    ids = batch["input_ids"][4:6]
    embeds = text_embeds(model, ids)
    out = adapter.merge(model, ids, embeds, None)
    assert out is embeds
    torch.testing.assert_close(out, reference[4:6], atol=0, rtol=0)


def test_video_media_refused_for_remote_code_kimi_vl(adapter, model, batch):
    """Remote-code Kimi-VL has no videos: a video chunk is refused before the tower runs (transformers'
    Kimi-K2.5 runs them: test_kimi_k25_video.py)."""
    video = torch.zeros((4, 3, 4, 4))
    chunk = VlmMediaChunk(None, None, video, torch.tensor([[1, 2, 2]]))
    ids = batch["input_ids"][4:6]
    remote = _RemoteKimiVL(model)
    counter = _CountCalls(model.model.vision_tower)
    try:
        with pytest.raises(ValueError, match="for model type 'kimi_vl' takes images only"):
            adapter.merge(remote, ids, text_embeds(model, ids), chunk)
    finally:
        counter.close()
    assert counter.calls == 0


def test_odd_patch_rows_refused(adapter, model, batch):
    ids = batch["input_ids"][0:2]
    chunk = VlmMediaChunk(batch["pixel_values"][:6], batch["image_grid_hws"][:1], None, None)
    with pytest.raises(ValueError, match=r"covers 16 patches but pixel_values \[6, 3, 4, 4\] has 6 patch rows"):
        adapter.merge(model, ids, text_embeds(model, ids), chunk)
    odd = torch.tensor([[2, 3]], dtype=batch["image_grid_hws"].dtype)  # 6 patches: not whole 2 x 2 blocks
    with pytest.raises(ValueError, match=r"row 0 gives 6 patches, not a multiple of the merge-kernel area 4"):
        adapter.merge(model, ids, text_embeds(model, ids), VlmMediaChunk(batch["pixel_values"][:6], odd, None, None))


class _RemoteKimiVL(torch.nn.Module):
    """The remote-code Kimi-VL layout: vision tower and projector on the top module, ``[images, 2]``
    grids, ``media_placeholder_token_id`` in the config. Delegates to the tiny Kimi-K2.5 weights."""

    def __init__(self, inner):
        super().__init__()
        self.vision_tower = inner.model.vision_tower
        self.multi_modal_projector = inner.model.mm_projector
        self.grids_seen: list[tuple[int, ...]] = []
        vision = inner.config.vision_config
        self.config = SimpleNamespace(
            model_type="kimi_vl",
            media_placeholder_token_id=inner.config.image_token_id,
            vision_config=SimpleNamespace(merge_kernel_size=list(vision.merge_kernel_size)),
        )

    def _extract_image_features(self, pixel_values, image_grid_hws):
        self.grids_seen.append(tuple(image_grid_hws.shape))
        thw = torch.cat([torch.ones_like(image_grid_hws[:, :1]), image_grid_hws], dim=1)
        pooled = self.vision_tower(pixel_values, grid_thw=thw).pooler_output
        projected = self.multi_modal_projector(pooled).squeeze(1)
        sizes = (image_grid_hws.prod(-1) // 4).tolist()
        return list(torch.split(projected, sizes))


@pytest.mark.parametrize("columns", [2, 3])
def test_remote_code_layout(adapter, model, batch, reference, columns):
    remote = _RemoteKimiVL(model)
    ids = batch["input_ids"]
    images, videos = adapter.media_per_sample(ids, remote.config)
    assert images.tolist() == IMAGES_PER_SAMPLE and videos.tolist() == [0] * 8
    assert set(adapter.placeholder_masks(ids, remote.config)) == {"image"}
    staged = _split(batch, 2, images, columns)
    stage = torch.nn.Module()
    with stage_media(stage, staged):
        for b0, b1 in staged.samples:
            chunk = next_vlm_media_chunk(stage)
            with torch.no_grad():
                merged = adapter.merge(remote, ids[b0:b1], text_embeds(model, ids[b0:b1]), chunk)
            torch.testing.assert_close(merged, reference[b0:b1], atol=ATOL, rtol=0)
    assert remote.grids_seen == [(5, 2), (3, 2)]  # always [images, 2]


def test_error_message_names_both_counts(adapter, model, batch):
    ids = batch["input_ids"][6:8]  # 7 + 6 = 13 placeholders
    # sample 6's own two images (grids 2x6 and 4x4, patches 60:88): 3 + 4 = 7 feature rows
    chunk = VlmMediaChunk(batch["pixel_values"][60:88], batch["image_grid_hws"][5:7], None, None)
    with pytest.raises(ValueError) as info:
        adapter.merge(model, ids, text_embeds(model, ids), chunk)
    numbers = set(re.findall(r"\d+", str(info.value)))
    assert {"13", "7"} <= numbers


def test_video_placeholders_fail_the_count_check(adapter, model, batch):
    """Kimi runs no videos: a video placeholder among the tokens is an error, not a text embedding."""
    ids = batch["input_ids"][0:2].clone()
    text = (ids != tiny.IMAGE_TOKEN_ID) & (ids != tiny.PAD_TOKEN_ID)
    row, col = [int(i) for i in text.nonzero()[-1]]
    ids[row, col] = model.config.video_token_id
    chunk = VlmMediaChunk(batch["pixel_values"][:32], batch["image_grid_hws"][:3], None, None)  # samples 0, 1: 3 images
    with pytest.raises(ValueError, match=r"^video: the microbatch has 1 placeholder tokens but its media give 0 feature rows"):
        adapter.merge(model, ids, text_embeds(model, ids), chunk)
