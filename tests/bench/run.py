"""ppmedia benchmarks, side by side with NeMo Automodel 0.7.0's PP media staging (``make bench``).

Usage::

    python tests/bench/run.py [--out bench-results.json] [--quick] [--no-install] [--balance | --load-memory | --fsdp-memory | --stage0 [--timeline FILE.svg] | --data | --tp-memory | --pack | --video | --lora-memory | --e2e | --ep-memory | --cp-memory]

Measures, in one process with ``torch.set_num_threads(1)``:

1. split + stage + consume of one Qwen-like batch (flat patch rows, 0-2 images per sample) for
   ``B`` in {64, 256, 1024} and ``n`` in {16, 64}: ppmedia, Automodel's ``prepare_vlm_media_for_pp``
   with its staging and an inline-style consumer, and the floor (see ``staging_bench.py``);
2. host reads of tensor data per batch and bytes copied into the chunks;
3. ``next_vlm_media_chunk`` per call, on ppmedia's staging and on Automodel's partial staging next to
   the consumer Automodel inlines (the anchor);
4. ``adapter.merge`` against the model's own ``get_image_features`` + ``masked_scatter``, per family;
5. the whole first stage (embedding + media merge) with and without ppmedia's staging, per family
   (see ``model_bench.py``);
6. media-aware balancing: real 2-process 1F1B and GPipe pipelines on a skewed batch, balanced vs as-is,
   and the simulator's prediction (see ``balance_bench.py``; alone: ``--balance``);
7. load memory: the last of 4 stages straight from a mid-size checkpoint vs ``from_pretrained`` of the
   whole model, peak RSS in fresh processes (see ``load_memory_bench.py``; alone: ``--load-memory``).
8. FSDP2 memory: pp=2 x dp=2 (4 processes) on a mid-size model, the largest rank's parameters +
   gradients + optimizer state over one process's, FSDP2 and replicated side by side (see
   ``fsdp_memory_bench.py``; alone: ``--fsdp-memory``).
9. the encoder spread: real 2-process 1F1B pipelines on a vision-heavy tiny model, the vision tower on
   stage 0 (uniform and other static splits) vs spread over both ranks, with the planner's predictions
   and the timeline picture (see ``stage0_bench.py``; alone: ``--stage0``).
10. data (``--data`` alone; see ``data_bench.py``): media files read per replica at pp=2 / pp=1, the
   loader's samples/s with 0 and 2 workers next to the training step's.
11. tensor-parallel memory: pp=2 x tp=2 (4 processes) on section 8's model, the largest rank's
   parameters + gradients + optimizer state over one process's (see ``tp_memory_bench.py``; alone:
   ``--tp-memory``, with section 8 beside it).
12. packing (``--pack`` alone; see ``pack_bench.py``): a length-skewed dataset one epoch padded and one
   packed, the padding fractions and the label tokens per second side by side.
13. video reading (``--video`` alone; see ``video_bench.py``): a 60 s 30 fps clip read for a processor
   that samples 2 frames a second, against decoding only the kept frames, and today's
   decode-everything reader beside it.
14. LoRA memory (``--lora-memory``; see ``lora_memory_bench.py``): pp=2 on section 8's model, the largest
   rank's gradients + optimizer state with LoRA rank 8 over full fine-tuning's, both step times.
15. end to end (``--e2e`` alone; see ``e2e_bench.py``): ``examples/train.py`` at pp1 and pp2, its
   defaults and ``--pack``, against the model's own training loop written from transformers alone.
16. expert-parallel memory (``--ep-memory`` alone; see ``ep_memory_bench.py``): pp=2 x dp=2 with ep=2
   against without on a Qwen3-VL-MoE whose experts hold most parameters, and the all-to-all bytes of a step.
17. context-parallel memory (``--cp-memory``; see ``cp_memory_bench.py``): the activations saved for the
   backward per rank at pp=2 x cp=2 over pp=2 x cp=1 on rows of 4096 tokens, the decoder stage and stage 0,
   both step times; stage 0 on 64-frame video rows with frame sharding (``--cp-vision shard``) and without.

Every comparison interleaves its sides repetition by repetition; times are medians, ratios are
medians of per-repetition ratios. Prints the tables and writes them as JSON (``--out``).
The Automodel reference is installed on first use into ``tests/bench/.ref`` (``pip install --no-deps
--target``; see ``setup_reference.sh``); without it the Automodel columns are left out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import transformers  # noqa: E402

import ppmedia  # noqa: E402
from ppmedia.testing.tiny_models import FAMILIES  # noqa: E402

import balance_bench  # noqa: E402
import cp_memory_bench  # noqa: E402
import data_bench  # noqa: E402
import e2e_bench  # noqa: E402
import load_memory_bench  # noqa: E402
import fsdp_memory_bench  # noqa: E402
import lora_memory_bench  # noqa: E402
import tp_memory_bench  # noqa: E402
import ep_memory_bench  # noqa: E402
import model_bench  # noqa: E402
import pack_bench  # noqa: E402
import video_bench  # noqa: E402
import stage0_bench  # noqa: E402
import staging_bench  # noqa: E402
from reference import load_reference  # noqa: E402

BATCH_SIZES = (64, 256, 1024)
MICROBATCHES = (16, 64)
CHUNK_CALL_CONFIG = (256, 64)

#: issue targets: name -> (threshold, direction)
TARGET_SPEEDUP = {(256, 64): 3.0, (64, 16): 2.5}
TARGET_CHUNK_CALL_US = 3.0
TARGET_MERGE_RATIO = 1.05


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _table(title: str, header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    line = "  ".join("-" * w for w in widths)
    out = [title, line, "  ".join(h.rjust(w) for h, w in zip(header, widths)), line]
    out += ["  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in rows]
    out.append(line)
    return "\n".join(out)


def _environment(reference_note: str) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "ppmedia": ppmedia.__version__,
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "reference": reference_note,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench-results.json", help="JSON results path")
    parser.add_argument("--quick", action="store_true", help="a tenth of the repetitions (smoke run)")
    parser.add_argument("--no-install", action="store_true", help="do not pip-install the Automodel reference")
    parser.add_argument("--balance", action="store_true", help="run only the balancing benchmark (section 6)")
    parser.add_argument("--force", action="store_true", help="balancing: print the ratio even on an unquiet machine")
    parser.add_argument("--load-memory", action="store_true", help="run only the load-memory benchmark (section 7)")
    parser.add_argument("--fsdp-memory", action="store_true", help="run only the FSDP2 memory benchmark (section 8)")
    parser.add_argument("--tp-memory", action="store_true",
                        help="run only the tensor-parallel memory benchmark (section 11), section 8 beside it")
    parser.add_argument("--ep-memory", action="store_true",
                        help="run only the expert-parallel memory benchmark (section 16)")
    parser.add_argument("--stage0", action="store_true", help="run only the encoder-spread benchmark (section 9)")
    parser.add_argument("--data", action="store_true", help="run only the data benchmark (section 10)")
    parser.add_argument("--pack", action="store_true", help="run only the packing benchmark (section 12)")
    parser.add_argument("--video", action="store_true", help="run only the video-reading benchmark (section 13)")
    parser.add_argument("--lora-memory", action="store_true", help="run only the LoRA memory benchmark (section 14)")
    parser.add_argument("--cp-memory", action="store_true",
                        help="run only the context-parallel memory benchmark (section 17)")
    parser.add_argument("--e2e", action="store_true",
                        help="run only the end-to-end benchmark against the model's own loop (section 15)")
    parser.add_argument("--timeline", type=Path, default=None,
                        help="section 9: draw its predicted and measured timelines here (SVG)")
    args = parser.parse_args(argv)
    if args.balance:
        return _run_balance(args, None)
    if args.load_memory:
        return _run_load_memory(args, None)
    if args.fsdp_memory:
        return _run_fsdp_memory(args, None)
    if args.tp_memory:
        return _run_tp_memory(args, None)
    if args.ep_memory:
        return _run_ep_memory(args, None)
    if args.stage0:
        return _run_stage0(args, None)
    if args.data:
        return _run_data(args, None)
    if args.pack:
        return _run_pack(args, None)
    if args.e2e:
        return _run_e2e(args, None)
    if args.video:
        return _run_video(args, None)
    if args.lora_memory:
        return _run_lora_memory(args, None)
    if args.cp_memory:
        return _run_cp_memory(args, None)

    torch.set_num_threads(1)
    scale = 0.1 if args.quick else 1.0

    def reps(n: int) -> int:
        return max(5, int(n * scale))

    started = time.perf_counter()
    ref, ref_note = load_reference(install=not args.no_install)
    print(f"reference: {ref_note}")
    env = _environment(ref_note)
    print(f"torch {env['torch']}, transformers {env['transformers']}, python {env['python']}, {env['cpu']}, 1 thread")
    print()

    # -- 1 + 2: split + stage + consume ---------------------------------------------------------
    staging = []
    for batch_size in BATCH_SIZES:
        for n in MICROBATCHES:
            repeats = reps(1000 if batch_size <= 256 else 400)
            staging.append(staging_bench.run_split_stage_consume(ref, batch_size, n, repeats))
    rows = []
    for r in staging:
        t, reads, copied = r["median_s"], r["host_reads"], r["bytes_copied"]
        rows.append([
            r["batch_size"], r["n_microbatches"], r["images"],
            _us(t["floor"]), _us(t["ppmedia"]), _us(t["automodel"]) if ref else "-",
            f"{r['automodel_over_ppmedia']:.2f}x" if ref else "-", f"{r['ppmedia_over_floor']:.2f}x",
            f"{reads['ppmedia']} / {reads.get('automodel', '-')}",
            f"{copied['ppmedia']} / {copied.get('automodel', '-')}",
            ("yes" if r["same_chunks_as_automodel"] else "NO") if ref else "-",
        ])
    print(_table(
        "1-2. split + stage + consume, one batch (median us; host reads and bytes copied per batch)",
        ["B", "n", "images", "floor", "ppmedia", "automodel", "automodel/ppmedia", "ppmedia/floor",
         "host reads pp/am", "bytes copied pp/am", "same chunks"],
        rows,
    ))
    print()

    # -- 3: next_vlm_media_chunk per call --------------------------------------------------------
    chunk_call = staging_bench.run_chunk_call(ref, *CHUNK_CALL_CONFIG, repeats=reps(2000))
    per_call = chunk_call["median_s_per_call"]
    lists = len(ppmedia.STAGED_ATTRIBUTES)
    first = f"automodel's 1st step, {len(chunk_call['partial_absent_lists'])} of {lists} lists absent"
    later = f"automodel's later steps, {len(chunk_call['partial_later_absent_lists'])} of {lists} absent"
    print(_table(
        f"3. one consumer call per microbatch (median us per call, B={CHUNK_CALL_CONFIG[0]}, n={CHUNK_CALL_CONFIG[1]})",
        ["staging", "consumer", "us per call", "vs anchor"],
        [
            ["ppmedia's, all lists set", "ppmedia next_vlm_media_chunk", _us(per_call["ppmedia_full"]), "-"],
            [first, "ppmedia next_vlm_media_chunk", _us(per_call["ppmedia_partial"]),
             f"{chunk_call['partial_over_anchor']:.2f}x"],
            [later, "ppmedia next_vlm_media_chunk", _us(per_call["ppmedia_partial_later"]),
             f"{chunk_call['partial_later_over_anchor']:.2f}x"],
            [first, "automodel inline (anchor)", _us(per_call["anchor"]), "1.00x"],
        ],
    ))
    print(f"   staged {chunk_call['partial_staged_by']}; absent on its 1st step: "
          f"{', '.join(chunk_call['partial_absent_lists'])}")
    print()

    # -- 4 + 5: tiny models -----------------------------------------------------------------------
    merges, stages = [], []
    for family in model_bench.BENCH_FAMILIES:
        setup = model_bench.setup_family(family)
        merges.append(model_bench.run_merge(setup, repeats=reps(60)))
        stages.append(model_bench.run_first_stage(setup, repeats=reps(60)))
        del setup
    print(_table(
        "4. adapter.merge vs the model's own get_image_features + masked_scatter "
        "(all media microbatches of the tiny batch, median ms)",
        ["family", "mbs", "adapter.merge", "direct", "ratio", "encode+scatter ratio", "host reads ad/direct",
         "masks us", "counts us", "check us", "max |diff|"],
        [[m["family"], m["microbatches"], _ms(m["median_s"]["adapter"]), _ms(m["median_s"]["direct"]),
          f"{m['ratio']:.3f}", f"{m['encode_scatter_ratio']:.3f}",
          f"{m['host_reads']['adapter']} / {m['host_reads']['direct']}",
          _us(m["adapter_parts_s"]["placeholder_masks"]), _us(m["adapter_parts_s"]["feature_counts"]),
          _us(m["adapter_parts_s"]["count_check"]), f"{m['max_abs_diff']:.1e}"] for m in merges],
    ))
    print()
    print(_table(
        "5. first stage: embedding + media merge of the tiny batch (B=8, n=4), with vs without ppmedia (median ms)",
        ["family", "with ppmedia", "by hand", "ratio", "host reads with/by hand", "max |diff|"],
        [[s["family"], _ms(s["median_s"]["with"]), _ms(s["median_s"]["without"]), f"{s['ratio']:.3f}",
          f"{s['host_reads']['with']} / {s['host_reads']['without']}", f"{s['max_abs_diff']:.1e}"] for s in stages],
    ))
    print()

    # -- 6: balancing ------------------------------------------------------------------------------
    targets = []
    balance = _run_balance(args, targets)
    print()

    # -- 7: load memory ----------------------------------------------------------------------------
    load_memory = _run_load_memory(args, targets)
    print()

    # -- 8: FSDP2 memory -----------------------------------------------------------------------------
    fsdp_memory = _run_fsdp_memory(args, targets)
    print()

    # -- 9: the encoder spread ---------------------------------------------------------------------
    spread = _run_stage0(args, targets)
    print()

    # -- 10: data ----------------------------------------------------------------------------------
    data_result = _run_data(args, targets)
    print()

    # -- 11: tensor-parallel memory ------------------------------------------------------------------
    tp_memory = _run_tp_memory(args, targets)
    print()

    # -- 12: packing -------------------------------------------------------------------------------
    pack_result = _run_pack(args, targets)
    print()

    # -- 13: video reading -------------------------------------------------------------------------
    video_result = _run_video(args, targets)
    print()

    lora_memory = _run_lora_memory(args, targets)
    print()

    # -- 15: end to end against the model's own loop ------------------------------------------------
    e2e_result = _run_e2e(args, targets)
    print()

    # -- 16: expert-parallel memory ------------------------------------------------------------------
    ep_memory = _run_ep_memory(args, targets)
    print()

    # -- 17: context-parallel memory -----------------------------------------------------------------
    cp_memory = _run_cp_memory(args, targets)
    print()

    # -- targets ----------------------------------------------------------------------------------
    by_config = {(r["batch_size"], r["n_microbatches"]): r for r in staging}
    for (batch_size, n), floor in TARGET_SPEEDUP.items():
        measured = by_config[(batch_size, n)].get("automodel_over_ppmedia")
        targets.append({
            "target": f"split+stage+consume >= {floor}x faster than Automodel at B={batch_size}, n={n}",
            "measured": None if measured is None else round(measured, 2),
            "met": None if measured is None else measured >= floor,
        })
    most_reads = max(r["host_reads"]["ppmedia"] for r in staging)
    targets.append({"target": "<= 1 host read per batch (ppmedia)", "measured": most_reads, "met": most_reads <= 1})
    most_copied = max(r["bytes_copied"]["ppmedia"] for r in staging)
    shared = all(r["ppmedia_chunks_share_storage"] for r in staging)
    targets.append({"target": "0 bytes copied (ppmedia chunks share the batch's storage)", "measured": most_copied,
                    "met": most_copied == 0 and shared})
    call_us = per_call["ppmedia_full"] * 1e6
    targets.append({"target": f"next_vlm_media_chunk <= {TARGET_CHUNK_CALL_US} us per call (ppmedia's staging)",
                    "measured": round(call_us, 2), "met": call_us <= TARGET_CHUNK_CALL_US})
    partial = max(chunk_call["partial_over_anchor"], chunk_call["partial_later_over_anchor"])
    targets.append({"target": "next_vlm_media_chunk on automodel's partial staging <= the anchor's inline consumer",
                    "measured": f"{partial:.2f}x", "met": partial <= 1.0})
    for m in merges:
        targets.append({"target": f"{m['family']}: adapter.merge within 5% of the direct call",
                        "measured": round(m["ratio"], 3), "met": m["ratio"] <= TARGET_MERGE_RATIO})
    print(_table(
        "targets (issue: benchmarks side by side with NeMo Automodel 0.7.0)",
        ["target", "measured", "met"],
        [[t["target"], "-" if t["measured"] is None else t["measured"],
          "n/a" if t["met"] is None else ("yes" if t["met"] else "NO")] for t in targets],
    ))

    elapsed = time.perf_counter() - started
    results = {
        "balance": balance,
        "stage0": spread,
        "load_memory": load_memory,
        "fsdp_memory": fsdp_memory,
        "data": data_result,
        "tp_memory": tp_memory,
        "ep_memory": ep_memory,

        "pack": pack_result,
        "e2e": e2e_result,
        "video": video_result,
        "lora_memory": lora_memory,
        "cp_memory": cp_memory,
        "environment": env,
        "command": "python tests/bench/run.py" + (" --quick" if args.quick else ""),
        "elapsed_s": round(elapsed, 1),
        "split_stage_consume": staging,
        "chunk_call": chunk_call,
        "adapter_merge": merges,
        "first_stage": stages,
        "targets": targets,
    }
    _write_out(args, results, indent=2)
    print(f"\nwrote {args.out} ({elapsed:.0f} s)")
    return 0


def _run_balance(args: argparse.Namespace, targets: list[dict[str, Any]] | None) -> Any:
    """Section 6; alone (``targets`` None) it writes ``--out`` with its own results and returns 0."""
    pairs = 6 if args.quick else 16
    raw = balance_bench.run(pairs)
    analysis = balance_bench.analyse(raw)
    text = balance_bench.report(raw, analysis, args.force)
    body, _, last = text.rpartition("\n")
    print(body)
    study = balance_bench.random_batches_study(60 if args.quick else 300)
    analysis["random_batches"] = study
    print()
    print(_table(
        "6b. simulated balanced/plain step time on random batches (1F1B; 60% text-only samples, 1-3 images of "
        "256-4096 patches, Qwen2.5-VL-7B encoder cost; bucketed = image samples first)",
        ["stages", "microbatches", "samples/mb", "random median", "random p10", "bucketed median", "bucketed p10"],
        [[r["stages"], r["microbatches"], r["per_microbatch"], f"{r['random_median']:.3f}", f"{r['random_p10']:.3f}",
          f"{r['bucketed_median']:.3f}", f"{r['bucketed_p10']:.3f}"] for r in study],
    ))
    for c in analysis["comparisons"]:
        limit = 0.90 if (c["plan"], c["arm"]) == ("1f1b", "balanced") else (1.01 if c["arm"] == "balanced" else None)
        if limit is not None and targets is not None:
            targets.append({"target": f"balancing {c['plan']}: balanced/skewed <= {limit}",
                            "measured": None if analysis["unquiet"] else round(c["ratio"], 3),
                            "met": None if analysis["unquiet"] else c["ratio"] <= limit})
    result = {"raw": raw, "analysis": analysis}
    if targets is None:
        _write_out(args, {"balance": result})
        print(last)
        return 0
    print(last)
    return result


def _run_stage0(args: argparse.Namespace, targets: list[dict[str, Any]] | None) -> Any:
    """Section 9; alone (``targets`` None) it writes ``--out`` with its own results and returns 0."""
    raw = stage0_bench.run(6 if args.quick else 16)
    analysis = stage0_bench.analyse(raw)
    print(stage0_bench.report(raw, analysis, args.force))
    if args.timeline is not None:
        from ppmedia.planning.timeline import write_svg

        write_svg(str(args.timeline), stage0_bench.timelines(raw, analysis),
                  "one 1F1B step of the benchmark's batch, predicted (left) and measured (right)")
        print(f"wrote {args.timeline}")
    quiet = not analysis["unquiet"]
    spread, error = analysis["arms"]["spread"]["ratio"], analysis["spread_error"]
    result = {"raw": raw, "analysis": analysis}
    costs = args.out.parent / "bench-stage0-costs.json"  # per-operation costs for ppmedia plan --calibration
    costs.parent.mkdir(parents=True, exist_ok=True)
    costs.write_text(json.dumps(analysis["costs"], indent=1) + "\n")
    print(f"wrote {costs} (ppmedia plan --calibration {costs.name})")
    if targets is None:
        _write_out(args, {"stage0": result})
        return 0
    targets.append({"target": "encoder spread: spread/stage-0 step time <= 0.80",
                    "measured": round(spread, 3) if quiet else None, "met": spread <= 0.80 if quiet else None})
    worst = max((a["predicted_ratio"] - a["ratio"] for a in analysis["arms"].values()), key=abs)
    targets.append({"target": "encoder spread: planner within 0.03 of the measured ratio on every arm (the spread's: "
                              f"{error:+.3f})",
                    "measured": round(worst, 3) if quiet else None, "met": abs(worst) <= 0.03 if quiet else None})
    ratio = analysis["vision_over_stage"]
    targets.append({"target": "encoder spread: vision per microbatch / one stage's decoder work in 1.1-1.2",
                    "measured": round(ratio, 3), "met": 1.1 <= ratio <= 1.2})
    return result


def _run_load_memory(args: argparse.Namespace, targets: list[dict[str, Any]] | None) -> Any:
    """Section 7; alone (``targets`` None) it writes ``--out`` with its own results and returns 0."""
    result = load_memory_bench.run(repeats=1 if args.quick else 3)
    print(load_memory_bench.report(result))
    if targets is not None:
        targets.append({"target": f"load memory: last of {result['n_stages']} stages / whole model <= {result['target']}",
                        "measured": round(result["ratio"], 3), "met": result["met"]})
        return result
    _write_out(args, {"load_memory": result})
    return 0


def _run_fsdp_memory(args: argparse.Namespace, targets: list[dict[str, Any]] | None) -> Any:
    """Section 8; alone (``targets`` None) it writes ``--out`` with its own results and returns 0."""
    return _ratio_section(args, targets, "fsdp_memory", fsdp_memory_bench,
                          "fsdp-memory: pp=2 x dp=2 FSDP2, largest rank / one process")


def _run_tp_memory(args: argparse.Namespace, targets: list[dict[str, Any]] | None) -> Any:
    """Section 11; alone (``targets`` None) it also runs section 8, writes ``--out`` and returns 0."""
    result = tp_memory_bench.run()
    print(tp_memory_bench.report(result))
    if targets is None:
        fsdp = fsdp_memory_bench.run()
        print(fsdp_memory_bench.report(fsdp).splitlines()[-1])
        _write_out(args, {"tp_memory": result, "fsdp_memory": fsdp})
        return 0
    targets.append({"target": f"tp-memory: pp=2 x tp=2, largest rank / one process <= {result['target']}",
                    "measured": round(result["R"], 3), "met": result["R"] <= result["target"]})
    return result


def _run_ep_memory(args: argparse.Namespace, targets: list[dict[str, Any]] | None) -> Any:
    """Section 16; alone (``targets`` None) it writes ``--out`` and returns 0."""
    return _ratio_section(args, targets, "ep_memory", ep_memory_bench,
                          "ep-memory: pp=2 x dp=2, largest rank with ep2 / without")


def _run_lora_memory(args: argparse.Namespace, targets: list[dict[str, Any]] | None) -> Any:
    """Section 14; alone (``targets`` None) it writes ``--out`` with its own results and returns 0."""
    return _ratio_section(args, targets, "lora_memory", lora_memory_bench,
                          "lora-memory: pp=2, LoRA rank 8 / full fine-tuning", digits=4)


def _run_cp_memory(args: argparse.Namespace, targets: list[dict[str, Any]] | None) -> Any:
    """Section 17; alone (``targets`` None) it writes ``--out`` with its own results and returns 0."""
    result = _ratio_section(args, targets, "cp_memory", cp_memory_bench,
                            "cp-memory: saved activations per rank, pp=2 x cp=2 / pp=2 x cp=1 (decoder stage)")
    if targets is not None:
        targets.append({"target": f"cp-memory: stage 0 with frame sharding (64-frame video), pp=2 x cp=2 / pp=2 x cp=1 "
                                  f"<= {result['target_video']}",
                        "measured": round(result["stage0_video_ratio"], 3),
                        "met": result["stage0_video_ratio"] <= result["target_video"]})
    return result


def _ratio_section(args: argparse.Namespace, targets: list[dict[str, Any]] | None, key: str, bench: Any,
                   label: str, digits: int = 3) -> Any:
    """A memory section whose ``bench.run()`` gives a ratio ``R`` and its goal ``target``: printed; alone
    (``targets`` None) written to ``--out`` under ``key`` (returns 0), else its ``label <= target`` entry
    appended to ``targets`` (returns the result)."""
    result = bench.run()
    print(bench.report(result))
    if targets is None:
        _write_out(args, {key: result})
        return 0
    targets.append({"target": f"{label} <= {result['target']}", "measured": round(result["R"], digits),
                    "met": result["R"] <= result["target"]})
    return result


def _write_out(args: argparse.Namespace, results: Any, indent: int = 1) -> None:
    """``results`` as JSON into ``--out`` (its folder made if needed)."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=indent) + "\n")


