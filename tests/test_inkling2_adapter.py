"""Inkling 2 against transformers' own model (tiny seeded): one pixel row per image token, and
attention-residual block states that grow at every block boundary and cross stage boundaries.

(``Inkling2ImageProcessor`` needs torchvision, which cannot be installed here: the tiny batch follows
its layout, ``[tiles, T, T, 3]`` channels-last with ``image_grid_thw`` in tokens.)
"""

from __future__ import annotations

import pytest
import torch

import ppmedia
from ppmedia.adapters.inkling2 import Inkling2Adapter, blocks_before
from ppmedia.testing import check_adapter, check_stage_splits
from ppmedia.testing.checks import AdapterMismatch
from ppmedia.testing.stages import reference_run, stage_run
from ppmedia.testing.tiny_models import constant_parameters
from ppmedia.testing.tiny_models import inkling2 as tiny

ATOL = 1e-5


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_found_by_model_type_and_block_state_queries_drawn(model):
    assert isinstance(ppmedia.get_adapter(model), Inkling2Adapter)
    assert constant_parameters(model) == []
    query = model.model.language_model.layers[1].attention_input.query  # zeros in transformers
    assert query.abs().min() > 0


def test_images_back_to_back_need_the_grid(model, batch, adapter):
    ids = batch["input_ids"]
    with_grid, _ = adapter.media_per_sample(ids, model.config, media=batch)
    assert with_grid.tolist() == [1, 2, 1, 1, 0, 0, 2, 1]
    runs, _ = adapter.media_per_sample(ids, model.config)  # tokens alone: one image per run
    assert runs.tolist() == [1, 1, 1, 1, 0, 0, 2, 1]
    assert adapter.media_counts(batch, model.config)["images_per_sample"].tolist() == with_grid.tolist()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_merge_matches_the_models_own_per_microbatch(model, batch, n):
    checks = check_adapter(tiny, microbatches=[n], model=model, batch=batch)
    assert len(checks) == n and max(c.max_abs_diff for c in checks) <= ATOL
    if n == 4:
        assert [c.has_media for c in checks] == [True, True, False, True]


def test_block_states_on_the_wire(model):
    assert [blocks_before(model.config, k) for k in range(5)] == [0, 1, 1, 2, 2]
    adapter = Inkling2Adapter()
    assert adapter.wire_tensors(model.config, 0) == ()
    (spec,) = adapter.wire_tensors(model.config, 3)
    assert (spec.name, spec.shape, spec.floating) == ("block_states", ("b", "S", 2, "H"), True)


def test_every_split_matches_the_model(model, batch):
    """Logits and every gradient, block-state queries and vision tower included, within 1e-5: the first
    block (the merged embeddings) crosses the default 2 + 2 boundary; in 1 + 2 + 1 the middle stage adds
    the second (layer 2's input) and sends both on."""
    splits = [(2, 2), (1, 3), (3, 1), (1, 2, 1), (1, 1, 1, 1), (4, 0), (0, 4)]
    checks = {c.layers_per_stage: c for c in check_stage_splits(tiny, splits, model=model, batch=batch)}
    assert all(c.max_logit_diff <= ATOL and c.max_grad_diff <= ATOL for c in checks.values())
    assert checks[(2, 2)].wire == (("block_states",),)
    assert checks[(0, 4)].wire == ((),)


def test_block_state_gradients_cross_back(model, batch):
    _, ref = reference_run(model, tiny, batch)
    _, got, _ = stage_run(model, batch, (2, 2))
    for name in ("model.language_model.layers.3.attention_input.query", "model.language_model.final_input.query",
                 "model.vision_tower.merger.linear_2.weight"):
        assert ref[name].abs().max() > 1e-5 and (got[name] - ref[name]).abs().max() <= ATOL, name


def test_final_input_runs_on_the_last_stage_only(model):
    from ppmedia.pipeline import build_stage_modules

    first, last = build_stage_modules(model, 2)
    assert not any("final_input" in n for n, _ in first.named_parameters())
    assert "model.language_model.final_input.query" in dict(last.named_parameters())
    hidden = torch.randn(1, 3, 64)
    assert first.stage_language_model.final_input(torch.zeros(1, 3, 0, 64), hidden)[0] is hidden


class _Dropping(Inkling2Adapter):
    """Carries no block states: each stage's language model starts its own, empty."""

    def wire_tensors(self, config, first_layer):
        return ()

    def stage_hooks(self, stage, layers, state):
        return ()


def test_an_adapter_that_drops_the_block_states_fails(model, batch):
    """Nothing raises, the logits are silently different: only the comparison catches it."""
    with pytest.raises(AdapterMismatch, match=r"inkling2, layers per stage \[2, 2\], 4 microbatches: logits differ"):
        check_stage_splits(tiny, [(2, 2)], adapter=_Dropping(), model=model, batch=batch)
    # 4 + 0 cuts one too: the last stage's final_input reads every block
    with pytest.raises(AdapterMismatch, match=r"layers per stage \[4, 0\]"):
        check_stage_splits(tiny, [(4, 0)], adapter=_Dropping(), model=model, batch=batch)
    assert check_stage_splits(tiny, [(0, 4)], adapter=_Dropping(), model=model, batch=batch)  # nothing crosses


def test_bad_pixels_are_refused_before_the_tower(model, batch, adapter):
    ids = batch["input_ids"][:1]
    embeds = model.get_input_embeddings()(ids)
    pixels, grid = batch["pixel_values"][:4], batch["image_grid_thw"][:1]
    with pytest.raises(ValueError, match=r"inkling2 pixel_values: shape \[4, 3, 8, 8\]; expected \[tokens, 8, 8, C\]"):
        adapter.merge(model, ids, embeds, ppmedia.VlmMediaChunk(pixels.permute(0, 3, 1, 2), grid, None, None))
    with pytest.raises(ValueError, match=r"inkling2 image_grid_thw \[1, 3\] covers 4 tiles but pixel_values \[3, 8, 8, 3\] has 3 rows"):
        adapter.merge(model, ids, embeds, ppmedia.VlmMediaChunk(pixels[:3], grid, None, None))


def test_with_the_models_own_activation_checkpointing():
    model = tiny.build_model(0)
    model.activation_checkpointing_enable()
    model.train()
    (check,) = check_stage_splits(tiny, [(1, 2, 1)], model=model)
    assert check.max_logit_diff <= ATOL and check.max_grad_diff <= ATOL
