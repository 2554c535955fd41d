"""LLaVA-NeXT adapter against transformers' own merge, on the tiny seeded model.

The batch's media are split with ``ppmedia.split_media`` (images per sample from the adapter's
``media_per_sample``), staged with ``ppmedia.stage_media`` and taken with ``next_vlm_media_chunk``
once per microbatch; the adapter's merge of each microbatch must equal the matching rows of the
``inputs_embeds`` the full model hands its language model. Token counts are checked against the
model's own packing, and the device-side count against transformers' host-side geometry functions.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape, unpad_image

import ppmedia
from ppmedia import HostReadCounter, VlmMediaChunk, next_vlm_media_chunk
from ppmedia.adapters.base import VlmAdapter
from ppmedia.adapters.llava_next import image_tokens
from ppmedia.testing.tiny_models import capture_merged_embeds
from ppmedia.testing.tiny_models import llava_next as tiny
from conftest import text_embeds

ATOL = 1e-5
IMAGES_PER_SAMPLE = [1, 2, 1, 1, 0, 0, 2, 1]
IMAGE_SIZES = [(10, 30), (30, 12), (24, 24), (7, 5), (33, 17), (16, 16), (9, 21), (20, 20)]
CROPS_PER_IMAGE = [3, 3, 5, 3, 5, 3, 3, 5]
TOKENS_PER_IMAGE = [34, 56, 88, 28, 56, 36, 52, 88]
TOKENS_PER_SAMPLE = [34, 144, 28, 56, 0, 0, 88, 88]
SEQ_LEN = 150


def _flat(chunk: VlmMediaChunk) -> VlmMediaChunk:
    """The chunk with its padded crops flattened to ``[crops, C, H, W]`` (padding dropped)."""
    crops = [tiny.crops_per_image(tuple(s)) for s in chunk.image_grid.tolist()]
    flat = torch.cat([chunk.pixel_values[i, :n] for i, n in enumerate(crops)], dim=0)
    return VlmMediaChunk(flat, chunk.image_grid, None, None)


def _host_tokens(size, pinpoints, crop, patch) -> int:
    """Tokens of one image from transformers' own host-side geometry (grid shape + unpad_image)."""
    side = crop // patch
    grid_h, grid_w = get_anyres_image_grid_shape(list(size), pinpoints, crop)
    rows, cols = unpad_image(torch.empty(1, grid_h * side, grid_w * side), list(size)).shape[1:]
    return side * side + rows * (cols + 1)


def _staged(adapter, model, batch, n):
    images, _ = adapter.media_per_sample(batch["input_ids"], model.config)
    return ppmedia.split_media(dict(batch), n, images_per_sample=images)


# -- the tiny module ------------------------------------------------------------------------------


def test_tiny_batch_layout(batch):
    assert tiny.MODEL_TYPE == "llava_next" == tiny.build_config().model_type
    assert batch["input_ids"].shape == (8, SEQ_LEN)
    assert batch["attention_mask"].shape == (8, SEQ_LEN)
    assert batch["pixel_values"].shape == (8, max(CROPS_PER_IMAGE), 3, 16, 16)
    assert batch["image_sizes"].tolist() == [list(s) for s in IMAGE_SIZES]
    assert [tiny.crops_per_image(s) for s in IMAGE_SIZES] == CROPS_PER_IMAGE
    assert [tiny.tokens_per_image(s) for s in IMAGE_SIZES] == TOKENS_PER_IMAGE
    is_image = batch["input_ids"] == tiny.IMAGE_TOKEN_ID
    assert is_image.sum(1).tolist() == TOKENS_PER_SAMPLE
    # right padding: the mask is a prefix of ones, the rest is the pad token
    lengths = batch["attention_mask"].sum(1)
    for i, length in enumerate(lengths.tolist()):
        assert batch["attention_mask"][i, :length].all()
        assert (batch["input_ids"][i, length:] == tiny.PAD_TOKEN_ID).all()
        assert (batch["input_ids"][i, :length] != tiny.PAD_TOKEN_ID).all()
    assert lengths.max().item() == SEQ_LEN and lengths.min().item() < SEQ_LEN
    # crops past an image's own count are zero padding, its own crops are not
    for k, n in enumerate(CROPS_PER_IMAGE):
        assert batch["pixel_values"][k, n:].abs().sum() == 0
        assert (batch["pixel_values"][k, :n].flatten(1).abs().sum(1) > 0).all()


