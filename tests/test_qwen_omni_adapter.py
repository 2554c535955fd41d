"""Qwen2.5-Omni and Qwen3-Omni thinkers (images, videos with audio tracks, audio; 3-D positions with
audio; Qwen3-Omni's deepstack) against the models' own full-batch forwards (tiny seeded models).

References: the ``inputs_embeds`` and ``position_ids`` the thinker's language model receives (a
forward pre-hook) and its logits and gradients; stage modules run one after the other in this process
(``ppmedia.testing.stages.stage_run``). The 2-process schedules are in test_audio_families_mp.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ppmedia
from ppmedia import VlmMediaChunk
from ppmedia.adapters.qwen_omni import Qwen2_5OmniThinkerAdapter, Qwen3OmniThinkerAdapter
from ppmedia.pipeline import make_labels
from ppmedia.testing.stages import reference_run, stage_run
from ppmedia.testing.tiny_models import capture_reference, load
from ppmedia.testing.tiny_models._batch import right_padded

FAMILIES = ("qwen2_5_omni", "qwen3_omni")
IMAGES = [1, 1, 0, 1, 0, 0, 0, 1]
VIDEOS = [0, 0, 1, 0, 0, 0, 0, 1]
AUDIOS = [1, 1, 1, 1, 0, 0, 2, 1]
ATOL = 1e-5
pytestmark = pytest.mark.usefixtures("one_thread")


def _capture(model, inputs):
    """The ``inputs_embeds`` and ``position_ids`` the thinker's language model receives."""
    return dict(zip(("inputs_embeds", "position_ids"), capture_reference(model, **inputs)))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    tiny = load(request.param)
    model = tiny.build_model(0)
    batch = tiny.build_batch(0)
    return request.param, tiny, model, batch, _capture(model, tiny.reference_inputs(batch))


def test_registry_covers_thinkers_and_top_level_model_types():
    for model_type in ("qwen2_5_omni_thinker", "qwen2_5_omni"):
        assert isinstance(ppmedia.get_adapter(model_type), Qwen2_5OmniThinkerAdapter)
    for model_type in ("qwen3_omni_moe_thinker", "qwen3_omni_moe"):
        assert isinstance(ppmedia.get_adapter(model_type), Qwen3OmniThinkerAdapter)


def test_counts_from_tokens(family):
    name, tiny, model, batch, _ = family
    counts = ppmedia.get_adapter(model).media_counts(batch, model.config)
    assert counts["images_per_sample"].tolist() == IMAGES
    assert counts["videos_per_sample"].tolist() == VIDEOS  # a video with its audio track: <vision_bos> <audio_bos>
    assert counts["audios_per_sample"].tolist() == AUDIOS  # stand-alone clips and video tracks
    staged = ppmedia.split_media(dict(batch), 4, **counts)
    assert staged.audios == (2, 2, 0, 3) and staged.sources["input_features_mask"] == "feature_attention_mask"
    assert staged.sources["second_per_grid_ts"] == "video_second_per_grid"


