"""The built-in LLaVA-OneVision adapter against transformers' own model (tiny, seeded): merges per
microbatch (1, 2, 4, 8 and an uneven 3), token arithmetic against the model's own functions (tiling,
unpadding, ``anyres_max`` downsampling), ``batch_num_images`` in the processor's form (one entry per
sample holding images) and as ``[B]``, the real ``LlavaOnevisionImageProcessorPil``, malformed input
refused with nothing popped, and stage splits against the model's gradients."""

from __future__ import annotations

import functools
import types

import numpy as np
import pytest
import torch

import ppmedia
from ppmedia.adapters.llava_onevision import LlavaOnevisionAdapter, image_tokens, video_tokens
from ppmedia.testing import check_adapter, check_stage_splits
from ppmedia.testing.tiny_models import capture_merged_embeds
from ppmedia.testing.tiny_models import llava_onevision as tiny

ATOL = 1e-5


def test_registered_with_its_layout_and_per_sample_input(adapter):
    assert isinstance(adapter, LlavaOnevisionAdapter) and adapter.model_types == ("llava_onevision",)
    assert [s.key for s in adapter.sample_inputs] == ["batch_num_images"]
    providers = dict((l.name, p) for l, p in ppmedia.registry.default_registry().list_layouts())
    assert providers["onevision_videos"] == "ppmedia (built-in)"


def test_merge_matches_the_model_at_1_2_4_8_and_an_uneven_split(model):
    checks = check_adapter(tiny, microbatches=[1, 2, 4, 8, 3], model=model)
    assert len(checks) == 18 and max(c.max_abs_diff for c in checks) <= ATOL
    assert [c.has_media for c in checks if c.n_microbatches == 4] == [True, True, False, True]
    assert [c.samples for c in checks if c.n_microbatches == 3] == [(0, 3), (3, 6), (6, 8)]


@pytest.mark.parametrize("size", [(10, 30), (30, 12), (24, 24), (16, 16), (7, 5), (33, 17), (5, 90), (90, 5), (1, 1)])
def test_token_counts_are_the_models(model, size):
    """Tiled tokens against transformers' own grid + unpad_image + the downsampling rule (the tiny
    module's), and the packing the model itself does on random features (its pack_image_features)."""
    config = model.config
    assert image_tokens(*size, config) == tiny.tiled_tokens(size)
    assert image_tokens(*size, config, tiled=False) == tiny.BASE_TOKENS == 17
    from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

    crops = image_size_to_num_patches(list(size), tiny.PINPOINTS, tiny.CROP)
    feats = torch.randn(crops, 16, 64)
    packed, lens = model.model.pack_image_features([feats], [list(size)], model.model.image_newline, config.vision_aspect_ratio)
    assert int(lens[0]) == image_tokens(*size, config)
    assert video_tokens(tiny.FRAMES, config) == tiny.VIDEO_TOKENS == 9


def test_downsampling_is_exercised(model):
    # (24, 24) tiles 2 x 2: an 8 x 8 map, above anyres_max_1's 1.1**2 * 16 rows: downsampled to 4 x 4
    assert image_tokens(24, 24, model.config) == 16 + 4 * 5
    nine = type(model.config)(**{**model.config.to_dict(), "vision_aspect_ratio": "anyres_max_9"})
    assert image_tokens(24, 24, nine) == 16 + 8 * 9


def test_batch_num_images_per_holder_or_per_sample(model, batch, adapter):
    config = model.config
    per_holder = adapter.media_counts(batch, config)
    assert per_holder["images_per_sample"].tolist() == [1, 2, 0, 1, 0, 0, 1, 0]
    assert per_holder["sample_inputs"]["batch_num_images"].tolist() == [1, 2, 0, 1, 0, 0, 1, 0]
    as_list = dict(batch, batch_num_images=[1, 2, 1, 1])  # the processor without return_tensors
    assert adapter.media_counts(as_list, config)["images_per_sample"].tolist() == [1, 2, 0, 1, 0, 0, 1, 0]
    assert adapter.sample_input_values(batch, config)["batch_num_images"].tolist() == [1, 2, 0, 1, 0, 0, 1, 0]
    as_b = dict(batch, batch_num_images=torch.tensor([1, 2, 0, 1, 0, 0, 1, 0]))
    assert adapter.media_counts(as_b, config)["images_per_sample"].tolist() == [1, 2, 0, 1, 0, 0, 1, 0]
    reference = capture_merged_embeds(model, **tiny.reference_inputs(batch))
    checks = check_adapter(tiny, microbatches=[4], model=model, batch=as_b, reference=reference)
    assert max(c.max_abs_diff for c in checks) <= ATOL
    assert per_holder["videos_per_sample"].tolist() == [0, 0, 1, 0, 0, 0, 1, 1]


