"""The built-in Idefics3 and SmolVLM adapters against transformers' own models (tiny, seeded): samples on
axis 0 (``pixel_values`` ``[B, max_crops, 3, H, W]`` + ``pixel_attention_mask``), all-zero crops as
padding, the language model at ``model.text_model``, a text-only microbatch that never reaches the
encoder (SmolVLM's own encoder would invent a crop for it), the real ``...ImageProcessorPil`` classes,
malformed input refused with nothing popped, and stage splits against the model's gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ppmedia
from ppmedia.adapters.idefics3 import Idefics3Adapter, tokens_per_crop
from ppmedia.adapters.smolvlm import SmolVLMAdapter
from ppmedia.pipeline import build_stage_modules, find_language_model
from ppmedia.testing import check_adapter, check_stage_splits
from ppmedia.testing.tiny_models import _idefics, capture_merged_embeds, idefics3, smolvlm

ATOL = 1e-5
tiny = idefics3
FAMILIES = {"idefics3": idefics3, "smolvlm": smolvlm}


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    return {name: module.build_model(0) for name, module in FAMILIES.items()}


def test_registered_with_the_language_model_at_text_model(models):
    for name, model in models.items():
        adapter = ppmedia.get_adapter(model)
        assert type(adapter) is {"idefics3": Idefics3Adapter, "smolvlm": SmolVLMAdapter}[name]
        assert find_language_model(model) == ("model.text_model", model.model.text_model)
        first, last = build_stage_modules(model, 2)
        assert "model.text_model.layers.0.mlp.up_proj.weight" in dict(first.named_parameters())
        assert "lm_head.weight" in dict(last.named_parameters()) and "model.vision_model" not in str(last)
    assert tokens_per_crop(models["idefics3"].config) == _idefics.TOKENS_PER_CROP == 4


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_merge_matches_the_model_at_1_2_4_8_and_an_uneven_split(models, name):
    model = models[name]
    calls = []
    handle = model.model.vision_model.register_forward_pre_hook(lambda m, a, k: calls.append(k["pixel_values"].shape[0]), with_kwargs=True)
    try:
        checks = check_adapter(FAMILIES[name], microbatches=[1, 2, 4, 8, 3], model=model)
    finally:
        handle.remove()
    assert len(checks) == 18 and max(c.max_abs_diff for c in checks) <= ATOL
    assert [c.samples for c in checks if c.n_microbatches == 3] == [(0, 3), (3, 6), (6, 8)]
    # the reference forward, then 1 + 2 + 3 (microbatch 2 of 4: padding only) + 6 (two of 8) + 3 encoder calls
    assert len(calls) == 1 + 1 + 2 + 3 + 6 + 3
    assert calls[0] == 17 and sum(calls[4:7]) == 17  # real crops only: padding never reaches the tower


def test_smolvlm_invents_a_crop_for_a_call_without_one(models):
    """Why a text-only microbatch must not reach SmolVLM's encoder: its own get_image_features returns the
    features of one made-up crop for an all-padding call (Idefics3's returns none)."""
    batch = smolvlm.build_batch(0)
    padding = batch["pixel_values"][4:6]
    assert not bool(padding.any())
    with torch.no_grad():
        fake = models["smolvlm"].model.get_image_features(padding, batch["pixel_attention_mask"][4:6]).pooler_output
    assert sum(f.shape[0] for f in fake) == _idefics.TOKENS_PER_CROP  # one invented crop, no placeholder for it
    ids = batch["input_ids"][4:6]
    adapter, model = SmolVLMAdapter(), models["smolvlm"]
    chunk = ppmedia.VlmMediaChunk(padding, None, None, None, extras={"pixel_attention_mask": batch["pixel_attention_mask"][4:6]})
    embeds = model.get_input_embeddings()(ids)
    assert torch.equal(adapter.merge(model, ids, embeds, chunk), embeds)  # nothing scattered, no encoder


def _processor_batch(cls, sizes_per_sample, seed=2):
    """Real ``cls`` (an ...ImageProcessorPil) output and the prompt ids Idefics3Processor writes for it."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    processor = cls(size={"longest_edge": 32}, max_image_size={"longest_edge": 16})
    images = [[Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in s] for s in sizes_per_sample]
    out = processor(images=images, return_tensors="pt", return_row_col_info=True)
    rows = []
    for s, r, c in zip(sizes_per_sample, out.pop("rows"), out.pop("cols")):
        ids = rng.integers(3, 100, 2).tolist()
        for k in range(len(s)):
            ids += _idefics.image_prompt(r[k], c[k]) + rng.integers(3, 100, 1).tolist()
        rows.append(ids)
    seq = max(map(len, rows))
    input_ids = torch.tensor([r + [0] * (seq - len(r)) for r in rows])
    return {"input_ids": input_ids, "attention_mask": (input_ids != 0).long(), **out}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_real_image_processor(models, name):
    from transformers import Idefics3ImageProcessorPil, SmolVLMImageProcessorPil

    cls = {"idefics3": Idefics3ImageProcessorPil, "smolvlm": SmolVLMImageProcessorPil}[name]
    batch = _processor_batch(cls, [[(40, 20)], [], [(10, 10), (30, 30)], [(12, 40)]])
    assert batch["pixel_values"].shape[:2] == (4, 10) and batch["pixel_attention_mask"].shape == (4, 10, 16, 16)
    reference = capture_merged_embeds(models[name], **_idefics.reference_inputs(batch))
    checks = check_adapter(FAMILIES[name], microbatches=[1, 2, 4], model=models[name], batch=batch, reference=reference)
    assert max(c.max_abs_diff for c in checks) <= ATOL


def test_without_pixel_attention_mask_one_row_per_sample(models):
    model = models["idefics3"]
    batch = {k: v for k, v in idefics3.build_batch(0).items() if k != "pixel_attention_mask"}
    staged = ppmedia.split_media(dict(batch), 4, **Idefics3Adapter().media_counts(batch, model.config))
    assert staged.layouts == ("images",) and staged.images == (2, 2, 2, 2)
    reference = capture_merged_embeds(model, **_idefics.reference_inputs(batch))
    checks = check_adapter(idefics3, microbatches=[1, 4], model=model, batch=batch, reference=reference)
    assert max(c.max_abs_diff for c in checks) <= ATOL


def test_the_split_stages_views_of_each_samples_rows(models):
    batch = idefics3.build_batch(0)
    staged = ppmedia.split_media(dict(batch), 4)
    assert staged.layouts == ("idefics3_images",) and staged.images == (2, 2, 2, 2)
    chunk = staged.chunk(3)
    assert chunk.pixel_values.data_ptr() == batch["pixel_values"][6].data_ptr()
    assert chunk.extras["pixel_attention_mask"].data_ptr() == batch["pixel_attention_mask"][6].data_ptr()


@pytest.mark.parametrize("change, error, match", [
    (lambda b: b.update(pixel_values=b["pixel_values"][:7]), ValueError,
     r"pixel_values: shape \[7, 5, 3, 16, 16\]; expected \[8, \.\.\.\] \(samples on axis 0; media layout 'idefics3_images'\)"),
    (lambda b: b.update(pixel_attention_mask=b["pixel_attention_mask"][:6]), ValueError,
     r"pixel_attention_mask: shape \[6, 5, 16, 16\]; expected \[8, \.\.\.\]"),
    (lambda b: b.update(pixel_values_videos=torch.zeros(1, 2, 3, 16, 16)), ValueError, r"idefics3: pixel_values_videos \[1, 2, 3, 16, 16\] in the batch"),
    (lambda b: b.pop("pixel_values"), ValueError, r"pixel_attention_mask: shape \[8, 5, 16, 16\] given without pixel_values"),
])
def test_malformed_batches_are_refused_with_nothing_popped(models, change, error, match):
    batch = idefics3.build_batch(0)
    change(batch)
    before = dict(batch)
    with pytest.raises(error, match=match):
        ppmedia.split_media(batch, 4, **Idefics3Adapter().media_counts(batch, models["idefics3"].config))
    assert batch.keys() == before.keys() and all(batch[k] is before[k] for k in batch)


def test_chunks_that_do_not_fit_are_refused_before_the_encoder(models):
    model, adapter = models["idefics3"], Idefics3Adapter()
    batch = idefics3.build_batch(0)
    ids, px, mask = batch["input_ids"][:2], batch["pixel_values"][:2], batch["pixel_attention_mask"][:2]
    embeds = model.get_input_embeddings()(ids)

    def merge(pixels, m):
        return adapter.merge(model, ids, embeds, ppmedia.VlmMediaChunk(pixels, None, None, None, extras={"pixel_attention_mask": m}))

    fewer = px.clone()
    fewer[1, 3] = 0  # sample 1 loses a real crop: 4 tokens more than its crops give
    with pytest.raises(ValueError, match=r"idefics3: sample 1 of the microbatch has 16 image tokens but 3 real crops"):
        merge(fewer, mask)
    blind = mask.clone()
    blind[0, 1] = 0
    with pytest.raises(ValueError, match=r"pixel_attention_mask: sample 0 of the microbatch has real crops \[1\] whose mask is all 0"):
        merge(px, blind)
    with pytest.raises(ValueError, match=r"pixel_attention_mask: shape \[2, 5, 8, 8\]; expected \[2, 5, 16, 16\]"):
        merge(px, mask[:, :, :8, :8])


def test_balancing_by_per_sample_costs_from_the_tokens(models):
    """The layout's items are samples of equal shape: a split balances by real crops only when given
    per-sample costs, e.g. the crops media_per_sample counts from the tokens."""
    batch = idefics3.build_batch(0)
    crops, _ = Idefics3Adapter().media_per_sample(batch["input_ids"], models["idefics3"].config)
    assert crops.tolist() == [3, 4, 1, 5, 0, 0, 1, 3]
    staged = ppmedia.split_media(batch, 4, balance=crops.tolist())
    loads = [sum(crops[list(staged.permutation[2 * k : 2 * k + 2])].tolist()) for k in range(4)]
    assert max(loads) - min(loads) <= 2 and sorted(staged.permutation) == list(range(8))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_stage_splits_match_the_model(models, name):
    checks = check_stage_splits(FAMILIES[name], [(1, 1), (0, 2)], model=models[name])
    assert all(c.max_grad_diff <= ATOL and c.max_logit_diff <= ATOL and c.wire == ((),) for c in checks)


class _EncodesPadding(SmolVLMAdapter):
    """Planted bug: runs the model's encoder whatever the microbatch holds (no skip for padding-only rows)."""

    def encode(self, model, chunk, host):
        inner = model.model
        features = inner.get_image_features(chunk.pixel_values, chunk.extras["pixel_attention_mask"]).pooler_output
        return {"image": torch.cat(list(features), dim=0)}


def test_a_text_only_microbatch_reaching_smolvlms_encoder_is_caught(models):
    from ppmedia.testing import AdapterMismatch

    with pytest.raises(AdapterMismatch, match=r"smolvlm.*4 microbatches, microbatch 2 .*encode returned 4 rows .*expected 0 rows"):
        check_adapter(smolvlm, adapter=_EncodesPadding(), microbatches=[4], model=models["smolvlm"])
