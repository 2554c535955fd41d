"""A parity worker: joins the process group, runs every family and scenario of its job step by step
(pipeline, reference, checks), and gathers every rank's results into the merged report."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import tempfile
import time
import traceback
from dataclasses import asdict
from datetime import timedelta
from typing import Any, Iterator

import torch

from .batches import _build_batch, _microbatch_infos, _shares, _split
from .build import _build, _loaded
from .groups import _GROUP_CACHE, _groups, _root_cause, exit_worker
from .probes import _check_calls, _encoded_rows, _media_rows, _Probe
from .report import ParityReport, _merge
from .scenarios import Scenario, _Job
from .steps import _accumulate_padded, _clip_both, _compare, _eval_loss, _pipeline_step, _reference_step

__all__ = [
    "run_worker",
]


def _run_scenario(
    family: str, scenario: Scenario, job: _Job, rank: int, world: int, pristine: torch.nn.Module, tiny_module: Any,
    checkpoint: str | None = None,
) -> dict[str, Any]:
    from ...pipeline import count_valid_tokens, make_labels, shard_batch
    from ...registry import get_adapter

    n = scenario.microbatches or job.n_microbatches
    adapter, config = get_adapter(pristine), pristine.config
    g = _groups(world, rank, scenario.dp, scenario.tp, scenario.ep)
    built = _build(scenario, job, g, pristine, tiny_module, checkpoint)
    loaded = _loaded(built, scenario, g, checkpoint)
    probe = _Probe(built)
    step_results = []
    try:
        for step in range(job.steps):
            where = f"{family} {scenario.name} step {step}"
            batch = _build_batch(tiny_module, scenario, job.seed + step)
            ids, mask = batch["input_ids"], batch["attention_mask"]
            num_valid = count_valid_tokens(make_labels(ids, config, adapter, attention_mask=mask))
            media_batch, local, media_local = _shares(scenario, tiny_module, batch, job.seed + 1000 + step, g, adapter, config)
            if scenario.variant == "varlen":
                _accumulate_padded(built, scenario, g, job.seed + 500 + step, probe, tiny_module, n)
            loss_eval = _eval_loss(built, scenario, local, media_local, num_valid, probe, adapter, config, n)
            losses, wall_pipeline, staged = _pipeline_step(built, scenario, g, local, media_local, num_valid, probe, adapter, config, n)
            targets = make_labels(ids, config, adapter, attention_mask=mask, shift=False)
            out, wall_reference = _reference_step(built, tiny_module, batch, targets, accumulate=scenario.variant == "varlen")
            norms = _clip_both(built, g) if scenario.clip else (None, None)
            diffs, scale, counts, worst = _compare(built)
            expected_calls, expected_layers = _check_calls(probe, built, scenario, step, n, where)
            global_split = _split(adapter, config, dict(media_batch), g.dp * n)
            step_results.append(
                {
                    "step": step,
                    # one last stage per replica: its tp peers' losses are the same loss
                    "loss_pipeline": float(sum(l.detach().float() for l in losses)) if losses and not g.tp_rank else None,
                    "loss_reference": float(out.loss.detach()),
                    "grad_diff_vision": diffs[False],
                    "grad_diff_lm": diffs[True],
                    "params_compared": len(built.owned),
                    "vision_params_compared": counts[False],
                    "worst_param_vision": worst[False],
                    "worst_param_lm": worst[True],
                    "reference_grad_max_vision": scale[False],
                    "reference_grad_max_lm": scale[True],
                    "wall_pipeline_s": wall_pipeline,
                    "wall_reference_s": wall_reference,
                    "first_stage_calls": len(probe.trace) if built.first is not None else None,
                    "expected_first_stage_calls": expected_calls,
                    "chunk_trace": [c for c, _ in probe.trace] if built.first is not None else None,
                    "grad_norm_pipeline": norms[0],
                    "grad_norm_reference": norms[1],
                    "layer_calls": probe.layer_calls,
                    "expected_layer_calls": expected_layers,
                    "vision_layer_calls": probe.vision_calls,
                    # a balanced split copies the media in the new order: nothing to locate in the batch
                    "media_rows": [] if scenario.balance else _media_rows(probe, media_batch, global_split, g, n, where),
                    "encoded": _encoded_rows(built, scenario, staged, g, where),
                    "loss_eval": loss_eval,
                    "position_problems": built.positions.take() if built.positions is not None else [],
                }
            )
            built.optimizer.step()
            built.ref_optimizer.step()
    finally:
        probe.remove()
        if built.positions is not None:
            built.positions.remove()
    return {
        "family": family,
        "scenario": asdict(scenario),
        "n_stages": built.n_stages,
        "layers_per_stage": built.layers_per_stage,
        "stage_indices": built.indices,
        "dp_rank": g.dp_rank,
        "tp_rank": g.tp_rank,
        "loaded": loaded,
        "owned": sorted(built.owned),
        "all_params": sorted(dict(built.reference.named_parameters(remove_duplicate=False))),
        "steps": step_results,
    }


def _run_family(family: str, job: _Job, rank: int, world: int) -> dict[str, Any]:
    from .. import tiny_models as tiny

    module = tiny.load(family)
    pristine = module.build_model(job.seed)
    batch = module.build_batch(job.seed)
    from ...registry import get_adapter

    specs = job.scenarios_of(family)
    dp = max((spec.get("dp", 1) for spec in specs), default=1)
    infos = _microbatch_infos(get_adapter(pristine), pristine.config, dict(batch), job.n_microbatches, dp)
    wants_checkpoint = any(spec.get("pretrained") for spec in specs)
    with _checkpoint(module, job, rank) if wants_checkpoint else contextlib.nullcontext((pristine, None)) as (written, path):
        results = [
            _run_scenario(family, Scenario(**spec), job, rank, world, written if spec.get("pretrained") else pristine,
                          module, path)
            for spec in specs
        ]
    return {
        "family": family,
        "model_type": pristine.config.model_type,
        "n_microbatches": job.n_microbatches,
        "batch_size": int(batch["input_ids"].shape[0]),
        "seq_len": int(batch["input_ids"].shape[1]),
        "microbatches": [asdict(i) for i in infos],
        "scenarios": results,
    }


@contextlib.contextmanager
def _checkpoint(tiny_module: Any, job: _Job, rank: int) -> Iterator[tuple[torch.nn.Module, str]]:
    """Rank 0 writes the tiny model (``build_checkpoint_model`` if the module has one, else
    ``build_model``) with ``save_pretrained`` in 40 KB shards; yields ``(model, directory)`` on every
    rank and removes the directory afterwards (collective: every rank enters)."""
    import shutil

    import torch.distributed as dist

    build = getattr(tiny_module, "build_checkpoint_model", tiny_module.build_model)
    model = build(job.seed)
    box: list[Any] = [None]
    if rank == 0:
        from transformers.utils import logging as hf_logging

        box[0] = tempfile.mkdtemp(prefix="ppmedia-parity-checkpoint-")
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            model.save_pretrained(box[0], max_shard_size="40KB")
        finally:
            if bars:
                hf_logging.enable_progress_bar()
    dist.broadcast_object_list(box, src=0)
    try:
        yield model, box[0]
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(box[0], ignore_errors=True)


def run_worker(
    rank: int,
    world_size: int,
    init_method: str,
    job: dict[str, Any],
    tolerance: float = 1e-5,
    launcher: str = "spawn",
) -> ParityReport:
    """One worker of a parity run: joins the gloo group, runs every family and scenario of ``job``,
    gathers all ranks' results and returns the merged report (on every rank).

    ``job`` holds ``families``, ``scenarios`` (dicts of :class:`Scenario` fields), ``steps``,
    ``n_microbatches``, ``seed``, ``lr`` and optionally ``extra`` (family -> its own scenario dicts). ``init_method`` is ``tcp://127.0.0.1:PORT`` or ``env://``.

    With ``env://`` (torchrun) the process group is created on the first call and kept for later
    calls in the same process (``ppmedia demo`` runs one family per call): re-creating it would
    meet the previous incarnation's keys in torchrun's agent store, which breaks the ``dp``/``pp``
    sub-groups. The launcher's process ends with :func:`exit_worker`. A spawned worker destroys its
    group before returning.
    """
    import torch.distributed as dist

    torch.set_num_threads(1)
    spec = _Job(**job)
    start = time.perf_counter()
    keep = init_method == "env://"
    if not (keep and dist.is_initialized()):
        kwargs: dict[str, Any] = {"timeout": timedelta(seconds=60)}
        if keep:
            dist.init_process_group("gloo", init_method="env://", **kwargs)
        else:
            dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size, **kwargs)
    try:
        mine = [_run_family(family, spec, dist.get_rank(), dist.get_world_size()) for family in spec.all_families()]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        return _merge(gathered, dist.get_world_size(), tolerance, launcher, time.perf_counter() - start)
    finally:
        gc.collect()
        if not keep:
            _GROUP_CACHE.clear()  # the sub-groups die with the process group
            dist.destroy_process_group()


def _spawn_entry(rank: int, world_size: int, init_method: str, job: dict[str, Any], tolerance: float, out_dir: str) -> None:
    import faulthandler

    faulthandler.enable(all_threads=True)
    try:
        report = run_worker(rank, world_size, init_method, job, tolerance, launcher="spawn")
    except BaseException as exc:
        with open(os.path.join(out_dir, f"error-rank{rank}.txt"), "w") as fh:
            fh.write(_root_cause(exc).replace("\n", " ") + "\n" + traceback.format_exc())
        raise
    if rank == 0:
        path = os.path.join(out_dir, "report.json")
        with open(path + ".tmp", "w") as fh:
            json.dump(report.to_dict(), fh)
        os.replace(path + ".tmp", path)
    exit_worker(0)
