"""Llama 4 against transformers' own model (tiny seeded): tiles of one size, 16 ``<|patch|>`` tokens a tile,
the projector outside ``get_image_features``, the language model at ``language_model.model``.

The tiny batch follows ``Llama4ImageProcessor``'s layout and its tokens are checked against
``Llama4Processor``'s own prompt writer; the real processor (torchvision) makes tiles of the tiny size
here and on every family's table in tests/test_processors.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import ppmedia
from ppmedia.adapters.llama4 import Llama4Adapter, tokens_per_tile
from ppmedia.pipeline import build_stage_modules
from ppmedia.testing import check_stage_splits
from ppmedia.testing.stages import reference_run
from ppmedia.testing.tiny_models import constant_parameters
from ppmedia.testing.tiny_models import llama4 as tiny

from conftest import check_microbatches

ATOL = 1e-5
pytestmark = pytest.mark.usefixtures("one_thread")


def test_found_by_model_type_with_its_language_model_path(model, adapter):
    assert isinstance(ppmedia.get_adapter(model), Llama4Adapter) and adapter.language_model_path == "language_model.model"
    assert constant_parameters(model) == []
    assert tokens_per_tile(model.config) == tiny.TOKENS_PER_TILE == 16
    real = type(model.config)(vision_config={"image_size": 336, "patch_size": 14, "pixel_shuffle_ratio": 0.5})
    assert tokens_per_tile(real) == 144
    first, last = build_stage_modules(model, 2)
    assert first.language_model_path == "language_model.model" and last.head_name == "language_model.lm_head"
    assert last.output_head is model.language_model.lm_head and first.output_head is None
    assert hasattr(first, "vision_model") and not hasattr(last, "vision_model")


def test_tiles_per_sample_from_the_patch_tokens(model, batch, adapter):
    tiles, videos = adapter.media_per_sample(batch["input_ids"], model.config)
    assert tiles.tolist() == tiny.TILES_PER_SAMPLE and videos.tolist() == [0] * 8
    staged = ppmedia.split_media(dict(batch), 4, **adapter.media_counts(batch, model.config))
    assert list(staged.images) == [4, 7, 0, 5] and staged.layouts == ("images",)
    assert staged.chunk(1).pixel_values.data_ptr() == batch["pixel_values"][4].data_ptr()  # a view


def test_the_tokens_are_the_processors():
    """The tiny batch writes an image as Llama4Processor's own prompt writer does (tile runs of 16)."""
    from transformers import Llama4Processor

    names = {"<|image_start|>": tiny.IMAGE_START_TOKEN_ID, "<|image_end|>": tiny.IMAGE_END_TOKEN_ID,
             "<|image|>": tiny.IMAGE_TOKEN_ID, "<|patch|>": tiny.PATCH_TOKEN_ID,
             "<|tile_x_separator|>": 7, "<|tile_y_separator|>": 8}
    for ratio in ((1, 1), (1, 2), (2, 2), (2, 1)):
        text = Llama4Processor._prompt_split_image(None, ratio, tiny.TOKENS_PER_TILE)
        ids = []
        while text:
            name = next(n for n in names if text.startswith(n))
            ids.append(names[name])
            text = text[len(name):]
        assert ids == tiny.image_tokens(*ratio)


def test_llama4_image_processor_gives_tiles_of_its_size():
    """Llama4ImageProcessor (torchvision; there is no Pil class) in the tiny Llama4Processor cuts an image
    into 32 x 32 tiles plus its global tile; the tokens are the processor's (tests/test_processors.py)."""
    from transformers import Llama4ImageProcessor

    from ppmedia.testing.processors import build_tiny_processor, chat_batch

    assert Llama4ImageProcessor().size["height"] == 336
    processor = build_tiny_processor("llama4")
    rng = np.random.default_rng(0)
    picture = ("image", Image.fromarray(rng.integers(0, 256, (30, 64, 3), dtype=np.uint8)))
    batch = chat_batch(processor, [[1, picture]])
    assert batch["pixel_values"].shape == (3, 3, tiny.IMAGE_SIZE, tiny.IMAGE_SIZE)  # 1 x 2 local tiles + global
    assert int((batch["input_ids"] == tiny.PATCH_TOKEN_ID).sum()) == 3 * tiny.TOKENS_PER_TILE


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_merge_matches_the_models_own_per_microbatch(model, batch, n):
    check_microbatches(tiny, n, ATOL, model=model, batch=batch)


def test_stage_splits_match_the_model(model, batch):
    checks = check_stage_splits(tiny, [(1, 1), (2, 0), (0, 2)], model=model, batch=batch)
    assert all(c.max_grad_diff <= ATOL and c.max_logit_diff <= ATOL and c.wire == ((),) for c in checks)


def test_the_tiny_text_model_exercises_chunked_attention_and_nope_scaling(model, batch):
    """Layer 0 attends within chunks of 8 tokens, layer 1 (NoPE) scales its queries by position: without
    them (one chunk, no temperature tuning) the model's logits change, so the splits above carry them."""
    config = tiny.build_config()
    config.text_config.attention_chunk_size = 4096
    config.text_config.attn_temperature_tuning = False
    plain = type(model)(config).eval()
    plain.load_state_dict(model.state_dict())
    logits, _ = reference_run(model, tiny, batch)
    other, _ = reference_run(plain, tiny, batch)
    assert (logits - other).abs().max() > 1e-3


def test_malformed_tiles_are_refused_before_the_encoder(model, batch, adapter):
    ids = batch["input_ids"][:2]
    embeds = model.get_input_embeddings()(ids)
    calls = []
    handle = model.vision_model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=r"llama4 pixel_values: shape \[4, 3, 64, 64\]; expected \[tiles, 3, 32, 32\]"):
            adapter.merge(model, ids, embeds, ppmedia.VlmMediaChunk(torch.zeros(4, 3, 64, 64), None, None, None))
        with pytest.raises(ValueError, match=r"image: the microbatch has 64 placeholder tokens but its media give 48 feature rows"):
            adapter.merge(model, ids, embeds, ppmedia.VlmMediaChunk(batch["pixel_values"][:3], None, None, None))
        with pytest.raises(ValueError, match="llama4 takes images only"):
            adapter.merge(model, ids, embeds, ppmedia.VlmMediaChunk(None, None, torch.zeros(4, 8), torch.tensor([[1, 2, 2]])))
    finally:
        handle.remove()
    assert calls == []
    short = batch["input_ids"].clone()
    short[0, (short[0] == tiny.PATCH_TOKEN_ID).nonzero()[0]] = 20  # one patch token short of 3 tiles
    assert adapter.media_per_sample(short, model.config)[0].tolist()[0] == 3
    one = short[:1]
    with pytest.raises(ValueError, match="47 placeholder tokens but its media give 48 feature rows"):
        adapter.merge(model, one, model.get_input_embeddings()(one), ppmedia.VlmMediaChunk(batch["pixel_values"][:3], None, None, None))
