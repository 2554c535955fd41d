"""ppmedia.data: the formats (LLaVA and messages JSON / JSON Lines, ``datasets``), media paths,
videos with PyAV, and every bad-record case (the error, and skipped + counted)."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

import data_fixtures as fx
from ppmedia import data
from ppmedia.testing.tiny_models import qwen2_5_vl as tiny

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    processor = fx.save_qwen_processor(str(root / "processor"))
    records = fx.llava_records(str(root), 6)
    jsonl = fx.write_jsonl(str(root / "train.jsonl"), records)
    return {"root": root, "processor": processor, "records": records, "jsonl": jsonl,
            "proc": data.SampleProcessor(processor, max_length=200, config=tiny.build_config())}


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_llava_jsonl_paths_relative_to_the_file(world):
    ds = data.open_dataset(world["jsonl"])
    assert len(ds) == 6 and ds.where(2) == f"{world['jsonl']}:3"
    record = ds[2]
    assert record.media["image"] == [str(world["root"] / "img2_0.png"), str(world["root"] / "img2_1.png")]
    assert [m["role"] for m in record.messages] == ["user", "assistant"]
    sample = world["proc"](record)
    assert sample["image_grid_thw"].shape == (2, 3) and sample["input_ids"].shape[0] == 1
    n_tokens = int((sample["image_grid_thw"].prod(-1) // 4).sum())
    assert int((sample["input_ids"] == tiny.IMAGE_TOKEN_ID).sum()) == n_tokens


def test_media_dir_comes_first(world, tmp_path):
    other = tmp_path / "media"
    other.mkdir()
    fx.write_image(str(other / "img1_0.png"), 8, 8, 99)
    ds = data.open_dataset(world["jsonl"], media_dir=other)
    assert ds[1].media["image"] == [str(other / "img1_0.png")]
    assert ds[2].media["image"][0] == str(world["root"] / "img2_0.png")  # not in media_dir: the file's folder


def _messages_style(record):
    roles = {"human": "user", "gpt": "assistant"}
    out = {"messages": [{"role": roles[t["from"]], "content": t["value"]} for t in record["conversations"]]}
    images = record.get("images") or ([record["image"]] if "image" in record else [])
    if images:
        out["images"] = images
    return out


def test_messages_style_json_list_gives_the_same_samples(world):
    path = world["root"] / "train_messages.json"
    path.write_text("[\n" + ",\n".join(json.dumps(_messages_style(r), indent=1) for r in world["records"]) + "\n]\n")
    llava, messages = data.open_dataset(world["jsonl"]), data.open_dataset(path)
    starts = [n for n, line in enumerate(path.read_text().splitlines(), 1) if line == "{"]
    assert [messages.where(i) for i in range(6)] == [f"{path}:{n}" for n in starts]  # the line a record starts on
    for i in range(6):
        _same(world["proc"](llava[i]), world["proc"](messages[i]))


def test_datasets_save_to_disk_and_object(world):
    import datasets

    rows = [_messages_style(r) for r in world["records"]]
    as_paths = datasets.Dataset.from_list([{"messages": r["messages"], "images": r.get("images", [])} for r in rows])
    absolute = datasets.Dataset.from_list([{"messages": r["messages"], "images": [str(world["root"] / p) for p in r.get("images", [])]}
                                           for r in rows])
    with_images = absolute.cast_column("images", datasets.List(datasets.Image()))  # the pixels in the arrow files
    folder = world["root"] / "saved"
    with_images.save_to_disk(str(folder))
    llava = data.open_dataset(world["jsonl"])
    from_disk = data.open_dataset(str(folder))
    from_object = data.open_dataset(as_paths, media_dir=world["root"])
    assert from_disk.where(3) == f"{folder}[3]" and from_object.where(3) == "dataset[3]"
    for i in range(6):
        expected = world["proc"](llava[i])
        _same(expected, world["proc"](from_disk[i]))
        _same(expected, world["proc"](from_object[i]))


def test_video_decoded_with_pyav_frames_sampled_by_the_processor(world):
    fx.write_video(str(world["root"] / "clip.mp4"), frames=8, rate=4)
    path = fx.write_jsonl(str(world["root"] / "video.jsonl"), [
        {"video": "clip.mp4", "conversations": [{"from": "human", "value": "<video> w1"}, {"from": "gpt", "value": "w2"}]}])
    sample = world["proc"](data.open_dataset(path)[0])
    # 8 frames at 4 fps = 2 s; the processor's fps=2 keeps 4 frames -> 2 temporal patches of 4x4 patches
    assert sample["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert sample["pixel_values_videos"].shape == (32, 96)
    assert int((sample["input_ids"] == tiny.VIDEO_TOKEN_ID).sum()) == 8
    assert torch.equal(sample["mm_token_type_ids"][0] == 2, sample["input_ids"][0] == tiny.VIDEO_TOKEN_ID)


def _inline_style(record, folder):
    """The messages style with each image inside its turn, the way Qwen's and TRL's users write them:
    ``{"type": "image", "image": PATH}``, the second image of a record as an ``image_url`` with a
    ``file://`` URL."""
    images = record.get("images") or ([record["image"]] if "image" in record else [])
    roles = {"human": "user", "gpt": "assistant"}
    turns = []
    for turn in record["conversations"]:
        text = turn["value"]
        parts = []
        while "<image>\n" in text:
            text = text.replace("<image>\n", "", 1)
            k = len([p for t in turns for p in t["content"] if p["type"] != "text"]) + len(parts)
            parts.append({"type": "image", "image": images[k]} if k == 0 else
                         {"type": "image_url", "image_url": {"url": "file://" + str(folder / images[k])}})
        turns.append({"role": roles[turn["from"]], "content": parts + [{"type": "text", "text": text}]})
    return {"messages": turns}


