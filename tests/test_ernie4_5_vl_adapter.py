"""ERNIE 4.5 VL MoE against transformers' own model (tiny seeded): Qwen-style rows of 588 features, mrope
from the model's ``get_rope_index``, and ``moe_mm_token_type_ids`` carried to every stage (its MoE layers
route vision tokens to their own experts).

Real ``Ernie4_5_VLMoeImageProcessorPil`` output (its text and token types as the processor's own methods
write them) goes through split -> stage -> merge; the whole real processor, videos included, is tested
in tests/test_processors.py.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

import ppmedia
from ppmedia.adapters.ernie4_5_vl import Ernie4_5_VLAdapter
from ppmedia.testing import check_adapter, check_stage_splits
from ppmedia.testing.stages import reference_run, stage_run
from ppmedia.testing.tiny_models import constant_parameters
from ppmedia.testing.tiny_models import ernie4_5_vl_moe as tiny

from conftest import check_microbatches

ATOL = 1e-5
KEY = "moe_mm_token_type_ids"
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reference(model, batch):
    return reference_run(model, tiny, batch)


def _writer():
    """What Ernie4_5_VLMoeProcessor's own text methods read (the processor itself needs a video
    processor, which needs torchvision)."""
    return types.SimpleNamespace(
        image_token_id=tiny.IMAGE_TOKEN_ID, video_token_id=tiny.VIDEO_TOKEN_ID,
        image_start_token_id=tiny.IMAGE_START_TOKEN_ID, image_end_token_id=tiny.IMAGE_END_TOKEN_ID,
        video_start_token_id=tiny.VIDEO_START_TOKEN_ID, video_end_token_id=tiny.VIDEO_END_TOKEN_ID,
    )


def test_found_by_model_type_with_its_token_types_on_every_stage(model, adapter):
    assert isinstance(ppmedia.get_adapter(model), Ernie4_5_VLAdapter)
    assert constant_parameters(model) == []  # the routers and correction biases start at zero
    (spec,) = adapter.sample_inputs
    assert (spec.key, spec.shape, spec.every_stage, spec.kwarg) == (KEY, ("b", "S"), True, KEY)
    assert [w.name for w in adapter.stage_wire_tensors(model.config, 1)] == ["position_ids", KEY]


def test_counts_and_token_types_are_the_processors(model, batch, adapter):
    ids = batch["input_ids"]
    images, videos = adapter.media_per_sample(ids, model.config)
    assert images.tolist() == [1, 1, 0, 2, 0, 0, 1, 1] and videos.tolist() == [0, 1, 1, 0, 0, 0, 1, 0]
    from transformers import Ernie4_5_VLMoeProcessor

    theirs = torch.tensor(Ernie4_5_VLMoeProcessor.create_moe_mm_token_type_ids(_writer(), ids.tolist()))
    assert torch.equal(adapter.moe_token_types(ids, model.config), theirs)
    assert torch.equal(theirs, batch[KEY]) and torch.equal(adapter.token_types(ids, model.config).long(), batch["mm_token_type_ids"])


def test_the_batch_token_types_are_staged_as_views(model, batch, adapter):
    counts = adapter.media_counts(batch, model.config)
    assert list(counts["sample_inputs"]) == [KEY]
    local = dict(batch)
    staged = ppmedia.split_media(local, 4, **counts)
    assert KEY not in local and "mm_token_type_ids" in local  # popped with the media; the other one stays
    third = staged.chunk(2)  # samples 4, 5: text only, the token types still staged
    assert not third.has_media and third.extras[KEY].data_ptr() == batch[KEY][4].data_ptr()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_merge_and_positions_match_the_models_own(model, batch, n):
    check_microbatches(tiny, n, ATOL, model=model, batch=batch)


def test_stage_splits_carry_positions_and_token_types(model, batch):
    checks = check_stage_splits(tiny, [(1, 1), (2, 0), (0, 2)], model=model, batch=batch)
    assert all(c.max_grad_diff <= ATOL and c.max_logit_diff <= ATOL for c in checks)
    assert checks[0].wire == (("position_ids", KEY),)


def test_token_types_derived_on_the_first_stage_when_the_batch_lacks_them(model, batch, reference):
    without = {k: v for k, v in batch.items() if k != KEY}
    logits, grads, _ = stage_run(model, without, (1, 1))
    ref_logits, ref_grads = reference
    assert (logits - ref_logits).abs().max() <= ATOL
    assert max(float((grads[k] - g).abs().max()) for k, g in ref_grads.items()) <= ATOL


def test_a_stage_given_wrong_token_types_gives_wrong_results(model, batch, reference):
    """The planted bugs: stage 1 (the MoE layer) handed all-text token types, or a batch whose types
    mark nothing: the logits leave the model's by far more than the tolerance."""

    class TextOnStage1(Ernie4_5_VLAdapter):
        def decoder_kwargs(self, stage, layers, hidden, attention_mask, wire):
            kwargs = super().decoder_kwargs(stage, layers, hidden, attention_mask, wire)
            if layers.start == 1:
                kwargs[KEY] = torch.zeros_like(wire[KEY])
            return kwargs

    ref_logits, _ = reference
    bad, _, _ = stage_run(model, batch, (1, 1), adapter=TextOnStage1())
    assert (bad - ref_logits).abs().max() > 1e-3
    blank, _, _ = stage_run(model, dict(batch, **{KEY: torch.zeros_like(batch[KEY])}), (1, 1))
    assert (blank - ref_logits).abs().max() > 1e-3


