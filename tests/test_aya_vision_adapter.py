"""The built-in Aya Vision adapter against transformers' own model (tiny, seeded): tiles on axis 0,
``<|IMG_PATCH|>`` tokens a tile, merges per microbatch, the real ``GotOcr2ImageProcessorPil``
(``crop_to_patches``), the image processor's per-image ``num_patches`` refused, and stage splits
against the model's gradients (Cohere 2 builds its sliding and global masks on every stage)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ppmedia
from ppmedia.adapters.aya_vision import AyaVisionAdapter, tokens_per_tile
from ppmedia.testing import check_adapter, check_stage_splits
from ppmedia.testing.tiny_models import aya_vision as tiny
from ppmedia.testing.tiny_models import capture_merged_embeds

ATOL = 1e-5


def test_registered(adapter, model):
    assert isinstance(adapter, AyaVisionAdapter)
    assert tokens_per_tile(model.config) == tiny.TOKENS_PER_TILE == 4
    released = type(model.config)(**{**model.config.to_dict(), "vision_config": {**model.config.vision_config.to_dict(),
                                                                                     "image_size": 364, "patch_size": 14}})
    assert tokens_per_tile(released) == 169


def test_merge_matches_the_model_at_1_2_4_8_and_an_uneven_split(model):
    checks = check_adapter(tiny, microbatches=[1, 2, 4, 8, 3], model=model)
    assert len(checks) == 18 and max(c.max_abs_diff for c in checks) <= ATOL
    assert [c.has_media for c in checks if c.n_microbatches == 4] == [True, True, False, True]


def test_tiles_per_sample_from_the_tokens(model, batch, adapter):
    tiles, videos = adapter.media_per_sample(batch["input_ids"], model.config)
    assert tiles.tolist() == [sum(s) for s in tiny.SAMPLES] == [3, 6, 1, 4, 0, 0, 2, 3] and not videos.any()


def test_real_got_ocr2_image_processor(model):
    from PIL import Image
    from transformers import GotOcr2ImageProcessorPil

    rng = np.random.default_rng(1)
    processor = GotOcr2ImageProcessorPil(size={"height": 16, "width": 16}, crop_to_patches=True, min_patches=1, max_patches=4)
    per_sample = [[(40, 20)], [], [(16, 16), (20, 70)], [(64, 64)]]
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for s in per_sample for h, w in s]
    out = processor(images=images, return_tensors="pt")
    tiles = out["num_patches"].tolist()
    assert out["pixel_values"].shape == (sum(tiles), 3, 16, 16) and max(tiles) > 1
    rows, k = [], 0
    for s in per_sample:
        ids = rng.integers(3, 100, 2).tolist()
        for _ in s:
            ids += tiny.image_ids(tiles[k]) + rng.integers(3, 100, 1).tolist()
            k += 1
        rows.append(ids)
    seq = max(map(len, rows))
    input_ids = torch.tensor([r + [0] * (seq - len(r)) for r in rows])
    batch = {"input_ids": input_ids, "attention_mask": (input_ids != 0).long(), "pixel_values": out["pixel_values"]}
    reference = capture_merged_embeds(model, **tiny.reference_inputs(batch))
    checks = check_adapter(tiny, microbatches=[1, 2, 4], model=model, batch=batch, reference=reference)
    assert max(c.max_abs_diff for c in checks) <= ATOL
    with_counts = dict(batch, num_patches=out["num_patches"])  # as the image processor returns it
    before = dict(with_counts)
    with pytest.raises(ValueError, match=r"aya_vision: num_patches \[4\] in the batch: GotOcr2ImageProcessor's tiles per image"):
        ppmedia.split_media(with_counts, 2, **AyaVisionAdapter().media_counts(with_counts, model.config))
    assert with_counts.keys() == before.keys()


def test_malformed_input_is_refused(model, batch, adapter):
    bad = dict(batch, pixel_values=batch["pixel_values"][:-1])  # one tile short
    before = dict(bad)
    with pytest.raises(ValueError, match=r"images_per_sample: counts sum to 19; expected 18"):
        ppmedia.split_media(bad, 4, **adapter.media_counts(bad, model.config))
    assert bad.keys() == before.keys()
    ids = batch["input_ids"][:1]
    with pytest.raises(ValueError, match=r"aya_vision pixel_values: shape \[3, 3, 32, 32\]; expected \[tiles, 3, 16, 16\]"):
        adapter.merge(model, ids, model.get_input_embeddings()(ids), ppmedia.VlmMediaChunk(torch.zeros(3, 3, 32, 32), None, None, None))
    default = type(model.config)(**{**model.config.to_dict(), "vision_feature_select_strategy": "default"})
    with pytest.raises(ValueError, match=r"vision_feature_select_strategy 'default'; expected 'full'"):
        tokens_per_tile(default)


def test_stage_splits_match_the_model(model):
    checks = check_stage_splits(tiny, [(1, 1), (2, 0)], model=model)
    assert all(c.max_grad_diff <= ATOL and c.max_logit_diff <= ATOL and c.wire == ((),) for c in checks)