def test_tiny_batch_is_deterministic(batch):
    again = tiny.build_batch(seed=0)
    assert all(torch.equal(batch[k], again[k]) for k in batch)
    other = tiny.build_batch(seed=1)
    assert not torch.equal(batch["pixel_values"], other["pixel_values"])
    assert torch.equal(batch["image_sizes"], other["image_sizes"])


def test_token_counts_are_the_models(model, batch, adapter):
    with torch.no_grad():
        out = model.model.get_image_features(batch["pixel_values"], batch["image_sizes"], return_dict=True)
    assert [f.shape[0] for f in out.pooler_output] == TOKENS_PER_IMAGE
    assert [image_tokens(h, w, model.config) for h, w in batch["image_sizes"].tolist()] == TOKENS_PER_IMAGE
    # the model's own placeholder check accepts the batch, and refuses one feature row less
    embeds = text_embeds(model, batch["input_ids"])
    features = torch.cat(out.pooler_output)
    mask = model.model.get_placeholder_mask(batch["input_ids"], embeds, features)
    assert mask.sum().item() == sum(TOKENS_PER_IMAGE)
    with pytest.raises(ValueError):
        model.model.get_placeholder_mask(batch["input_ids"], embeds, features[:-1])


def test_image_tokens_match_transformers_geometry():
    """Host token counts equal the test's reference built on transformers' functions, tiny and LLaVA-1.6."""
    config = tiny.build_config()
    sizes = [(h, w) for h in range(1, 65) for w in range(1, 65)]
    assert [image_tokens(h, w, config) for h, w in sizes] == [_host_tokens(s, tiny.GRID_PINPOINTS, 16, 4) for s in sizes]

    pinpoints = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
    big = SimpleNamespace(
        vision_config=SimpleNamespace(image_size=336, patch_size=14),
        image_grid_pinpoints=pinpoints,
        vision_feature_select_strategy="default",
    )
    rng = random.Random(0)
    sizes = [(rng.randint(1, 4000), rng.randint(1, 4000)) for _ in range(2000)]
    sizes += [(1080, 1920), (1920, 1080), (1, 4000), (4000, 1), (49, 1), (1, 49), (336, 336)]
    assert [image_tokens(h, w, big) for h, w in sizes] == [_host_tokens(s, pinpoints, 336, 14) for s in sizes]


def test_host_unpad_arithmetic_is_the_models():
    """image_tokens' unpadding equals the model's unpad_image run on (meta) feature maps."""
    from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape, unpad_image

    pinpoints = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
    big = SimpleNamespace(vision_config=SimpleNamespace(image_size=336, patch_size=14),
                          image_grid_pinpoints=pinpoints, vision_feature_select_strategy="default")
    rng = random.Random(1)
    for h, w in [(rng.randint(1, 3000), rng.randint(1, 3000)) for _ in range(500)] + [(1, 4000), (4000, 1), (7, 5)]:
        gh, gw = get_anyres_image_grid_shape((h, w), pinpoints, 336)
        rows, cols = unpad_image(torch.empty((0, gh * 24, gw * 24), device="meta"), [h, w]).shape[1:]
        assert image_tokens(h, w, big) == 24 * 24 + rows * (cols + 1), (h, w)


# -- token side -----------------------------------------------------------------------------------


def test_adapter_identity(adapter):
    assert isinstance(adapter, VlmAdapter)
    assert adapter.name == "llava_next"
    assert adapter.model_types == ("llava_next",)
    assert "max_crops" in adapter.layout and "[images, 2]" in adapter.layout


def test_media_per_sample(model, batch, adapter):
    with HostReadCounter() as reads:
        images, videos = adapter.media_per_sample(batch["input_ids"], model.config)
    assert reads.total == 0
    assert images.dtype == torch.int64 and videos.dtype == torch.int64
    assert images.tolist() == IMAGES_PER_SAMPLE
    assert videos.tolist() == [0] * 8
    masks = adapter.placeholder_masks(batch["input_ids"], model.config)
    assert set(masks) == {"image"}
    assert masks["image"].dtype == torch.bool
    assert masks["image"].sum(1).tolist() == TOKENS_PER_SAMPLE


def test_media_per_sample_with_image_sizes_reads_once(model, batch, adapter):
    with HostReadCounter() as reads:
        images, videos = adapter.media_per_sample(batch["input_ids"], model.config, media=batch)
    assert reads.total == 1
    assert images.tolist() == IMAGES_PER_SAMPLE and videos.tolist() == [0] * 8
    assert images.dtype == videos.dtype == torch.int64


