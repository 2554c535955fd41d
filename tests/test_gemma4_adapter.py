"""Gemma 4 adapter (images, video frames, audio; per-layer inputs and shared KV across stages) against
the model's own full-batch forward (tiny seeded model).

References are the model's own: the ``inputs_embeds`` and ``per_layer_inputs`` its language model
receives (a forward pre-hook; the per-layer inputs projected with the model's own
``project_per_layer_inputs``), and its logits and gradients. ppmedia's path: split_media ->
stage_media -> next_vlm_media_chunk -> adapter.first_stage, then stage modules run one after the other
in this process (``ppmedia.testing.stages.stage_run``; the 2-process schedules are in
test_audio_families_mp.py). ``model``, ``batch`` and ``adapter`` are conftest's (seed 0).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ppmedia
from ppmedia import VlmMediaChunk
from ppmedia.adapters.base import VlmAdapter
from ppmedia.adapters.gemma4 import Gemma4Adapter
from ppmedia.pipeline import build_stage_modules
from ppmedia.testing.stages import reference_run, stage_run
from ppmedia.testing.tiny_models import capture_merged_embeds
from ppmedia.testing.tiny_models import gemma4 as tiny
from ppmedia.testing.tiny_models._batch import right_padded

IMAGES = [1, 1, 0, 1, 0, 0, 1, 1]
VIDEOS = [0, 0, 1, 1, 0, 0, 0, 1]
AUDIOS = [1, 1, 0, 1, 0, 0, 2, 0]
ATOL = 1e-5
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reference(model, batch):
    """What the model's language model receives on the full batch, PLE projected as the model does."""
    seen = {}
    handle = model.model.language_model.register_forward_pre_hook(lambda _m, _a, kw: seen.update(kw), with_kwargs=True)
    try:
        with torch.no_grad():
            model(**tiny.reference_inputs(batch))
            seen["ple"] = model.model.language_model.project_per_layer_inputs(seen["inputs_embeds"], seen["per_layer_inputs"])
    finally:
        handle.remove()
    return seen


@pytest.fixture(scope="module")
def model_run(model, batch):
    """The model's own full-batch logits and gradients."""
    return reference_run(model, tiny, batch)


# -------------------------------------------------------------------------------------------------
# counts and the split


def test_registry_and_counts(adapter, model, batch):
    assert isinstance(adapter, Gemma4Adapter) and ppmedia.get_adapter(model) is adapter
    counts = adapter.media_counts(batch, model.config)
    assert counts["images_per_sample"].tolist() == IMAGES
    assert counts["videos_per_sample"].tolist() == VIDEOS
    assert counts["audios_per_sample"].tolist() == AUDIOS
    # frames are blocks of their own: without num_frames_per_video the tokens cannot count videos
    with pytest.raises(ValueError, match=r"samples \[2, 3, 7\] hold video frame blocks.*n_videos_per_sample"):
        adapter.media_per_sample(batch["input_ids"], model.config)
    # counts the batch holds are left to split_media
    held = dict(batch, n_audios_per_sample=torch.tensor(AUDIOS), n_videos_per_sample=torch.tensor(VIDEOS))
    assert sorted(adapter.media_counts(held, model.config)) == ["images_per_sample"]


def test_split_keeps_each_clip_and_frame_with_its_sample(adapter, model, batch):
    staged = ppmedia.split_media(dict(batch), 4, **adapter.media_counts(batch, model.config))
    assert staged.audios == (2, 1, 0, 2) and staged.videos == (0, 2, 0, 1) and staged.images == (2, 1, 0, 2)
    assert staged.video_rows == (0, 3, 0, 3)
    chunks = list(staged)
    assert chunks[2] is None  # samples 4 and 5: text only
    assert [c.input_features.shape[0] for c in (chunks[0], chunks[1], chunks[3])] == [2, 1, 2]
    assert chunks[1].num_frames_per_video.tolist() == [2, 1] and chunks[1].video_position_ids.shape == (3, 8, 2)
    # views of the batch's tensors, no copy
    assert chunks[3].input_features.untyped_storage().data_ptr() == batch["input_features"].untyped_storage().data_ptr()
    assert chunks[3].input_features_mask.data_ptr() == batch["input_features_mask"][3:].data_ptr()


