"""Gemma 3 adapter against transformers' own model, on the tiny seeded model.

Each microbatch's merge (split_media -> stage_media -> next_vlm_media_chunk -> adapter.merge) must
equal the rows of the ``inputs_embeds`` the full model hands its language model; the real
``Gemma3ImageProcessorPil`` output (with and without pan-and-scan) goes the same way; the pipeline's
stages must build the model's bidirectional image-block masks on every stage.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Gemma3ImageProcessorPil

import ppmedia
from ppmedia import HostReadCounter, VlmMediaChunk, next_vlm_media_chunk
from ppmedia.pipeline import build_stage_modules, static_stage_args
from ppmedia.testing.tiny_models import capture_merged_embeds
from ppmedia.testing.tiny_models import gemma3 as tiny
from conftest import text_embeds

ATOL = 1e-5
ROWS_PER_SAMPLE = [1, 4, 1, 4, 0, 0, 2, 3]


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
    assert tiny.MODEL_TYPE == "gemma3" == model.config.model_type
    assert batch["pixel_values"].shape == (15, 3, tiny.IMAGE_SIZE, tiny.IMAGE_SIZE)
    is_image = batch["input_ids"] == tiny.IMAGE_TOKEN_ID
    assert is_image.sum(1).tolist() == [tiny.TOKENS_PER_IMAGE * r for r in ROWS_PER_SAMPLE]
    assert torch.equal(batch["token_type_ids"], is_image.long())
    # every row is one <boi> <image>*4 <eoi> block
    assert (batch["input_ids"] == tiny.BOI_TOKEN_ID).sum(1).tolist() == ROWS_PER_SAMPLE
    assert (batch["input_ids"] == tiny.EOI_TOKEN_ID).sum(1).tolist() == ROWS_PER_SAMPLE


def test_projector_is_drawn_so_images_differ(model, batch):
    """transformers zero-initialises mm_input_projection_weight: the tiny model draws it."""
    assert model.model.multi_modal_projector.mm_input_projection_weight.abs().min() > 0
    with torch.no_grad():
        features = model.model.get_image_features(batch["pixel_values"]).pooler_output
    assert features.shape == (15, tiny.TOKENS_PER_IMAGE, model.config.text_config.hidden_size)
    assert (features[0] - features[1]).abs().max() > 0.1


def test_token_types_change_the_models_output(model, batch):
    """The reference uses the bidirectional image blocks: without token_type_ids the logits differ."""
    with torch.no_grad():
        with_types = model(**tiny.reference_inputs(batch)).logits
        inputs = dict(tiny.reference_inputs(batch))
        del inputs["token_type_ids"]
        causal = model(**inputs).logits
    assert (with_types - causal).abs().max() > 1e-2


# -- token side -----------------------------------------------------------------------------------


def test_adapter_identity_and_counts(model, batch, adapter):
    assert adapter.name == "gemma3" and adapter.model_types == ("gemma3",)
    assert ppmedia.get_adapter(model) is adapter
    with HostReadCounter() as reads:
        images, videos = adapter.media_per_sample(batch["input_ids"], model.config)
        types = adapter.token_type_ids(batch["input_ids"], model.config)
    assert reads.total == 0
    assert images.tolist() == ROWS_PER_SAMPLE and videos.tolist() == [0] * 8
    assert torch.equal(types, batch["token_type_ids"])
    assert set(adapter.placeholder_masks(batch["input_ids"], model.config)) == {"image"}


def test_media_per_sample_counts_partial_blocks_up(model, adapter):
    img = tiny.IMAGE_TOKEN_ID
    ids = torch.tensor([[img] * 4 + [5] * 4, [img] * 6 + [5] * 2, [5] * 8])
    assert adapter.media_per_sample(ids, model.config)[0].tolist() == [1, 2, 0]


# -- merge per microbatch -------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4])
def test_merge_matches_model_per_microbatch(model, batch, reference, adapter, first_stage, n):
    row_at = [0, *np.cumsum(ROWS_PER_SAMPLE).tolist()]
    for rows, merged, chunk in _merge_all(model, adapter, batch, n, first_stage):
        b0, b1 = int(rows[0]), int(rows[-1]) + 1
        assert (merged - reference[rows]).abs().max().item() <= ATOL
        if row_at[b0] == row_at[b1]:
            assert chunk is None
        else:  # exactly this microbatch's rows, as a view of the batch's pixels
            assert chunk.pixel_values.shape[0] == row_at[b1] - row_at[b0]
            assert chunk.pixel_values.data_ptr() == batch["pixel_values"][row_at[b0]].data_ptr()


def test_merge_reads_the_host_once(model, batch, adapter):
    ids = batch["input_ids"][:2]
    chunk = VlmMediaChunk(batch["pixel_values"][:5], None, None, None)
    embeds = text_embeds(model, ids)
    with torch.no_grad(), HostReadCounter() as reads:
        adapter.merge(model, ids, embeds, chunk)
    assert reads.total == 1


def test_errors_name_the_problem(model, batch, adapter):
    ids = batch["input_ids"][:2]  # 5 rows of images
    embeds = text_embeds(model, ids)
    pixels = batch["pixel_values"]
    with pytest.raises(ValueError, match=r"image: the microbatch has 20 placeholder tokens but its media give 16 feature rows; placeholders per sample: \[4, 16\]"):
        adapter.merge(model, ids, embeds, VlmMediaChunk(pixels[:4], None, None, None))
    with pytest.raises(ValueError, match=r"gemma3 pixel_values: shape \(5, 3, 16, 32\); expected \[rows, 3, 32, 32\]"):
        adapter.merge(model, ids, embeds, VlmMediaChunk(pixels[:5, :, :16], None, None, None))
    with pytest.raises(TypeError, match="pixel_values: dtype torch.uint8"):
        adapter.merge(model, ids, embeds, VlmMediaChunk(pixels[:5].to(torch.uint8), None, None, None))
    with pytest.raises(ValueError, match="no per-image grid"):
        adapter.merge(model, ids, embeds, VlmMediaChunk(pixels[:5], torch.ones(5, 2, dtype=torch.int64), None, None))
    with pytest.raises(ValueError, match="takes images only, but the chunk carries videos"):
        adapter.merge(model, ids, embeds, VlmMediaChunk(pixels[:5], None, torch.zeros(4, 8), torch.ones(1, 3)))
    with pytest.raises(ValueError, match=r"placeholder tokens but its media give 0 feature rows; placeholders per sample: \[4, 16\]"):
        adapter.merge(model, ids, embeds, VlmMediaChunk(None, None, None, None))


# -- the real image processor ---------------------------------------------------------------------


def _image(rng: np.random.Generator, height: int, width: int) -> Image.Image:
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _processor_tokens(sizes_per_sample, crops, rng) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` / ``attention_mask`` laid out as Gemma3Processor expands its image tokens: per
    image its own block, then (pan-and-scan) a text run and one block per crop."""
    text = lambda n: rng.integers(3, tiny.BOI_TOKEN_ID, n).tolist()  # noqa: E731
    rows, k = [], 0
    for sizes in sizes_per_sample:
        ids = text(3)
        for _ in sizes:
            ids += text(2) + tiny.image_block_ids() + text(2)
            if crops[k]:
                ids += text(5) + sum((tiny.image_block_ids() + text(1) for _ in range(crops[k])), [])
            k += 1
        rows.append(ids + text(2))
    seq = max(map(len, rows))
    input_ids = torch.zeros(len(rows), seq, dtype=torch.int64)
    mask = torch.zeros_like(input_ids)
    for i, ids in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
    return input_ids, mask


