"""End-to-end step time against the floor (``python tests/bench/run.py --e2e``, issue 42).

The floor is the model's own training loop, written here from transformers alone: the checkpoint's
processor (``AutoProcessor``) on each microbatch of 2 records (its chat template, the images read with
PIL, padding to the microbatch's longest row), the model's ``forward`` with its own loss summed over the
global batch's label tokens (``num_items_in_batch``: a token mean over the global batch), ``backward``
per microbatch, ``AdamW``; one process, one thread. Against it ``examples/train.py`` (torchrun) at pp1 and
pp2, its defaults and ``--pack``, on the same checkpoint, data, global batch (8 samples as 4 microbatches)
and ``--max-length``. Every arm trains 2 epochs; its figure is the mean step time of the second epoch
(every arm sees the same samples in an epoch, whatever its order; the first epoch holds start-up and
first-touch costs). Rounds run every arm once, in a rotating order; ratios are medians of per-round
ratios.

The model: the tiny Qwen2.5-VL's vision tower and processor with a 31M-parameter language model (hidden
512, 8 layers, as the issue's table), so that compute dominates on 2 cores. The data: ``ppmedia.testing.
datasets.write_length_skewed_dataset`` (log-normal question lengths, 40% text-only, the others one or two
images of several sizes).

Printed: ``e2e: train.py --pp 1 step / the model's own loop = R1`` and ``e2e-pp2: train.py --pp 2 step /
the model's own loop = R2 (ideal I)`` with each arm's padding fraction; ``I = (m + pp - 1) / (m * pp)`` is
1F1B's ideal share of one process's time with ``m`` microbatches. Goals: ``R1 <= 1.05``, ``R2 <= 1.10 x I``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
BATCH, MICROBATCHES, MAX_LENGTH = 8, 4, 256
HIDDEN, LAYERS = 512, 8
GOAL_R1, GOAL_R2 = 1.05, 1.10
#: the arms, in the order of the first round: (name, train.py options or None for the model's own loop)
ARMS: tuple[tuple[str, list[str] | None], ...] = (
    ("own", None),
    ("pp1", ["--pp", "1"]),
    ("pp1-pack", ["--pp", "1", "--pack"]),
    ("pp2", ["--pp", "2"]),
    ("pp2-pack", ["--pp", "2", "--pack"]),
)


def ideal(pp: int, microbatches: int = MICROBATCHES) -> float:
    """1F1B's ideal step time over one process's: ``(m + pp - 1) / (m * pp)``."""
    return (microbatches + pp - 1) / (microbatches * pp)


def _checkpoint(folder: str) -> str:
    """The issue's model: the tiny Qwen2.5-VL's tower and processor, a 31M-parameter language model."""
    from pack_bench import wide_checkpoint

    return wide_checkpoint(folder, HIDDEN, LAYERS, heads=(8, 4), max_length=MAX_LENGTH)


def prepare(folder: str, records: int) -> tuple[str, str]:
    """The checkpoint and a length-skewed dataset of ``records`` records under ``folder``."""
    import transformers

    from ppmedia.testing.datasets import write_length_skewed_dataset
    from ppmedia.testing.word_tokenizer import text_words

    checkpoint = _checkpoint(folder)
    words = text_words(transformers.AutoProcessor.from_pretrained(checkpoint).tokenizer)
    path = write_length_skewed_dataset(os.path.join(folder, "data"), records, words=words, max_words=MAX_LENGTH // 2)
    return checkpoint, str(path)


# -- the model's own loop (transformers alone) ----------------------------------------------------------------

def _messages(record: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """A LLaVA-style record as the chat template's messages, and its image files."""
    messages = []
    for turn in record["conversations"]:
        role = "user" if turn["from"] == "human" else "assistant"
        text = turn["value"]
        content: list[dict[str, Any]] = [{"type": "image"} for _ in range(text.count("<image>"))]
        content.append({"type": "text", "text": text.replace("<image>\n", "").replace("<image>", "")})
        messages.append({"role": role, "content": content})
    return messages, list(record.get("images", []))


def own_loop(checkpoint: str, data: str, epochs: int) -> dict[str, Any]:
    """The model's own loop, in this process (one thread): per step its seconds, per epoch."""
    import transformers
    from PIL import Image

    torch.set_num_threads(1)
    processor = transformers.AutoProcessor.from_pretrained(checkpoint)
    model = transformers.AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    records = [json.loads(line) for line in Path(data).read_text().splitlines() if line.strip()]
    folder, pad_id = Path(data).parent, processor.tokenizer.pad_token_id
    image_id = model.config.image_token_id
    step_s: list[list[float]] = []
    pads = positions = 0
    for _ in range(epochs):
        times = []
        for first in range(0, len(records) - BATCH + 1, BATCH):
            start = time.perf_counter()
            micro = []
            per = BATCH // MICROBATCHES
            for k in range(first, first + BATCH, per):
                chats, images = [], []
                for record in records[k : k + per]:
                    messages, files = _messages(record)
                    chats.append(processor.apply_chat_template(messages, tokenize=False))
                    images += [Image.open(folder / name).convert("RGB") for name in files]
                inputs = processor(text=chats, images=images or None, padding=True, return_tensors="pt")
                labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
                labels = labels.masked_fill(labels == image_id, -100)
                micro.append((inputs, labels))
                pads += int((inputs["attention_mask"] == 0).sum())
                positions += int(inputs["attention_mask"].numel())
            tokens = sum(int((labels[:, 1:] != -100).sum()) for _, labels in micro)
            for inputs, labels in micro:
                out = model(**inputs, labels=labels, num_items_in_batch=torch.tensor(tokens), use_cache=False)
                out.loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
        step_s.append(times)
    return {"step_s": step_s, "padding_fraction": pads / positions if positions else 0.0}


