"""``ppmedia demo``: the main job on the built-in tiny seeded models.

For each family: the tiny model and its 8-sample mixed batch (``ppmedia.tiny``, the models behind
``fixtures/``), a real 2-process pipeline (gloo on 127.0.0.1, or the ``torchrun`` launcher's
processes) running the chosen schedule with shapes inferred on the first step and with static shapes,
and the single-process full-batch run of the same model as the reference.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from .testing import parity
from .testing import tiny_models as tiny

__all__ = ["run"]


def _say(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, flush=True)


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns 0 when every family matched its reference within 1e-5."""
    families = list(tiny.FAMILIES) if args.family == "all" else [args.family]
    scenarios = [f"{args.schedule}/inferred", f"{args.schedule}/static"]
    torchrun = parity.launched_by_torchrun()
    where = f"torchrun, {os.environ.get('WORLD_SIZE')} processes" if torchrun else "2 processes, gloo on 127.0.0.1"
    _say(
        f"ppmedia demo: {len(families)} tiny VLM(s), {args.microbatches} microbatches, schedule {args.schedule} "
        f"(shapes inferred on the first step, then static input/output args), {args.steps} steps, {where}"
    )
    failed = []
    started = time.perf_counter()
    for i, family in enumerate(families, 1):
        _say(f"[{i}/{len(families)}] {family}: building stages and spawning the pipeline ...")
        t0 = time.perf_counter()
        report = parity.run_parity(family, scenarios, steps=args.steps, n_microbatches=args.microbatches)
        _say(report.format())
        _say(f"[{i}/{len(families)}] {family}: {'parity ok' if report.ok else 'PARITY FAILED'} in {time.perf_counter() - t0:.1f} s\n")
        if not report.ok:
            failed.append(family)
    total = time.perf_counter() - started
    if failed:
        _say(f"ppmedia demo: parity FAILED for {', '.join(failed)} ({total:.1f} s)")
        return 1
    _say(f"ppmedia demo: all {len(families)} families match the single-process run within 1e-5 ({total:.1f} s)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run(argparse.Namespace(family="all", microbatches=4, schedule="1f1b", steps=2)))
