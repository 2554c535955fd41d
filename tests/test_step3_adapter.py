"""Step3 adapter against transformers' own Step3p7 merge, on the tiny seeded model.

The reference is the ``inputs_embeds`` the full model hands its language model
(``capture_merged_embeds``). Each microbatch's media are staged on a module -- by hand from
``torch.tensor_split`` sample boundaries, and through ``split_media``/``stage_media`` -- taken with
``next_vlm_media_chunk`` and merged by the adapter; the result must equal the reference rows.
"""

from __future__ import annotations

import pytest
import torch

import ppmedia
from ppmedia import HostReadCounter, VlmMediaChunk, next_vlm_media_chunk
from ppmedia.adapters.base import VlmAdapter
from ppmedia.adapters.step3 import tokens_per_view
from ppmedia.testing.tiny_models import step3 as tiny
from conftest import text_embeds

ATOL = 1e-5
IMAGES_PER_SAMPLE = [1, 1, 1, 1, 0, 0, 1, 1]
CROPS_PER_SAMPLE = [2, 0, 4, 2, 0, 0, 3, 6]
CROPS_PER_IMAGE = [2, 0, 4, 2, 3, 6]
NEWLINES_PER_SAMPLE = [0, 0, 1, 1, 0, 0, 0, 2]


def _merge(adapter, model, input_ids, chunk):
    embeds = text_embeds(model, input_ids)
    with torch.no_grad():
        return embeds, adapter.merge(model, input_ids, embeds, chunk)


def _offsets(counts):
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def _hand_staged_chunks(batch, n):
    """Stage per-microbatch views by hand (tensor_split sample boundaries); take them back in order."""
    samples = torch.tensor_split(torch.arange(batch["input_ids"].shape[0]), n)
    image_at = _offsets(IMAGES_PER_SAMPLE)
    crop_at = _offsets(CROPS_PER_SAMPLE)
    lists = {name: [] for name in ("pixel_values", "patch_pixel_values", "num_patches", "patch_newline_mask")}
    for rows in samples:
        first, stop = int(rows[0]), int(rows[-1]) + 1
        lists["pixel_values"].append(batch["pixel_values"][image_at[first] : image_at[stop]])
        lists["patch_pixel_values"].append(batch["patch_pixel_values"][crop_at[first] : crop_at[stop]])
        lists["patch_newline_mask"].append(batch["patch_newline_mask"][crop_at[first] : crop_at[stop]])
        lists["num_patches"].append(batch["num_patches"][first:stop])
    module = torch.nn.Linear(1, 1)
    for name, staged in lists.items():
        setattr(module, ppmedia.STAGED_ATTRIBUTES[name], staged)
    setattr(module, ppmedia.CURSOR_ATTRIBUTE, 0)
    chunks = [next_vlm_media_chunk(module) for _ in samples]
    assert getattr(module, ppmedia.CURSOR_ATTRIBUTE) == n
    return samples, chunks


def _gathered(batch, order):
    """Input ids and a chunk for the samples ``order`` in that order (media concatenated to match)."""
    image_at = _offsets(IMAGES_PER_SAMPLE)
    crop_at = _offsets(CROPS_PER_SAMPLE)
    globals_ = [batch["pixel_values"][image_at[s] : image_at[s + 1]] for s in order]
    crops = [batch["patch_pixel_values"][crop_at[s] : crop_at[s + 1]] for s in order]
    newline = [batch["patch_newline_mask"][crop_at[s] : crop_at[s + 1]] for s in order]

    def nonempty(t):
        return t if t.numel() else None

    chunk = VlmMediaChunk(
        pixel_values=nonempty(torch.cat(globals_)),
        image_grid=None,
        pixel_values_videos=None,
        video_grid=None,
        patch_pixel_values=nonempty(torch.cat(crops)),
        num_patches=batch["num_patches"][list(order)],
        patch_newline_mask=nonempty(torch.cat(newline)),
    )
    return batch["input_ids"][list(order)], chunk


class _EncoderCalls:
    """Counts calls of the vision tower and the host reads made before its first call."""

    def __init__(self, model, reads: HostReadCounter | None = None):
        self.calls = 0
        self.reads_before = None
        self._reads = reads
        self._handle = model.model.vision_model.register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        if self.calls == 0 and self._reads is not None:
            self.reads_before = self._reads.total
        self.calls += 1

    def close(self):
        self._handle.remove()


