"""GLM-4.1V / 4.5V / 4.6V against transformers' own models (tiny seeded): Qwen-style patch rows with grids,
mrope positions from the model's ``get_rope_index``, and videos whose frames use the IMAGE token inside
video start/end (the adapter builds both placeholder masks itself).

transformers' own forward cannot run a batch holding images AND videos (both its masks are the image
token: "Image features and image tokens do not match"). Mixed batches are therefore checked against
``glm4v.mixed_reference``: the model's own forward run once per modality (the other modality's
placeholders turned into text), shown below to equal the model's single forward wherever that runs.

Real ``Glm4vImageProcessorPil`` output (its text as ``Glm4vProcessor``'s own methods write it) goes
through split -> stage -> merge; the whole real processor, videos included, is tested in
tests/test_processors.py.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

import ppmedia
from ppmedia.adapters.glm4v import Glm4vAdapter
from ppmedia.testing import check_adapter, check_stage_splits
from ppmedia.testing.stages import reference_run, stage_run
from ppmedia.testing.tiny_models import capture_merged_embeds, capture_reference, constant_parameters
from ppmedia.testing.tiny_models import glm4v as tiny
from ppmedia.testing.tiny_models import glm4v_moe, glm46v

from conftest import check_microbatches

ATOL = 1e-5
FAMILIES = {"glm4v": tiny, "glm4v_moe": glm4v_moe, "glm46v": glm46v}
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models():
    return {name: module.build_model(0) for name, module in FAMILIES.items()}


@pytest.fixture(scope="module")
def mixed(models):
    batch = tiny.build_mixed_batch(0)
    embeds, positions = tiny.mixed_reference(models["glm4v"], batch)
    return batch, embeds, positions


def test_one_adapter_for_the_three_model_types(models):
    for name, model in models.items():
        assert isinstance(ppmedia.get_adapter(model), Glm4vAdapter), name
        assert model.config.model_type == name and constant_parameters(model) == [], name
    assert type(models["glm4v_moe"].model.language_model.layers[1].mlp).__name__ == "Glm4vMoeTextMoE"


def test_masks_and_counts_follow_the_video_blocks(models, mixed, adapter):
    batch = mixed[0]
    config = models["glm4v"].config
    masks = adapter.placeholder_masks(batch["input_ids"], config)
    types_ = batch["mm_token_type_ids"]  # what the processor writes
    assert torch.equal(masks["image"], types_ == 1) and torch.equal(masks["video"], types_ == 2)
    assert torch.equal(adapter.mm_token_type_ids(batch["input_ids"], config).long(), types_)
    images, videos = adapter.media_per_sample(batch["input_ids"], config)
    assert images.tolist() == [1, 1, 0, 1, 0, 0, 1, 1] and videos.tolist() == [0, 1, 1, 0, 0, 0, 1, 1]
    staged = ppmedia.split_media(dict(batch), 4, **adapter.media_counts(batch, config))
    assert list(staged.images) == [2, 1, 0, 2] and list(staged.videos) == [1, 1, 0, 2]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_merge_and_positions_match_the_models_own(models, family, n):
    """Merged embeddings within 1e-5 and mrope positions exactly (check_adapter compares both)."""
    check_microbatches(FAMILIES[family], n, ATOL, model=models[family])


def test_transformers_cannot_run_images_and_videos_together(models, mixed):
    with pytest.raises(ValueError, match="Image features and image tokens do not match"):
        models["glm4v"](**tiny.reference_inputs(mixed[0]))


def _rows_of(batch, pixels, grid, items):
    """The patch rows and grid rows of items ``items`` (indices into the batch's grid)."""
    ends = torch.cumsum(batch[grid].prod(dim=1), 0).tolist()
    starts = [0] + ends[:-1]
    return (torch.cat([batch[pixels][starts[i]:ends[i]] for i in items]), batch[grid][items])


def test_the_mixed_reference_is_the_models_own_forward_where_that_runs(models, mixed):
    """Samples holding one modality (0 and 3: an image each; 2: a video) as sub-batches of the mixed
    batch (their rows, their media) run through the model's own single forward; mixed_reference gives
    the same rows, and the model's own positions."""
    model = models["glm4v"]
    batch, embeds, positions = mixed
    for rows, kind, items in (([0, 3], "image", [0, 2]), ([2], "video", [1])):
        pixels, grid = ("pixel_values", "image_grid_thw") if kind == "image" else ("pixel_values_videos", "video_grid_thw")
        sub = {k: batch[k][rows] for k in ("input_ids", "attention_mask", "mm_token_type_ids")}
        sub[pixels], sub[grid] = _rows_of(batch, pixels, grid, items)
        own, own_positions = capture_reference(model, **tiny.reference_inputs(sub))
        assert (own - embeds[rows]).abs().max() <= ATOL
        assert torch.equal(own_positions, positions[:, rows])


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_mixed_batch_merge_and_positions(models, mixed, n):
    batch, embeds, positions = mixed
    checks = check_adapter(tiny, microbatches=[n], model=models["glm4v"], batch=batch, reference=embeds, positions=positions)
    assert len(checks) == n and max(c.max_abs_diff for c in checks) <= ATOL


def test_transformers_masks_would_fail_on_the_mixed_batch(models, mixed):
    """The planted bug: masks as transformers takes them (both = the image token) scatter image and
    video features over each other; the mixed reference sees it."""

    class SameMasks(Glm4vAdapter):
        def placeholder_masks(self, input_ids, config):
            image = input_ids == tiny.IMAGE_TOKEN_ID
            return {"image": image, "video": image}

    batch, embeds, positions = mixed
    with pytest.raises(AssertionError):
        check_adapter(tiny, adapter=SameMasks(), microbatches=[2], model=models["glm4v"], batch=batch, reference=embeds)


@pytest.mark.parametrize("family", FAMILIES)
def test_stage_splits_carry_the_positions(models, family):
    checks = check_stage_splits(FAMILIES[family], [(1, 1), (2, 0), (0, 2)], model=models[family])
    assert all(c.max_grad_diff <= ATOL and c.max_logit_diff <= ATOL for c in checks)
    assert checks[0].wire == (("position_ids",),)


def test_a_stage_with_1d_positions_differs(models):
    class Flat(Glm4vAdapter):
        def decoder_kwargs(self, stage, layers, hidden, attention_mask, wire):
            if layers.start == 1:
                b, S = hidden.shape[:2]
                return {"position_ids": torch.arange(S).expand(3, b, S)}
            return super().decoder_kwargs(stage, layers, hidden, attention_mask, wire)

    model = models["glm4v_moe"]
    batch = glm4v_moe.build_batch(0)
    ref, _ = reference_run(model, glm4v_moe, batch)
    good, _, _ = stage_run(model, batch, (1, 1))
    bad, _, _ = stage_run(model, batch, (1, 1), adapter=Flat())
    assert (good - ref).abs().max() <= ATOL and (bad - ref).abs().max() > 1e-3


def test_malformed_media_are_refused(models, adapter):
    model = models["glm4v"]
    batch = tiny.build_batch(0)
    ids = batch["input_ids"][:1]
    embeds = model.get_input_embeddings()(ids)
    rows = batch["pixel_values"][:16]
    with pytest.raises(ValueError, match=r"image: the grid \[1, 3\] covers 32 patches but the chunk has 16 patch rows"):
        adapter.merge(model, ids, embeds, ppmedia.VlmMediaChunk(rows, torch.tensor([[1, 4, 8]]), None, None))
    with pytest.raises(ValueError, match="image: the microbatch has 4 placeholder tokens but its media give 0 feature rows"):
        adapter.merge(model, ids, embeds, ppmedia.VlmMediaChunk(None, None, rows, torch.tensor([[1, 4, 4]])))


def test_real_glm4v_image_processor_with_the_processors_text(models, adapter):
    """Glm4vImageProcessorPil (patch 8, temporal 2, merge 2) on images of several sizes; the text and
    token types as Glm4vProcessor's own replace_image_token and create_mm_token_type_ids write them."""
    from PIL import Image
    from transformers import Glm4vImageProcessorPil, Glm4vProcessor

    model = models["glm4v"]
    rng = np.random.default_rng(3)
    images = Glm4vImageProcessorPil(patch_size=8, temporal_patch_size=2, merge_size=2,
                                    size={"shortest_edge": 32 * 32, "longest_edge": 64 * 64})
    sizes = [[(40, 70)], [], [(64, 30), (20, 20)], [(33, 90)]]
    out = images([Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for s in sizes for h, w in s], return_tensors="pt")
    assert out["pixel_values"].shape[1] == tiny.PATCH_DIM
    writer = types.SimpleNamespace(image_processor=images, image_token="<|image|>", image_token_id=tiny.IMAGE_TOKEN_ID,
                                   video_start_id=tiny.VIDEO_START_TOKEN_ID, video_end_id=tiny.VIDEO_END_TOKEN_ID)
    names = {"<|image|>": tiny.IMAGE_TOKEN_ID}
    rows, k = [], 0
    for s in sizes:
        ids = [tiny.BOS_TOKEN_ID, 20]
        for _ in s:
            text = Glm4vProcessor.replace_image_token(writer, {"image_grid_thw": out["image_grid_thw"]}, k)
            assert text == "<|image|>" * (len(text) // len("<|image|>"))
            ids += [tiny.IMAGE_START_TOKEN_ID] + [names["<|image|>"]] * (len(text) // len("<|image|>")) + [tiny.IMAGE_END_TOKEN_ID, 21]
            k += 1
        rows.append(ids)
    seq = max(map(len, rows))
    input_ids = torch.tensor([r + [0] * (seq - len(r)) for r in rows])
    token_types = torch.tensor(Glm4vProcessor.create_mm_token_type_ids(writer, input_ids.tolist()))
    batch = {"input_ids": input_ids, "attention_mask": (input_ids != 0).long(), "mm_token_type_ids": token_types, **out}
    assert torch.equal(adapter.mm_token_type_ids(input_ids, model.config).long(), token_types)
    checks = check_adapter(tiny, microbatches=[1, 2, 3, 4], model=model, batch=batch)
    assert max(c.max_abs_diff for c in checks) <= ATOL
    assert capture_merged_embeds(model, **tiny.reference_inputs(batch)).shape[0] == 4
