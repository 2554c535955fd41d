"""Load memory: one rank's last stage of 4 from a checkpoint vs ``from_pretrained`` of the whole model.

A mid-size Qwen2.5-VL checkpoint (real-width layers: text hidden 1024, 8 decoder layers, vocab 32000;
vision tower 8 blocks of hidden 1024; about 280M parameters, 1.1 GB in float32) is written with
``save_pretrained`` (200 MB shards: 7 files) to a temporary directory. Each measurement runs in a
FRESH process: import torch, transformers, ppmedia and the model class (its modeling module alone is
about 90 MB), reset the peak RSS (``/proc/self/clear_refs`` ``5``), take the RSS as the baseline,
load, read every loaded tensor once (safetensors maps the files: a tensor's pages become resident when
read, as training reads them), read the peak (``VmHWM``). The sides alternate, repetition by
repetition; the ratio is of the medians:

    R = peak RSS over baseline of stages_from_pretrained(path, 4, stages=[3])
        / peak RSS over baseline of from_pretrained(path)

The last stage holds 2 decoder layers, the final norm and ``lm_head`` (about a quarter of the
weights); the issue's goal is R <= 0.35.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

TARGET_RATIO = 0.35
N_STAGES = 4

_MEASURE = r"""
import json, re, sys
import torch, transformers
import ppmedia.pipeline.pretrained
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
torch.set_num_threads(1)
model_class = transformers.Qwen2_5_VLForConditionalGeneration  # the class and its modeling module, imported

def status(key):
    return int(re.search(key + r":\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024

path, side, n_stages = sys.argv[1], sys.argv[2], int(sys.argv[3])
open("/proc/self/clear_refs", "w").write("5")  # the peak RSS restarts at the current RSS
baseline = status("VmRSS")
if side == "full":
    loaded = [model_class.from_pretrained(path)]
else:
    loaded = ppmedia.pipeline.stages_from_pretrained(path, n_stages, stages=[n_stages - 1])
as_loaded = status("VmHWM") - baseline
with torch.no_grad():  # read every tensor once, as training does: memory-mapped pages become resident
    for m in loaded:
        for t in [*m.parameters(), *m.buffers()]:
            t.sum()
params = sum(p.numel() for m in loaded for p in m.parameters())
print(json.dumps({"side": side, "peak_over_baseline": status("VmHWM") - baseline, "as_loaded": as_loaded,
                  "baseline": baseline, "parameters": params}))
"""


def build_checkpoint(directory: str) -> dict[str, Any]:
    """Write the mid-size checkpoint; returns its shape and size."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    config = transformers.Qwen2_5_VLConfig(
        text_config={
            "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
            "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
            "tie_word_embeddings": False,
        },
        vision_config={
            "depth": 8, "hidden_size": 1024, "intermediate_size": 2816, "num_heads": 16, "patch_size": 14,
            "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 112, "out_hidden_size": 1024,
            "fullatt_block_indexes": [3, 7],
        },
        image_token_id=31990, video_token_id=31991, vision_start_token_id=31992, vision_end_token_id=31993,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    model.to_empty(device="cpu")  # then seeded values, much faster than the model's own init
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=generator)
    model.save_pretrained(directory, max_shard_size="200MB")
    files = [f for f in os.listdir(directory) if f.endswith(".safetensors")]
    size = sum(os.path.getsize(os.path.join(directory, f)) for f in files)
    return {"parameters": sum(p.numel() for p in model.parameters()), "bytes": size, "files": len(files)}


def _measure(path: str, side: str) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-c", _MEASURE, path, side, str(N_STAGES)], capture_output=True,
                            text=True, env=env, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"load-memory {side}: {result.stderr[-3000:]}")
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def run(repeats: int = 3) -> dict[str, Any]:
    """Both sides ``repeats`` times each, alternating, in fresh processes."""
    with tempfile.TemporaryDirectory(prefix="ppmedia-load-memory-") as directory:
        checkpoint = build_checkpoint(directory)
        rows = []
        for _ in range(repeats):
            for side in ("full", "stage"):
                rows.append(_measure(directory, side))
    peaks = {side: [r["peak_over_baseline"] for r in rows if r["side"] == side] for side in ("full", "stage")}
    medians = {side: statistics.median(values) for side, values in peaks.items()}
    ratio = medians["stage"] / medians["full"]
    return {
        "checkpoint": checkpoint,
        "n_stages": N_STAGES,
        "stage_parameters": next(r["parameters"] for r in rows if r["side"] == "stage"),
        "peaks_bytes": peaks,
        "median_peak_bytes": medians,
        "ratio": ratio,
        "target": TARGET_RATIO,
        "met": ratio <= TARGET_RATIO,
    }


def report(result: dict[str, Any]) -> str:
    mb = 1024 * 1024
    ck = result["checkpoint"]
    lines = [
        f"7. load memory: a {ck['parameters'] / 1e6:.0f}M-parameter Qwen2.5-VL checkpoint ({ck['bytes'] / mb:.0f} MB in "
        f"{ck['files']} files), fresh processes, peak RSS over the post-import baseline (median of "
        f"{len(result['peaks_bytes']['full'])})",
        f"   from_pretrained, whole model:           {result['median_peak_bytes']['full'] / mb:8.1f} MB",
        f"   stages_from_pretrained, stage 4 of 4:   {result['median_peak_bytes']['stage'] / mb:8.1f} MB "
        f"({result['stage_parameters'] / 1e6:.0f}M parameters)",
        f"load-memory: last of {result['n_stages']} stages, peak RSS over baseline / from_pretrained of the whole "
        f"model = {result['ratio']:.3f} (goal <= {result['target']})",
    ]
    return "\n".join(lines)
