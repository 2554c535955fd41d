"""InternVL against transformers' own model (tiny seeded): image tiles and video frames in ONE
``pixel_values``, in prompt order, 16 image tokens a row (256 in the released models).

Real ``GotOcr2ImageProcessorPil`` tiles go through split -> stage -> merge, with the text InternVL's
processor writes for them (its own ``replace_image_token``); the whole ``InternVLProcessor``, videos
included, is tested in tests/test_processors.py.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

import ppmedia
from ppmedia.adapters.internvl import InternVLAdapter, tokens_per_row
from ppmedia.testing import check_adapter, check_stage_splits
from ppmedia.testing.tiny_models import capture_merged_embeds, constant_parameters
from ppmedia.testing.tiny_models import internvl as tiny

from conftest import check_microbatches

ATOL = 1e-5
pytestmark = pytest.mark.usefixtures("one_thread")


def test_found_by_model_type_and_every_parameter_distinct(model, adapter):
    assert isinstance(ppmedia.get_adapter(model), InternVLAdapter) and adapter is ppmedia.get_adapter(model)
    assert constant_parameters(model) == []  # position embeddings and the CLS start at zero in transformers
    assert model.model.vision_tower.embeddings.position_embeddings.abs().min() > 0
    assert tokens_per_row(model.config) == tiny.TOKENS_PER_ROW == 16
    released = type(model.config)(vision_config={"image_size": [448, 448], "patch_size": [14, 14]})
    assert tokens_per_row(released) == 256


def test_rows_per_sample_in_prompt_order(model, batch, adapter):
    rows, videos = adapter.media_per_sample(batch["input_ids"], model.config)
    assert rows.tolist() == tiny.ROWS_PER_SAMPLE and videos.tolist() == [0] * 8
    assert sum(tiny.ROWS_PER_SAMPLE) == batch["pixel_values"].shape[0]
    staged = ppmedia.split_media(dict(batch), 4, **adapter.media_counts(batch, model.config))
    assert list(staged.images) == [6, 6, 0, 8]
    # sample 1's image tile and its two frames, in prompt order: rows 3, 4, 5 of the batch
    assert staged.chunk(0).pixel_values.data_ptr() == batch["pixel_values"][0].data_ptr()
    assert staged.chunk(1).pixel_values.data_ptr() == batch["pixel_values"][6].data_ptr()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_merge_matches_the_models_own_per_microbatch(model, batch, n):
    check_microbatches(tiny, n, ATOL, model=model, batch=batch)


def test_stage_splits_match_the_model(model, batch):
    checks = check_stage_splits(tiny, [(1, 1), (2, 0), (0, 2)], model=model, batch=batch)
    assert all(c.max_grad_diff <= ATOL and c.wire == ((),) for c in checks)


def test_rows_out_of_prompt_order_are_caught(model, batch):
    """A layout that put the frames after all image tiles (not prompt order) merges other features: the
    check sees it (sample 1 holds an image tile then two frames; sample 2 three frames)."""
    swapped = dict(batch)
    order = list(range(batch["pixel_values"].shape[0]))
    order[3], order[6] = order[6], order[3]  # sample 1's image tile <-> sample 2's first frame
    swapped["pixel_values"] = batch["pixel_values"][order]
    reference = capture_merged_embeds(model, **tiny.reference_inputs(batch))
    with pytest.raises(AssertionError, match=r"microbatch 0 \(samples 0\.\.1\): merged embeddings differ"):
        check_adapter(tiny, microbatches=[4], model=model, batch=swapped, reference=reference)


def test_image_processor_num_patches_is_refused_with_the_way_out(model, batch, adapter):
    bad = dict(batch, num_patches=torch.tensor([3, 1, 2, 1, 5, 1]))
    with pytest.raises(ValueError, match=r"internvl: the batch holds num_patches \[3, 1, 2, 1, 5, 1\].*\[3, 3, 3, 3, 0, 0, 5, 3\] here.*remove num_patches"):
        adapter.media_counts(bad, model.config)


def test_malformed_rows_are_refused_before_the_encoder(model, batch, adapter):
    ids = batch["input_ids"][:1]
    embeds = model.get_input_embeddings()(ids)
    with pytest.raises(ValueError, match=r"internvl pixel_values: shape \[3, 3, 64, 64\]; expected \[rows, 3, 32, 32\]"):
        adapter.merge(model, ids, embeds, ppmedia.VlmMediaChunk(torch.zeros(3, 3, 64, 64), None, None, None))
    with pytest.raises(ValueError, match="48 placeholder tokens but its media give 32 feature rows"):
        adapter.merge(model, ids, embeds, ppmedia.VlmMediaChunk(batch["pixel_values"][:2], None, None, None))
    with pytest.raises(ValueError, match="internvl takes images only"):
        adapter.merge(model, ids, embeds, ppmedia.VlmMediaChunk(None, None, torch.zeros(2, 3, 32, 32), torch.tensor([[2, 1, 1]])))


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "look at this and that here".split()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<img>": 3, "</img>": 4, "<IMG_CONTEXT>": 5, "<image>": 8}
    vocab.update({w: 10 + i for i, w in enumerate(words)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        extra_special_tokens={"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>"},
    )


def test_real_gotocr2_tiles_through_split_stage_merge(model, adapter):
    """GotOcr2ImageProcessorPil cuts images into 32 x 32 tiles plus a thumbnail; InternVL's processor
    writes 16 * tiles image tokens per image (its own replace_image_token) and drops num_patches."""
    from PIL import Image
    from transformers import GotOcr2ImageProcessorPil, InternVLProcessor

    rng = np.random.default_rng(5)
    images = [[(60, 130)], [], [(32, 32), (200, 50)], [(90, 90)]]
    texts = ["look <image> at this", "look at this", "<image> and <image> here", "that <image>"]
    processor = GotOcr2ImageProcessorPil(size={"height": 32, "width": 32}, crop_to_patches=True, max_patches=4)
    flat = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for s in images for h, w in s]
    out = processor(images=flat, return_tensors="pt")
    tiles = out["num_patches"].tolist()
    assert tiles == [3, 1, 5, 5] and out["pixel_values"].shape == (sum(tiles), 3, 32, 32)
    writer = types.SimpleNamespace(start_image_token="<img>", end_image_token="</img>", image_token="<IMG_CONTEXT>",
                                   image_seq_length=tiny.TOKENS_PER_ROW)
    k = 0
    prompts = []
    for text in texts:
        while "<image>" in text:
            text = text.replace("<image>", InternVLProcessor.replace_image_token(writer, {"num_patches": tiles}, k), 1)
            k += 1
        prompts.append(text)
    encoded = _tokenizer()(prompts, padding=True, return_tensors="pt")
    batch = {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"], "pixel_values": out["pixel_values"]}
    assert adapter.media_per_sample(batch["input_ids"], model.config)[0].tolist() == [3, 0, 6, 5]
    reference = capture_merged_embeds(model, **tiny.reference_inputs(batch))
    checks = check_adapter(tiny, microbatches=[1, 2, 3, 4], model=model, batch=batch, reference=reference)
    assert max(c.max_abs_diff for c in checks) <= ATOL


def test_internvl_processor_with_its_video_processor_refuses_mixed_frame_counts():
    """The tiny InternVLProcessor holds its real InternVLVideoProcessor (torchvision); videos of
    different frame counts in one call are refused by the video processor, which stacks them
    (docs/processors.md; equal counts are tested in tests/test_processors.py)."""
    from ppmedia.testing.processors import build_tiny_processor, chat_batch

    processor = build_tiny_processor("internvl")
    assert type(processor.video_processor).__name__ == "InternVLVideoProcessor"
    rng = np.random.default_rng(0)
    clip = lambda t: ("video", rng.integers(0, 256, (t, 32, 32, 3), dtype=np.uint8))  # noqa: E731
    with pytest.raises(ValueError, match="pixel_values_videos"):
        chat_batch(processor, [[clip(2)], [clip(3)]])