# -- examples/train.py ---------------------------------------------------------------------------------------

def _train_py(checkpoint: str, data: str, options: list[str], folder: str, epochs: int) -> dict[str, Any]:
    log = os.path.join(folder, "loss.jsonl")
    if os.path.exists(log):
        os.remove(log)
    pp = int(options[options.index("--pp") + 1])
    command = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", str(pp),
               str(REPO / "examples" / "train.py"), "--model", checkpoint, "--data", data, "--batch-size", str(BATCH),
               "--microbatches", str(MICROBATCHES), "--max-length", str(MAX_LENGTH), "--epochs", str(epochs),
               "--loss-log", log, *options]
    done = subprocess.run(command, capture_output=True, text=True, cwd=folder)
    if done.returncode != 0:
        raise RuntimeError(f"e2e bench: {' '.join(options)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    rows = [json.loads(line) for line in Path(log).read_text().splitlines() if line.strip()]
    per_epoch = len(rows) // epochs
    step_s = [[r["step_time_s"] for r in rows[e * per_epoch : (e + 1) * per_epoch]] for e in range(epochs)]
    pads = statistics.fmean(r["padding_fraction"] for r in rows)
    return {"step_s": step_s, "padding_fraction": pads, "samples": sum(r["samples"] for r in rows)}


def _own(checkpoint: str, data: str, folder: str, epochs: int) -> dict[str, Any]:
    """The model's own loop in a fresh process (as train.py's arms start fresh)."""
    out = os.path.join(folder, "own.json")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, __file__, "own", checkpoint, data, str(epochs), out],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"e2e bench: the model's own loop failed:\n{done.stderr[-4000:]}")
    return dict(json.loads(Path(out).read_text()))


def run(rounds: int = 2, records: int = 96, epochs: int = 2) -> dict[str, Any]:
    """Every arm ``rounds`` times, in a rotating order; per arm its rounds' second-epoch mean step."""
    with tempfile.TemporaryDirectory(prefix="e2e-bench-") as folder:
        checkpoint, data = prepare(folder, records)
        results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in ARMS}
        for r in range(rounds):
            order = ARMS[r % len(ARMS):] + ARMS[: r % len(ARMS)]
            for name, options in order:
                arm = _own(checkpoint, data, folder, epochs) if options is None else \
                    _train_py(checkpoint, data, options, folder, epochs)
                arm["mean_step_s"] = statistics.fmean(arm["step_s"][-1])
                results[name].append(arm)
    out: dict[str, Any] = {"records": records, "batch": BATCH, "microbatches": MICROBATCHES, "max_length": MAX_LENGTH,
                           "hidden": HIDDEN, "layers": LAYERS, "rounds": rounds, "epochs": epochs,
                           "load_before": os.getloadavg()[0], "arms": {}}
    for name, arms in results.items():
        ratios = [a["mean_step_s"] / own["mean_step_s"] for a, own in zip(arms, results["own"])]
        out["arms"][name] = {"mean_step_s": [a["mean_step_s"] for a in arms], "ratio": statistics.median(ratios),
                             "padding_fraction": arms[0]["padding_fraction"]}
    out["R1"], out["R2"], out["I"] = out["arms"]["pp1"]["ratio"], out["arms"]["pp2"]["ratio"], ideal(2)
    out["load_after"] = os.getloadavg()[0]
    return out


def report(result: dict[str, Any]) -> str:
    arms = result["arms"]
    pad = {name: f"padding {arm['padding_fraction']:.3f}" for name, arm in arms.items()}
    lines = [
        f"e2e: train.py --pp 1 step / the model's own loop = {result['R1']:.2f} ({pad['pp1']}; own loop {pad['own']}; "
        f"goal <= {GOAL_R1})",
        f"e2e-pp2: train.py --pp 2 step / the model's own loop = {result['R2']:.2f} (ideal {result['I']:.3f}; "
        f"{pad['pp2']}; goal <= {GOAL_R2} x ideal = {GOAL_R2 * result['I']:.3f})",
    ]
    for name, arm in arms.items():
        steps = ", ".join(f"{s * 1e3:.0f}" for s in arm["mean_step_s"])
        lines.append(f"  {name:9s} step ms per round [{steps}]  / own loop {arm['ratio']:.2f}  {pad[name]}")
    lines.append(f"  ({result['records']} records, global batch {result['batch']} as {result['microbatches']} "
                 f"microbatches, --max-length {result['max_length']}, Qwen2.5-VL text hidden {result['hidden']} x "
                 f"{result['layers']} layers, epoch {result['epochs']} of each arm timed, {result['rounds']} rounds; "
                 f"load {result['load_before']:.2f} before, {result['load_after']:.2f} after)")
    return "\n".join(lines)


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "own":
    result = own_loop(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    Path(sys.argv[5]).write_text(json.dumps(result))
