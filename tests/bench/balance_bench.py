"""Balancing benchmark: real 2-process pipelines on a skewed batch, balanced vs as-is, A/B alternated.

Model: the tiny Qwen2.5-VL with a heavier vision tower (depth 4, hidden 128, full attention in 2 of
the 4 layers) and a text model of 3 decoder layers (hidden 256), split 1 + 2 over the 2 stages, so that
the first stage (vision + 1 layer) and the second (2 layers + head) do similar work per step: a
partition a user would choose. Batch: 8 samples, ``S = 80``; the skewed batch has all 8 images
(8x8 patches each, 16 tokens) in samples 0-1 (the first quarter), the even batch one image per
sample. 2 stages (gloo on 127.0.0.1, one thread per process), 4 microbatches.

Per schedule (1F1B, GPipe) the arms alternate step by step, their order flipped every pair
(ABBA...): ``skewed`` (the batch as it is), ``balanced`` (``split_media(balance=adapter cost)``,
heaviest microbatch first), and for 1F1B ``balanced_heavy_last``. The even batch runs 1F1B as-is vs
balanced. Every step records each stage's ``forward_one_chunk`` / ``backward_one_chunk`` times; the
simulator (:mod:`ppmedia.planning.simulate`) replays each arm from its own median per-operation costs, and
the planner predicts the balanced step from the skewed run's calibration and the balanced loads alone.

Quietness: rank 0 reads ``/proc/stat`` around each measured window and subtracts the CPU time of the
two workers (``getrusage``): the rest is what other processes used. The parent does the same over one
idle second before spawning. More than 0.25 cores used by others in either marks the run unquiet (the
load average is printed for information only: the sections of ``make bench`` before this one raise it).
"""

from __future__ import annotations

import functools
import json
import os
import resource
import statistics
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch

N_MICROBATCHES = 4
#: decoder layers per stage: the first stage also runs the vision encoder, so it gets fewer (a
#: partition a user would choose to even out the stages' total work).
LM_LAYERS = (1, 2)
SEQ_LEN = 80
GRID = (1, 8, 8)  # 64 patches, 16 tokens


def build_config() -> Any:
    from transformers import Qwen2_5_VLConfig

    from ppmedia.testing.tiny_models import qwen2_5_vl as tiny

    text = {
        "vocab_size": 128, "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": sum(LM_LAYERS),
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [8, 12, 12]},
        "pad_token_id": tiny.PAD_TOKEN_ID, "bos_token_id": tiny.BOS_TOKEN_ID, "eos_token_id": tiny.EOS_TOKEN_ID,
    }
    vision = {
        "depth": 4, "hidden_size": 128, "intermediate_size": 512, "num_heads": 4, "in_channels": 3,
        "patch_size": tiny.PATCH_SIZE, "temporal_patch_size": tiny.TEMPORAL_PATCH_SIZE, "spatial_merge_size": tiny.MERGE,
        "window_size": 16, "out_hidden_size": 256, "fullatt_block_indexes": [1, 3],
    }
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=tiny.IMAGE_TOKEN_ID, video_token_id=tiny.VIDEO_TOKEN_ID,
        vision_start_token_id=tiny.VISION_START_TOKEN_ID, vision_end_token_id=tiny.VISION_END_TOKEN_ID,
    )


def build_batch(kind: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """``skewed``: 4 images in each of samples 0 and 1; ``even``: one image per sample."""
    from ppmedia.testing.tiny_models import qwen2_5_vl as tiny

    gen = torch.Generator().manual_seed(seed)
    images = {0: 4, 1: 4} if kind == "skewed" else {s: 1 for s in range(8)}
    tokens = GRID[0] * GRID[1] * GRID[2] // 4
    ids = torch.full((8, SEQ_LEN), tiny.PAD_TOKEN_ID, dtype=torch.long)
    for s in range(8):
        row = [tiny.BOS_TOKEN_ID]
        for _ in range(images.get(s, 0)):
            row += [tiny.VISION_START_TOKEN_ID] + [tiny.IMAGE_TOKEN_ID] * tokens + [tiny.VISION_END_TOKEN_ID]
        row += torch.randint(10, 128, (SEQ_LEN - 1 - len(row),), generator=gen).tolist() + [tiny.EOS_TOKEN_ID]
        ids[s] = torch.tensor(row)
    n_images = sum(images.values())
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": torch.randn(n_images * GRID[0] * GRID[1] * GRID[2], tiny.PATCH_DIM, generator=gen),
        "image_grid_thw": torch.tensor([GRID] * n_images, dtype=torch.long),
    }


