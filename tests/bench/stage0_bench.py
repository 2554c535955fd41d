"""Encoder-spread benchmark: real 2-process pipelines on a vision-heavy tiny model, the vision tower
on stage 0 (uniform and other static splits) against spread over both ranks, A/B alternated.

Model: a tiny Qwen2.5-VL whose vision tower (depth 4, hidden 128, full attention in 2 of 4 layers)
costs per microbatch 1.1-1.2 times one stage's share of the text model (4 decoder layers, hidden
256, forward and backward): the images' size is chosen on the machine at hand (:func:`size_tower`:
the tower and a stage timed on both ranks at once, the patches rescaled; 8x12 patches gave 1.14 on
the docs' machine, 0.93 on a 2-core AMD EPYC), and the ratio got is printed with every run. B=16
samples with one image each, ``S = 80``, 8 microbatches
of 2, 1F1B on 2 ranks (gloo on 127.0.0.1, one thread per process). Arms, alternated step by step with their order rotated
every repetition: ``stage0`` (layers 2 + 2, the uniform split), ``stage0/1+3`` and ``stage0/0+4`` (vision
on stage 0 with fewer layers there), ``spread`` (2 + 2, ``encoder="spread"`` with its background lane)
and ``spread/nolane`` (the same without the lane: every encode before the schedule, every vision
backward after it), so what the lane buys is measured side by side.

Calibration for the planner (independent of the arms it predicts): before the repetitions both
workers time, at the same time, the vision tower's forward and backward per MFLOP of the adapter's
cost model, one decoder layer's forward and backward on a microbatch, and the spread's weight
broadcast plus gradient reduction, and the part of a free core the background lanes get (both
lanes encoding while one rank computes and the other waits). After them, the ``stage0`` arm's own per-action medians give the
first and last stages' extra work (embedding, merge, head and loss) and the send latency (fitted so
the model reproduces that arm's step time). :mod:`ppmedia.planning.stepmodel` then predicts every arm.

Quietness as in ``balance_bench``: more than 0.25 cores used by other processes (``/proc/stat``
minus the workers' own CPU time) before or during the runs prints ``n/a`` instead of the ratio.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch

import balance_bench as bb

N_MICROBATCHES = 8
BATCH = 16
GRID = (1, 8, 12)  # patches of each sample's image: 96, i.e. 24 tokens
SEQ_LEN = 80
TEXT_LAYERS = 4
SCHEDULE = "1f1b"
#: arm -> (encoder, layers per stage)
ARMS: dict[str, tuple[str, tuple[int, int]]] = {
    "stage0": ("stage0", (2, 2)),
    "stage0/1+3": ("stage0", (1, 3)),
    "stage0/0+4": ("stage0", (0, 4)),
    "spread": ("spread", (2, 2)),
    "spread/nolane": ("spread", (2, 2)),
}
#: the spread's arms without its background lane (every encode before the schedule, every vision
#: backward after it, contiguous shares): what the lane buys, measured side by side
NO_LANE = ("spread/nolane",)
BASELINE = "stage0"


def build_config() -> Any:
    """balance_bench's model with 4 decoder layers (the vision tower as there)."""
    saved = bb.LM_LAYERS
    bb.LM_LAYERS = (TEXT_LAYERS // 2, TEXT_LAYERS - TEXT_LAYERS // 2)
    try:
        return bb.build_config()
    finally:
        bb.LM_LAYERS = saved


def build_batch(seed: int = 0, grid: tuple[int, int, int] = GRID) -> dict[str, torch.Tensor]:
    """``BATCH`` samples, each with one image of ``grid`` patches, then random text to ``SEQ_LEN``."""
    from ppmedia.testing.tiny_models import qwen2_5_vl as tiny

    gen = torch.Generator().manual_seed(seed)
    tokens = grid[0] * grid[1] * grid[2] // 4
    ids = torch.full((BATCH, SEQ_LEN), tiny.PAD_TOKEN_ID, dtype=torch.long)
    for s in range(BATCH):
        row = [tiny.BOS_TOKEN_ID, tiny.VISION_START_TOKEN_ID] + [tiny.IMAGE_TOKEN_ID] * tokens + [tiny.VISION_END_TOKEN_ID]
        row += torch.randint(10, 128, (SEQ_LEN - 1 - len(row),), generator=gen).tolist() + [tiny.EOS_TOKEN_ID]
        ids[s] = torch.tensor(row)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values": torch.randn(BATCH * grid[0] * grid[1] * grid[2], tiny.PATCH_DIM, generator=gen),
        "image_grid_thw": torch.tensor([grid] * BATCH, dtype=torch.long),
    }