def test_the_split_refuses_two_timings_and_orphan_audio(family):
    """``video_second_per_grid`` is the video layout's timing as ``second_per_grid_ts`` is (one of them);
    a mask without its features, or features of two audio layouts, are refused, the batch intact."""
    name, tiny, model, batch, _ = family
    counts = ppmedia.get_adapter(model).media_counts(batch, model.config)
    timing = batch["video_second_per_grid"]
    cases = [
        (dict(batch, second_per_grid_ts=timing.clone()),
         r"video timing: got second_per_grid_ts and video_second_per_grid; expected at most one of them"),
        (dict(batch, video_second_per_grid=timing[:1]), r"video_second_per_grid: shape \[1\]; expected \[2\]"),
        ({k: v for k, v in batch.items() if k != "input_features"}, r"feature_attention_mask: shape .* given without input_features"),
        (dict(batch, audio_input_ids=torch.zeros(batch["input_features"].shape[0], 3, 2, dtype=torch.long)),
         r"audio media: the batch holds the keys of two audio layouts, 'audio_features' \(input_features\) and 'audio_codes'"),
        (dict(batch, input_features_mask=batch["feature_attention_mask"].clone()),
         r"audio mask: got input_features_mask and feature_attention_mask; expected at most one of them"),
    ]
    for broken, message in cases:
        keys = {k: id(v) for k, v in broken.items()}
        with pytest.raises(ValueError, match=message):
            ppmedia.split_media(broken, 4, **counts)
        assert {k: id(v) for k, v in broken.items()} == keys  # nothing popped
    # an empty timing in a batch without videos is dropped, as second_per_grid_ts is
    no_videos = {k: v for k, v in batch.items() if k not in ("pixel_values_videos", "video_grid_thw")}
    no_videos["video_second_per_grid"] = torch.zeros(0)
    staged = ppmedia.split_media(no_videos, 4, images_per_sample=counts["images_per_sample"],
                                 audios_per_sample=counts["audios_per_sample"])
    assert "video_second_per_grid" not in no_videos and "second_per_grid_ts" not in staged.tensors


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_first_stage_merge_and_positions_equal_the_models_own(family, n):
    name, tiny, model, batch, reference = family
    adapter = ppmedia.get_adapter(model)
    staged = ppmedia.split_media(dict(batch), n, **adapter.media_counts(batch, model.config))
    ids, mask = batch["input_ids"], batch["attention_mask"]
    first = torch.nn.Module()
    with ppmedia.stage_media(first, staged), torch.no_grad():
        for k, (a, b) in enumerate(staged.samples):
            chunk = ppmedia.next_vlm_media_chunk(first)
            hidden, wire = adapter.first_stage(model, ids[a:b], mask[a:b], model.get_input_embeddings()(ids[a:b]), chunk)
            assert (hidden - reference["inputs_embeds"][a:b]).abs().max() <= ATOL, (name, n, k)
            # 3-D positions exactly the model's own, audio (and a video's audio track) included
            assert torch.equal(wire["position_ids"].transpose(0, 1), reference["position_ids"][:, a:b]), (name, n, k)
    audio = ids == tiny.AUDIO_TOKEN_ID
    assert (reference["inputs_embeds"][audio] - model.get_input_embeddings()(ids)[audio]).abs().max() > 1e-2


@pytest.mark.parametrize("split", [(1, 1), (2, 0), (0, 2)])
def test_stages_match_the_model(family, split):
    name, tiny, model, batch, _ = family
    adapter = ppmedia.get_adapter(model)
    ref_logits, ref = reference_run(model, tiny, batch)
    logits, grads, stages = stage_run(model, batch, split, adapter=adapter)
    real = batch["attention_mask"].bool()
    assert (logits - ref_logits)[real].abs().max() <= ATOL
    assert set(grads) == set(ref)
    assert max((grads[k] - g).abs().max().item() for k, g in ref.items()) <= ATOL
    assert max(g.abs().max() for k, g in ref.items() if "audio_tower" in k) > 1e-4  # the audio tower trains
    crossing = [w.name for w in stages[0].wire_out]
    deepstack = {(1, 1): ["visual_pos_mask", "deepstack_1"], (0, 2): ["visual_pos_mask", "deepstack_0", "deepstack_1"]}
    assert crossing == ["position_ids"] + (deepstack.get(split, []) if name == "qwen3_omni" else [])


def test_positions_that_ignore_the_audio_fail_the_comparison(family):
    """The checks can fail: 1-D positions (what a forward from inputs_embeds silently uses without
    position_ids) give other logits through the stages; positions computed without the clips' lengths
    break the model's own get_rope_index."""
    name, tiny, model, batch, reference = family
    base = type(ppmedia.get_adapter(model))
    targets = make_labels(batch["input_ids"], model.config, attention_mask=batch["attention_mask"], shift=False)
    with torch.no_grad():
        ref_logits = model(**tiny.reference_inputs(batch), labels=targets).logits

    class FlatPositions(base):
        def position_ids(self, model, input_ids, chunk, attention_mask=None):
            flat = super().position_ids(model, input_ids, None, attention_mask)  # no media: 1-D positions
            return flat

    class NoAudioLengths(base):
        def rope_kwargs(self, input_ids, chunk, config):
            kwargs = super().rope_kwargs(input_ids, chunk, config)
            kwargs.pop("audio_seqlens", None)
            return kwargs

    logits, _, _ = stage_run(model, batch, (1, 1), adapter=FlatPositions())
    real = batch["attention_mask"].bool()
    assert (logits - ref_logits)[real].abs().max() > 1e-3
    staged = ppmedia.split_media(dict(batch), 4, **base().media_counts(batch, model.config))
    a, b = staged.samples[1]  # a video with its audio track, and an audio clip
    with pytest.raises(TypeError):  # the model's own get_rope_index indexes the missing lengths
        NoAudioLengths().position_ids(model, batch["input_ids"][a:b], staged.chunk(1), batch["attention_mask"][a:b])


