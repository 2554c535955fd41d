"""docs/audio-families.md against the code: the tables name the real chunk fields, staged attributes,
batch keys and adapters (its Python blocks are run by tests/test_docs.py, as every page's)."""

from __future__ import annotations

import pathlib
import re

import ppmedia

DOC = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "audio-families.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", DOC, flags=re.S)


def test_there_are_blocks_and_the_tables_name_real_things():
    assert len(BLOCKS) == 3
    for field in ("input_features", "input_features_mask", "video_position_ids", "num_frames_per_video"):
        assert f"| `{field}` | `{ppmedia.STAGED_ATTRIBUTES[field]}` |" in DOC
    for key in ("input_features", "audio_input_ids", "input_features_mask", "feature_attention_mask",
                "audio_input_ids_mask", "n_audios_per_sample", "video_second_per_grid", "num_frames_per_video"):
        assert key in ppmedia.MEDIA_KEYS and f"`{key}`" in DOC, key
    for name in ("gemma4", "qwen2_5_omni", "qwen3_omni", "inkling"):
        assert f"`{name}`" in DOC and ppmedia.get_adapter(name).name == name