@pytest.mark.parametrize("pan_and_scan", [False, True])
def test_real_processor_output_through_split_stage_merge(model, adapter, first_stage, pan_and_scan):
    rng = np.random.default_rng(7)
    sizes_per_sample = [[(40, 100)], [(64, 64), (120, 30)], [], [(50, 61)], [(30, 30), (33, 90)]]
    processor = Gemma3ImageProcessorPil(
        size={"height": tiny.IMAGE_SIZE, "width": tiny.IMAGE_SIZE},
        do_pan_and_scan=pan_and_scan,
        pan_and_scan_min_crop_size=8,
        pan_and_scan_max_num_crops=3,
        pan_and_scan_min_ratio_to_activate=1.2,
    )
    out = processor(images=[[_image(rng, h, w) for h, w in s] for s in sizes_per_sample if s], return_tensors="pt")
    crops = out["num_crops"].tolist()
    assert crops == ([3, 0, 3, 2, 0, 3] if pan_and_scan else [0] * 6)
    assert out["pixel_values"].shape == (6 + sum(crops), 3, tiny.IMAGE_SIZE, tiny.IMAGE_SIZE)
    input_ids, mask = _processor_tokens(sizes_per_sample, crops, rng)
    batch = {"input_ids": input_ids, "attention_mask": mask, "token_type_ids": (input_ids == tiny.IMAGE_TOKEN_ID).long(),
             "pixel_values": out["pixel_values"]}
    # rows per sample from the tokens = images + crops per sample from the processor's num_crops
    per_image = iter(crops)
    from_crops = [sum(1 + next(per_image) for _ in s) for s in sizes_per_sample]
    assert adapter.media_per_sample(input_ids, model.config)[0].tolist() == from_crops
    reference = capture_merged_embeds(model, **tiny.reference_inputs(batch))
    for n in (1, 5):
        for rows, merged, _ in _merge_all(model, adapter, batch, n, first_stage):
            assert (merged - reference[rows]).abs().max().item() <= ATOL