def _cpu_busy() -> float:
    """Seconds of CPU time used by everything on the machine so far (``/proc/stat``)."""
    with open("/proc/stat") as fh:
        fields = [float(v) for v in fh.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _OpTimer:
    """Wraps a ``PipelineStage``'s ``forward_one_chunk`` / ``backward_one_chunk`` to time each call."""

    def __init__(self, stage: Any) -> None:
        self.forward: dict[int, float] = {}
        self.backward: dict[int, float] = {}
        for name, store in (("forward_one_chunk", self.forward), ("backward_one_chunk", self.backward)):
            original = getattr(stage, name)

            def timed(mb: int, *args: Any, _original: Any = original, _store: dict = store, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return _original(mb, *args, **kwargs)
                finally:
                    _store[mb] = time.perf_counter() - t0

            setattr(stage, name, timed)

    def take(self) -> tuple[list[float], list[float]]:
        out = ([self.forward.get(m, 0.0) for m in range(N_MICROBATCHES)],
               [self.backward.get(m, 0.0) for m in range(N_MICROBATCHES)])
        self.forward.clear()
        self.backward.clear()
        return out


def _prepare(kind: str, arm: str, adapter: Any, config: Any) -> dict[str, Any]:
    """The batch of ``kind`` split for ``arm``, with labels and per-microbatch vision loads."""
    from ppmedia import split_media
    from ppmedia.balance import balanced_split, microbatch_loads, sample_costs
    from ppmedia.pipeline import count_valid_tokens, make_labels

    batch = build_batch(kind)
    cost = functools.partial(adapter.image_costs, config=config)
    images, videos = adapter.media_per_sample(batch["input_ids"], config)
    per_sample = split_media(dict(batch), 8, images_per_sample=images, videos_per_sample=videos)
    costs = sample_costs(per_sample, per_sample.tensors, cost) / 1e6  # MFLOP
    order = "heavy_last" if arm == "balanced_heavy_last" else "heavy_first"
    if arm == "skewed":
        permutation = list(range(8))
        staged = split_media(batch, N_MICROBATCHES, images_per_sample=images, videos_per_sample=videos)
    else:
        staged = balanced_split(batch, N_MICROBATCHES, cost, images_per_sample=images, videos_per_sample=videos,
                                order=order)
        permutation = list(staged.permutation)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    labels = make_labels(ids, config, adapter, attention_mask=mask)
    return {"ids": ids, "mask": mask, "labels": labels, "num_valid": count_valid_tokens(labels), "staged": staged,
            "loads": microbatch_loads(costs, N_MICROBATCHES, permutation), "permutation": permutation}


def _worker(rank: int, init_method: str, job: dict[str, Any], out_dir: str) -> None:
    import torch.distributed as dist

    from ppmedia import get_adapter, stage_media
    from ppmedia.pipeline import build_schedule, make_pipeline_stages
    from ppmedia.testing.parity import exit_worker
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        config = build_config()
        model = Qwen2_5_VLForConditionalGeneration(config).float()
        adapter = get_adapter(config)
        results: dict[str, Any] = {"arms": {}}
        for plan in job["plans"]:
            stages = make_pipeline_stages(model, 2, [rank], "cpu", layers_per_stage=list(LM_LAYERS), static_microbatch=(8 // N_MICROBATCHES, SEQ_LEN))
            stage = stages[0]
            schedule = build_schedule(plan["schedule"], stages, N_MICROBATCHES)
            timer = _OpTimer(stage)
            arms = {arm: _prepare(plan["batch"], arm, adapter, config) for arm in plan["arms"]}

            def step(arm: str) -> tuple[float, list[float], list[float]]:
                data = arms[arm]
                dist.barrier()
                t0 = time.perf_counter()
                losses: list[torch.Tensor] = []
                if stage.is_first:
                    with stage_media(stage, data["staged"]):
                        schedule.step(data["ids"], data["mask"], target=data["labels"], losses=losses,
                                      loss_kwargs={"num_valid_tokens": data["num_valid"]})
                else:
                    schedule.step(data["ids"], data["mask"], target=data["labels"], losses=losses,
                                  loss_kwargs={"num_valid_tokens": data["num_valid"]})
                wall = time.perf_counter() - t0
                for p in stage.submod.parameters():
                    p.grad = None
                fwd, bwd = timer.take()
                return wall, fwd, bwd

            for _ in range(job["warmup"]):
                for arm in plan["arms"]:
                    step(arm)
            dist.barrier()
            busy0, own0, t_start = _cpu_busy(), _own_cpu(), time.perf_counter()
            records: dict[str, list[Any]] = {arm: [] for arm in plan["arms"]}
            for rep in range(job["pairs"]):
                order = plan["arms"] if rep % 2 == 0 else list(reversed(plan["arms"]))
                for arm in order:
                    records[arm].append(step(arm))
            window = time.perf_counter() - t_start
            own = torch.tensor([_own_cpu() - own0])
            dist.all_reduce(own)
            busy = _cpu_busy() - busy0
            gathered: list[Any] = [None, None]
            dist.all_gather_object(gathered, records)
            if rank == 0:
                for arm in plan["arms"]:
                    walls = [max(gathered[r][arm][i][0] for r in range(2)) for i in range(job["pairs"])]
                    results["arms"][f"{plan['name']}/{arm}"] = {
                        "walls": walls,
                        "forward": [[gathered[r][arm][i][1] for i in range(job["pairs"])] for r in range(2)],
                        "backward": [[gathered[r][arm][i][2] for i in range(job["pairs"])] for r in range(2)],
                        "loads": arms[arm]["loads"],
                        "permutation": arms[arm]["permutation"],
                    }
                results.setdefault("windows", []).append(
                    {"plan": plan["name"], "seconds": window, "foreign_cores": max(0.0, busy - float(own)) / window}
                )
        if rank == 0:
            with open(os.path.join(out_dir, "balance.json"), "w") as fh:
                json.dump(results, fh)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_worker(0)


PLANS = [
    {"name": "1f1b", "schedule": "1f1b", "batch": "skewed", "arms": ["skewed", "balanced", "balanced_heavy_last"]},
    {"name": "gpipe", "schedule": "gpipe", "batch": "skewed", "arms": ["skewed", "balanced"]},
    {"name": "1f1b-even", "schedule": "1f1b", "batch": "even", "arms": ["skewed", "balanced"]},
]


def split_overhead(repeats: int = 200) -> dict[str, float]:
    """Median microseconds of ``split_media`` on the skewed batch, plain vs balanced (alternated, one
    thread): what balancing adds to the producer per batch (the costs, the assignment, the copies)."""
    from ppmedia import get_adapter, split_media

    torch.set_num_threads(1)
    config = build_config()
    adapter = get_adapter(config)
    cost = functools.partial(adapter.image_costs, config=config)
    source = build_batch("skewed")
    images, videos = adapter.media_per_sample(source["input_ids"], config)
    times: dict[str, list[float]] = {"plain": [], "balanced": []}
    for _ in range(repeats):
        for arm in times:
            batch = dict(source)
            t0 = time.perf_counter()
            split_media(batch, N_MICROBATCHES, images_per_sample=images, videos_per_sample=videos,
                        balance=cost if arm == "balanced" else False)
            times[arm].append(time.perf_counter() - t0)
    return {arm: statistics.median(v) * 1e6 for arm, v in times.items()}


def run(pairs: int = 16, warmup: int = 2) -> dict[str, Any]:
    """Spawn the two workers, run every plan, return the raw results plus the loadavg before."""
    import torch.multiprocessing as mp
    from ppmedia.testing.parity import _free_port

    load_before = os.getloadavg()[0]
    busy0, t0 = _cpu_busy(), time.perf_counter()
    time.sleep(1.0)  # this process idles: whatever runs now is someone else's
    foreign_before = (_cpu_busy() - busy0) / (time.perf_counter() - t0)
    job = {"plans": PLANS, "pairs": pairs, "warmup": warmup}
    with tempfile.TemporaryDirectory(prefix="ppmedia-balance-") as out_dir:
        mp.spawn(_worker, args=(f"tcp://127.0.0.1:{_free_port()}", job, out_dir), nprocs=2, join=True)
        with open(os.path.join(out_dir, "balance.json")) as fh:
            results = json.load(fh)
    results["loadavg_before"] = load_before
    results["split_us"] = split_overhead()
    results["foreign_cores_before"] = foreign_before
    results["pairs"] = pairs
    return results


def _median_matrix(per_rank: list[list[list[float]]]) -> list[list[float]]:
    """``[stage][microbatch]`` medians over the steps (rank r runs stage r)."""
    return [[statistics.median(step[m] for step in rank) for m in range(N_MICROBATCHES)] for rank in per_rank]


def analyse(results: dict[str, Any], max_foreign: float = 0.25) -> dict[str, Any]:
    """Ratios (median of per-pair ratios), simulator predictions, quietness verdict."""
    from ppmedia.planning.simulate import fit_calibration, predict, simulate

    arms = results["arms"]
    out: dict[str, Any] = {"comparisons": [], "arms": {}}
    for name, arm in arms.items():
        fwd, bwd = _median_matrix(arm["forward"]), _median_matrix(arm["backward"])
        schedule = name.split("/")[0].replace("-even", "")
        sim = simulate(schedule, fwd, bwd)
        walls = arm["walls"]
        out["arms"][name] = {
            "median_s": statistics.median(walls), "spread": (max(walls) - min(walls)) / statistics.median(walls),
            "forward_ms": [[round(v * 1e3, 1) for v in row] for row in fwd],
            "backward_ms": [[round(v * 1e3, 1) for v in row] for row in bwd],
            "simulated_s": sim.step_time, "bubble": sim.bubble, "loads": arm["loads"],
        }
    for plan, base, other in (("1f1b", "skewed", "balanced"), ("1f1b", "skewed", "balanced_heavy_last"),
                              ("gpipe", "skewed", "balanced"), ("1f1b-even", "skewed", "balanced")):
        a, b = arms[f"{plan}/{base}"], arms[f"{plan}/{other}"]
        ratios = [y / x for x, y in zip(a["walls"], b["walls"])]
        sa, sb = out["arms"][f"{plan}/{base}"], out["arms"][f"{plan}/{other}"]
        schedule = plan.replace("-even", "")
        fwd_a, bwd_a = _median_matrix(a["forward"]), _median_matrix(a["backward"])
        calibration = fit_calibration(fwd_a, bwd_a, a["loads"], step_time=sa["median_s"], schedule=schedule)
        # the simulator on each arm's own median per-operation costs, with the send latency fitted so the
        # skewed arm's simulated step equals its measured one
        sim_a = simulate(schedule, fwd_a, bwd_a, latency=calibration.latency).step_time
        sim_b = simulate(schedule, _median_matrix(b["forward"]), _median_matrix(b["backward"]),
                         latency=calibration.latency).step_time
        planned = predict(schedule, b["loads"], calibration).step_time / predict(schedule, a["loads"], calibration).step_time
        out["comparisons"].append({
            "plan": plan, "arm": other, "ratio": statistics.median(ratios), "pairs": len(ratios),
            "simulated_ratio": sim_b / sim_a, "planned_ratio": planned, "latency_ms": calibration.latency * 1e3,
        })
        if (plan, other) == ("1f1b", "balanced"):
            out["calibration"] = {"text_forward": [v * 1e3 for v in calibration.text_forward],
                                  "vision_per_unit": calibration.vision_per_unit * 1e3,
                                  "backward_ratio": calibration.backward_ratio, "latency": calibration.latency * 1e3}
    foreign = max(w["foreign_cores"] for w in results["windows"])
    reasons = []
    if results["foreign_cores_before"] > max_foreign:
        reasons.append(f"other processes used {results['foreign_cores_before']:.2f} cores just before the start")
    if foreign > max_foreign:
        reasons.append(f"other processes used {foreign:.2f} cores during the runs")
    out["foreign_cores"] = foreign
    out["unquiet"] = reasons
    return out


def report(results: dict[str, Any], analysis: dict[str, Any], force: bool = False) -> str:
    """The tables and the final ``balance: ...`` line."""
    lines = [f"6. balancing: 2-process pipelines on a skewed batch (B=8, n={N_MICROBATCHES}, 2 stages, "
             f"{results['pairs']} alternated repetitions per arm; median step ms)"]
    header = ("run", "median ms", "spread", "stage-0 fwd ms per mb", "stage-0 bwd ms per mb", "vision MFLOP per mb",
              "simulated ms", "bubble")
    rows = []
    for name, arm in analysis["arms"].items():
        rows.append((name, f"{arm['median_s'] * 1e3:.1f}", f"{arm['spread']:.2f}",
                     " ".join(f"{v:.0f}" for v in arm["forward_ms"][0]),
                     " ".join(f"{v:.0f}" for v in arm["backward_ms"][0]),
                     " ".join(f"{v:.1f}" for v in arm["loads"]), f"{arm['simulated_s'] * 1e3:.1f}", f"{arm['bubble']:.2f}"))
    from ppmedia.cli.tables import format_table

    lines.append(format_table(header, rows))
    lines.append("")
    rows = [(c["plan"], f"{c['arm']}/skewed", f"{c['ratio']:.3f}", c["pairs"], f"{c['simulated_ratio']:.3f}",
             f"{c['simulated_ratio'] - c['ratio']:+.3f}", f"{c['planned_ratio']:.3f}", f"{c['latency_ms']:.1f}")
            for c in analysis["comparisons"]]
    lines.append(format_table(("schedule", "ratio", "measured", "pairs", "simulated", "sim - measured",
                               "planner (skewed calibration)", "fitted latency ms"), rows))
    lines.append("simulated: each arm's own median per-operation times, send latency fitted on the skewed arm; "
                 "planner: the skewed arm's calibration and the balanced vision loads only")
    lines.append(f"other processes' CPU: {results['foreign_cores_before']:.2f} cores in the second before, "
                 f"{analysis['foreign_cores']:.2f} during the runs; 1-min load average before: {results['loadavg_before']:.2f}")
    split = results["split_us"]
    lines.append(f"producer cost per batch (split_media, median): plain {split['plain']:.0f} us, balanced "
                 f"{split['balanced']:.0f} us (costs, assignment, one copy of each media tensor and the text rows)")
    main = analysis["comparisons"][0]
    if analysis["unquiet"] and not force:
        lines.append("balance: balanced/skewed step time = n/a (machine unquiet: " + "; ".join(analysis["unquiet"])
                     + "; rerun on a quiet machine, or --force)")
    else:
        flag = f" [unquiet: {'; '.join(analysis['unquiet'])}]" if analysis["unquiet"] else ""
        lines.append(f"balance: balanced/skewed step time = {main['ratio']:.2f} (median of {main['pairs']} pairs){flag}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python tests/bench/balance_bench.py [--pairs N] [--force] [--out FILE]``."""
    import argparse

    parser = argparse.ArgumentParser(description="ppmedia balancing benchmark")
    parser.add_argument("--pairs", type=int, default=16)
    parser.add_argument("--force", action="store_true", help="print the ratio even on an unquiet machine")
    parser.add_argument("--out", help="write the raw results and analysis as JSON")
    args = parser.parse_args(argv)
    results = run(args.pairs)
    analysis = analyse(results)
    print(report(results, analysis, args.force))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"raw": results, "analysis": analysis}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def random_batches_study(trials: int = 300, seed: int = 0) -> list[dict[str, Any]]:
    """Simulated balanced/plain step-time ratios on random batches (no processes; the simulator only).

    Samples are text-only with probability 0.6, else carry 1-3 images of 256-4096 patches (uniform in
    log2), costed with Qwen2.5-VL-7B's vision encoder model (hidden 1280, 32 layers, full attention in 4,
    windows of 64 patches elsewhere). Stages: the first runs the vision encoder plus fewer decoder layers
    (text forward 0.5 against 1.0 on the others); the vision forward of the mean microbatch is 0.5
    (stages even on average); backward 2x forward. Reported per (stages, microbatches, samples per
    microbatch): median and 10th percentile of balanced/plain under 1F1B, and for bucketed batches
    (image samples first) as well.
    """
    import random

    import numpy as np
    from transformers import Qwen2_5_VLConfig

    from ppmedia.balance import balance_microbatches, encoder_flops, microbatch_loads
    from ppmedia.planning.simulate import Calibration, predict

    vision = Qwen2_5_VLConfig(vision_config={"depth": 32, "hidden_size": 1280, "intermediate_size": 3420,
                                              "patch_size": 14, "window_size": 112,
                                              "fullatt_block_indexes": [7, 15, 23, 31]})
    rng = random.Random(seed)
    rows = []
    for stages, n, per_mb in ((2, 4, 4), (4, 8, 4), (4, 8, 8), (4, 16, 2)):
        ratios: dict[str, list[float]] = {"random": [], "bucketed": []}
        for _ in range(trials):
            B = n * per_mb
            costs = []
            for _ in range(B):
                k = 0 if rng.random() < 0.6 else rng.randint(1, 3)
                patches = np.array([int(2 ** rng.uniform(8, 12)) for _ in range(k)], dtype=np.int64)
                costs.append(float(encoder_flops(patches, vision).sum()) if k else 0.0)
            for kind in ratios:
                c = sorted(costs, reverse=True) if kind == "bucketed" else costs
                plain = microbatch_loads(c, n)
                mean = sum(plain) / n
                if mean == 0:
                    continue
                cal = Calibration([0.5] + [1.0] * (stages - 1), 0.5 / mean, [2.0] * stages)
                balanced = microbatch_loads(c, n, balance_microbatches(c, n))
                ratios[kind].append(predict("1f1b", balanced, cal).step_time / predict("1f1b", plain, cal).step_time)
        rows.append({"stages": stages, "microbatches": n, "per_microbatch": per_mb,
                     **{f"{k}_median": float(np.median(v)) for k, v in ratios.items()},
                     **{f"{k}_p10": float(np.percentile(v, 10)) for k, v in ratios.items()}})
    return rows