#: the documented workload: vision per microbatch (forward + backward) / one stage's decoder work
TARGET_RATIO = (1.1, 1.2)
#: image grids the sizing picks from (``(t, h, w)`` patches; h and w even for the 2x2 merge; at most
#: ``SEQ_LEN - 4`` image tokens)
GRIDS = tuple((1, h, w) for h in range(4, 18, 2) for w in range(h, h + 6, 2) if h * w // 4 <= SEQ_LEN - 4)


def _vision_and_stage(model: Any, adapter: Any, grid: tuple[int, int, int], repeat: int = 5) -> tuple[float, float]:
    """Median seconds of the tower's forward + backward on one microbatch of ``grid`` images, and of
    one stage's decoder work (``TEXT_LAYERS // 2`` layers and the stage's own, forward + backward),
    timed on this rank (both ranks at once)."""
    import ppmedia
    from ppmedia.pipeline import build_stage_modules, vision_replica

    config = model.config
    batch = build_batch(0, grid)
    staged = ppmedia.split_media(dict(batch), N_MICROBATCHES, **adapter.media_counts(batch, config))
    vision = vision_replica(model)
    half = TEXT_LAYERS // 2
    stage = build_stage_modules(model, 3, stages=[1], layers_per_stage=[1, half, TEXT_LAYERS - half - 1])[0]
    b = BATCH // N_MICROBATCHES
    hidden = torch.randn(b, SEQ_LEN, config.text_config.hidden_size, requires_grad=True)
    mask = torch.ones(b, SEQ_LEN, dtype=torch.long)
    positions = torch.arange(SEQ_LEN).expand(b, 3, SEQ_LEN).contiguous()
    ids = batch["input_ids"]
    a, z = staged.samples[0]
    chunk = staged.chunk(0)
    _, host = adapter.check_counts(ids[a:z], chunk, config)
    tower, decoder = [], []
    for _ in range(repeat + 1):  # the first: warm-up
        t0 = time.perf_counter()
        out = adapter.encoder_outputs(vision, chunk, host)["image"]
        out.backward(torch.ones_like(out))
        t1 = time.perf_counter()
        out = stage(hidden, mask, positions)[0]
        out.backward(torch.ones_like(out))
        t2 = time.perf_counter()
        tower.append(t1 - t0)
        decoder.append(t2 - t1)
    for p in model.parameters():
        p.grad = None
    return statistics.median(tower[1:]), statistics.median(decoder[1:])


def size_tower(model: Any, adapter: Any) -> tuple[tuple[int, int, int], float]:
    """The image grid whose tower work per microbatch is ``TARGET_RATIO``'s middle times one stage's
    decoder work on this machine (the tower's time taken as proportional to its patches, checked once
    more on the grid chosen), and the ratio measured on it. Both ranks time at once and agree."""
    import torch.distributed as dist

    def ratio(grid: tuple[int, int, int]) -> float:
        tower, decoder = _vision_and_stage(model, adapter, grid)
        found = torch.tensor([tower / decoder])
        dist.all_reduce(found)
        return float(found) / dist.get_world_size()

    target = sum(TARGET_RATIO) / 2
    tried = {GRID: ratio(GRID)}
    grid = GRID
    for _ in range(4):  # rescale the patches from the last grid; stop in the range or on a grid seen
        got = tried[grid]
        if TARGET_RATIO[0] <= got <= TARGET_RATIO[1]:
            break
        patches = grid[1] * grid[2] * target / got
        grid = min(GRIDS, key=lambda g: abs(g[1] * g[2] - patches))
        if grid in tried:
            break
        tried[grid] = ratio(grid)
    best = min(tried, key=lambda g: abs(tried[g] - target))  # timings are noisy: the closest of those seen
    return best, tried[best]


def free_core_time(bars: list[Any], cores: int, lanes: int, start: float, end: float) -> float:
    """Core-seconds in ``[start, end)`` that the ranks' own operations (``bars``: every rank's main-thread
    bars) leave free for ``lanes`` background lanes, at most one core each."""
    main = [b for b in bars if b[1] in ("F", "B", "I", "W", "E", "V")]
    points = sorted({start, end} | {t for b in main for t in (b[2], b[3]) if start < t < end})
    free = 0.0
    for a, z in zip(points, points[1:]):
        busy = sum(1 for b in main if b[2] <= (a + z) / 2 < b[3])
        free += min(lanes, max(0, cores - busy)) * (z - a)
    return free


def lane_share_of_run(results: dict[str, Any], arm: str = "spread") -> float:
    """The part of a free core the lanes' work got in a recorded spread arm (its per-action timestamps):
    every lane job (``LE``, ``LV``) at its direct cost (the probe's vision forward / backward per
    microbatch) over the core-time the ranks' operations left free while the lanes had work, shared
    among the lanes then running. What :func:`lane_share_in` measures inside the baseline's schedule."""
    probe, cores = results["probe"], int(results.get("cores") or os.cpu_count() or 1)
    direct = {"LE": probe["vision_forward"], "LV": probe["vision_backward"]}
    work = available = 0.0
    for bars in results["arms"][arm]["bars"]:
        lanes = [b for b in bars if b[1] in direct]
        main = [b for b in bars if b[1] in ("F", "B", "I", "W", "E", "V")]
        work += sum(direct[b[1]] for b in lanes)
        points = sorted({t for b in bars for t in (b[2], b[3])})
        for a, z in zip(points, points[1:]):
            mid = (a + z) / 2
            running = sum(1 for b in lanes if b[2] <= mid < b[3])
            if running:
                busy = sum(1 for b in main if b[2] <= mid < b[3])
                available += min(running, max(0, cores - busy)) * (z - a)
    return min(1.0, work / available) if available > 0 else 1.0


def lane_share_in(step: Any, model: Any, adapter: Any, staged: Any, ids: torch.Tensor, direct: float) -> float:
    """The part of a free core the background lanes' work gets inside a schedule: one step of the
    baseline arm (``step()``: its wall and this rank's bars) while each rank's lane encodes (forward and
    backward) the batch's chunks; the encodes finished within the step, at their direct cost
    ``direct`` (seconds each), over the core-time the schedule's operations leave free (a waiting
    rank's schedule is not all idle: it sends, receives and bookkeeps in Python)."""
    import torch.distributed as dist

    from ppmedia.pipeline import vision_replica
    from ppmedia.pipeline.lane import Lane

    config = model.config
    # a copy of its own: the lane's backward must not accumulate into the parameters the step's own
    # backward fills and then drops (``p.grad = None`` while the lane adds to it: a crash, or a race)
    vision = copy.deepcopy(vision_replica(model))
    chunks = [(k, staged.chunk(k)) for k in range(N_MICROBATCHES) if staged.chunk(k) is not None]
    finished: list[float] = []

    def encode(k: int, chunk: Any) -> None:
        a, z = staged.samples[k]
        _, host = adapter.check_counts(ids[a:z], chunk, config)
        out = adapter.encoder_outputs(vision, chunk, host)["image"]
        out.backward(torch.ones_like(out))
        finished.append(time.perf_counter())

    lane = Lane([(lambda: None, (lambda k=k, c=c: encode(k, c))) for k, c in chunks])
    wall, bars = step()
    end = time.perf_counter()
    lane.cancel()
    lane.join()
    for p in vision.parameters():
        p.grad = None
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"bars": [_bar_json(b) for b in bars], "done": sum(1 for t in finished if t <= end)})
    everyone = [b for g in gathered for b in g["bars"]]  # seconds from the step's start (a barrier)
    last = max(b[3] for b in everyone)
    free = free_core_time(everyone, os.cpu_count() or 1, len(gathered), 0.0, last)
    work = sum(g["done"] for g in gathered) * direct
    return min(1.0, max(0.05, work / free)) if free > 0 else 1.0