def test_the_frames_layout_refuses_what_does_not_fit_before_popping(adapter, model, batch):
    """Gemma 4's frames are the media layout ``video_frames`` (pixel_values_videos + num_frames_per_video);
    a Qwen-style grid beside them is ambiguous, positions without the frame counts are orphans, a video
    of 0 frames or positions of another shape are refused: each naming the key, with the batch intact."""
    counts = adapter.media_counts(batch, model.config)
    frames = batch["num_frames_per_video"]
    cases = [
        (dict(batch, video_grid_thw=torch.ones(frames.shape[0], 3, dtype=torch.long)),
         r"video metadata: got video_grid_thw and num_frames_per_video; expected at most one of them"),
        ({k: v for k, v in batch.items() if k != "num_frames_per_video"},
         r"video_position_ids: shape \[6, 8, 2\] given without num_frames_per_video"),
        (dict(batch, num_frames_per_video=torch.tensor([3, 0, 3])), r"num_frames_per_video: video 1 has 0 frames"),
        (dict(batch, video_position_ids=batch["video_position_ids"][:, :4]),
         r"video_position_ids: shape \[6, 4, 2\]; expected \[6, 8, 2\]"),
        (dict(batch, video_position_ids=batch["video_position_ids"].float()), r"video_position_ids: dtype torch.float32"),
    ]
    for broken, message in cases:
        keys = {k: id(v) for k, v in broken.items()}
        with pytest.raises((ValueError, TypeError), match=message):
            ppmedia.split_media(broken, 4, **counts)
        assert {k: id(v) for k, v in broken.items()} == keys  # nothing popped
    assert ppmedia.split_media(dict(batch), 4, **counts).layouts == ("images_with_position_ids", "video_frames", "audio_features")


# -------------------------------------------------------------------------------------------------
# the first stage: merge and per-layer inputs, any number of microbatches


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_first_stage_matches_the_models_own_inputs(adapter, model, batch, reference, n):
    staged = ppmedia.split_media(dict(batch), n, **adapter.media_counts(batch, model.config))
    ids, mask = batch["input_ids"], batch["attention_mask"]
    first = torch.nn.Module()
    text_only = []
    with ppmedia.stage_media(first, staged), torch.no_grad():
        for k, (a, b) in enumerate(staged.samples):
            chunk = ppmedia.next_vlm_media_chunk(first)
            text_only += [k] if chunk is None else []
            hidden, wire = adapter.first_stage(model, ids[a:b], mask[a:b], model.get_input_embeddings()(ids[a:b]), chunk)
            assert (hidden - reference["inputs_embeds"][a:b]).abs().max() <= ATOL, (n, k)
            assert (wire["per_layer_inputs"] - reference["ple"][a:b]).abs().max() <= ATOL, (n, k)
            assert torch.equal(wire["mm_token_type_ids"], batch["mm_token_type_ids"][a:b])
    assert text_only == {4: [2], 8: [4, 5]}.get(n, [])
    # the comparison is real: audio, image and video features differ from the text embeddings
    text = model.get_input_embeddings()(ids)
    for token in (tiny.AUDIO_TOKEN_ID, tiny.IMAGE_TOKEN_ID, tiny.VIDEO_TOKEN_ID):
        where = ids == token
        assert (reference["inputs_embeds"][where] - text[where]).abs().max() > 1e-2