def _tiny_gemma3_processor(pan_and_scan: bool):
    """transformers' own Gemma3Processor with a word-level tokenizer built here (no download): the
    tiny model's special ids (<boi> 125, <eoi> 126, <image> 127), 4 image tokens per image."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Gemma3Processor, PreTrainedTokenizerFast

    words = "Here is the original image and here are some crops to help you see better look at this".split()
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<boi>": 125, "<eoi>": 126, "<img>": 127}
    vocab.update({w: 3 + i for i, w in enumerate(words)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
        extra_special_tokens={"boi_token": "<boi>", "eoi_token": "<eoi>", "image_token": "<img>"},
    )
    images = Gemma3ImageProcessorPil(size={"height": tiny.IMAGE_SIZE, "width": tiny.IMAGE_SIZE})
    processor = Gemma3Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=tiny.TOKENS_PER_IMAGE)
    kwargs = dict(do_pan_and_scan=pan_and_scan, pan_and_scan_min_crop_size=8, pan_and_scan_max_num_crops=3,
                  pan_and_scan_min_ratio_to_activate=1.2)
    return processor, kwargs


@pytest.mark.parametrize("pan_and_scan", [False, True])
def test_real_processor_with_text_through_split_stage_merge_and_stages(model, adapter, first_stage, pan_and_scan):
    """Gemma3Processor's whole output (it drops num_crops): rows per sample come from the tokens."""
    processor, kwargs = _tiny_gemma3_processor(pan_and_scan)
    rng = np.random.default_rng(11)
    texts = ["look <boi> at this", "look at this", "<boi> here <boi> this", "look at <boi>"]
    images = [[_image(rng, 40, 100)], [], [_image(rng, 64, 64), _image(rng, 120, 30)], [_image(rng, 50, 61)]]
    out = processor(text=texts, images=images, return_tensors="pt", padding=True, **kwargs)
    assert set(out) == {"input_ids", "attention_mask", "token_type_ids", "pixel_values"}  # no num_crops
    rows = adapter.media_per_sample(out["input_ids"], model.config)[0].tolist()
    assert rows == ([4, 0, 5, 3] if pan_and_scan else [1, 0, 2, 1])
    assert out["pixel_values"].shape[0] == sum(rows)
    assert torch.equal(adapter.token_type_ids(out["input_ids"], model.config), out["token_type_ids"])
    batch = dict(out)
    reference = capture_merged_embeds(model, **tiny.reference_inputs(batch))
    for n in (1, 2, 4):
        for rows_k, merged, _ in _merge_all(model, adapter, batch, n, first_stage):
            assert (merged - reference[rows_k]).abs().max().item() <= ATOL
    with torch.no_grad():
        expected = model(**tiny.reference_inputs(batch)).logits
    got = _run_stages(build_stage_modules(model, 2), batch, adapter, model.config, n=2)
    assert (got - expected).abs().max().item() <= ATOL