def _probe(model: Any, adapter: Any, staged: Any, ids: torch.Tensor, spread: Any) -> Any:
    """A function that times each operation once on this rank (while the other rank does the same),
    appending to the lists it returns with ``summary()``: called once per repetition, between the
    arms, so the calibration sees the same machine as they do."""
    import torch.distributed as dist

    from ppmedia.pipeline import build_stage_modules, vision_replica

    config = model.config
    vision = vision_replica(model)
    # a middle stage of one layer and one of two: their difference is a layer, without the stage's
    # fixed work (masks, rotary embedding), which the first and last stages' extras then include
    one = build_stage_modules(model, 4, stages=[1], layers_per_stage=[1, 1, 1, 1])[0]
    two = build_stage_modules(model, 3, stages=[1], layers_per_stage=[1, 2, 1])[0]
    b = ids.shape[0] // N_MICROBATCHES
    hidden = torch.randn(b, SEQ_LEN, config.text_config.hidden_size, requires_grad=True)
    mask = torch.ones(b, SEQ_LEN, dtype=torch.long)
    positions = torch.arange(SEQ_LEN).expand(b, 3, SEQ_LEN).contiguous()
    times: dict[str, list[float]] = {k: [] for k in ("vision_forward", "vision_backward", "one_forward",
                                                     "one_backward", "two_forward", "two_backward", "sync")}
    chunks = [(k, staged.chunk(k)) for k in range(N_MICROBATCHES) if staged.chunk(k) is not None]

    def once() -> None:
        dist.barrier()
        for k, chunk in chunks:
            a, z = staged.samples[k]
            _, host = adapter.check_counts(ids[a:z], chunk, config)
            t0 = time.perf_counter()
            out = adapter.encoder_outputs(vision, chunk, host)["image"]
            t1 = time.perf_counter()
            out.backward(torch.ones_like(out))
            t2 = time.perf_counter()
            times["vision_forward"].append(t1 - t0)
            times["vision_backward"].append(t2 - t1)
        for name, stage in (("one", one), ("two", two)):
            t0 = time.perf_counter()
            out = stage(hidden, mask, positions)[0]
            t1 = time.perf_counter()
            out.backward(torch.ones_like(out))
            t2 = time.perf_counter()
            times[f"{name}_forward"].append(t1 - t0)
            times[f"{name}_backward"].append(t2 - t1)
        for p in model.parameters():
            p.grad = None
        dist.barrier()
        t0 = time.perf_counter()
        spread.refresh(everything=False)  # stage 0's rank: in the background; the copies wait for it
        for work in spread._pending:
            work.wait()
        spread._pending.clear()
        spread._reduce_gradients()
        times["sync"].append(time.perf_counter() - t0)

    def summary() -> dict[str, float]:
        found = {k: statistics.median(v) for k, v in times.items()}
        for part in ("forward", "backward"):
            found[f"layer_{part}"] = max(found[f"two_{part}"] - found[f"one_{part}"], 1e-6)
            found[f"stage_{part}"] = max(found[f"one_{part}"] - found[f"layer_{part}"], 0.0)
        return found

    once.summary = summary  # type: ignore[attr-defined]
    once.times = times  # type: ignore[attr-defined]
    return once