def _run_data(args: argparse.Namespace, targets: list[dict[str, Any]] | None) -> Any:
    """Section 10; alone (``targets`` None) it writes ``--out`` with its own results and returns 0."""
    result = data_bench.run(repeats=2 if args.quick else 5)
    print(data_bench.report(result))
    if targets is None:
        _write_out(args, {"data": result})
        return 0
    reads = result["reads"]
    targets.append({"target": "data: media files read per replica at pp=2 / at pp=1 = 1.00",
                    "measured": round(reads["R"], 2), "met": reads["R"] == reads["goal"]})
    return result


def _run_pack(args: argparse.Namespace, targets: list[dict[str, Any]] | None) -> Any:
    """Section 12; alone (``targets`` None) it writes ``--out`` with its own results and returns 0."""
    result = pack_bench.run(repeats=2 if args.quick else 5)
    print(pack_bench.report(result))
    if targets is None:
        _write_out(args, {"pack": result})
        return 0
    targets.append({"target": f"pack: padding fraction packed / padded <= {pack_bench.GOAL_P}",
                    "measured": round(result["P"], 3), "met": result["P"] <= pack_bench.GOAL_P})
    targets.append({"target": f"pack: label tokens per second packed / padded >= {pack_bench.GOAL_R}",
                    "measured": round(result["R"], 2), "met": result["R"] >= pack_bench.GOAL_R})
    return result


