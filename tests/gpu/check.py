"""The GPU check (issue 24): run it when an accelerator is lent, `bash tests/gpu/check.sh`.

1. A one-process interleaved pipeline step (two stages on one rank) of the tiny Qwen2.5-VL on the
   device: its loss must match the same step on the CPU (within 1e-4: other kernels, float32).
2. Staging on the device: ``split_media`` + ``stage_media`` + one ``next_vlm_media_chunk`` per
   microbatch on a Qwen-like batch (B=64, 16 microbatches) already on the device, median time and host
   reads (at most one per batch in the producer, none in the consumer).
3. Transfer: ``StagedMedia.to(device, non_blocking=True)`` of a split made in pinned host memory, in
   GB/s, against one plain ``tensor.to(device)`` of the same bytes.
4. The consumer alone: one ``next_vlm_media_chunk`` call, in microseconds (no device sync).

``--device cpu`` runs the same code on the CPU (the suite does, so the script cannot rot); the figures
are printed as ``name: value`` lines and written as JSON to ``--out`` (default ``$OUT/gpu-check.json``
when ``OUT`` is set).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Any, Callable

import torch

import ppmedia
from ppmedia import HostReadCounter, next_vlm_media_chunk, pipeline, split_media, stage_media
from ppmedia.testing.tiny_models import qwen2_5_vl as tiny

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
from staging_bench import qwen_like_batch  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def pipeline_loss_on(device: torch.device, n_microbatches: int = 4) -> float:
    """One interleaved step (2 stages on this rank) of the tiny Qwen2.5-VL on ``device``; its loss."""
    model = tiny.build_model(seed=0)
    adapter = ppmedia.get_adapter(model)
    layout = pipeline.schedule_layout("interleaved")
    stages = pipeline.make_pipeline_stages(model, layout.n_stages(1), layout.stage_indices(0, 1), device)
    schedule = pipeline.build_schedule("interleaved", stages, n_microbatches)
    batch = {k: v.to(device) for k, v in tiny.build_batch(seed=0).items()}
    ids, mask = batch["input_ids"], batch["attention_mask"]
    labels = pipeline.make_labels(ids, model.config, adapter, attention_mask=mask)
    images, videos = adapter.media_per_sample(ids, model.config)
    staged = split_media(batch, n_microbatches, images_per_sample=images, videos_per_sample=videos)
    losses: list[torch.Tensor] = []
    with stage_media(stages[0], staged):
        schedule.step(ids, mask, target=labels, losses=losses,
                      loss_kwargs={"num_valid_tokens": pipeline.count_valid_tokens(labels)})
    return float(sum(loss.detach().cpu() for loss in losses))


def staging_figures(device: torch.device, repeats: int, batch_size: int = 64, n: int = 16) -> dict[str, float]:
    host = qwen_like_batch(batch_size, n)
    on_device = {k: v.to(device) for k, v in host.items()}
    module = torch.nn.Module()

    def split_stage_consume() -> None:
        staged = split_media(dict(on_device), n)
        with stage_media(module, staged):
            for _ in range(n):
                next_vlm_media_chunk(module)

    with HostReadCounter() as reads:
        staged = split_media(dict(on_device), n)
    producer_reads = reads.total
    with stage_media(module, staged), HostReadCounter() as consumer:
        for _ in range(n):
            next_vlm_media_chunk(module)
    figures = {"staging_ms": 1e3 * _median(split_stage_consume, device, repeats),
               "producer_host_reads": float(producer_reads), "consumer_host_reads": float(consumer.total)}
    pinned = split_media({k: (v.pin_memory() if device.type == "cuda" else v) for k, v in host.items()}, n)
    size = sum(t.numel() * t.element_size() for t in [host["pixel_values"], host["image_grid_thw"]])
    moved = _median(lambda: pinned.to(device, non_blocking=True), device, repeats)
    plain = _median(lambda: host["pixel_values"].to(device), device, repeats)
    figures.update(transfer_gb_s=size / moved / 1e9, plain_copy_gb_s=host["pixel_values"].nbytes / plain / 1e9)
    with stage_media(module, staged):
        start = time.perf_counter()
        for _ in range(n):
            next_vlm_media_chunk(module)
        figures["consumer_us_per_call"] = 1e6 * (time.perf_counter() - start) / n
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", default=None, help="JSON figures (default: $OUT/gpu-check.json when OUT is set)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False on this machine")
    torch.manual_seed(0)
    pipeline.init_distributed("gloo")  # one process; both stages on this rank exchange tensors locally
    try:
        cpu_loss = pipeline_loss_on(torch.device("cpu"))
        device_loss = pipeline_loss_on(device)
        figures: dict[str, Any] = {"device": str(device), "torch": torch.__version__,
                                   "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                                   "loss_cpu": cpu_loss, "loss_device": device_loss,
                                   "loss_diff": abs(cpu_loss - device_loss)}
        figures.update(staging_figures(device, args.repeats))
    finally:
        torch.distributed.destroy_process_group()
    for key, value in figures.items():
        print(f"{key}: {value:.6g}" if isinstance(value, float) else f"{key}: {value}")
    out = args.out or (os.path.join(os.environ["OUT"], "gpu-check.json") if os.environ.get("OUT") else None)
    if out:
        pathlib.Path(out).write_text(json.dumps(figures, indent=1) + "\n")
    ok = figures["loss_diff"] <= 1e-4 and figures["consumer_host_reads"] == 0 and figures["producer_host_reads"] <= 1
    print("gpu check:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