# -- the tiny batch and the model's own layout --------------------------------------------------


def test_tiny_batch_layout(model, batch):
    ids = batch["input_ids"]
    assert ids.shape == (8, 51)
    assert batch["pixel_values"].shape == (6, 3, tiny.GLOBAL_SIZE, tiny.GLOBAL_SIZE)
    assert batch["patch_pixel_values"].shape == (17, 3, tiny.CROP_SIZE, tiny.CROP_SIZE)
    assert batch["num_patches"].tolist() == CROPS_PER_SAMPLE
    # the processor's rule: the last crop of every row but the final one ends a row
    assert batch["patch_newline_mask"].tolist() == [
        False, False,  # sample 0: 2 x 1
        False, True, False, False,  # sample 2: 2 x 2
        True, False,  # sample 3: 1 x 2
        False, False, False,  # sample 6: 3 x 1
        False, True, False, True, False, False,  # sample 7: 2 x 3
    ]  # fmt: skip
    placeholders = (ids == tiny.IMAGE_TOKEN_ID).sum(-1).tolist()
    assert placeholders == [
        c * tiny.TOKENS_PER_CROP + i * tiny.TOKENS_PER_GLOBAL for c, i in zip(CROPS_PER_SAMPLE, IMAGES_PER_SAMPLE)
    ]
    # the newline mask's only effect: one <patch_newline> text token per marked crop
    assert (ids == tiny.PATCH_NEWLINE_ID).sum(-1).tolist() == NEWLINES_PER_SAMPLE
    assert (ids[:, -1] != tiny.PAD_TOKEN_ID).sum() == 1  # right-padded to the longest sample
    assert torch.equal(batch["attention_mask"].bool(), ids != tiny.PAD_TOKEN_ID)
    assert tiny.reference_inputs(batch)["num_local_patches"] == CROPS_PER_IMAGE
    # the model's own features per image: its crops, then its global view
    with torch.no_grad():
        feats = model.model.get_image_features(
            batch["pixel_values"], batch["patch_pixel_values"], CROPS_PER_IMAGE
        ).pooler_output
    assert [f.shape[0] for f in feats] == [p for p in placeholders if p]


def test_tiny_is_deterministic(batch):
    again = tiny.build_batch(seed=0)
    assert all(torch.equal(again[k], v) for k, v in batch.items())
    assert tiny.build_model(seed=0).config.model_type == tiny.MODEL_TYPE == "step3p7"


def test_class_attributes(adapter):
    assert isinstance(adapter, VlmAdapter)
    assert adapter.name == "step3"
    assert adapter.model_types == ("step3_vl", "step3p7")
    assert "num_patches" in adapter.layout and "newline" in adapter.layout


def test_tokens_per_view_matches_step3_checkpoint_sizes():
    assert tokens_per_view(728, 728, 14) == 169  # Step3 global view
    assert tokens_per_view(504, 504, 14) == 81  # Step3 crop
    assert tokens_per_view(tiny.GLOBAL_SIZE, tiny.GLOBAL_SIZE, 4) == tiny.TOKENS_PER_GLOBAL
    assert tokens_per_view(tiny.CROP_SIZE, tiny.CROP_SIZE, 4) == tiny.TOKENS_PER_CROP


# -- token side ---------------------------------------------------------------------------------


def test_media_per_sample(adapter, model, batch):
    with HostReadCounter() as reads:
        images, videos = adapter.media_per_sample(batch["input_ids"], model.config)
    assert reads.total == 0
    assert images.dtype == videos.dtype == torch.int64
    assert images.tolist() == IMAGES_PER_SAMPLE
    assert videos.tolist() == [0] * 8


def test_placeholder_masks(adapter, model, batch):
    masks = adapter.placeholder_masks(batch["input_ids"], model.config)
    assert set(masks) == {"image"}
    assert torch.equal(masks["image"], batch["input_ids"] == model.config.image_token_id)