def test_bad_media_raise_before_the_towers(adapter, model, batch):
    staged = ppmedia.split_media(dict(batch), 4, **adapter.media_counts(batch, model.config))
    a, b = staged.samples[1]
    ids, mask = batch["input_ids"][a:b], batch["attention_mask"][a:b]
    embeds = model.get_input_embeddings()(ids)
    c = staged.chunk(1)
    calls = []
    handles = [model.model.audio_tower.register_forward_pre_hook(lambda *_: calls.append("audio")),
               model.model.vision_tower.register_forward_pre_hook(lambda *_: calls.append("vision"))]
    try:
        def replace(**kw):
            fields = {f: getattr(c, f) for f in c.__slots__}
            return VlmMediaChunk(**{**fields, **kw})

        with pytest.raises(ValueError, match=r"audio: the microbatch has 2 placeholder tokens but its media give 0 feature rows"):
            adapter.first_stage(model, ids, mask, embeds, replace(input_features=None, input_features_mask=None))
        with pytest.raises(ValueError, match=r"gemma4 audio: input_features \[1, 16, 128\] with input_features_mask \[1, 15\]"):
            adapter.first_stage(model, ids, mask, embeds, replace(input_features_mask=c.input_features_mask[:, 1:]))
        short = c.input_features_mask.clone()
        short[0, 4:] = False  # a clip whose mask is shorter than its placeholders: 4 frames, 1 token
        with pytest.raises(ValueError, match=r"audio: the microbatch has 2 placeholder tokens but its media give 1 feature rows"):
            adapter.first_stage(model, ids, mask, embeds, replace(input_features_mask=short))
        with pytest.raises(ValueError, match=r"num_frames_per_video \[2, 2\] \(sum 4\); expected positive counts summing to the chunk's 3 frames"):
            adapter.first_stage(model, ids, mask, embeds, replace(num_frames_per_video=torch.tensor([2, 2])))
        odd = c.image_grid.clone()
        odd[0, 2] = -1  # an image of 3 real patches
        with pytest.raises(ValueError, match=r"gemma4 image 0 of the chunk has 3 real patches"):
            adapter.first_stage(model, ids, mask, embeds, replace(image_grid=odd))
        with pytest.raises(ValueError, match=r"gemma4 video: pixels \[3, 8, 12\] with video_position_ids None"):
            adapter.first_stage(model, ids, mask, embeds, replace(video_position_ids=None))
    finally:
        for h in handles:
            h.remove()
    assert calls == []


# -------------------------------------------------------------------------------------------------
# per-layer inputs and shared KV across stage boundaries


@pytest.mark.parametrize("split", [(2, 2), (1, 3), (3, 1), (4, 0), (0, 4), (1, 1, 1, 1)])
def test_stages_match_the_model_for_any_layer_split(adapter, model, batch, model_run, split):
    ref_logits, ref_grads = model_run
    logits, grads, stages = stage_run(model, batch, split, adapter=adapter)
    assert (logits - ref_logits).abs().max() <= ATOL
    assert set(grads) == set(ref_grads)  # every parameter (vision and audio towers too) got its gradient
    for name, grad in ref_grads.items():
        assert (grads[name] - grad).abs().max() <= ATOL, name
    for part in ("audio_tower", "vision_tower", "embed_audio", "embed_tokens_per_layer", "per_layer_model_projection"):
        assert max(g.abs().max() for k, g in ref_grads.items() if part in k) > 1e-4, part
    # what crosses each boundary: the PLE of the layers ahead; each KV pair while producer behind, consumer ahead
    start = 0
    for module, size in zip(stages, split):
        start += size
        names = [w.name for w in module.wire_out]
        if module.is_last:
            assert names == []
            continue
        links = (("sliding_attention", 0, 2), ("full_attention", 1, 3))  # (type, producer, last consumer)
        kv = [f"shared_kv_{t}_{p}" for t, made, last in links if made < start <= last for p in ("key", "value")]
        assert names == ["mm_token_type_ids"] + (["per_layer_inputs"] if start < 4 else []) + kv, (split, start)
    # the PLE tables live on the first stage only
    for module in stages[1:]:
        assert not any("per_layer" in n and "layers." not in n for n, _ in module.named_parameters())


