"""docs/audio-families.md against the code: every Python block runs, self-contained, and the tables
name the real chunk fields, staged attributes, batch keys and adapters."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

import ppmedia

DOC = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "audio-families.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", DOC, flags=re.S)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_python_blocks_run(index):
    exec(compile(BLOCKS[index], f"docs/audio-families.md block {index}", "exec"), {})


def test_there_are_blocks_and_the_tables_name_real_things():
    assert len(BLOCKS) == 3
    for field in ("input_features", "input_features_mask", "video_position_ids", "num_frames_per_video"):
        assert f"| `{field}` | `{ppmedia.STAGED_ATTRIBUTES[field]}` |" in DOC
    for key in ("input_features", "audio_input_ids", "input_features_mask", "feature_attention_mask",
                "audio_input_ids_mask", "n_audios_per_sample", "video_second_per_grid", "num_frames_per_video"):
        assert key in ppmedia.MEDIA_KEYS and f"`{key}`" in DOC, key
    for name in ("gemma4", "qwen2_5_omni", "qwen3_omni", "inkling"):
        assert f"`{name}`" in DOC and ppmedia.get_adapter(name).name == name