def _run_e2e(args: argparse.Namespace, targets: list[dict[str, Any]] | None) -> Any:
    """Section 15; alone (``targets`` None) it writes ``--out`` with its own results and returns 0."""
    result = e2e_bench.run(rounds=1, records=32) if args.quick else e2e_bench.run()
    print(e2e_bench.report(result))
    if targets is None:
        _write_out(args, {"e2e": result})
        return 0
    targets.append({"target": f"e2e: train.py --pp 1 step / the model's own loop <= {e2e_bench.GOAL_R1}",
                    "measured": round(result["R1"], 2), "met": result["R1"] <= e2e_bench.GOAL_R1})
    goal2 = e2e_bench.GOAL_R2 * result["I"]
    targets.append({"target": f"e2e-pp2: train.py --pp 2 step / the model's own loop <= {goal2:.3f}",
                    "measured": round(result["R2"], 2), "met": result["R2"] <= goal2})
    return result


def _run_video(args: argparse.Namespace, targets: list[dict[str, Any]] | None) -> Any:
    """Section 13; alone (``targets`` None) it writes ``--out`` with its own results and returns 0."""
    result = video_bench.run(repeats=3 if args.quick else 7)
    print(video_bench.report(result))
    if targets is None:
        _write_out(args, {"video": result})
        return 0
    targets.append({"target": f"video-read: ppmedia / decoding only the kept frames <= {video_bench.GOAL_R}",
                    "measured": round(result["R"], 2), "met": result["R"] <= video_bench.GOAL_R and result["same_frames"]})
    return result


if __name__ == "__main__":
    sys.exit(main())