def test_media_per_sample_counts_runs_not_tokens(model, adapter):
    img, txt = tiny.IMAGE_TOKEN_ID, 5
    ids = torch.tensor(
        [
            [img, img, txt, img, txt, img, img, img],  # run at position 0, then two more
            [txt, txt, txt, txt, txt, txt, txt, txt],
            [img, img, img, img, img, img, img, img],
        ]
    )
    images, videos = adapter.media_per_sample(ids, model.config)
    assert images.tolist() == [3, 0, 1]
    assert videos.tolist() == [0, 0, 0]


# -- merge per microbatch -------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["padded", "flat"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_merge_matches_model_per_microbatch(model, batch, reference, adapter, first_stage, n, layout):
    staged = _staged(adapter, model, batch, n)
    bounds = torch.tensor_split(torch.arange(8), n)
    image_at = [0, *torch.cumsum(torch.tensor(IMAGES_PER_SAMPLE), 0).tolist()]
    with ppmedia.stage_media(first_stage, staged):
        for k, rows in enumerate(bounds):
            b0, b1 = int(rows[0]), int(rows[-1]) + 1
            chunk = next_vlm_media_chunk(first_stage)
            ids = batch["input_ids"][b0:b1]
            embeds = text_embeds(model, ids)
            placeholders = int((ids == tiny.IMAGE_TOKEN_ID).sum())
            if placeholders == 0:
                assert chunk is None
                assert adapter.merge(model, ids, embeds, chunk) is embeds
                continue
            # the chunk holds exactly this microbatch's images, as views of the batch
            i0, i1 = image_at[b0], image_at[b1]
            assert chunk.pixel_values.shape[0] == i1 - i0
            assert chunk.image_grid.tolist() == [list(s) for s in IMAGE_SIZES[i0:i1]]
            if layout == "flat":
                chunk = _flat(chunk)
                assert chunk.pixel_values.shape[0] == sum(CROPS_PER_IMAGE[i0:i1])
            # image_sizes are read with the placeholder counts, in one host read
            with HostReadCounter() as reads:
                masks, host = adapter.check_counts(ids, chunk, model.config)
            assert reads.total == 1
            assert host.values["image_sizes"] == chunk.image_grid.reshape(-1).tolist()
            assert host.placeholders["image"] == TOKENS_PER_SAMPLE[b0:b1]
            with HostReadCounter() as reads:
                counts = adapter.feature_counts(chunk, model.config, host)
            assert reads.total == 0
            assert counts == {"image": placeholders} and placeholders == sum(TOKENS_PER_IMAGE[i0:i1])
            with torch.no_grad(), HostReadCounter() as reads:
                merged = adapter.merge(model, ids, embeds, chunk)
            # the count check's read is the only one: encode takes the sizes from it
            assert reads.total == 1
            assert merged.shape == embeds.shape
            torch.testing.assert_close(merged, reference[b0:b1], atol=ATOL, rtol=0)
    text_only = [k for k, images in enumerate(staged.images) if images == 0]
    assert text_only == ([2] if n == 4 else [])


def test_hand_split_equals_split_media(model, batch, adapter):
    """split_media's views are the tensor_split rows, cut by hand from the placeholder runs."""
    staged = _staged(adapter, model, batch, 4)
    image_at = [0, *torch.cumsum(torch.tensor(IMAGES_PER_SAMPLE), 0).tolist()]
    for k, rows in enumerate(torch.tensor_split(torch.arange(8), 4)):
        i0, i1 = image_at[int(rows[0])], image_at[int(rows[-1]) + 1]
        chunk = staged.chunk(k)
        if i0 == i1:
            assert chunk is None
            continue
        assert torch.equal(chunk.pixel_values, batch["pixel_values"][i0:i1])
        base = batch["pixel_values"].untyped_storage().data_ptr()
        assert chunk.pixel_values.untyped_storage().data_ptr() == base  # a view, not a copy
        assert torch.equal(chunk.image_grid, batch["image_sizes"][i0:i1])


def test_encode_is_in_placeholder_order(model, batch, reference, adapter):
    chunk = VlmMediaChunk(batch["pixel_values"], batch["image_sizes"], None, None)
    _, host = adapter.check_counts(batch["input_ids"], chunk, model.config)
    with torch.no_grad(), HostReadCounter() as reads:
        feats = adapter.encode(model, chunk, host)["image"]
    assert reads.total == 0
    mask = batch["input_ids"] == tiny.IMAGE_TOKEN_ID
    torch.testing.assert_close(feats, reference[mask], atol=ATOL, rtol=0)


