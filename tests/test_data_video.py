"""ppmedia.data's videos (``ppmedia.data.video``): the video processor's own frame choice and the video's
metadata, only the kept frames decoded, for every family with a video processor; the Omni families'
audio tracks; bad videos named by their record.

The reference is the family's processor sampling the whole decoded video itself (``do_sample_frames``,
every frame decoded with PyAV, the same metadata without ``frames_indices``): the sample ppmedia makes
from the kept frames alone must hold the same tensors, token ids included (Qwen3-VL, GLM-4V, Gemma 4,
VideoLLaMA3, Kimi-K2.5 and MiniMax-M3 write the kept frames' timestamps into the text; Qwen2.5-VL times
the video by them). The tiny processors save ``do_sample_frames=False``; each test turns it on with
the settings below, so that the processor keeps a strict subset of the clip's 24 frames.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import pytest
import torch

from ppmedia import data
from ppmedia.data.labels import render
from ppmedia.data.records import parse_record
from ppmedia.data.video import FrameSampler, read_video
from ppmedia.testing.processors import build_tiny_processor, processor_call_kwargs

pytestmark = pytest.mark.usefixtures("one_thread")

FRAMES, RATE, SIZE = 24, 12, 32  # 2 s

#: per family: the sampling settings its processor lacks for a 2 s clip (the others sample by their
#: saved fps: 2 frames a second, GLM-4.6V by its duration table, MiniMax-M3 at 1)
SAMPLING: dict[str, dict[str, object]] = {
    "qwen2_5_vl": {"fps": 2}, "qwen3_vl": {}, "glm4v": {}, "glm46v": {}, "internvl": {"num_frames": 4},
    "llava_onevision": {"num_frames": 4}, "video_llama_3": {"fps": 2}, "qwen2_5_omni": {"fps": 2},
    "qwen3_omni": {"fps": 2}, "gemma4": {"num_frames": 4}, "minimax_m3_vl": {}, "kimi_vl": {},
    "ernie4_5_vl_moe": {"fps": 2},
}


def write_clip(path, frames=FRAMES, rate=RATE, size=SIZE, gop=6, audio=None, pts=None):
    """A libx264 clip (B-frames, a keyframe every ``gop`` frames) of a pattern moving one pixel a
    frame (no scene cuts: keyframes only where ``gop`` puts them); ``audio``: a mono float32 track at
    16 kHz (PCM, lossless); ``pts``: each frame's time in ms (a variable frame rate)."""
    import av

    base = np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.codec_context.gop_size = gop
        if pts is not None:
            stream.codec_context.time_base = Fraction(1, 1000)
        track = container.add_stream("pcm_s16le", rate=16000) if audio is not None else None
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.roll(base, i, axis=1), format="rgb24")
            if pts is not None:
                frame.pts, frame.time_base = pts[i], Fraction(1, 1000)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
        if track is not None:
            samples = av.AudioFrame.from_ndarray(audio[None], format="flt", layout="mono")
            samples.sample_rate = 16000
            for packet in list(track.encode(samples)) + list(track.encode()):
                container.mux(packet)
    return str(path)


def decode_all(path):
    """Every frame, decoded one after the other (ppmedia's reader before it sampled)."""
    import av

    with av.open(path) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


@dataclass
class Clip:
    path: str
    frames: np.ndarray

    def metadata(self):
        from transformers.video_utils import VideoMetadata

        return VideoMetadata(total_num_frames=FRAMES, fps=float(RATE), width=SIZE, height=SIZE,
                             duration=FRAMES / RATE, video_backend="pyav")


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    path = write_clip(tmp_path_factory.mktemp("video") / "clip.mp4")
    return Clip(path, decode_all(path))


def video_record(path, where="clip.jsonl:1"):
    return parse_record({"messages": [{"role": "user", "content": [{"type": "video", "video": path},
                                                                   {"type": "text", "text": "w1"}]},
                                      {"role": "assistant", "content": "w2"}]}, where)


def sampling_kwargs(family):
    call = processor_call_kwargs(family)
    call["videos_kwargs"] = {**call.get("videos_kwargs", {}), "do_sample_frames": True, **SAMPLING[family]}
    return call


def own_output(processor, record, videos, metadata, call):
    """The processor on the whole decoded video(s), sampling them itself."""
    text = render(processor, record.messages, record.where)[0]
    out = processor(text=[text], videos=videos, video_metadata=metadata, return_tensors="pt",
                    add_special_tokens=False, **call)
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}


