"""Packing benchmark (``python tests/bench/run.py --pack``): packed rows against padded ones, one run.

On a generated length-skewed dataset (``ppmedia.testing.datasets.write_length_skewed_dataset``: question
lengths log-normal, 40% text-only records, the others one or two images of 4 to 16 tokens) and the
tiny Qwen2.5-VL with a wider language model (hidden 256, 4 layers) saved with its real processor, the same loader (``ppmedia.data.ReplicaLoader``,
``--max-length`` rows, no shuffle) one epoch padded and one epoch packed (``data.Packing``):

* **padding fraction**: pad positions / all token positions of the epoch's rows, each arm;
  ``P`` = packed / padded;
* **label tokens per second**: the epoch's label tokens (the same in both arms: the same samples in
  every step) over the summed times of its ``pipeline.train_step`` calls (pp=1 x dp=1, one process,
  1F1B with 2 microbatches, AdamW), median over the repetitions, the arms interleaved repetition by
  repetition; ``R`` = packed / padded.

Goals (issue 26): ``P <= 0.15``, ``R >= 1.5``.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

import torch

N_RECORDS, BATCH, MAX_LENGTH, MICROBATCHES = 128, 32, 256, 2
GOAL_P, GOAL_R = 0.15, 1.5
TEXT_HIDDEN = 256


def _checkpoint(folder: str) -> str:
    """The tiny Qwen2.5-VL (its vision tower and processor) with a wider language model, so that the
    step's time follows its token positions rather than per-operation overheads: text hidden 256,
    4 layers, 4 heads, MLP 1024."""
    return wide_checkpoint(folder, TEXT_HIDDEN, 4)


def wide_checkpoint(folder: str, hidden: int, layers: int, heads: tuple[int, int] | None = None,
                    max_length: int = MAX_LENGTH) -> str:
    """``folder/ckpt``: the tiny Qwen2.5-VL's vision tower and processor with a language model of
    ``hidden`` x ``layers`` (MLP 4 x hidden; ``heads``: attention and key-value heads, else the tiny
    model's; positions for 2 x ``max_length``), seeded; the benches' model whose compute dominates on 2 cores."""
    import transformers

    from ppmedia.testing.processors import save_tiny_processor
    from ppmedia.testing.tiny_models import qwen2_5_vl

    config = qwen2_5_vl.build_config()
    text = config.text_config
    text.hidden_size, text.intermediate_size, text.num_hidden_layers = hidden, 4 * hidden, layers
    if heads is not None:
        text.num_attention_heads, text.num_key_value_heads = heads
    text.layer_types = ["full_attention"] * layers
    text.max_position_embeddings = 2 * max_length
    text.rope_parameters = dict(text.rope_parameters, mrope_section=[8, 12, 12])  # head_dim 64 / 2
    config.vision_config.out_hidden_size = hidden
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    path = os.path.join(folder, "ckpt")
    model.save_pretrained(path)
    save_tiny_processor("qwen2_5_vl", path)
    return path


def _dataset(folder: str) -> tuple[str, str]:
    import transformers

    from ppmedia.testing.datasets import write_length_skewed_dataset
    from ppmedia.testing.word_tokenizer import text_words

    checkpoint = _checkpoint(folder)
    words = text_words(transformers.AutoProcessor.from_pretrained(checkpoint).tokenizer)
    path = write_length_skewed_dataset(os.path.join(folder, "data"), N_RECORDS, words=words, max_words=MAX_LENGTH // 2)
    return str(checkpoint), str(path)


def _parts(checkpoint: str, packed: bool) -> Any:
    from ppmedia import packing, pipeline

    modules = pipeline.stages_from_pretrained(checkpoint, 1)
    pipeline.train_mode(modules)
    if packed:
        packing.enable_packing(modules)
    stages = pipeline.make_pipeline_stages(modules, 1, [0], "cpu")
    return pipeline.PipelineParts(pipeline.build_schedule("1f1b", stages, MICROBATCHES), stages[0], modules,
                                  pipeline.stage_adamw(modules, 1e-3, 0.01), list(modules[0].tied))


def _shares(checkpoint: str, path: str, parts: Any, packed: bool) -> list[Any]:
    import transformers

    from ppmedia import data, pipeline

    processor = data.SampleProcessor(transformers.AutoProcessor.from_pretrained(checkpoint), max_length=MAX_LENGTH,
                                     config=parts.modules[0].config)
    loader = data.ReplicaLoader(data.open_dataset(path), processor, global_batch_size=BATCH, shuffle=False,
                                adapter=parts.modules[0].adapter,
                                packing=data.Packing(MAX_LENGTH, MICROBATCHES) if packed else None)
    shares = list(pipeline.loader_shares(loader, parts.modules[0].config, parts.modules[0].adapter, MICROBATCHES,
                                         stages_media=True, epochs=1))
    if loader.skipped:
        raise RuntimeError(f"pack bench: {loader.skipped} samples skipped; the dataset must fit max_length={MAX_LENGTH}")
    return shares


def _epoch_time(parts: Any, shares: list[Any]) -> float:
    from ppmedia import pipeline

    total = 0.0
    for share in shares:
        start = time.perf_counter()
        pipeline.train_step(parts, share)
        total += time.perf_counter() - start
    return total


def run(repeats: int = 5) -> dict[str, Any]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        checkpoint, path = _dataset(folder)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            arms = {}
            for name in ("padded", "packed"):
                parts = _parts(checkpoint, name == "packed")
                shares = _shares(checkpoint, path, parts, name == "packed")
                _epoch_time(parts, shares[:1])  # shape inference and first-touch costs out of the timing
                arms[name] = {"parts": parts, "shares": shares, "times": []}
            for _ in range(repeats):
                for arm in arms.values():
                    arm["times"].append(_epoch_time(arm["parts"], arm["shares"]))
        finally:
            dist.destroy_process_group()
    result: dict[str, Any] = {"records": N_RECORDS, "batch": BATCH, "max_length": MAX_LENGTH, "repeats": repeats}
    for name, arm in arms.items():
        shares = arm["shares"]
        pads, positions = sum(s.pad_positions for s in shares), sum(s.positions for s in shares)
        tokens = sum(s.num_valid_tokens for s in shares)
        result[name] = {"steps": len(shares), "rows": sum(int(s.input_ids.shape[0]) for s in shares),
                        "positions": positions, "padding_fraction": pads / positions, "label_tokens": tokens,
                        "epoch_s": statistics.median(arm["times"]),
                        "label_tokens_per_s": tokens / statistics.median(arm["times"])}
    if result["packed"]["label_tokens"] != result["padded"]["label_tokens"]:
        raise RuntimeError(f"pack bench: the arms train different label tokens: {result['packed']['label_tokens']} "
                           f"packed, {result['padded']['label_tokens']} padded")
    padded, packed = result["padded"], result["packed"]
    result["P"] = packed["padding_fraction"] / padded["padding_fraction"]
    ratios = [b / a for a, b in zip(arms["packed"]["times"], arms["padded"]["times"])]
    result["R"] = statistics.median(ratios)
    return result


def report(result: dict[str, Any]) -> str:
    padded, packed = result["padded"], result["packed"]
    return "\n".join([
        f"pack: padding fraction packed / padded = {result['P']:.3f} ({packed['padding_fraction']:.3f} packed in "
        f"{packed['rows']} rows, {padded['padding_fraction']:.3f} padded in {padded['rows']} rows; goal P <= {GOAL_P})",
        f"pack: label tokens per second packed / padded = {result['R']:.2f} ({packed['label_tokens_per_s']:.0f} "
        f"against {padded['label_tokens_per_s']:.0f}; {padded['label_tokens']} label tokens in {padded['steps']} steps "
        f"of {result['batch']} samples, rows of at most {result['max_length']} tokens, tiny Qwen2.5-VL vision, text hidden {TEXT_HIDDEN} x 4 layers, pp=1, "
        f"{MICROBATCHES} microbatches, one thread; goal R >= {GOAL_R})",
    ])
