"""Starting a parity run: :func:`run_parity` checks its arguments, then spawns the workers (or, under
``torchrun``, runs the worker in this process) and returns the report; :func:`main` is
``python -m ppmedia.testing.parity``."""

from __future__ import annotations

import inspect
import json
import os
import tempfile
from dataclasses import asdict
from typing import Iterable, Mapping, Sequence

from .groups import _free_port, _root_cause, launched_by_torchrun
from .report import ParityReport
from .scenarios import DEFAULT_SCENARIOS, PACKED_FAULTS, PACKED_PER_ROW, Scenario, _Job, parse_scenarios
from .worker import _spawn_entry, run_worker

__all__ = [
    "ParityError",
    "main",
    "run_parity",
]


class ParityError(RuntimeError):
    """A worker failed; the message carries the worker's traceback."""


def _validate(families: list[str], scenarios: list[Scenario], n_microbatches: int, world_size: int, steps: int) -> None:
    from ...pipeline import schedule_layout
    from .. import tiny_models as tiny

    for family in families:
        tiny.load(family)  # a built-in name or a plugin's dotted module name; ValueError/TypeError if neither
    if steps < 1:
        raise ValueError(f"steps: got {steps}; expected >= 1")
    if world_size < 1:
        raise ValueError(f"world_size: got {world_size}; expected >= 1")
    batch_size = 8  # every tiny batch
    if n_microbatches < 1 or batch_size % n_microbatches:
        raise ValueError(
            f"n_microbatches: got {n_microbatches}; the tiny batches have {batch_size} samples and the "
            f"schedules need equal microbatches: use 1, 2, 4 or 8"
        )
    for sc in scenarios:
        if world_size % (sc.dp * sc.tp):
            raise ValueError(f"{sc.name}: dp {sc.dp} x tp {sc.tp} does not divide the {world_size} processes")
        total = batch_size // PACKED_PER_ROW if sc.packed else batch_size
        rows = total // sc.dp if total % sc.dp == 0 else 0
        n = sc.microbatches or n_microbatches
        if rows == 0 or n < 1 or rows % n:
            raise ValueError(
                f"{sc.name}: {sc.dp} replicas of the {batch_size}-sample batch cannot each run {n} "
                f"equal microbatches"
            )
        n_stages = schedule_layout(sc.schedule).n_stages(world_size // (sc.dp * sc.tp))
        if sc.layers is not None and len(sc.layers) != n_stages:
            raise ValueError(f"{sc.name}: {len(sc.layers)} layer counts for {n_stages} stages")
        for family in families:
            _refuse_idle_ranks(family, sc, world_size // (sc.dp * sc.tp))
        if sc.variant == "text_only_first":
            for family in families:
                if "text_only_first" not in inspect.signature(tiny.load(family).build_batch).parameters:
                    raise ValueError(f"{sc.name}: the tiny {family} batch has no text_only_first order")
        if sc.fault == "stale_copies" and sc.encoder != "spread":
            raise ValueError(f"{sc.name}: the stale_copies fault breaks the encoder spread: add /spread")
        if sc.encoder == "spread" and sc.fault not in (None, "stale_copies"):
            raise ValueError(f"{sc.name}: the encoder spread runs no fault but stale_copies")
        if sc.encoder == "spread" and sc.pretrained:
            raise ValueError(f"{sc.name}: the encoder spread cuts its vision copies from the full model; "
                             f"stages_from_pretrained gives none: drop /pretrained or /spread")
        if sc.balance and (sc.dp != 1 or sc.fault is not None):
            raise ValueError(f"{sc.name}: balancing is run with one replica and no fault")
        if sc.pretrained and sc.checkpointing:
            raise ValueError(f"{sc.name}: a scenario loads its stages from a checkpoint or checkpoints activations, not both")
        if sc.fsdp and sc.dp < 2:
            raise ValueError(f"{sc.name}: fsdp shards over the data-parallel replicas: use dp2 or more")
        if sc.variant == "text_only_replica" and sc.dp != 2:
            raise ValueError(f"{sc.name}: text_only_replica gives replica 0 of two the text-only half: use dp2")
        if sc.fault in PACKED_FAULTS and not sc.packed:
            raise ValueError(f"{sc.name}: the {sc.fault} fault breaks packed rows: add /packed")
        if sc.packed and (sc.variant is not None or sc.balance or sc.encoder != "stage0" or sc.pretrained):
            raise ValueError(f"{sc.name}: /packed runs with stage0 encoding, no variant, balancing or checkpoint")
        if sc.fault == "unreduced_tower" and sc.tp < 2:
            raise ValueError(f"{sc.name}: the unreduced_tower fault breaks tensor parallelism: add /tp2")
        if sc.tp > 1 and sc.encoder == "spread":
            raise ValueError(f"{sc.name}: the encoder spread does not go with tensor parallelism")
        if sc.fault == "bare_module" and sc.shapes != "inferred":
            raise ValueError(f"{sc.name}: the bare_module fault only breaks a run with inferred shapes")


def _refuse_idle_ranks(family: str, sc: Scenario, pp: int) -> None:
    """A pipeline rank whose stages hold neither a decoder layer nor the first or last stage has nothing
    to train (and torch's optimizer refuses an empty parameter list): refuse it before spawning."""
    from ...pipeline import default_layer_split, schedule_layout
    from .. import tiny_models as tiny

    layout = schedule_layout(sc.schedule)
    n_stages = layout.n_stages(pp)
    config = tiny.load(family).build_config()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_layers = int(getattr(text, "num_hidden_layers"))
    layers = list(sc.layers) if sc.layers is not None else default_layer_split(num_layers, n_stages)
    for rank in range(pp):
        indices = layout.stage_indices(rank, pp)
        if all(layers[i] == 0 and 0 < i < n_stages - 1 for i in indices):
            raise ValueError(
                f"{sc.name}: {n_stages} pipeline stages ({pp} ranks x {layout.stages_per_rank}) for the {num_layers} decoder "
                f"layers of {family} (per stage {layers}): pipeline rank {rank} would hold only stages {indices}, "
                f"without a layer; use at most {max(1, (num_layers + 2) // layout.stages_per_rank)} pipeline ranks for "
                f"{layout.name}" + (", or a schedule with one stage per rank" if layout.stages_per_rank > 1 else "")
            )


def run_parity(
    families: str | Sequence[str],
    scenarios: Iterable[str | Scenario] = DEFAULT_SCENARIOS,
    *,
    steps: int = 2,
    n_microbatches: int = 4,
    seed: int = 0,
    lr: float = 1e-2,
    tolerance: float = 1e-5,
    world_size: int = 2,
    family_scenarios: Mapping[str, Iterable[str | Scenario]] | None = None,
    rtol: float = 0.0,
) -> ParityReport:
    """Run ``families`` through a real multi-process pipeline and compare with the model itself.

    Every family runs every scenario in ONE set of worker processes (starting a pair costs seconds).
    Under ``torchrun`` (:func:`launched_by_torchrun`) the current process is the worker: environment
    rendezvous, the launcher's world size; every rank returns the merged report.

    Args:
        families: one family name or several (``ppmedia.testing.tiny_models.FAMILIES``).
        scenarios: :class:`Scenario` objects or strings such as ``"1f1b/static"``.
        steps: training steps per scenario; an SGD step (``lr``) follows each, on both sides.
        n_microbatches: microbatches per step (the tiny batches have 8 samples).
        seed: model and batch seed (step ``k`` uses batch ``seed + k``).
        lr: the SGD learning rate of the steps, at most a tiny module's ``MAX_PARITY_LR`` (Gemma 4's
            tiny model: 1e-4).
        tolerance: what :meth:`ScenarioResult.passed` and :attr:`ParityReport.ok` accept: the
            absolute bound on the loss difference and on every gradient difference (float32).
        rtol: a relative bound beside it: a value passes within ``tolerance + rtol * scale``, the
            scale being the reference loss, or the largest reference gradient entry of the side
            (vision or language model). 0 (the default): absolute only. For families whose
            gradients are large (entries of 1e3 and more), where float32 rounding alone exceeds 1e-5.
        world_size: processes to spawn (ignored under torchrun).
        family_scenarios: more scenarios for single families, run in the same processes after
            ``scenarios`` (a family named only here runs only its own).

    Raises:
        ParityError: a worker failed (its traceback is in the message).
        ValueError: bad arguments (checked before anything starts).
    """
    if not (isinstance(tolerance, (int, float)) and tolerance >= 0 and isinstance(rtol, (int, float)) and rtol >= 0):
        raise ValueError(f"run_parity: tolerance {tolerance!r}, rtol {rtol!r}; expected numbers >= 0")
    names = [families] if isinstance(families, str) else list(families)
    specs = parse_scenarios(scenarios)
    extra = {family: parse_scenarios(more) for family, more in (family_scenarios or {}).items()}
    if launched_by_torchrun():
        world_size = int(os.environ["WORLD_SIZE"])
    _validate(names, specs, n_microbatches, world_size, steps)
    for family, more in extra.items():
        _validate([family], more, n_microbatches, world_size, steps)
    job = asdict(_Job(names, [asdict(s) for s in specs], steps, n_microbatches, seed, lr,
                      {family: [asdict(s) for s in more] for family, more in extra.items()}))

    if launched_by_torchrun():
        try:
            nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))  # torchrun's agents (nodes)
            launcher = f"torchrun, {nodes} nodes" if nodes > 1 else "torchrun"
            report = run_worker(int(os.environ["RANK"]), world_size, "env://", job, tolerance, launcher=launcher)
            report.rtol = rtol
            return report
        except Exception as exc:
            raise ParityError(f"parity worker failed on rank {os.environ['RANK']}: {_root_cause(exc)}") from exc

    import multiprocessing

    import torch.multiprocessing as mp

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(_MAIN_GUARD)
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    with tempfile.TemporaryDirectory(prefix="ppmedia-parity-") as out_dir:
        try:
            mp.spawn(
                _spawn_entry,
                args=(world_size, init_method, job, tolerance, out_dir),
                nprocs=world_size,
                join=True,
            )
        except Exception as exc:  # ProcessRaisedException / ProcessExitedException
            summaries, details = [], []
            for rank in range(world_size):
                path = os.path.join(out_dir, f"error-rank{rank}.txt")
                if os.path.exists(path):
                    with open(path) as fh:
                        summary, _, trace = fh.read().partition("\n")
                    summaries.append(f"rank {rank}: {summary}")
                    details.append(f"--- rank {rank} ---\n{trace}")
            if not summaries:  # no worker got as far as _spawn_entry
                summaries.append(f"{exc} (no worker reached the harness: a call of run_parity at the top level of a "
                                 f"script needs `if __name__ == \"__main__\":` around it, the workers import the script)")
            raise ParityError("parity worker failed: " + "; ".join(summaries) + "\n" + "\n".join(details)) from exc
        with open(os.path.join(out_dir, "report.json")) as fh:
            report = ParityReport.from_dict(json.load(fh))
        report.rtol = rtol
        return report