def assert_same(sample, own):
    assert set(own) == set(sample) - {"labels"}
    for key, value in own.items():
        assert torch.equal(sample[key], value), key


@pytest.fixture
def texts(monkeypatch):
    """The texts the processors hand their tokenizer, placeholders expanded (the tiny tokenizer reads a
    timestamp as [UNK], so the token ids alone would not show a wrong one)."""
    from transformers import PreTrainedTokenizerFast

    seen: list[list[str]] = []
    call = PreTrainedTokenizerFast.__call__

    def spy(self, text=None, *args, **kwargs):
        if not kwargs.get("return_offsets_mapping"):  # not ppmedia's own tokenising for the labels
            seen.append(list(text) if isinstance(text, list) else [text])
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerFast, "__call__", spy)
    return seen


@pytest.mark.parametrize("family", sorted(SAMPLING))
def test_kept_frames_give_the_processors_own_sampling(family, clip, texts):
    processor = build_tiny_processor(family)
    call = sampling_kwargs(family)
    record = video_record(clip.path)
    sample = data.SampleProcessor(processor, processor_kwargs=call)(record)
    ours = texts[-1]
    assert_same(sample, own_output(processor, record, [clip.frames], [clip.metadata()], call))
    assert ours == texts[-1]
    video = read_video(clip.path, record.where, FrameSampler(processor, call))
    kept = [int(i) for i in video.metadata.frames_indices]
    assert 0 < len(kept) < FRAMES and np.array_equal(video.frames, clip.frames[kept])
    assert video.decoded < FRAMES  # the frames after the last kept one are never decoded
    # the metadata the processor makes for itself (the tiny tokenizer reads timestamps as [UNK]: compare it too)
    own = processor.video_processor(videos=[clip.frames], video_metadata=[clip.metadata()], return_metadata=True,
                                    **call["videos_kwargs"])["video_metadata"][0]
    assert type(own.frames_indices) is type(video.metadata.frames_indices)
    assert [int(i) for i in own.frames_indices] == kept and own.timestamps == video.metadata.timestamps
    assert {k: v for k, v in own.items() if k != "frames_indices"} == {
        k: v for k, v in video.metadata.items() if k != "frames_indices"}


@pytest.mark.parametrize("family", ["qwen3_vl", "glm4v"])
def test_a_processor_that_does_not_sample_gets_every_frame_and_its_timestamps(family, clip):
    """The tiny processors as saved (``do_sample_frames=False``): before the metadata carried the kept
    frames' indices, Qwen3-VL died in ``_calculate_timestamps`` and GLM-4V with "Cannot infer video
    timestamps"."""
    processor = build_tiny_processor(family)
    record = video_record(clip.path)
    sample = data.SampleProcessor(processor)(record)
    metadata = clip.metadata()
    metadata.frames_indices = list(range(FRAMES))
    assert_same(sample, own_output(processor, record, [clip.frames], [metadata], {}))


def test_a_planted_frame_shift_is_caught(clip, monkeypatch):
    """The comparison above fails when the reader hands over the frame after each kept one."""
    from ppmedia.data import video as video_module

    get = video_module._Frames.get
    monkeypatch.setattr(video_module._Frames, "get", lambda self, k: get(self, min(k + 1, FRAMES - 1)))
    processor = build_tiny_processor("qwen2_5_vl")
    call = sampling_kwargs("qwen2_5_vl")
    record = video_record(clip.path)
    sample = data.SampleProcessor(processor, processor_kwargs=call)(record)
    own = own_output(processor, record, [clip.frames], [clip.metadata()], call)
    assert not torch.equal(sample["pixel_values_videos"], own["pixel_values_videos"])


def _keyframes(path):
    import av

    with av.open(path) as container:
        stream = container.streams.video[0]
        scale = stream.time_base * stream.average_rate
        return sorted(round(p.pts * scale) for p in container.demux(stream) if p.pts is not None and p.is_keyframe)


CONTAINERS = {
    "mp4": {},  # frame count in the header
    "mkv": {},  # no frame count in the header: counted from the packets
    "vfr": {"pts": [sum(100 if k % 3 else 250 for k in range(i)) for i in range(60)]},  # off any frame grid
}