def test_malformed_grids_are_refused(model, batch, adapter):
    ids = batch["input_ids"][2:3]  # one video (4, 2, 4): 4 tokens
    embeds = model.get_input_embeddings()(ids)
    rows = batch["pixel_values_videos"][:32]
    with pytest.raises(ValueError, match="video grid: row 0 has t = 3 frames, not a multiple of temporal_merge_size = 2"):
        adapter.merge(model, ids, embeds, ppmedia.VlmMediaChunk(None, None, rows[:12], torch.tensor([[3, 2, 2]])))
    with pytest.raises(ValueError, match="video grid: row 0 has t = 1 frames"):  # an [n, 2] grid: t = 1
        adapter.merge(model, ids, embeds, ppmedia.VlmMediaChunk(None, None, rows, torch.tensor([[4, 8]])))
    with pytest.raises(ValueError, match=r"image grid: row 0 has t = 2; expected 1"):
        adapter.merge(model, ids, embeds, ppmedia.VlmMediaChunk(rows[:16], torch.tensor([[2, 2, 4]]), None, None))
    with pytest.raises(ValueError, match=r"video: the grid \[1, 3\] covers 16 patches but the chunk has 32 patch rows"):
        adapter.merge(model, ids, embeds, ppmedia.VlmMediaChunk(None, None, rows, torch.tensor([[2, 2, 4]])))


def test_real_ernie_image_processor_with_the_processors_text(model, adapter):
    """Ernie4_5_VLMoeImageProcessorPil at its defaults (patch 14, merge 2: 588 features a row); the
    placeholders and both token types as the processor's own methods write them."""
    from PIL import Image
    from transformers import Ernie4_5_VLMoeImageProcessorPil, Ernie4_5_VLMoeProcessor

    rng = np.random.default_rng(9)
    images = Ernie4_5_VLMoeImageProcessorPil()
    sizes = [[(60, 90)], [(40, 40), (100, 30)], [], [(56, 112)]]
    out = images([Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for s in sizes for h, w in s], return_tensors="pt")
    assert out["pixel_values"].shape[1] == tiny.PATCH_DIM == 588
    writer = _writer()
    writer.image_processor, writer.image_token = images, "<|image|>"
    rows, k = [], 0
    for s in sizes:
        ids = [tiny.BOS_TOKEN_ID, 20]
        for _ in s:
            n = len(Ernie4_5_VLMoeProcessor.replace_image_token(writer, {"image_grid_thw": out["image_grid_thw"]}, k)) // len("<|image|>")
            ids += [tiny.IMAGE_START_TOKEN_ID] + [tiny.IMAGE_TOKEN_ID] * n + [tiny.IMAGE_END_TOKEN_ID, 21]
            k += 1
        rows.append(ids)
    seq = max(map(len, rows))
    input_ids = torch.tensor([r + [0] * (seq - len(r)) for r in rows])
    batch = {"input_ids": input_ids, "attention_mask": (input_ids != 0).long(), **out,
             "mm_token_type_ids": tiny.token_types(input_ids),
             KEY: torch.tensor(Ernie4_5_VLMoeProcessor.create_moe_mm_token_type_ids(writer, input_ids.tolist()))}
    checks = check_adapter(tiny, microbatches=[1, 2, 4], model=model, batch=batch)
    assert max(c.max_abs_diff for c in checks) <= ATOL
    logits, _, _ = stage_run(model, batch, (1, 1), n_microbatches=2)
    assert (logits - reference_run(model, tiny, batch)[0]).abs().max() <= ATOL