def test_inline_media_give_the_same_samples(world):
    path = fx.write_jsonl(str(world["root"] / "inline.jsonl"), [_inline_style(r, world["root"]) for r in world["records"]])
    inline, llava = data.open_dataset(path), data.open_dataset(world["jsonl"])
    assert inline[2].media == llava[2].media  # relative and file:// paths resolve alike
    for i in range(6):
        _same(world["proc"](llava[i]), world["proc"](inline[i]))
    video = {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": "clip.mp4"},
                                                       {"type": "audio", "audio": "file:///data/a%20b.wav"}]},
                          {"role": "assistant", "content": "w1"}]}
    record = data.parse_record(video, "v.jsonl:1", ["/data"])
    assert record.media == {"video": ["/data/clip.mp4"], "audio": ["/data/a b.wav"]}
    assert record.messages[0]["content"] == [{"type": "video"}, {"type": "audio"}]


def _bad(world, name, lines):
    path = world["root"] / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


GOOD = json.dumps({"conversations": [{"from": "human", "value": "w1"}, {"from": "gpt", "value": "w2"}]})

OPEN_CASES = {
    "json": ("{not json", "not valid JSON"),
    "missing": (json.dumps({"image": "nowhere.png", "conversations": [{"from": "human", "value": "<image>"},
                                                                      {"from": "gpt", "value": "w1"}]}),
                "image file '.*nowhere.png' does not exist"),
    "more_tags": (json.dumps({"image": "img1_0.png", "conversations": [{"from": "human", "value": "<image><image>"},
                                                                       {"from": "gpt", "value": "w1"}]}),
                  "2 <image> tag\\(s\\) in the turns but 1 image"),
    "fewer_tags": (json.dumps({"images": ["img1_0.png", "img2_0.png"], "conversations": [
        {"from": "human", "value": "<image> w1"}, {"from": "gpt", "value": "w1"}]}), "1 <image> tag\\(s\\) in the turns but 2 image"),
    "role": (json.dumps({"conversations": [{"from": "robot", "value": "w1"}, {"from": "gpt", "value": "w1"}]}), "turn 0: role .robot."),
    "no_reply": (json.dumps({"conversations": [{"from": "human", "value": "w1"}]}), "no assistant turn"),
    "inline_and_list": (json.dumps({"images": ["img1_0.png"], "messages": [
        {"role": "user", "content": [{"type": "image", "image": "img2_0.png"}]}, {"role": "assistant", "content": "w1"}]}),
        "turn 0 holds its image inline and the record has a top-level 'images' list: give the media one way"),
    "inline_and_tag": (json.dumps({"messages": [
        {"role": "user", "content": [{"type": "image", "image": "img2_0.png"}, {"type": "text", "text": "<image> w2"}]},
        {"role": "assistant", "content": "w1"}]}), "turn 0 has an image slot without a file .* give the media one way"),
    "remote_url": (json.dumps({"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.org/a.png"}}]},
        {"role": "assistant", "content": "w1"}]}), "turn 0: 'https://example.org/a.png' is a URL, not a local file"),
}


@pytest.mark.parametrize("case", sorted(OPEN_CASES))
def test_bad_record_found_when_opened(world, case, caplog):
    line, problem = OPEN_CASES[case]
    path = _bad(world, f"bad_{case}.jsonl", [GOOD, GOOD, line, GOOD])
    with pytest.raises(data.DataError, match=f"^{path}:3: {problem}"):
        data.open_dataset(path)
    with caplog.at_level(logging.WARNING, logger="ppmedia.data"):
        ds = data.open_dataset(path, skip_bad_samples=True)
    assert len(ds) == 3 and [w for w, _ in ds.skipped] == [f"{path}:3"]
    assert [r.message for r in caplog.records if f"{path}:3" in r.message] and len(caplog.records) == 1


RECORD = {"conversations": [{"from": "human", "value": "caf\u00e9 w1"}, {"from": "gpt", "value": "w2"}]}
TEXT = json.dumps(RECORD, ensure_ascii=False)