def test_without_batch_num_images_every_image_is_tiled(model):
    """The model's own rule without batch_num_images; sample 1's back-to-back images then need more
    tokens, so the tiny batch without sample 1's second image and with tiled tokens is used."""
    batch = tiny.build_batch(0)
    keep = [0, 2, 3, 4, 5, 6, 7]  # sample 1 (two images) left out: every other image is alone in its sample
    sizes = batch["image_sizes"][[0, 3, 4]]
    small = {"input_ids": batch["input_ids"][keep + [0]], "attention_mask": batch["attention_mask"][keep + [0]],
             "pixel_values": batch["pixel_values"][[0, 3, 4, 0]], "image_sizes": torch.cat([sizes, sizes[:1]]),
             "pixel_values_videos": batch["pixel_values_videos"]}
    reference = capture_merged_embeds(model, **{k: small[k] for k in small})
    checks = check_adapter(tiny, microbatches=[1, 4], model=model, batch=small, reference=reference)
    assert max(c.max_abs_diff for c in checks) <= ATOL


def _processor_batch(image_sizes_per_sample, videos_per_sample=None, seed=5):
    """A batch of real LlavaOnevisionImageProcessorPil output, with the image tokens the processor's own
    arithmetic gives (LlavaOnevisionProcessor._get_number_of_features; its tokenizer is not needed)."""
    from PIL import Image
    from transformers import LlavaOnevisionImageProcessorPil
    from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor as Processor

    rng = np.random.default_rng(seed)
    processor = LlavaOnevisionImageProcessorPil(size={"height": 16, "width": 16}, image_grid_pinpoints=tiny.PINPOINTS)
    images = [[Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in s] for s in image_sizes_per_sample]
    out = processor(images=images, return_tensors="pt")
    arithmetic = types.SimpleNamespace(image_processor=processor, num_image_tokens=16, vision_aspect_ratio=tiny.ASPECT)
    arithmetic._get_unpadded_features = functools.partial(Processor._get_unpadded_features, arithmetic)
    sizes, k, rows = out["image_sizes"].tolist(), 0, []
    for s in image_sizes_per_sample:
        ids = rng.integers(3, 100, 3).tolist()
        for _ in s:
            n = Processor._get_number_of_features(arithmetic, *sizes[k], 16, 16) if len(s) == 1 else 16 + 1
            ids += [tiny.IMAGE_TOKEN_ID] * n
            k += 1
        rows.append(ids + rng.integers(3, 100, 2).tolist())
    seq = max(map(len, rows))
    input_ids = torch.tensor([r + [0] * (seq - len(r)) for r in rows])
    return {"input_ids": input_ids, "attention_mask": (input_ids != 0).long(), **out}


def test_real_image_processor(model):
    batch = _processor_batch([[(40, 100)], [(30, 30), (10, 50)], [], [(64, 64)]])
    assert batch["batch_num_images"].tolist() == [1, 2, 1] and batch["pixel_values"].shape == (4, 5, 3, 16, 16)
    reference = capture_merged_embeds(model, **tiny.reference_inputs(batch))
    checks = check_adapter(tiny, microbatches=[1, 2, 4], model=model, batch=batch, reference=reference)
    assert max(c.max_abs_diff for c in checks) <= ATOL
    assert [c.has_media for c in checks if c.n_microbatches == 4] == [True, True, False, True]


def test_real_video_processor(model):
    """LlavaOnevisionVideoProcessor (torchvision) inside the tiny LlavaOnevisionProcessor: videos of
    3 frames at several sizes, ``[videos, 3, 3, 16, 16]``, placeholders written by the processor; the
    merges equal the model's own (the full table: tests/test_processors.py)."""
    from ppmedia.testing.processors import build_tiny_processor, chat_batch

    processor = build_tiny_processor("llava_onevision")
    assert type(processor.video_processor).__name__ == "LlavaOnevisionVideoProcessor"
    rng = np.random.default_rng(4)
    clip = lambda h, w: ("video", rng.integers(0, 256, (3, h, w, 3), dtype=np.uint8))  # noqa: E731
    batch = chat_batch(processor, [[2, clip(16, 16)], [3], [clip(40, 20), 1], [clip(8, 30)]], nested=True)
    assert batch["pixel_values_videos"].shape == (3, 3, 3, 16, 16) and "pixel_values" not in batch
    per_video = video_tokens(3, model.config)  # 3 frames pooled to 2 x 2, one newline
    assert per_video == 13 and (batch["input_ids"] == tiny.VIDEO_TOKEN_ID).sum(-1).tolist() == [per_video, 0, per_video, per_video]
    reference = capture_merged_embeds(model, **batch)
    checks = check_adapter(tiny, microbatches=[1, 2, 4], model=model, batch=batch, reference=reference)
    assert max(c.max_abs_diff for c in checks) <= ATOL