def test_bad_audio_raises_before_the_towers(family):
    name, tiny, model, batch, _ = family
    adapter = ppmedia.get_adapter(model)
    staged = ppmedia.split_media(dict(batch), 4, **adapter.media_counts(batch, model.config))
    a, b = staged.samples[0]
    ids, mask = batch["input_ids"][a:b], batch["attention_mask"][a:b]
    embeds = model.get_input_embeddings()(ids)
    c = staged.chunk(0)
    fields = {f: getattr(c, f) for f in c.__slots__}
    calls = []
    handle = model.model.audio_tower.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(ValueError, match=r"audio: input_features \[2, 128, \d+\] with feature_attention_mask \[2, \d+\]"):
            adapter.first_stage(model, ids, mask, embeds, VlmMediaChunk(**{**fields, "input_features_mask": c.input_features_mask[:, 1:]}))
        with pytest.raises(ValueError, match=r"audio: the microbatch has \d+ placeholder tokens but its media give \d+ feature rows"):
            adapter.first_stage(model, ids, mask, embeds, VlmMediaChunk(**{**fields, "input_features": c.input_features[:1],
                                                                        "input_features_mask": c.input_features_mask[:1]}))
        staged2 = ppmedia.split_media(dict(batch), 4, **adapter.media_counts(batch, model.config))
        v = staged2.chunk(1)
        a2, b2 = staged2.samples[1]
        no_timing = VlmMediaChunk(**{**{f: getattr(v, f) for f in v.__slots__}, "second_per_grid_ts": None})
        with pytest.raises(ValueError, match=r"video: the chunk has videos \[1, 3\] but no video_second_per_grid"):
            adapter.first_stage(model, batch["input_ids"][a2:b2], batch["attention_mask"][a2:b2],
                                model.get_input_embeddings()(batch["input_ids"][a2:b2]), no_timing)
    finally:
        handle.remove()
    assert calls == []


def test_whisper_feature_extractor_output(family):
    """WhisperFeatureExtractor (128 mel bins, as the Omni processors configure it) on waveforms of
    varied lengths -> split -> first stage equals the thinker's own merge and positions."""
    from transformers import WhisperFeatureExtractor

    name, tiny, model, _, _ = family
    adapter = ppmedia.get_adapter(model)
    fe = WhisperFeatureExtractor(feature_size=128)
    rng = np.random.default_rng(0)
    waves = [rng.standard_normal(n).astype(np.float32) * 0.1 for n in (4000, 16000, 9000)]
    out = fe(waves, sampling_rate=16000, return_attention_mask=True, padding="max_length", return_tensors="pt")
    feats, fmask = out["input_features"], out["attention_mask"]
    assert feats.shape == (3, 128, 3000) and fmask.shape == (3, 3000)
    tokens = [tiny.audio_tokens(int(n)) for n in fmask.sum(-1)]
    per_sample = [[0], [], [1, 2], []]
    rows = []
    for clips in per_sample:
        ids = [1, 20]
        for j in clips:
            ids += [tiny.AUDIO_START_TOKEN_ID] + [tiny.AUDIO_TOKEN_ID] * tokens[j] + [tiny.AUDIO_END_TOKEN_ID, 21]
        rows.append(ids + [2])
    input_ids, attention_mask = right_padded(rows, 0)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "input_features": feats, "feature_attention_mask": fmask}
    reference = _capture(model, {**batch, "use_cache": False})
    staged = ppmedia.split_media(dict(batch), 2, **adapter.media_counts(batch, model.config))
    first = torch.nn.Module()
    with ppmedia.stage_media(first, staged), torch.no_grad():
        for a, b in staged.samples:
            chunk = ppmedia.next_vlm_media_chunk(first)
            ids = input_ids[a:b]
            hidden, wire = adapter.first_stage(model, ids, attention_mask[a:b], model.get_input_embeddings()(ids), chunk)
            assert (hidden - reference["inputs_embeds"][a:b]).abs().max() <= ATOL
            real = attention_mask[a:b].bool()
            assert torch.equal(wire["position_ids"].transpose(0, 1)[:, real], reference["position_ids"][:, a:b][:, real])