# -- pipeline stages: the image-block masks on every stage ------------------------------------------


def _run_stages(stages, batch, adapter, config, n=4):
    ids, mask = batch["input_ids"], batch["attention_mask"]
    images, _ = adapter.media_per_sample(ids, config)
    staged = ppmedia.split_media(dict(batch), n, images_per_sample=images)
    logits = []
    with ppmedia.stage_media(stages[0], staged), torch.no_grad():
        for a, b in staged.samples:
            x = (ids[a:b], mask[a:b])
            for module in stages:
                x = module(*x)
                x = x if isinstance(x, tuple) else (x,)
            logits.append(x[0])
    return torch.cat(logits)


@pytest.mark.parametrize("layers", [[2], [1, 1], [0, 2], [2, 0], [0, 1, 1]])
def test_stages_build_the_models_masks(model, batch, adapter, layers):
    with torch.no_grad():
        expected = model(**tiny.reference_inputs(batch)).logits
    stages = build_stage_modules(model, len(layers), layers_per_stage=layers)
    assert all([w.name for w in s.wire_out] == ["token_type_ids"] for s in stages[:-1])
    got = _run_stages(stages, batch, adapter, model.config)
    assert (got - expected).abs().max().item() <= ATOL


def test_a_later_stage_without_token_types_differs(model, batch, adapter):
    """The token types that travel matter: a last stage given all-zero token types (causal masks for
    its layer) gives other logits, so the parity tests would catch a stage that drops them."""
    stages = build_stage_modules(model, 2, layers_per_stage=[1, 1])

    class ZeroTypes(torch.nn.Module):
        def forward(self, *args):
            return (*args[:-1], torch.zeros_like(args[-1]))

    with torch.no_grad():
        expected = model(**tiny.reference_inputs(batch)).logits
    broken = _run_stages([stages[0], ZeroTypes(), stages[1]], batch, adapter, model.config)
    assert (broken - expected).abs().max().item() > 1e-3


def test_static_stage_args_carry_token_types(model):
    first, last = build_stage_modules(model, 2)
    inputs, outputs = static_stage_args(first, 2, 33)
    assert [tuple(t.shape) for t in outputs] == [(2, 33, 64), (2, 33), (2, 33)]
    assert outputs[2].dtype == torch.int64
    inputs, _ = static_stage_args(last, 2, 33)
    assert [tuple(t.shape) for t in inputs] == [(2, 33, 64), (2, 33), (2, 33)]


def test_attention_masks_are_the_ones_the_model_builds(model, batch, adapter):
    """adapter.attention_masks on the full batch equals the mapping Gemma3Model hands its language model."""
    seen = {}

    def hook(_module, args, kwargs):
        seen.update(kwargs["attention_mask"])

    lm = model.model.language_model
    handle = lm.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**tiny.reference_inputs(batch))
    finally:
        handle.remove()
    embeds = text_embeds(model, batch["input_ids"])
    types = adapter.token_type_ids(batch["input_ids"], model.config)
    ours = adapter.attention_masks(lm, embeds, batch["attention_mask"], types)
    assert set(ours) == set(seen) == {"full_attention", "sliding_attention"}
    for kind in ours:
        assert torch.equal(ours[kind], seen[kind]), kind
    # image tokens see the rest of their block (a later position), text tokens never see ahead
    full = ours["full_attention"][1, 0]
    first_image = int(types[1].nonzero()[0])
    assert bool(full[first_image, first_image + 3]) and not bool(full[first_image - 1, first_image])