def test_feature_counts_from_shapes(adapter, model, batch):
    ids, chunk = _gathered(batch, range(8))
    with HostReadCounter() as reads:
        _, host = adapter.check_counts(ids, chunk, model.config)
    assert reads.total == 1  # per-sample placeholders and num_patches together
    assert host.values["num_patches"] == CROPS_PER_SAMPLE
    with HostReadCounter() as reads:
        counts = adapter.feature_counts(chunk, model.config, host)
    assert reads.total == 0
    assert counts == {"image": 17 * tiny.TOKENS_PER_CROP + 6 * tiny.TOKENS_PER_GLOBAL}
    assert counts["image"] == (batch["input_ids"] == tiny.IMAGE_TOKEN_ID).sum()


# -- merge against the model's own merge --------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4])
def test_merge_matches_model_hand_staged(adapter, model, batch, reference, n):
    samples, chunks = _hand_staged_chunks(batch, n)
    for k, (rows, chunk) in enumerate(zip(samples, chunks)):
        if n == 4 and k == 2:
            assert chunk is not None and chunk.pixel_values is None  # only num_patches [0, 0] staged
        embeds, merged = _merge(adapter, model, batch["input_ids"][rows], chunk)
        torch.testing.assert_close(merged, reference[rows], atol=ATOL, rtol=0)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_merge_matches_model_split_media(adapter, model, batch, reference, n):
    images, _ = adapter.media_per_sample(batch["input_ids"], model.config)
    staged = ppmedia.split_media(dict(batch), n, images_per_sample=images)
    module = torch.nn.Linear(1, 1)
    with ppmedia.stage_media(module, staged):
        for rows in torch.tensor_split(torch.arange(8), n):
            chunk = next_vlm_media_chunk(module)
            ids = batch["input_ids"][rows]
            with HostReadCounter() as reads:
                encoder = _EncoderCalls(model, reads)
                try:
                    embeds, merged = _merge(adapter, model, ids, chunk)
                finally:
                    encoder.close()
            if chunk is None:
                assert merged is embeds and encoder.calls == 0
            else:
                assert encoder.reads_before == 1  # the adapter's one host read, before the encoder
            torch.testing.assert_close(merged, reference[rows], atol=ATOL, rtol=0)


def test_text_only_microbatch(adapter, model, batch):
    ids = batch["input_ids"][4:6]
    embeds, merged = _merge(adapter, model, ids, None)
    assert merged is embeds
    # a chunk that only carries the microbatch's zero crop counts is text-only as well
    chunk = VlmMediaChunk(None, None, None, None, num_patches=batch["num_patches"][4:6])
    embeds, merged = _merge(adapter, model, ids, chunk)
    torch.testing.assert_close(merged, embeds, atol=0, rtol=0)


def test_no_crop_image(adapter, model, batch, reference):
    ids, chunk = _gathered(batch, [1])
    assert chunk.patch_pixel_values is None and chunk.num_patches.tolist() == [0]
    _, host = adapter.check_counts(ids, chunk, model.config)
    assert adapter.feature_counts(chunk, model.config, host) == {"image": tiny.TOKENS_PER_GLOBAL}
    _, merged = _merge(adapter, model, ids, chunk)
    torch.testing.assert_close(merged, reference[1:2], atol=ATOL, rtol=0)
    with torch.no_grad():
        feats = adapter.encode(model, chunk, host)["image"]
    assert feats.shape == (tiny.TOKENS_PER_GLOBAL, model.config.text_config.hidden_size)


@pytest.mark.parametrize(
    "order",
    [
        [1, 2, 4],  # no-crop image, 4-crop image, text: per image [0, 4]
        [4, 2, 1],  # same per-sample counts reversed: per image [4, 0]
        [5, 1, 4, 6],  # text, no-crop image, text, 3-crop image
        [7, 4, 1, 0],
    ],
)
def test_zero_crop_image_vs_text_only_sample(adapter, model, batch, reference, order):
    ids, chunk = _gathered(batch, order)
    _, merged = _merge(adapter, model, ids, chunk)
    torch.testing.assert_close(merged, reference[order], atol=ATOL, rtol=0)


# -- errors -------------------------------------------------------------------------------------