# -- errors ---------------------------------------------------------------------------------------


class _TowerCalls:
    def __init__(self, model):
        self.calls = 0
        self._handle = model.model.vision_tower.register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        self.calls += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._handle.remove()


def test_wrong_image_sizes_raise_before_encoder(model, batch, adapter):
    ids = batch["input_ids"][0:2]
    embeds = text_embeds(model, ids)
    sizes = batch["image_sizes"][0:3].clone()
    sizes[0] = torch.tensor([30, 10])  # 40 tokens instead of 34
    chunk = VlmMediaChunk(batch["pixel_values"][0:3], sizes, None, None)
    with _TowerCalls(model) as tower, pytest.raises(ValueError) as err:
        adapter.merge(model, ids, embeds, chunk)
    assert tower.calls == 0
    assert "178" in str(err.value) and "184" in str(err.value)  # placeholders and features


def test_missing_image_raises_before_encoder(model, batch, adapter):
    ids = batch["input_ids"][0:2]  # 3 images: 178 placeholders
    embeds = text_embeds(model, ids)
    chunk = VlmMediaChunk(batch["pixel_values"][0:2], batch["image_sizes"][0:2], None, None)
    with _TowerCalls(model) as tower, pytest.raises(ValueError) as err:
        adapter.merge(model, ids, embeds, chunk)
    assert tower.calls == 0
    assert "178" in str(err.value) and "90" in str(err.value)


def test_placeholders_without_media_raise(model, batch, adapter):
    ids = batch["input_ids"][0:2]
    with pytest.raises(ValueError, match="178"):
        adapter.merge(model, ids, text_embeds(model, ids), None)


def test_bad_crop_layouts_raise_before_encoder(model, batch, adapter):
    ids = batch["input_ids"][0:2]
    embeds = text_embeds(model, ids)
    sizes = batch["image_sizes"][0:3]
    flat = _flat(VlmMediaChunk(batch["pixel_values"][0:3], sizes, None, None))
    short_flat = VlmMediaChunk(flat.pixel_values[:-1], sizes, None, None)
    short_padded = VlmMediaChunk(batch["pixel_values"][0:3, :4], sizes, None, None)  # image 2 needs 5
    with _TowerCalls(model) as tower:
        with pytest.raises(ValueError, match="10 crops but the image sizes imply 11"):
            adapter.merge(model, ids, embeds, short_flat)
        with pytest.raises(ValueError, match="cannot hold"):
            adapter.merge(model, ids, embeds, short_padded)
        with pytest.raises(ValueError, match="2 images but image sizes describe 3"):
            adapter.merge(model, ids, embeds, VlmMediaChunk(batch["pixel_values"][0:2], sizes, None, None))
        with pytest.raises(ValueError, match=r"images only.*pixel_values_videos \[4, 8\]"):
            videos = VlmMediaChunk(batch["pixel_values"][0:3], sizes, torch.zeros(4, 8), torch.ones(1, 3))
            adapter.merge(model, ids, embeds, videos)
        with pytest.raises(ValueError, match=r"\(image_grid\): shape \[3\]"):
            adapter.merge(model, ids, embeds, VlmMediaChunk(batch["pixel_values"][0:3], sizes[:, 0], None, None))
        zero = sizes.clone()
        zero[1, 1] = 0
        with pytest.raises(ValueError, match=r"row 1 is \[30, 0\]"):
            adapter.merge(model, ids, embeds, VlmMediaChunk(batch["pixel_values"][0:3], zero, None, None))
        with pytest.raises(TypeError, match="image_sizes: dtype torch.float32"):
            adapter.merge(model, ids, embeds, VlmMediaChunk(batch["pixel_values"][0:3], sizes.float(), None, None))
    assert tower.calls == 0


def test_chunk_none_returns_inputs_embeds(model, batch, adapter):
    ids = batch["input_ids"][4:6]  # text-only samples
    embeds = text_embeds(model, ids)
    assert adapter.merge(model, ids, embeds, None) is embeds


# -- images written back to back (one run of placeholder tokens) ----------------------------------


