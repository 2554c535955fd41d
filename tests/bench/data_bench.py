"""Data benchmark (``python tests/bench/run.py --data``): what ``ppmedia.data`` costs per rank.

On one generated dataset (the tiny Qwen2.5-VL saved with its real processor; 32 LLaVA-style records,
one PNG image each, ``ppmedia.testing.datasets``):

* **media files read per replica**: a replica at pp=2 (2 processes, gloo on 127.0.0.1, the loader's
  ``pp_group`` the pair, stage 0's rank reading) against the same replica at pp=1 (one process), over
  one epoch: every file open of ``ppmedia.data.media`` counted on every rank. ``R`` = files read by
  the pp=2 replica's ranks together / files read at pp=1; the goal is 1.00 (no rank reads what another
  of its replica reads);
* **loader samples/s** with 0 and 2 ``DataLoader`` workers (one epoch, median of the repetitions);
* **training step samples/s** on the same batches (pp=1 x dp=1, one process, 2 microbatches,
  ``pipeline.train_step`` with AdamW): next to the loader's, whether the loader keeps up.
"""

from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch

N_RECORDS, BATCH, MAX_LENGTH = 32, 4, 64


def _dataset(folder: str) -> tuple[str, str]:
    import transformers

    from ppmedia.testing.datasets import save_tiny_checkpoint, write_image_chat_dataset
    from ppmedia.testing.word_tokenizer import text_words

    checkpoint = save_tiny_checkpoint("qwen2_5_vl", os.path.join(folder, "ckpt"))
    words = text_words(transformers.AutoProcessor.from_pretrained(checkpoint).tokenizer)
    return str(checkpoint), str(write_image_chat_dataset(os.path.join(folder, "data"), N_RECORDS, words=words))


def _loader(checkpoint: str, path: str, **kwargs: Any) -> Any:
    import transformers

    from ppmedia import data

    processor = data.SampleProcessor(transformers.AutoProcessor.from_pretrained(checkpoint), max_length=MAX_LENGTH,
                                     config=transformers.AutoConfig.from_pretrained(checkpoint))
    return data.ReplicaLoader(data.open_dataset(path), processor, global_batch_size=BATCH, dp_rank=0, dp_size=1,
                              seed=0, shuffle=False, **kwargs)


def _reads_worker(rank: int, port: int, checkpoint: str, path: str, out: str) -> None:
    import torch.distributed as dist

    from ppmedia.data import media

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                           timeout=timedelta(seconds=60))
    try:
        loader = _loader(checkpoint, path, pp_group=dist.group.WORLD, reads_media=rank == 0)
        before = len(media.OPENED)
        batches = sum(1 for _ in loader)
        with open(f"{out}.{rank}", "w") as fh:
            fh.write(f"{len(media.OPENED) - before} {batches}\n")
    finally:
        dist.destroy_process_group()


def media_reads(checkpoint: str, path: str) -> dict[str, Any]:
    """Files opened per rank over one epoch at pp=2 (one replica), and in one process at pp=1."""
    import torch.multiprocessing as mp

    from ppmedia.data import media

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "reads")
        mp.spawn(_reads_worker, args=(port, checkpoint, path, out), nprocs=2, join=True)
        per_rank = [int(open(f"{out}.{r}").read().split()[0]) for r in range(2)]
    before = len(media.OPENED)
    sum(1 for _ in _loader(checkpoint, path))
    alone = len(media.OPENED) - before
    return {"pp2_per_rank": per_rank, "pp2": sum(per_rank), "pp1": alone,
            "R": sum(per_rank) / alone if alone else float("nan"), "goal": 1.0}


def loader_rate(checkpoint: str, path: str, workers: int, repeats: int) -> float:
    """Samples per second of one epoch of the loader (median over ``repeats`` epochs)."""
    times = []
    for _ in range(repeats):
        loader = _loader(checkpoint, path, workers=workers)
        start = time.perf_counter()
        n = sum(BATCH for _ in loader)
        times.append(time.perf_counter() - start)
    return n / statistics.median(times)


def step_rate(checkpoint: str, path: str, repeats: int) -> float:
    """Samples per second of ``pipeline.train_step`` on the loader's batches (pp=1 x dp=1)."""
    import torch.distributed as dist

    from ppmedia import pipeline

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        modules = pipeline.stages_from_pretrained(checkpoint, 1)
        pipeline.train_mode(modules)
        stages = pipeline.make_pipeline_stages(modules, 1, [0], "cpu")
        parts = pipeline.PipelineParts(pipeline.build_schedule("1f1b", stages, 2), stages[0], modules,
                                       pipeline.stage_adamw(modules, 1e-3, 0.01), list(modules[0].tied))
        loader = _loader(checkpoint, path, adapter=modules[0].adapter)
        shares = list(pipeline.loader_shares(loader, modules[0].config, modules[0].adapter, 2, stages_media=True,
                                             epochs=1))
        pipeline.train_step(parts, shares[0])  # the first step infers the shapes
        times = []
        for _ in range(repeats):
            for share in shares:
                start = time.perf_counter()
                pipeline.train_step(parts, share)
                times.append(time.perf_counter() - start)
        return BATCH / statistics.median(times)
    finally:
        dist.destroy_process_group()


def run(repeats: int = 5) -> dict[str, Any]:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        checkpoint, path = _dataset(folder)
        reads = media_reads(checkpoint, path)
        return {"records": N_RECORDS, "batch": BATCH, "reads": reads,
                "loader_samples_per_s": {str(w): loader_rate(checkpoint, path, w, repeats) for w in (0, 2)},
                "step_samples_per_s": step_rate(checkpoint, path, repeats)}


def report(result: dict[str, Any]) -> str:
    reads, rates = result["reads"], result["loader_samples_per_s"]
    lines = [
        f"data: media files read per replica at pp=2 / at pp=1 = {reads['R']:.2f} "
        f"({reads['pp2']} = {' + '.join(map(str, reads['pp2_per_rank']))} by ranks 0 and 1, against {reads['pp1']}; "
        f"goal {reads['goal']:.2f})",
        f"data: loader {rates['0']:.1f} samples/s with 0 workers, {rates['2']:.1f} with 2; training step "
        f"{result['step_samples_per_s']:.1f} samples/s ({result['records']} records, batches of {result['batch']}, "
        f"tiny Qwen2.5-VL, one thread per process)",
    ]
    return "\n".join(lines)