def test_count_mismatch_raises_before_encoder(adapter, model, batch):
    ids, chunk = _gathered(batch, [0, 1])
    short = VlmMediaChunk(
        chunk.pixel_values, None, None, None, chunk.patch_pixel_values[:-1], chunk.num_patches, None
    )
    placeholders = int((ids == tiny.IMAGE_TOKEN_ID).sum())
    features = placeholders - tiny.TOKENS_PER_CROP
    encoder = _EncoderCalls(model)
    try:
        with pytest.raises(ValueError, match=rf"{placeholders} placeholder tokens.*{features} feature rows"):
            _merge(adapter, model, ids, short)
        # placeholders but no media at all
        with pytest.raises(ValueError, match=rf"{placeholders} placeholder tokens.*0 feature rows"):
            _merge(adapter, model, ids, None)
    finally:
        encoder.close()
    assert encoder.calls == 0


def test_per_sample_mismatch_raises_before_encoder(adapter, model, batch):
    # the totals agree, but sample 0's crops are attributed to sample 1 (and vice versa)
    ids, chunk = _gathered(batch, [0, 1])
    swapped = VlmMediaChunk(
        chunk.pixel_values, None, None, None, chunk.patch_pixel_values, chunk.num_patches.flip(0), None
    )
    encoder = _EncoderCalls(model)
    try:
        with pytest.raises(ValueError, match=r"sample 0 .* 17 placeholder tokens .* 9 feature rows"):
            _merge(adapter, model, ids, swapped)
        # two images' placeholders in one sample: the totals agree, but Step3 stages one image per sample
        two = torch.full((1, 20), 11)
        two[0, :18] = tiny.IMAGE_TOKEN_ID
        pair = VlmMediaChunk(batch["pixel_values"][:2], None, None, None, num_patches=torch.zeros(1, dtype=torch.int64))
        with pytest.raises(ValueError, match=r"1 samples have placeholder tokens \(per sample: \[18\]\) but the chunk has 2 global"):
            _merge(adapter, model, two, pair)
        with pytest.raises(ValueError, match=r"num_patches: shape \[3\] but the microbatch has 2 samples"):
            _merge(adapter, model, ids, VlmMediaChunk(
                chunk.pixel_values, None, None, None, chunk.patch_pixel_values, torch.tensor([2, 0, 0]), None
            ))
    finally:
        encoder.close()
    assert encoder.calls == 0


def test_encode_takes_per_image_crops_from_the_host_read(adapter, model, batch, reference):
    """num_patches is per sample; encode maps it to images with the per-sample placeholders read by
    check_counts (a text-only sample's 0 is not an image's), with no read of its own."""
    order = [1, 4, 2]  # no-crop image, text-only sample, 4-crop image: per image [0, 4]
    ids, mixed = _gathered(batch, order)
    _, host = adapter.check_counts(ids, mixed, model.config)
    assert host.placeholders["image"][1] == 0 and host.values["num_patches"] == [0, 0, 4]
    with torch.no_grad(), HostReadCounter() as reads:
        feats = adapter.encode(model, mixed, host)["image"]
    with torch.no_grad(), HostReadCounter() as model_reads:  # the vision model's own reads
        model.model.get_image_features(mixed.pixel_values, mixed.patch_pixel_values, [0, 4])
    assert reads.total == model_reads.total
    assert feats.shape[0] == 4 * tiny.TOKENS_PER_CROP + 2 * tiny.TOKENS_PER_GLOBAL
    mask = ids == tiny.IMAGE_TOKEN_ID
    torch.testing.assert_close(feats, reference[order][mask], atol=ATOL, rtol=0)


def test_videos_and_orphan_crops_refused(adapter, model, batch):
    ids, chunk = _gathered(batch, [0, 1])
    videos = VlmMediaChunk(chunk.pixel_values, None, torch.zeros(4, 8), torch.ones(1, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"step3 takes images only.*pixel_values_videos \[4, 8\]"):
        _merge(adapter, model, ids, videos)
    orphans = VlmMediaChunk(None, None, None, None, chunk.patch_pixel_values, chunk.num_patches, None)
    with pytest.raises(ValueError, match=r"crop patches \[2, 3, \d+, \d+\] but no global views"):
        _merge(adapter, model, ids, orphans)
