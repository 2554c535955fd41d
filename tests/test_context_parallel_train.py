"""examples/train.py --cp 2 on a real checkpoint and data file (torchrun, 4 processes: pp2 x cp2).

One run at lr 1e-2 over 3 steps: its step-0 loss is the model's own loss at the initial weights (the lr-0
check), and steps 1 and 2 follow the model's own single-process AdamW within 1e-4; its DCP checkpoint
then resumes WITHOUT --cp (pp2, 2 processes) for a 4th step that follows the same reference. Weight
decay 0 and no clipping, so the reference is plain ``torch.optim.AdamW``. The options refused with
--cp, and a family that cannot shard, exit 2 before anything starts.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from ppmedia import data
from ppmedia.testing.datasets import save_tiny_checkpoint, write_image_chat_dataset

ROOT = pathlib.Path(__file__).resolve().parents[1]
TORCHRUN = pathlib.Path(sys.executable).with_name("torchrun")
N, B, MAX_LENGTH, LR = 16, 4, 64, 1e-2
COMMON = ["--batch-size", str(B), "--max-length", str(MAX_LENGTH), "--lr", str(LR), "--weight-decay", "0",
          "--max-grad-norm", "1e9", "--no-shuffle", "--steps"]


def _torchrun(nproc: int, *args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc), str(ROOT / "examples" / "train.py"), *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout + result.stderr


def _rows(path: pathlib.Path) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, path.read_text().splitlines())}


def _reference(checkpoint: pathlib.Path, jsonl: pathlib.Path, steps: int) -> list[float]:
    """The model's own losses under its own AdamW (one process, the same batches in order)."""
    import transformers
    from train_helpers import model_loss

    torch.set_num_threads(1)
    model = transformers.AutoModelForImageTextToText.from_pretrained(checkpoint).train()
    processor = data.SampleProcessor(transformers.AutoProcessor.from_pretrained(checkpoint), max_length=MAX_LENGTH,
                                     config=model.config)
    loader = data.ReplicaLoader(data.open_dataset(str(jsonl)), processor, global_batch_size=B, dp_rank=0, dp_size=1,
                                seed=0, shuffle=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses: list[float] = []
    for batch in loader:
        if len(losses) == steps:
            break
        loss = model_loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.multiprocess
def test_pp2_cp2_trains_as_the_model_and_resumes_without_cp(tmp_path):
    checkpoint = save_tiny_checkpoint("qwen2_5_vl", tmp_path / "ckpt", max_shard_size="40KB")
    import transformers

    from ppmedia.testing.word_tokenizer import text_words

    words = text_words(transformers.AutoProcessor.from_pretrained(checkpoint).tokenizer)
    jsonl = write_image_chat_dataset(tmp_path / "data", N, words=words, seed=1)
    log, resumed = tmp_path / "cp.jsonl", tmp_path / "resumed.jsonl"
    model = ["--model", str(checkpoint), "--data", str(jsonl)]
    printed = _torchrun(4, *model, "--pp", "2", "--cp", "2", *COMMON, "3", "--loss-log", str(log),
                        "--save-dir", str(tmp_path / "runs"), "--save-every", "3")
    _torchrun(2, *model, "--pp", "2", *COMMON, "4", "--loss-log", str(resumed), "--resume", "auto",
              "--save-dir", str(tmp_path / "runs"), "--save-every", "4")
    reference = _reference(checkpoint, jsonl, 4)
    rows, more = _rows(log), _rows(resumed)
    assert abs(rows[0]["loss"] - reference[0]) <= 1e-5, (rows[0]["loss"], reference[0])  # the lr-0 check
    for step in (1, 2):
        assert abs(rows[step]["loss"] - reference[step]) <= 1e-4, (step, rows[step]["loss"], reference[step])
    assert sorted(more) == [3] and abs(more[3]["loss"] - reference[3]) <= 1e-4, (more, reference[3])
    # each cp rank of stage 0 reads its replica's share itself: ranks 0 and 1 (cp 0, 1 of stage 0)
    line = next(x for x in printed.splitlines() if x.startswith("media files opened per rank: "))
    assert "2: 0 (0 distinct)" in line and "3: 0 (0 distinct)" in line and "0: 0 " not in line, line


@pytest.mark.parametrize("extra, reason", [
    (["--fsdp", "--dp", "2"], "--fsdp with --cp 2: FSDP2 reduce-scatters over the dp mesh only"),
    (["--activation-checkpointing"], "--cp 2 with --activation-checkpointing: a layer recomputed"),
    (["--family", "gemma4"], "--cp 2: the decoder cannot be sharded: gemma4:"),
    (["--family", "qwen3_vl", "--cp-vision", "shard"], "--cp-vision shard: qwen3_vl keeps its vision tower replicated"),
])
def test_cp_refusals_exit_2_before_anything_starts(extra, reason, capsys):
    from ppmedia.train.options import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["--cp", "2", *extra])
    assert exc.value.code == 2
    assert reason in capsys.readouterr().err


def test_cp_vision_needs_cp(capsys):
    from ppmedia.train.options import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["--cp-vision", "shard"])
    assert exc.value.code == 2 and "--cp-vision shard places stage 0's vision tower" in capsys.readouterr().err


def test_frame_sharding_items_encode_alone_as_in_the_whole_chunk():
    """The per-family decision, the longest-first assignment, and Qwen2.5-VL's units (each image, each temporal
    patch of a video) encoded one by one give the whole chunk's features (one process, the real tower)."""
    from ppmedia import split_media
    from ppmedia.pipeline.cp_vision import VISION_SHARDING, assign_items, resolve_cp_vision
    from ppmedia.registry import get_adapter
    from ppmedia.testing import tiny_models

    assert assign_items([1.0, 5.0, 3.0, 3.0], 2) == [0, 0, 1, 1]  # 5 -> 0, 3 -> 1, 3 -> 1, 1 -> 0 (5 < 6)
    fam = tiny_models.load("qwen2_5_vl")
    model, batch = fam.build_model(seed=0), fam.build_batch(seed=0)
    adapter = get_adapter(model)
    assert resolve_cp_vision(adapter, None) == "shard"
    assert resolve_cp_vision(get_adapter(tiny_models.load("qwen3_vl").build_config()), None) == "replicate"
    temporal_patches = int(batch["video_grid_thw"][:, 0].sum())
    chunk = split_media(batch, 1, **adapter.media_counts(batch, model.config)).chunk(0)
    items_of, subchunk = VISION_SHARDING[adapter.name]
    items = items_of(adapter, chunk, model.config)
    assert sum(i.modality == "video" for i in items) == temporal_patches > 3
    with torch.no_grad():
        whole = adapter.encode(model, chunk, None)
        for modality in ("image", "video"):
            alone = [adapter.encode(model, subchunk(chunk, [i]), None)[modality] for i in items if i.modality == modality]
            assert torch.allclose(torch.cat(alone), whole[modality], atol=1e-6), modality