def test_state_that_does_not_cross_fails_the_comparison(model, batch, model_run):
    """The checks can fail: an adapter that drops the per-layer inputs at the boundary (later stages
    get zeros) gives other logits; one that drops the shared KV breaks the consumers' own forward; one
    that forgets the logit soft-cap gives other logits."""
    ref_logits, _ = model_run

    class DropsPLE(Gemma4Adapter):
        def wire_tensors(self, config, first_layer):
            return tuple(w for w in super().wire_tensors(config, first_layer) if first_layer == 0 or w.name != "per_layer_inputs")

        def decoder_kwargs(self, stage, layers, hidden, attention_mask, wire):
            kwargs = super().decoder_kwargs(stage, layers, hidden, attention_mask, wire)
            if layers.start:
                kwargs["per_layer_inputs"] = hidden.new_zeros(*hidden.shape[:2], len(layers), 4)
            return kwargs

    class DropsKV(Gemma4Adapter):
        def wire_tensors(self, config, first_layer):
            return tuple(w for w in super().wire_tensors(config, first_layer) if not w.name.startswith("shared_kv"))

    class NoSoftcap(Gemma4Adapter):
        def logits(self, stage, hidden):
            return VlmAdapter.logits(self, stage, hidden)  # the plain lm_head

    class NoHooks(Gemma4Adapter):
        def stage_hooks(self, stage, layers, state):
            return ()  # the KV the producers store never reaches the wire

    logits, _, _ = stage_run(model, batch, (2, 2), adapter=DropsPLE())
    assert (logits - ref_logits).abs().max() > 1e-3
    with pytest.raises(KeyError, match="sliding_attention"):
        stage_run(model, batch, (2, 2), adapter=DropsKV())
    logits, _, _ = stage_run(model, batch, (2, 2), adapter=NoSoftcap())
    assert (logits - ref_logits).abs().max() > 1e-3
    with pytest.raises(TypeError, match="declares 'shared_kv_sliding_attention_key' for stage 1, but this stage does not hold it"):
        stage_run(model, batch, (2, 2), adapter=NoHooks())


def test_static_stage_args_follow_the_wire(adapter, model):
    from ppmedia.pipeline import static_stage_args

    stages = build_stage_modules(model, 2, adapter=adapter)
    (_, outs0), (ins1, _) = (static_stage_args(m, 2, 24) for m in stages)
    shapes = [list(t.shape) for t in outs0]
    assert shapes == [[2, 24, 32], [2, 24], [2, 24], [2, 24, 2, 4], [2, 1, 24, 8], [2, 1, 24, 8], [2, 1, 24, 16], [2, 1, 24, 16]]
    assert [t.requires_grad for t in outs0] == [True, False, False, True, True, True, True, True]
    assert [list(t.shape) for t in ins1] == shapes


# -------------------------------------------------------------------------------------------------
# real processor and feature extractor output


