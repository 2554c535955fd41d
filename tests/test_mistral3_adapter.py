"""Mistral 3 adapter against transformers' own model, on the tiny seeded model.

Each microbatch's merge (split_media -> stage_media -> next_vlm_media_chunk -> adapter.merge) must
equal the rows of the ``inputs_embeds`` the full model hands its language model, also for the real
``PixtralImageProcessorPil`` output (images of different sizes padded to the batch's largest).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import PixtralImageProcessorPil

import ppmedia
from ppmedia import HostReadCounter, VlmMediaChunk, next_vlm_media_chunk
from ppmedia import HostReadCounter
from ppmedia.adapters.mistral3 import Mistral3Adapter, image_tokens
from ppmedia.testing.tiny_models import capture_merged_embeds
from ppmedia.testing.tiny_models import mistral3 as tiny
from conftest import text_embeds

ATOL = 1e-5
IMAGES_PER_SAMPLE = [1, 2, 1, 1, 0, 0, 2, 1]
TOKENS_PER_IMAGE = [6, 1, 8, 12, 4, 4, 2, 16]


def _merge_all(model, adapter, batch, n, stage):
    """Per microbatch: (rows, merged embeds, chunk) through split -> stage -> next chunk -> merge."""
    images, videos = adapter.media_per_sample(batch["input_ids"], model.config)
    staged = ppmedia.split_media(dict(batch), n, images_per_sample=images, videos_per_sample=videos)
    out = []
    with ppmedia.stage_media(stage, staged), torch.no_grad():
        for rows in torch.tensor_split(torch.arange(batch["input_ids"].shape[0]), n):
            ids = batch["input_ids"][rows]
            chunk = next_vlm_media_chunk(stage)
            out.append((rows, adapter.merge(model, ids, text_embeds(model, ids), chunk), chunk))
    return out


# -- the tiny model and batch ---------------------------------------------------------------------


def test_tiny_batch_layout(model, batch):
    assert tiny.MODEL_TYPE == "mistral3" == model.config.model_type
    sizes = [s for per_sample in tiny.SAMPLE_IMAGE_SIZES for s in per_sample]
    assert batch["image_sizes"].tolist() == [list(s) for s in sizes]
    assert batch["pixel_values"].shape == (8, 3, tiny.MAX_SIZE, tiny.MAX_SIZE)
    for k, (h, w) in enumerate(sizes):  # zero padding past each image's true size
        assert batch["pixel_values"][k, :, h:].abs().sum() == 0 and batch["pixel_values"][k, :, :, w:].abs().sum() == 0
        assert batch["pixel_values"][k, :, :h, :w].abs().min() > 0
    ids = batch["input_ids"]
    assert (ids == tiny.IMAGE_END_TOKEN_ID).sum(1).tolist() == IMAGES_PER_SAMPLE
    # one [IMG_BREAK] per row of merged patches but the last
    rows = [h // 16 - 1 for h, _ in sizes]
    per_sample = np.split(np.array(rows), np.cumsum(IMAGES_PER_SAMPLE)[:-1])
    assert (ids == tiny.IMAGE_BREAK_TOKEN_ID).sum(1).tolist() == [int(r.sum()) for r in per_sample]


def test_token_counts_are_the_models(model, batch):
    with torch.no_grad():
        out = model.model.get_image_features(batch["pixel_values"], batch["image_sizes"], return_dict=True)
    assert [f.shape[0] for f in out.pooler_output] == TOKENS_PER_IMAGE
    assert [image_tokens(h, w, model.config) for h, w in batch["image_sizes"].tolist()] == TOKENS_PER_IMAGE
    # real Mistral-Small-3.1 geometry: patch 14, merge 2 (a 1540 x 1036 image -> 55 x 37 tokens)
    big = SimpleNamespace(vision_config=SimpleNamespace(patch_size=14), spatial_merge_size=2)
    assert image_tokens(1540, 1036, big) == 55 * 37


# -- token side -----------------------------------------------------------------------------------


def test_adapter_identity_and_counts(model, batch, adapter):
    assert adapter.name == "mistral3" and adapter.model_types == ("mistral3",)
    assert ppmedia.get_adapter(model) is adapter
    assert adapter.special_token_ids(model.config) == (10, 12, 13)
    with HostReadCounter() as reads:
        images, videos = adapter.media_per_sample(batch["input_ids"], model.config)
    assert reads.total == 0
    assert images.tolist() == IMAGES_PER_SAMPLE and videos.tolist() == [0] * 8
    mask = adapter.placeholder_masks(batch["input_ids"], model.config)["image"]
    assert mask.sum().item() == sum(TOKENS_PER_IMAGE)


def test_break_and_end_ids_from_the_config_or_the_adapter(model):
    ids = torch.tensor([[10, 10, 40, 10, 10, 41, 5], [10, 41, 10, 10, 41, 5, 5]])
    config = model.config
    assert Mistral3Adapter(image_break_token_id=40, image_end_token_id=41).media_per_sample(ids, config)[0].tolist() == [1, 2]
    assert Mistral3Adapter().media_per_sample(ids, config)[0].tolist() == [0, 0]
    with_ids = SimpleNamespace(image_token_id=10, image_break_token_id=40, image_end_token_id=41)
    assert Mistral3Adapter().special_token_ids(with_ids) == (10, 40, 41)
    assert Mistral3Adapter().media_per_sample(ids, with_ids)[0].tolist() == [1, 2]
    # a user's tokenizer: an adapter instance with its ids replaces the built-in one
    from ppmedia.registry.registry import AdapterRegistry

    registry = AdapterRegistry(entry_point_group=None)
    registry.register_adapter(Mistral3Adapter(image_break_token_id=40, image_end_token_id=41), override=True)
    assert registry.get(model).media_per_sample(ids, config)[0].tolist() == [1, 2]


# -- merge per microbatch -------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4])
def test_merge_matches_model_per_microbatch(model, batch, reference, adapter, first_stage, n):
    image_at = [0, *np.cumsum(IMAGES_PER_SAMPLE).tolist()]
    for rows, merged, chunk in _merge_all(model, adapter, batch, n, first_stage):
        b0, b1 = int(rows[0]), int(rows[-1]) + 1
        assert (merged - reference[rows]).abs().max().item() <= ATOL
        if image_at[b0] == image_at[b1]:
            assert chunk is None
        else:
            assert chunk.pixel_values.shape[0] == chunk.image_grid.shape[0] == image_at[b1] - image_at[b0]
            assert chunk.pixel_values.data_ptr() == batch["pixel_values"][image_at[b0]].data_ptr()


def test_merge_reads_sizes_once_with_the_counts(model, batch, adapter):
    ids = batch["input_ids"][:2]
    chunk = VlmMediaChunk(batch["pixel_values"][:3], batch["image_sizes"][:3], None, None)
    with HostReadCounter() as reads:
        masks, host = adapter.check_counts(ids, chunk, model.config)
    # the one read of the microbatch: placeholder counts and the 3 x 2 sizes together
    assert reads.total == 1
    assert host.rows("image_sizes", 2) == batch["image_sizes"][:3].tolist()
    assert host.total("image") == adapter.feature_counts(chunk, model.config, host)["image"] == 15


def test_errors_name_the_problem(model, batch, adapter):
    ids = batch["input_ids"][:2]  # 3 images: 6 + 1 + 8 tokens
    embeds = text_embeds(model, ids)
    pixels, sizes = batch["pixel_values"][:3], batch["image_sizes"][:3]
    with pytest.raises(ValueError, match=r"image: the microbatch has 15 placeholder tokens but its media give 7 feature rows; placeholders per sample: \[6, 9\]"):
        adapter.merge(model, ids, embeds, VlmMediaChunk(pixels[:2], sizes[:2], None, None))
    too_big = sizes.clone()
    too_big[1] = torch.tensor([80, 16])
    with pytest.raises(ValueError, match=r"image_sizes: row 1 of the microbatch is \[80, 16\]; expected each side between 16"):
        adapter.merge(model, ids, embeds, VlmMediaChunk(pixels, too_big, None, None))
    with pytest.raises(ValueError, match=r"image_sizes: shape \[2, 2\]; expected \[3, 2\]"):
        adapter.merge(model, ids, embeds, VlmMediaChunk(pixels, sizes[:2], None, None))
    # larger than the tower's image_size (64), even in pixels padded to 80
    big = torch.nn.functional.pad(pixels, (0, 16, 0, 16))
    with pytest.raises(ValueError, match=r"row 0 of the microbatch is \[80, 48\]; expected each side between 16 .* and \[64, 64\]"):
        adapter.merge(model, ids, embeds, VlmMediaChunk(big, torch.tensor([[80, 48], [16, 16], [64, 32]]), None, None))
    with pytest.raises(TypeError, match="image_sizes: dtype torch.float32; expected an integer dtype"):
        adapter.merge(model, ids, embeds, VlmMediaChunk(pixels, sizes.float(), None, None))
    with pytest.raises(TypeError, match="pixel_values: dtype torch.uint8"):
        adapter.merge(model, ids, embeds, VlmMediaChunk(pixels.to(torch.uint8), sizes, None, None))
    with pytest.raises(ValueError, match=r"image_sizes None; expected both"):
        adapter.merge(model, ids, embeds, VlmMediaChunk(pixels, None, None, None))
    with pytest.raises(ValueError, match=r"pixel_values: shape \[3, 12288\]"):
        adapter.merge(model, ids, embeds, VlmMediaChunk(pixels.flatten(1), sizes, None, None))


# -- the real image processor ---------------------------------------------------------------------


def test_real_processor_output_through_split_stage_merge(model, adapter, first_stage):
    rng = np.random.default_rng(3)
    sizes_per_sample = [[(40, 100)], [(64, 64), (120, 30)], [], [(17, 23)], [(30, 45), (200, 90)]]
    step = tiny.PATCH_SIZE * tiny.MERGE  # what PixtralProcessor passes as the image processor's patch size
    processor = PixtralImageProcessorPil(patch_size={"height": step, "width": step}, size={"longest_edge": tiny.MAX_SIZE})
    images = [[Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in s] for s in sizes_per_sample if s]
    out = processor(images=images, return_tensors="pt")
    true_sizes = out["image_sizes"].tolist()
    assert len({tuple(s) for s in true_sizes}) > 3  # images of different sizes, padded to the largest
    assert out["pixel_values"].shape[2:] == (max(h for h, _ in true_sizes), max(w for _, w in true_sizes))
    text = lambda n: rng.integers(14, 128, n).tolist()  # noqa: E731
    rows, k = [], 0
    for sizes in sizes_per_sample:
        ids = text(2)
        for _ in sizes:
            ids += tiny.image_ids(tuple(true_sizes[k])) + text(1)
            k += 1
        rows.append(ids)
    seq = max(map(len, rows))
    input_ids = torch.zeros(len(rows), seq, dtype=torch.int64)
    mask = torch.zeros_like(input_ids)
    for i, ids in enumerate(rows):
        input_ids[i, : len(ids)], mask[i, : len(ids)] = torch.tensor(ids), 1
    batch = {"input_ids": input_ids, "attention_mask": mask, **out}
    reference = capture_merged_embeds(model, **tiny.reference_inputs(batch))
    for n in (1, 5):
        for rows_k, merged, _ in _merge_all(model, adapter, batch, n, first_stage):
            assert (merged - reference[rows_k]).abs().max().item() <= ATOL