#: what a worker says when run_parity is called while it imports the script (no ``__main__`` guard)
_MAIN_GUARD = (
    "run_parity: called while a spawned worker imports the main module: the workers start by importing "
    "the script that called run_parity, so a call at its top level runs again in each of them; put the "
    "call under `if __name__ == \"__main__\":`"
)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ppmedia.testing.parity [FAMILY ...] [--scenario S ...] [--steps N] [--microbatches N] [--world-size N]``.

    Works as a plain command (spawns the workers) and under ``torchrun --nproc-per-node 2``.
    Prints the report (rank 0 only under torchrun); exit status 0 when every scenario passed.
    """
    import argparse

    from .. import parity
    from .. import tiny_models as tiny

    description = (parity.__doc__ or "").splitlines()[0]  # the package's first line
    parser = argparse.ArgumentParser(prog="python -m ppmedia.testing.parity", description=description)
    parser.add_argument("families", nargs="*", default=list(tiny.FAMILIES), help="families (default: all)")
    parser.add_argument(
        "--scenario", action="append",
        help="schedule[/shapes][/fault][/dpN][/tpN][/fsdp][/mbN][/ckpt][/bf16][/clip][/layers=A+B][/variant][/balanced][/pretrained][/spread][/nolane], e.g. ZBVZeroBubble/static/dp2 (repeatable; "
        "default: gpipe and 1f1b, both shapes); dpN needs N x pp processes (--world-size or torchrun)",
    )
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=2, help="processes to spawn (ignored under torchrun)")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="absolute bound on loss and gradient differences")
    parser.add_argument("--rtol", type=float, default=0.0,
                        help="relative bound beside it: pass within tolerance + rtol * scale (default 0)")
    args = parser.parse_args(argv)
    try:
        report = run_parity(
            args.families,
            args.scenario or DEFAULT_SCENARIOS,
            steps=args.steps,
            n_microbatches=args.microbatches,
            seed=args.seed,
            world_size=args.world_size,
            tolerance=args.tolerance,
            rtol=args.rtol,
        )
    except (ValueError, TypeError) as exc:  # arguments refused before anything started: one line
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    if not launched_by_torchrun() or os.environ.get("RANK") == "0":
        print(report.format())
    return 0 if report.ok else 1