def _back_to_back(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch with the text token between two images of a sample removed (samples 1 and 6), so
    their placeholders form one run; rows stay right-padded to the same length."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    img = tiny.IMAGE_TOKEN_ID
    rows, masks = [], []
    for row, length in zip(ids.tolist(), mask.sum(1).tolist()):
        row = row[:length]
        kept = [t for i, t in enumerate(row) if not (0 < i < len(row) - 1 and t != img and row[i - 1] == img and row[i + 1] == img)]
        rows.append(kept + [tiny.PAD_TOKEN_ID] * (ids.shape[1] - len(kept)))
        masks.append([1] * len(kept) + [0] * (ids.shape[1] - len(kept)))
    return {**batch, "input_ids": torch.tensor(rows), "attention_mask": torch.tensor(masks, dtype=mask.dtype)}


@pytest.fixture(scope="module")
def back_to_back(batch):
    return _back_to_back(batch)


def _runs(ids: torch.Tensor) -> list[int]:
    is_image = ids == tiny.IMAGE_TOKEN_ID
    starts = is_image.clone()
    starts[:, 1:] &= ~is_image[:, :-1]
    return starts.sum(1).tolist()


def test_back_to_back_without_sizes_counts_runs_and_split_refuses(model, back_to_back, adapter):
    assert _runs(back_to_back["input_ids"]) == [1, 1, 1, 1, 0, 0, 1, 1]  # samples 1 and 6: one run, two images
    images, _ = adapter.media_per_sample(back_to_back["input_ids"], model.config)
    assert images.tolist() == [1, 1, 1, 1, 0, 0, 1, 1]
    before = dict(back_to_back)
    with pytest.raises(ValueError, match="counts sum to 6; expected 8"):
        ppmedia.split_media(before, 4, images_per_sample=images)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_back_to_back_split_staged_merged_equals_model(model, back_to_back, adapter, first_stage, n):
    """Counted from run lengths and image_sizes, split, staged and merged: the model's own merge."""
    reference = capture_merged_embeds(model, **tiny.reference_inputs(back_to_back))
    images, _ = adapter.media_per_sample(back_to_back["input_ids"], model.config, media=back_to_back)
    assert images.tolist() == IMAGES_PER_SAMPLE
    staged = ppmedia.split_media(dict(back_to_back), n, images_per_sample=images)
    with ppmedia.stage_media(first_stage, staged):
        for rows in torch.tensor_split(torch.arange(8), n):
            b0, b1 = int(rows[0]), int(rows[-1]) + 1
            ids = back_to_back["input_ids"][b0:b1]
            chunk = next_vlm_media_chunk(first_stage)
            with torch.no_grad():
                merged = adapter.merge(model, ids, text_embeds(model, ids), chunk)
            torch.testing.assert_close(merged, reference[b0:b1], atol=ATOL, rtol=0)


def test_back_to_back_runs_that_sizes_cannot_fill_raise(model, back_to_back, adapter):
    ids = back_to_back["input_ids"]
    swapped = dict(back_to_back)
    sizes = back_to_back["image_sizes"].clone()
    sizes[[1, 2]] = sizes[[2, 1]]  # 88 + 56 still fills sample 1's run of 144 ...
    swapped["image_sizes"] = sizes
    assert adapter.media_per_sample(ids, model.config, media=swapped)[0].tolist() == IMAGES_PER_SAMPLE
    wrong = dict(back_to_back)
    sizes = back_to_back["image_sizes"].clone()
    sizes[2] = torch.tensor([10, 30])  # 34 tokens: sample 1's run of 144 is 56 + 88, not 56 + 34 + ...
    wrong["image_sizes"] = sizes
    with pytest.raises(ValueError) as err:
        adapter.media_per_sample(ids, model.config, media=wrong)
    message = str(err.value)
    assert "sample 1" in message and "run of 144" in message and "n_images_per_sample" in message
    fewer = {**back_to_back, "image_sizes": back_to_back["image_sizes"][:-1]}
    with pytest.raises(ValueError, match=r"sample 7 has a run of 88 .* all 7 images .*n_images_per_sample"):
        adapter.media_per_sample(ids, model.config, media=fewer)
    five = {**back_to_back, "image_sizes": back_to_back["image_sizes"][:5]}
    with pytest.raises(ValueError, match=r"6 runs of placeholder tokens but image_sizes describes 5 images"):
        adapter.media_per_sample(ids, model.config, media=five)
    more = {**back_to_back, "image_sizes": torch.cat([back_to_back["image_sizes"], back_to_back["image_sizes"][:1]])}
    with pytest.raises(ValueError, match=r"hold 8 images but image_sizes describes 9.*n_images_per_sample"):
        adapter.media_per_sample(ids, model.config, media=more)
    with pytest.raises(ValueError, match=r"image_sizes: shape \[8\]"):
        adapter.media_per_sample(ids, model.config, media={"image_sizes": back_to_back["image_sizes"][:, 0]})