def _worker(rank: int, init_method: str, job: dict[str, Any], out_dir: str) -> None:
    import torch.distributed as dist
    from transformers import Qwen2_5_VLForConditionalGeneration

    import ppmedia
    from ppmedia.pipeline import StepTracer, build_schedule, encoder_spread_of, make_labels, make_pipeline_stages
    from ppmedia.testing.parity import exit_worker

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        config = build_config()
        model = Qwen2_5_VLForConditionalGeneration(config).float()
        adapter = ppmedia.get_adapter(config)
        grid, sized = size_tower(model, adapter) if job.get("size", True) else (GRID, float("nan"))
        batch = build_batch(0, grid)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        labels = make_labels(ids, config, adapter, attention_mask=mask)
        staged = ppmedia.split_media(dict(batch), N_MICROBATCHES, **adapter.media_counts(batch, config))
        num_valid = int((labels >= 0).sum())  # neither IGNORE_INDEX nor SHIFTED_MARK
        built = {}
        for arm, (encoder, layers) in ARMS.items():
            stages = make_pipeline_stages(model, 2, [rank], "cpu", layers_per_stage=list(layers), encoder=encoder,
                                          static_microbatch=(ids.shape[0] // N_MICROBATCHES, SEQ_LEN))
            spread = encoder_spread_of(stages) if encoder == "spread" else None
            if arm in NO_LANE:
                spread.set_background(False)
            built[arm] = (stages, build_schedule(SCHEDULE, stages, N_MICROBATCHES), spread, StepTracer(stages, spread))
        probe = _probe(model, adapter, staged, ids, built["spread"][2])

        def step(arm: str) -> tuple[float, list[Any]]:
            stages, schedule, spread, tracer = built[arm]
            losses: list[torch.Tensor] = []
            tracer.start()  # a barrier, then the clock
            t0 = time.perf_counter()
            if spread is not None:
                staging: Any = spread.step(staged, ids)
            else:
                staging = ppmedia.stage_media(stages[0], staged) if stages[0].is_first else _null()
            with staging:
                schedule.step(ids, mask, target=labels, losses=losses, loss_kwargs={"num_valid_tokens": num_valid})
            wall = time.perf_counter() - t0
            for p in model.parameters():
                p.grad = None
            return wall, tracer.bars(rank)

        for _ in range(job["warmup"]):
            for arm in ARMS:
                step(arm)
            probe()
        dist.barrier()
        busy0, own0, t_start = bb._cpu_busy(), bb._own_cpu(), time.perf_counter()
        records: dict[str, list[Any]] = {arm: [] for arm in ARMS}
        names = list(ARMS)
        shares: list[float] = []
        for rep in range(job["pairs"]):
            shift = rep % len(names)
            for arm in names[shift:] + names[:shift]:
                records[arm].append(step(arm))
            probe()
            direct = statistics.median(probe.times["vision_forward"]) + statistics.median(probe.times["vision_backward"])  # type: ignore[attr-defined]
            shares.append(lane_share_in(lambda: step(BASELINE), model, adapter, staged, ids, direct))
        window = time.perf_counter() - t_start
        own = torch.tensor([bb._own_cpu() - own0])
        dist.all_reduce(own)
        busy = bb._cpu_busy() - busy0
        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, {"records": records, "probe": {**probe.summary(), "lane_share": statistics.median(shares)}})
        if rank == 0:
            result = {
                "arms": {arm: {"walls": [max(gathered[r]["records"][arm][i][0] for r in range(2)) for i in range(job["pairs"])],
                               "bars": [[b for r in range(2) for b in gathered[r]["records"][arm][i][1]]
                                        for i in range(job["pairs"])]}
                         for arm in ARMS},
                "probe": {k: statistics.mean(gathered[r]["probe"][k] for r in range(2)) for k in gathered[0]["probe"]},
                "loads": list(built["spread"][2].last_plan.costs),
                "grid": list(grid), "sized_ratio": sized,
                "window": {"seconds": window, "foreign_cores": max(0.0, busy - float(own)) / window},
            }
            with open(os.path.join(out_dir, "stage0.json"), "w") as fh:
                json.dump(result, fh, default=_bar_json)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_worker(0)


def _null() -> Any:
    import contextlib

    return contextlib.nullcontext()


def _bar_json(bar: Any) -> Any:
    return [bar.rank, bar.kind, bar.start, bar.end, bar.stage, bar.microbatch]


def run(pairs: int = 12, warmup: int = 2, size: bool = True) -> dict[str, Any]:
    """Spawn the two workers; the raw results plus the machine's state before."""
    import torch.multiprocessing as mp
    from ppmedia.testing.parity import _free_port

    load_before = os.getloadavg()[0]
    busy0, t0 = bb._cpu_busy(), time.perf_counter()
    time.sleep(1.0)  # this process idles: whatever runs now is someone else's
    foreign_before = (bb._cpu_busy() - busy0) / (time.perf_counter() - t0)
    job = {"pairs": pairs, "warmup": warmup, "size": size}
    with tempfile.TemporaryDirectory(prefix="ppmedia-stage0-") as out_dir:
        mp.spawn(_worker, args=(f"tcp://127.0.0.1:{_free_port()}", job, out_dir), nprocs=2, join=True)
        with open(os.path.join(out_dir, "stage0.json")) as fh:
            results = json.load(fh)
    results.update(loadavg_before=load_before, loadavg_after=os.getloadavg()[0], foreign_cores_before=foreign_before,
                   pairs=pairs, cores=os.cpu_count())
    return results


def _bars(raw: list[list[Any]]) -> list[Any]:
    from ppmedia.planning.timeline import Bar

    return [Bar(int(r), str(k), float(a), float(b), int(s), int(m)) for r, k, a, b, s, m in raw]


def _op_medians(steps: list[list[Any]], kind: str, stage: int) -> float:
    """Median over steps of the mean duration of ``kind`` on ``stage`` (per microbatch)."""
    per_step = []
    for raw in steps:
        spans = [b.end - b.start for b in _bars(raw) if b.kind == kind and b.stage == stage]
        if spans:
            per_step.append(sum(spans) / len(spans))
    return statistics.median(per_step) if per_step else 0.0


def calibrate(results: dict[str, Any]) -> Any:
    """:class:`ppmedia.planning.stepmodel.OpCosts` (seconds) from the probe and the baseline arm's per-action
    medians, the latency fitted to the baseline's median step."""
    from ppmedia.planning.stepmodel import OpCosts, predict_step

    probe, loads = results["probe"], results["loads"]
    mean_load = statistics.mean(l for l in loads if l > 0)
    vf, vb = probe["vision_forward"] / mean_load, probe["vision_backward"] / mean_load
    lf, lb = probe["layer_forward"], probe["layer_backward"]
    sf, sb = probe["stage_forward"], probe["stage_backward"]
    base = results["arms"][BASELINE]["bars"]
    l0, l1 = ARMS[BASELINE][1]
    f0, f1 = _op_medians(base, "F", 0), _op_medians(base, "F", 1)
    b0, b1 = _op_medians(base, "B", 0), _op_medians(base, "B", 1)
    costs = OpCosts(layer_forward=lf, layer_backward=lb, vision_forward=vf, vision_backward=vb, stage_forward=sf,
                    stage_backward=sb, first_forward=max(0.0, f0 - l0 * lf - sf - vf * mean_load),
                    first_backward=max(0.0, b0 - l0 * lb - sb - vb * mean_load), last_forward=max(0.0, f1 - l1 * lf - sf),
                    last_backward=max(0.0, b1 - l1 * lb - sb), sync=probe["sync"], unit="s",
                    cores=results.get("cores"), lane_share=probe.get("lane_share", 1.0))
    target = statistics.median(results["arms"][BASELINE]["walls"])

    def step(latency: float) -> float:
        costs.latency = latency
        return predict_step(SCHEDULE, costs, loads, n_ranks=2, layers_per_stage=ARMS[BASELINE][1]).step_time

    low, high = 0.0, target
    if step(0.0) < target:
        for _ in range(40):  # the step grows with the latency
            mid = (low + high) / 2
            low, high = (mid, high) if step(mid) < target else (low, mid)
    costs.latency = low
    return costs


def analyse(results: dict[str, Any], max_foreign: float = 0.25) -> dict[str, Any]:
    """Measured ratios (median of per-repetition ratios to the baseline), predictions, quietness."""
    from ppmedia.planning.stepmodel import compare_placements, predict_step

    costs = calibrate(results)
    loads = results["loads"]
    base_walls = results["arms"][BASELINE]["walls"]
    arms: dict[str, Any] = {}
    for arm, (encoder, layers) in ARMS.items():
        walls = results["arms"][arm]["walls"]
        predicted = predict_step(SCHEDULE, costs, loads, n_ranks=2, layers_per_stage=layers, encoder=encoder,
                                 background=arm not in NO_LANE)
        arms[arm] = {"median_s": statistics.median(walls), "ratio": statistics.median(w / b for w, b in zip(walls, base_walls)),
                     "predicted_s": predicted.step_time, "bubble": predicted.bubble}
    base_pred = arms[BASELINE]["predicted_s"]
    for arm in arms.values():
        arm["predicted_ratio"] = arm["predicted_s"] / base_pred
    statics = [a for a in ARMS if a != BASELINE and ARMS[a][0] == "stage0"]
    best_static = min(statics, key=lambda a: arms[a]["median_s"])
    options, best = compare_placements(SCHEDULE, costs, loads, n_ranks=2, num_layers=TEXT_LAYERS)
    reasons = []
    if results["foreign_cores_before"] > max_foreign:
        reasons.append(f"other processes used {results['foreign_cores_before']:.2f} cores just before the start")
    if results["window"]["foreign_cores"] > max_foreign:
        reasons.append(f"other processes used {results['window']['foreign_cores']:.2f} cores during the runs")
    mean_load = statistics.mean(l for l in loads if l > 0)
    stage_work = (TEXT_LAYERS // 2) * (costs.layer_forward + costs.layer_bwd) + costs.stage_forward + costs.stage_backward
    vision_work = mean_load * (costs.vision_forward + costs.vision_bwd)
    return {"arms": arms, "best_static": best_static, "costs": costs.to_dict(), "unquiet": reasons,
            "vision_over_stage": vision_work / stage_work,
            "planner": [{"label": o.label, "layers": o.layers_per_stage, "predicted_s": o.step_time,
                         "ratio": o.step_time / base_pred} for o in options],
            "recommended": best.label, "spread_error": arms["spread"]["predicted_ratio"] - arms["spread"]["ratio"]}


def timelines(results: dict[str, Any], analysis: dict[str, Any]) -> list[list[Any]]:
    """Rows (stage 0 uniform, the best static split, spread) of (predicted, measured median step)."""
    from ppmedia.planning.stepmodel import OpCosts, predict_step
    from ppmedia.planning.timeline import Timeline

    costs = OpCosts.from_dict(analysis["costs"])
    rows = []
    for arm in (BASELINE, analysis["best_static"], "spread"):
        encoder, layers = ARMS[arm]
        predicted = predict_step(SCHEDULE, costs, results["loads"], n_ranks=2, layers_per_stage=layers, encoder=encoder,
                                 background=arm not in NO_LANE, title=f"predicted: {arm} (layers {list(layers)})").timeline
        walls = results["arms"][arm]["walls"]
        median = sorted(range(len(walls)), key=lambda i: walls[i])[len(walls) // 2]
        measured = Timeline(f"measured: {arm}, median step of {len(walls)}", 2, _bars(results["arms"][arm]["bars"][median]))
        rows.append([predicted, measured])
    return rows


def report(results: dict[str, Any], analysis: dict[str, Any], force: bool = False) -> str:
    """The tables and the final ``stage0: ...`` line."""
    from ppmedia.cli.tables import format_table

    arms = analysis["arms"]
    lines = [f"9. encoder spread: 2-process {SCHEDULE} pipelines, vision-heavy tiny Qwen2.5-VL (B={BATCH}, n={N_MICROBATCHES}, "
             f"{TEXT_LAYERS} decoder layers, images sized to {TARGET_RATIO[0]}-{TARGET_RATIO[1]} stages of decoder work per microbatch: measured below); "
             f"{results['pairs']} alternated repetitions per arm"]
    rows = [(arm, ARMS[arm][0], "+".join(map(str, ARMS[arm][1])), f"{a['median_s'] * 1e3:.1f}", f"{a['ratio']:.3f}",
             f"{a['predicted_s'] * 1e3:.1f}", f"{a['predicted_ratio']:.3f}", f"{a['predicted_ratio'] - a['ratio']:+.3f}")
            for arm, a in arms.items()]
    lines.append(format_table(("arm", "vision", "layers", "median ms", "measured / stage0", "predicted ms",
                               "predicted / stage0", "pred - meas"), rows))
    c = analysis["costs"]
    lines.append(f"calibration (ms): layer fwd {c['layer_forward'] * 1e3:.2f} bwd {c['layer_backward'] * 1e3:.2f}, stage "
                 f"+{c['stage_forward'] * 1e3:.2f}/+{c['stage_backward'] * 1e3:.2f}; vision "
                 f"fwd {c['vision_forward'] * 1e6:.2f} bwd {c['vision_backward'] * 1e6:.2f} us/MFLOP; first +{c['first_forward'] * 1e3:.2f}"
                 f"/+{c['first_backward'] * 1e3:.2f}, last +{c['last_forward'] * 1e3:.2f}/+{c['last_backward'] * 1e3:.2f}; "
                 f"spread sync {c['sync'] * 1e3:.2f}; fitted latency {c['latency'] * 1e3:.2f}; {c.get('cores')} cores, "
                 f"lane share of a free core {c.get('lane_share', 1.0):.2f}")
    grid = results.get("grid", list(GRID))
    lines.append(f"vision per microbatch (forward + backward) / one stage's decoder work: {analysis['vision_over_stage']:.2f} "
                 f"(images of {grid[1]}x{grid[2]} patches, sized on this machine to {TARGET_RATIO[0]}-{TARGET_RATIO[1]}: "
                 f"{results.get('sized_ratio', float('nan')):.2f} when sized)")
    lines.append("planner (" + "; ".join(f"{p['label']} {p['layers']}: {p['ratio']:.3f}" for p in analysis["planner"])
                 + f") recommends {analysis['recommended']}")
    lines.append(f"other processes' CPU: {results['foreign_cores_before']:.2f} cores in the second before, "
                 f"{results['window']['foreign_cores']:.2f} during the runs; 1-min load average {results['loadavg_before']:.2f} "
                 f"before, {results['loadavg_after']:.2f} after")
    best = analysis["best_static"]
    spread = arms["spread"]
    if analysis["unquiet"] and not force:
        lines.append(f"best static split ({best}): n/a; planner error: n/a")
        lines.append("stage0: spread/stage-0 step time = n/a (machine unquiet: " + "; ".join(analysis["unquiet"])
                     + "; rerun on a quiet machine, or --force)")
    else:
        flag = f" [unquiet: {'; '.join(analysis['unquiet'])}]" if analysis["unquiet"] else ""
        lines.append(f"best static split ({best}): {arms[best]['ratio']:.3f} of stage 0's step (predicted "
                     f"{arms[best]['predicted_ratio']:.3f}); planner error on the spread: {analysis['spread_error']:+.3f}")
        lines.append(f"stage0: spread/stage-0 step time = {spread['ratio']:.2f} (median of {results['pairs']} pairs){flag}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python tests/bench/stage0_bench.py [--pairs N] [--force] [--out FILE] [--timeline FILE.svg]``."""
    import argparse

    from ppmedia.planning.timeline import write_svg

    parser = argparse.ArgumentParser(description="ppmedia encoder-spread benchmark")
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--force", action="store_true", help="print the ratio even on an unquiet machine")
    parser.add_argument("--out", help="write the raw results and analysis as JSON")
    parser.add_argument("--timeline", help="draw predicted and measured timelines of the arms here (SVG)")
    args = parser.parse_args(argv)
    results = run(args.pairs)
    analysis = analyse(results)
    print(report(results, analysis, args.force))
    if args.timeline:
        write_svg(args.timeline, timelines(results, analysis), "one 1F1B step, predicted (left) and measured (right)")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"raw": results, "analysis": analysis}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