ENCODINGS = {  # file name, its bytes, the error
    "latin1_line": ("latin1.jsonl", (TEXT + "\n" + TEXT + "\n").encode() + TEXT.encode("latin-1") + b"\n",
                    ":3: not UTF-8: byte 0xe9 at column 51 \\(Latin-1 or another 8-bit encoding\\?\\); JSON and "
                    "JSON Lines files must be UTF-8"),
    "utf16": ("utf16.jsonl", (TEXT + "\n").encode("utf-16"), ":1: UTF-16 text \\(byte-order mark ff fe\\); JSON and "
              "JSON Lines files must be UTF-8"),
    "utf16_no_mark": ("utf16.json", ("[" + TEXT + "]").encode("utf-16-be"), ":1: NUL bytes \\(UTF-16 or UTF-32 text\\?\\)"),
    "latin1_list": ("latin1.json", ("[\n" + TEXT + ",\n" + TEXT + "\n]").encode("latin-1"), ":2: not UTF-8: byte 0xe9"),
}


@pytest.mark.parametrize("case", sorted(ENCODINGS))
def test_text_that_is_not_utf8_is_one_error_naming_file_and_line(world, case):
    name, raw, problem = ENCODINGS[case]
    path = world["root"] / name
    path.write_bytes(raw)
    with pytest.raises(data.DataError, match=f"^{path}{problem}"):
        data.open_dataset(str(path))
    if case == "latin1_line":  # one bad line of JSON Lines is one bad record: skipped like one
        ds = data.open_dataset(str(path), skip_bad_samples=True)
        assert len(ds) == 2 and [w for w, _ in ds.skipped] == [f"{path}:3"]


def test_a_utf8_byte_order_mark_is_read(world):
    path = world["root"] / "bom.jsonl"
    path.write_bytes(("\ufeff" + TEXT + "\n" + TEXT + "\n").encode())
    ds = data.open_dataset(str(path))
    assert len(ds) == 2 and ds[0].messages[0]["content"] == [{"type": "text", "text": "caf\u00e9 w1"}]


def _undecodable(world):
    (world["root"] / "broken.png").write_bytes(b"not a png at all")
    return json.dumps({"image": "broken.png", "conversations": [{"from": "human", "value": "<image>"},
                                                                {"from": "gpt", "value": "w1"}]})


PROCESS_CASES = {
    "undecodable": (_undecodable, "image '.*broken.png' cannot be read"),
    "template_refuses": (lambda world: json.dumps({"conversations": [
        {"from": "human", "value": "w1"}, {"from": "system", "value": "w2"}, {"from": "gpt", "value": "w3"}]}),
        "the chat template refuses this record .*a system turn must come first"),
}


@pytest.mark.parametrize("case", sorted(PROCESS_CASES))
def test_bad_record_found_when_processed(world, case, caplog):
    make, problem = PROCESS_CASES[case]
    path = _bad(world, f"bad_{case}.jsonl", [GOOD, make(world), GOOD, GOOD])
    ds = data.open_dataset(path)  # cheap checks pass: the file exists, the turns parse
    for workers in (0, 1):  # a worker process re-raises the same error
        loader = data.ReplicaLoader(ds, world["proc"], global_batch_size=2, shuffle=False, workers=workers)
        with pytest.raises(data.DataError, match=f"{path}:2: {problem}"):
            list(loader)
    loader = data.ReplicaLoader(ds, world["proc"], global_batch_size=2, shuffle=False, skip_bad_samples=True)
    with caplog.at_level(logging.WARNING, logger="ppmedia.data"):
        batches = list(loader) + list(loader)  # two epochs: counted twice, named once
    assert [b["n_samples"] for b in batches] == [1, 2, 1, 2]
    assert batches[0]["sample_names"] == [f"{path}:1", None] and batches[0]["input_ids"].shape[0] == 2
    assert [b["skipped"] for b in batches] == [1, 1, 2, 2]
    named = [r.message for r in caplog.records if f"{path}:2" in r.message]
    assert len(named) == 1 and "skipped" in named[0]


def test_audio_read_with_soundfile_at_the_extractors_rate(world):
    import numpy as np
    import soundfile

    from ppmedia.testing.processors import processor_call_kwargs, save_tiny_processor

    processor = fx.AutoProcessor_from(str(save_tiny_processor("qwen2_5_omni", world["root"] / "omni")))
    assert processor.feature_extractor.sampling_rate == 16000
    clip = np.random.default_rng(0).standard_normal(8000).astype(np.float32) * 0.1
    soundfile.write(str(world["root"] / "clip.wav"), clip, 8000)  # 1 s at 8 kHz: resampled to 16 kHz
    (world["root"] / "noise.wav").write_bytes(b"RIFF but not a wav")
    lines = [json.dumps({"audio": name, "conversations": [{"from": "human", "value": "<audio> w1"}, {"from": "gpt", "value": "w2"}]})
             for name in ("clip.wav", "noise.wav")]
    ds = data.open_dataset(_bad(world, "audio.jsonl", lines))
    proc = data.SampleProcessor(processor, processor_kwargs=processor_call_kwargs("qwen2_5_omni"))
    sample = proc(ds[0])
    # Whisper features: one frame per 160 samples at 16 kHz -> 100 frames of 1 s (of the 3000 padded)
    assert sample["input_features"].shape == (1, 128, 3000) and int(sample["feature_attention_mask"].sum()) == 100
    with pytest.raises(data.DataError, match="audio.jsonl:2: audio '.*noise.wav' cannot be read"):
        proc(ds[1])