def test_real_image_processor_and_audio_feature_extractor(adapter):
    """Gemma4ImageProcessorPil (patch 2, pooling 2) and Gemma4AudioFeatureExtractor on synthetic images
    and waveforms of varied sizes -> split -> stage -> first_stage equals the model's own merge."""
    from PIL import Image
    from transformers import Gemma4AudioFeatureExtractor, Gemma4ImageProcessorPil

    model = tiny.build_model(0, vision_overrides={"position_embedding_size": 128})
    images = Gemma4ImageProcessorPil(patch_size=2, pooling_kernel_size=2, max_soft_tokens=70)
    rng = np.random.default_rng(0)
    pictures = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in [(20, 36), (30, 30), (12, 50)]]
    out = images(images=pictures, return_tensors="pt")
    assert out["pixel_values"].shape == (3, 280, 12) and out["image_position_ids"].shape == (3, 280, 2)
    tokens = out["num_soft_tokens_per_image"]
    fe = Gemma4AudioFeatureExtractor()
    waves = [rng.standard_normal(n).astype(np.float32) * 0.1 for n in (8000, 3000, 5600)]
    audio = fe(waves, sampling_rate=16000, return_tensors="pt")
    feats, fmask = audio["input_features"], audio["input_features_mask"]
    assert feats.shape[0] == 3 and feats.shape[2] == 128 and fmask.dtype == torch.bool
    clips = fmask[:, ::2][:, ::2].sum(-1).tolist()
    per_sample = [(1, 1), (0, 0), (2, 1), (0, 1)]  # (images, audios) per sample
    rows, i, j = [], 0, 0
    for n_img, n_aud in per_sample:
        ids = [tiny.BOS_TOKEN_ID, 7]
        for _ in range(n_img):
            ids += [tiny.BOI_TOKEN_ID] + [tiny.IMAGE_TOKEN_ID] * int(tokens[i]) + [tiny.EOI_TOKEN_ID, 8]
            i += 1
        for _ in range(n_aud):
            ids += [tiny.BOA_TOKEN_ID] + [tiny.AUDIO_TOKEN_ID] * int(clips[j]) + [tiny.EOA_TOKEN_ID, 9]
            j += 1
        rows.append(ids + [tiny.EOS_TOKEN_ID])
    input_ids, attention_mask = right_padded(rows, tiny.PAD_TOKEN_ID)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "mm_token_type_ids": tiny.mm_token_type_ids(input_ids),
             "pixel_values": out["pixel_values"], "image_position_ids": out["image_position_ids"],
             "input_features": feats, "input_features_mask": fmask}
    reference = capture_merged_embeds(model, **tiny.reference_inputs(batch))
    counts = adapter.media_counts(batch, model.config)
    assert counts["audios_per_sample"].tolist() == [1, 0, 1, 1]
    staged = ppmedia.split_media(dict(batch), 2, **counts)
    first = torch.nn.Module()
    with ppmedia.stage_media(first, staged), torch.no_grad():
        for a, b in staged.samples:
            chunk = ppmedia.next_vlm_media_chunk(first)
            ids = input_ids[a:b]
            hidden, _ = adapter.first_stage(model, ids, attention_mask[a:b], model.get_input_embeddings()(ids), chunk)
            assert (hidden - reference[a:b]).abs().max() <= ATOL


def test_real_video_processor():
    """Gemma4VideoProcessor (torchvision) in the tiny Gemma4Processor: videos of 1 and 3 frames become
    padded patch rows per frame with ``video_position_ids`` and ``num_frames_per_video``, and the
    processor writes one timestamped block per frame (the merges: tests/test_processors.py)."""
    from ppmedia.testing.processors import build_tiny_processor, chat_batch

    processor = build_tiny_processor("gemma4")
    assert type(processor.video_processor).__name__ == "Gemma4VideoProcessor"
    rng = np.random.default_rng(2)
    clips = [("video", rng.integers(0, 256, (t, 8, 16, 3), dtype=np.uint8)) for t in (1, 3)]
    batch = chat_batch(processor, [[2, clips[0]], [clips[1], 1]], nested=True)
    assert batch["num_frames_per_video"].tolist() == [1, 3]
    assert batch["pixel_values_videos"].shape[0] == 4 and batch["video_position_ids"].shape[:2] == batch["pixel_values_videos"].shape[:2]
    blocks = (batch["input_ids"] == tiny.BOI_TOKEN_ID).sum(-1).tolist()
    assert blocks == [1, 3]

def test_inspect_shows_the_audio_clips_per_microbatch(capsys):
    """``ppmedia inspect`` on the golden batch (config.json beside it) counts the clips per microbatch."""
    import pathlib

    from ppmedia.cli import main

    golden = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "gemma4" / "inputs.safetensors"
    assert main(["inspect", str(golden), "--microbatches", "4"]) == 0
    out = capsys.readouterr().out
    assert "audios [1, 1, 0, 1, 0, 0, 2, 0]" in out
    header = next(line for line in out.splitlines() if line.startswith("mb "))
    assert header.split()[:5] == ["mb", "samples", "images", "videos", "audios"]
    lines = out.splitlines()
    table = lines[lines.index(header) + 2 : lines.index(header) + 6]  # the 4 microbatch rows under the rule
    assert [int(line.split()[4]) for line in table] == [2, 1, 0, 2]
