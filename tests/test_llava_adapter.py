"""The built-in LLaVA adapter against transformers' own model: LLaVA-1.5 (CLIP tower, fixed-size
images, images back to back) and Pixtral-backbone LLaVA (Pixtral-12B layout), tiny seeded models.

Merges per microbatch against the model's own merged embeddings (1, 2, 3, 4, 8 microbatches), real
image processors (``LlavaImageProcessorPil``, ``PixtralImageProcessorPil``: no torchvision), stage
splits against the model's gradients, and the example plugin (tests/plugin) overriding the built-in.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import ppmedia
from ppmedia.adapters.llava import LlavaAdapter, is_pixtral, tokens_per_image
from ppmedia.testing import check_adapter, check_stage_splits
from ppmedia.testing.tiny_models import capture_merged_embeds, llava, llava_pixtral
from conftest import pixtral_processor_batch

ATOL = 1e-5
tiny = llava


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def pixtral_model():
    return llava_pixtral.build_model(0)


def test_one_adapter_two_layouts(model, pixtral_model):
    assert ppmedia.get_adapter(model) is ppmedia.get_adapter(pixtral_model)
    assert isinstance(ppmedia.get_adapter("llava"), LlavaAdapter)
    assert not is_pixtral(model.config) and is_pixtral(pixtral_model.config)
    assert tokens_per_image(model.config) == llava.TOKENS_PER_IMAGE == 16  # CLIP: 16 patches + CLS, CLS dropped
    full = type(model.config)(**{**model.config.to_dict(), "vision_feature_select_strategy": "full"})
    assert tokens_per_image(full) == 17


@pytest.mark.parametrize("family", [llava, llava_pixtral])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_merge_matches_the_models_own_per_microbatch(family, n, model, pixtral_model):
    checks = check_adapter(family, microbatches=[n], model=pixtral_model if family is llava_pixtral else model)
    assert len(checks) == n and max(c.max_abs_diff for c in checks) <= ATOL
    if n == 4:
        assert [c.has_media for c in checks] == [True, True, False, True]


def test_images_back_to_back_are_counted_by_tokens(model, batch, adapter):
    images, videos = adapter.media_per_sample(batch["input_ids"], model.config)
    assert images.tolist() == [1, 2, 1, 1, 0, 0, 2, 1] and videos.tolist() == [0] * 8
    ids = batch["input_ids"].clone()
    ids[1, (ids[1] == llava.IMAGE_TOKEN_ID).nonzero()[0]] = 20  # one placeholder short of two images
    with pytest.raises(ValueError, match=r"llava input_ids: samples \[1\] hold \[31\] image placeholder tokens, not a multiple of 16"):
        adapter.media_per_sample(ids, model.config)


def test_llava_1_5_refuses_images_of_another_size(model, batch, adapter):
    ids = batch["input_ids"][:1]
    chunk = ppmedia.VlmMediaChunk(torch.zeros(1, 3, 32, 32), None, None, None)
    with pytest.raises(ValueError, match=r"llava pixel_values: shape \[1, 3, 32, 32\]; expected \[images, C, 16, 16\]"):
        adapter.merge(model, ids, model.get_input_embeddings()(ids), chunk)
    videos = ppmedia.VlmMediaChunk(None, None, torch.zeros(4, 3, 16, 16), torch.tensor([[1, 2, 2]]))
    with pytest.raises(ValueError, match="llava takes images only"):
        adapter.merge(model, ids, model.get_input_embeddings()(ids), videos)


def test_real_llava_image_processor(model):
    """LlavaImageProcessorPil (resize + center crop to the tower's 16 x 16) on images of any size."""
    from PIL import Image
    from transformers import LlavaImageProcessorPil

    rng = np.random.default_rng(0)
    processor = LlavaImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    counts = [2, 0, 1, 3]
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in [(40, 30), (16, 64), (23, 23), (90, 50), (31, 17), (64, 64)]]
    out = processor(images=images, return_tensors="pt")
    assert out["pixel_values"].shape == (6, 3, 16, 16)
    rows = [[5] * 2 + [llava.IMAGE_TOKEN_ID] * (16 * c) + [6] * 3 for c in counts]
    seq = max(map(len, rows))
    input_ids = torch.tensor([r + [0] * (seq - len(r)) for r in rows])
    batch = {"input_ids": input_ids, "attention_mask": (input_ids != 0).long(), "pixel_values": out["pixel_values"]}
    reference = capture_merged_embeds(model, **llava.reference_inputs(batch))
    checks = check_adapter(llava, microbatches=[1, 3, 4], model=model, batch=batch, reference=reference)
    assert max(c.max_abs_diff for c in checks) <= ATOL


def test_real_pixtral_processor_one_token_image(pixtral_model):
    """PixtralImageProcessorPil for Pixtral-backbone LLaVA (patch 8, no merger); a microbatch whose only
    image is one token (transformers' get_image_features alone fails on it)."""
    batch = pixtral_processor_batch(llava_pixtral.LAYOUT, [[(20, 50)], [(8, 8)], [], [(30, 30), (47, 12)]])
    assert [8, 8] in batch["image_sizes"].tolist()
    reference = capture_merged_embeds(pixtral_model, **llava_pixtral.reference_inputs(batch))
    checks = check_adapter(llava_pixtral, microbatches=[1, 4], model=pixtral_model, batch=batch, reference=reference)
    assert max(c.max_abs_diff for c in checks) <= ATOL


@pytest.mark.parametrize("family", [llava, llava_pixtral])
def test_stage_splits_match_the_model(family, model, pixtral_model):
    checks = check_stage_splits(family, [(1, 1), (2, 0), (0, 2)], model=pixtral_model if family is llava_pixtral else model)
    assert all(c.max_grad_diff <= ATOL and c.wire == ((),) for c in checks)  # nothing but hidden states crosses


def test_the_example_plugin_overrides_the_built_in(monkeypatch):
    """tests/plugin's LLaVA-1.5 adapter claims ``llava`` too; it sets ``override = True``, so with the plugin
    loaded it serves ``llava`` and the built-in is not listed."""
    import pathlib

    from ppmedia.registry import AdapterRegistry

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent / "plugin"))
    monkeypatch.setenv("PPMEDIA_PLUGINS", "ppmedia_llava_plugin")
    try:
        registry = AdapterRegistry(entry_point_group=None)
        assert type(registry.get("llava")).__module__ == "ppmedia_llava_plugin"
        assert [i.provider for i in registry.list() if i.name == "llava"] == ["ppmedia_llava_plugin (PPMEDIA_PLUGINS)"]
        monkeypatch.delenv("PPMEDIA_PLUGINS")
        assert type(AdapterRegistry(entry_point_group=None).get("llava")) is LlavaAdapter
    finally:
        for name in [m for m in sys.modules if m.startswith("ppmedia_llava_plugin")]:
            del sys.modules[name]