@pytest.mark.parametrize("key, value, error, match", [
    ("batch_num_images", torch.tensor([1, 2, 1]), ValueError, r"batch_num_images: shape \[3\]; expected \[4\] \(one entry per sample"),
    ("batch_num_images", torch.tensor([1, 2, 0, 1]), ValueError, r"batch_num_images: sample 3 is given 0 images but holds"),
    ("batch_num_images", torch.tensor([1, 2, 0, 1, 0, 1, 1, 0]), ValueError, r"batch_num_images: sample 5 is given 1 images but has no"),
    ("batch_num_images", torch.tensor([1.0, 2.0, 1.0, 1.0]), TypeError, r"batch_num_images: dtype torch.float32"),
    ("pixel_values_videos", torch.randn(2, 2, 3, 16, 16), ValueError, r"videos_per_sample: counts sum to 3; expected 2, the number of videos"),
    ("image_sizes", torch.ones(4, 2, dtype=torch.long), ValueError, r"image_sizes: shape \[4, 2\]; expected \[5, 2\] \(height, width of each image of pixel_values"),
])
def test_malformed_input_is_refused_with_nothing_popped(model, batch, adapter, key, value, error, match):
    bad = dict(batch, **{key: value})
    before = dict(bad)
    with pytest.raises(error, match=match):
        ppmedia.split_media(bad, 4, **adapter.media_counts(bad, model.config))
    assert bad.keys() == before.keys() and all(bad[k] is before[k] for k in bad)


def test_a_chunk_that_does_not_fit_is_refused_before_the_encoder(model, batch, adapter):
    ids = batch["input_ids"][:1]
    embeds = model.get_input_embeddings()(ids)
    few = ppmedia.VlmMediaChunk(batch["pixel_values"][:1, :2], batch["image_sizes"][:1], None, None)  # 3 crops needed
    with pytest.raises(ValueError, match=r"padded crops \[1, 2, 3, 16, 16\] cannot hold 1 images of \[3\] crops"):
        adapter.merge(model, ids, embeds, few)
    grid = ppmedia.VlmMediaChunk(None, None, batch["pixel_values_videos"][:1], torch.tensor([[2, 4, 4]]))
    with pytest.raises(ValueError, match="videos have no grid"):
        adapter.merge(model, ids, embeds, grid)


def test_clip_with_full_strategy_cannot_tile(model):
    from transformers import CLIPVisionConfig

    clip = type(model.config)(**{**model.config.to_dict(), "vision_config": CLIPVisionConfig(image_size=16, patch_size=4).to_dict()})
    assert image_tokens(10, 30, clip, tiled=False) == 16 + 1 + 1  # the CLS row kept, then the newline
    with pytest.raises(ValueError, match=r"a tiled image needs 4 x 4 feature rows a crop, but .* keep 17"):
        image_tokens(10, 30, clip)


def test_stage_splits_match_the_model(model):
    checks = check_stage_splits(tiny, [(1, 1), (2, 0)], model=model)
    assert all(c.max_grad_diff <= ATOL and c.max_logit_diff <= ATOL and c.wire == ((),) for c in checks)


class _TilesEverything(LlavaOnevisionAdapter):
    """Planted bug: ignores the staged batch_num_images (every image tiled, as without it)."""

    def host_inputs(self, chunk, config):
        inputs = super().host_inputs(chunk, config)
        inputs.pop("batch_num_images", None)
        return inputs


def test_ignoring_batch_num_images_is_caught(model):
    from ppmedia.testing import AdapterMismatch

    with pytest.raises(AdapterMismatch, match=r"llava_onevision .*microbatch 0 .*image: the microbatch has 68 placeholder tokens but its media give 101 feature rows"):
        check_adapter(tiny, adapter=_TilesEverything(), microbatches=[4], model=model)