@pytest.mark.parametrize("kind", sorted(CONTAINERS))
def test_reader_decodes_only_what_the_kept_frames_need(kind, tmp_path):
    path = write_clip(tmp_path / f"clip.{'mp4' if kind == 'vfr' else kind}", frames=60, rate=10, gop=10, **CONTAINERS[kind])
    every = decode_all(path)
    kept = [3, 25, 26, 58]
    video = read_video(path, "v.jsonl:1", lambda metadata: kept)
    assert np.array_equal(video.frames, every[kept]) and video.metadata.frames_indices == kept
    assert video.metadata.total_num_frames == 60 and video.metadata.width == video.metadata.height == SIZE
    if kind == "vfr":  # no frame grid: decoded twice (to count, to convert), still the right frames
        assert video.decoded == 120
        return
    keys = _keyframes(path)
    assert keys[:6] == [0, 10, 20, 30, 40, 50]
    held = read_video({"bytes": open(path, "rb").read(), "path": None}, "v.jsonl:1", lambda metadata: kept)
    assert np.array_equal(held.frames, video.frames) and held.decoded == video.decoded  # a datasets bytes dict
    # from the keyframe before each kept frame, never past the last: 3+1, 5+1+1, 8+1 = 20 of 60
    assert video.decoded == 20 and video.metadata.fps == 10.0 and video.metadata.duration == 6.0


def test_audio_tracks_of_the_omni_processors(clip, tmp_path):
    """``load_audio_from_video``: the reader decodes each video's track at the extractor's rate and
    the processor gets it in the video's audio slot; a video without a track is refused."""
    wave = (0.3 * np.sin(np.arange(32000) * 2 * np.pi * 440 / 16000)).astype(np.float32)  # 2 s
    path = write_clip(tmp_path / "talk.mkv", audio=wave)
    family = "qwen2_5_omni"
    processor = build_tiny_processor(family)
    call = {**sampling_kwargs(family), "load_audio_from_video": True}
    proc = data.SampleProcessor(processor, processor_kwargs=call)
    video = read_video(path, "a:1", FrameSampler(processor, call), audio_rate=16000)
    assert video.audio.shape == wave.shape and np.abs(video.audio - wave).max() < 1e-4  # 16-bit PCM
    record = video_record(path)
    own = own_output(processor, record, [decode_all(path)], [clip.metadata()],
                     {**call, "audio": [video.audio], "audio_from_video_indices": [0]})
    sample = proc(record)
    assert_same(sample, own)
    assert int((sample["input_ids"] == processor.tokenizer.convert_tokens_to_ids(processor.audio_token)).sum()) > 0
    with pytest.raises(data.DataError, match=r"^silent.jsonl:1: video '.*clip.mp4' has no audio track"):
        proc(video_record(clip.path, "silent.jsonl:1"))


def test_bad_videos_are_one_error_naming_the_record_and_skipped(clip, tmp_path):
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"\x00\x00\x00\x18ftypmp42 but nothing after it")
    lines = [{"messages": [{"role": "user", "content": [{"type": "video", "video": path}, {"type": "text", "text": "w1"}]},
                           {"role": "assistant", "content": "w2"}]} for path in (clip.path, str(broken), clip.path, clip.path)]
    jsonl = tmp_path / "videos.jsonl"
    jsonl.write_text("".join(json.dumps(line) + "\n" for line in lines))
    ds = data.open_dataset(str(jsonl))
    # Gemma 4 keeps 32 frames unless told otherwise: more than the clip has
    gemma = data.SampleProcessor(build_tiny_processor("gemma4"), processor_kwargs={"do_sample_frames": True})
    with pytest.raises(data.DataError, match=rf"^{jsonl}:1: video '.*clip.mp4' \(24 frames at 12 fps\): the processor "
                                             "cannot sample its frames \\(ValueError: .*num_frames=32"):
        gemma(ds[0])
    proc = data.SampleProcessor(build_tiny_processor("qwen3_vl"), processor_kwargs={"do_sample_frames": True})
    with pytest.raises(data.DataError, match=rf"^{jsonl}:2: video '.*broken.mp4' cannot be read"):
        list(data.ReplicaLoader(ds, proc, global_batch_size=2, shuffle=False))
    batches = list(data.ReplicaLoader(ds, proc, global_batch_size=2, shuffle=False, skip_bad_samples=True))
    assert [b["n_samples"] for b in batches] == [1, 2] and batches[0]["sample_names"] == [f"{jsonl}:1", None]
    assert batches[-1]["skipped"] == 1
