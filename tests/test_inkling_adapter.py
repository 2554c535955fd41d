"""Inkling adapter (channels-last image patches, one token per patch; discrete audio codes) against the
model's own full-batch forward (tiny seeded model; conftest's ``model``, ``batch`` and ``reference``,
the merged ``inputs_embeds`` the model's language model receives)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

import ppmedia
from ppmedia import VlmMediaChunk
from ppmedia.adapters.base import VlmAdapter
from ppmedia.adapters.inkling import InklingAdapter
from ppmedia.pipeline import static_stage_args
from ppmedia.testing.stages import reference_run, stage_run
from ppmedia.testing.tiny_models import capture_merged_embeds
from ppmedia.testing.tiny_models import inkling as tiny
from ppmedia.testing.tiny_models._batch import right_padded

ROWS = [3, 2, 4, 1, 0, 0, 1, 5]  # image tokens = pixel_values rows per sample
AUDIOS = [1, 1, 0, 2, 0, 0, 1, 0]
ATOL = 1e-5
pytestmark = pytest.mark.usefixtures("one_thread")


def test_counts_rows_from_tokens(model, batch):
    adapter = ppmedia.get_adapter(model)
    assert isinstance(adapter, InklingAdapter) and ppmedia.get_adapter("inkling") is adapter
    counts = adapter.media_counts(batch, model.config)
    assert counts["images_per_sample"].tolist() == ROWS and counts["audios_per_sample"].tolist() == AUDIOS
    staged = ppmedia.split_media(dict(batch), 4, **counts)
    assert staged.image_rows == (5, 5, 0, 6) and staged.audios == (2, 2, 0, 1)
    assert staged.sources["input_features"] == "audio_input_ids"


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_merge_equals_the_models_own(model, batch, reference, n):
    adapter = ppmedia.get_adapter(model)
    staged = ppmedia.split_media(dict(batch), n, **adapter.media_counts(batch, model.config))
    ids = batch["input_ids"]
    first = torch.nn.Module()
    with ppmedia.stage_media(first, staged), torch.no_grad():
        for a, b in staged.samples:
            chunk = ppmedia.next_vlm_media_chunk(first)
            merged = adapter.merge(model, ids[a:b], model.get_input_embeddings()(ids[a:b]), chunk)
            assert (merged - reference[a:b]).abs().max() <= ATOL, (n, a)
    for token in (tiny.IMAGE_TOKEN_ID, tiny.AUDIO_TOKEN_ID):
        where = ids == token
        assert (reference[where] - model.get_input_embeddings()(ids)[where]).abs().max() > 1e-2


def test_stages_match_the_model_and_the_head_is_the_models(model, batch):
    """Logits sliced to unpadded_vocab_size after the mup scaling, as the model's own forward does; an
    adapter that leaves the head as a plain lm_head fails the comparison."""
    adapter = ppmedia.get_adapter(model)
    ref_logits, ref = reference_run(model, tiny, batch)
    logits, grads, stages = stage_run(model, batch, (1, 1), adapter=adapter)
    assert logits.shape[-1] == 120 and (logits - ref_logits).abs().max() <= ATOL
    assert set(grads) == set(ref) and max((grads[k] - g).abs().max().item() for k, g in ref.items()) <= ATOL
    assert max(g.abs().max() for k, g in ref.items() if "audio_tower" in k) > 1e-4
    assert static_stage_args(stages[1], 2, batch["input_ids"].shape[1])[1][0].shape[-1] == 120

    class PlainHead(InklingAdapter):
        def logits(self, stage, hidden):
            return VlmAdapter.logits(self, stage, hidden)

        def logits_width(self, config, head_width):
            return head_width

    logits, _, _ = stage_run(model, batch, (1, 1), adapter=PlainHead())
    assert logits.shape[-1] == 128  # the padded vocabulary: a softmax over rows the model never predicts
    assert (logits[..., :120] - ref_logits).abs().max() > 1e-3  # and no mup scaling


def test_bad_media_raise_before_the_towers(model, batch):
    adapter = ppmedia.get_adapter(model)
    staged = ppmedia.split_media(dict(batch), 4, **adapter.media_counts(batch, model.config))
    a, b = staged.samples[1]
    ids = batch["input_ids"][a:b]
    embeds = model.get_input_embeddings()(ids)
    c = staged.chunk(1)
    fields = {f: getattr(c, f) for f in c.__slots__}
    calls = []
    handles = [model.model.audio_tower.register_forward_pre_hook(lambda *_: calls.append(1)),
               model.model.vision_tower.register_forward_pre_hook(lambda *_: calls.append(1))]
    try:
        with pytest.raises(ValueError, match=r"inkling audio: audio_input_ids \[2, 6, 80\] with audio_input_ids_mask \[2, 5\]"):
            adapter.merge(model, ids, embeds, VlmMediaChunk(**{**fields, "input_features_mask": c.input_features_mask[:, 1:]}))
        with pytest.raises(ValueError, match=r"inkling pixel_values: shape \[5, 3, 4, 4, 2\]; expected \[patches, 2, 4, 4, 3\]"):
            adapter.merge(model, ids, embeds, VlmMediaChunk(**{**fields, "pixel_values": c.pixel_values.permute(0, 4, 2, 3, 1)}))
        with pytest.raises(ValueError, match=r"image: the microbatch has 5 placeholder tokens but its media give 4 feature rows"):
            adapter.merge(model, ids, embeds, VlmMediaChunk(**{**fields, "pixel_values": c.pixel_values[1:]}))
    finally:
        for h in handles:
            h.remove()
    assert calls == []


def test_real_feature_extractor_output(model):
    """InklingFeatureExtractor on waveforms of varied lengths, quantised to dMel codes with the
    processor's own _extract_dmel_bins (16 bins, the tiny model's mel_vocab_size) -> split -> merge
    equals the model's own. (Inkling's image processor needs torchvision.)"""
    from transformers import InklingFeatureExtractor, InklingProcessor

    fe = InklingFeatureExtractor()
    rng = np.random.default_rng(0)
    waves = [rng.standard_normal(n).astype(np.float32) * 0.1 for n in (4000, 2400, 6400)]
    out = fe(waves, sampling_rate=16000, return_tensors="pt")
    quantiser = types.SimpleNamespace(bin_centers=torch.linspace(-7.0, 2.0, 16, dtype=torch.float64).float(),
                                      dmel_min_value=-7.0, dmel_max_value=2.0)
    codes = InklingProcessor._extract_dmel_bins(quantiser, out["input_features"])
    mask = out["input_features_mask"]
    assert codes.shape[:2] == mask.shape and codes.shape[2] == 80 and int(codes.max()) < 16
    frames = mask.sum(-1).tolist()
    per_sample = [[0], [], [1, 2], []]
    rows = []
    for clips in per_sample:
        ids = [1, 20]
        for j in clips:
            ids += [tiny.AUDIO_BOS_TOKEN_ID] + [tiny.AUDIO_TOKEN_ID] * int(frames[j]) + [21]
        rows.append(ids + [2])
    input_ids, attention_mask = right_padded(rows, 0)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "audio_input_ids": codes, "audio_input_ids_mask": mask}
    reference = capture_merged_embeds(model, **batch, use_cache=False)
    adapter = ppmedia.get_adapter(model)
    staged = ppmedia.split_media(dict(batch), 2, **adapter.media_counts(batch, model.config))
    first = torch.nn.Module()
    with ppmedia.stage_media(first, staged), torch.no_grad():
        for a, b in staged.samples:
            chunk = ppmedia.next_vlm_media_chunk(first)
            merged = adapter.merge(model, input_ids[a:b], model.get_input_embeddings()(input_ids[a:b]), chunk)
            assert (merged - reference[a:b]).abs().max() <= ATOL
