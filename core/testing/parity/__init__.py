"""Parity harness: a tiny model family through a REAL multi-process pipeline vs. the model itself.

:func:`run_parity` spawns ``world_size`` (default 2) worker processes talking gloo on 127.0.0.1 (or,
launched under ``torchrun``, runs the worker in the current process with environment rendezvous).
Each worker builds the same tiny seeded model (``ppmedia.testing.tiny_models``), its own pipeline stages
(:mod:`ppmedia.pipeline`) and runs every requested :class:`Scenario` for ``steps`` training steps::

    local = shard_batch(batch, dp_rank, dp, ...)            # dp > 1: this replica's samples and media
    staged = split_media(local, n, images_per_sample=..., videos_per_sample=...)
    with stage_media(first_stage, staged):
        schedule.step(input_ids, attention_mask, target=labels, losses=losses,
                      loss_kwargs={"num_valid_tokens": N})      # N: the GLOBAL batch's valid tokens
    sync_tied_gradients(..., pp_group); all_reduce_gradients(..., dp_group)   # dp > 1
    [clip_grad_norm]; compare with the reference; SGD step (pipeline and reference)

A scenario (:class:`Scenario`) picks the schedule (any torch ships), inferred or static shapes, the
``dp x pp`` layout (``pp = world_size // dp``; rank ``= dp_rank * pp + pp_rank``), the model's own
activation checkpointing, bfloat16 parameters and global-norm clipping, or stages loaded from a
checkpoint (``pretrained``: rank 0 writes the tiny model with ``save_pretrained`` once per family, in
many small shards, and every rank builds only its stages with
:func:`ppmedia.pipeline.stages_from_pretrained`; the ranks need a file system they share).

The reference is computed in the same worker, single-process, on the full batch, by the model's OWN
forward (``model(**reference_inputs(batch), labels=...)``, transformers' own loss: the mean token
cross-entropy, i.e. the same normalisation as :func:`ppmedia.pipeline.pipeline_loss` summed over the
microbatches). Each rank compares the gradients of every parameter its stages hold (vision encoder on
the first stage, language model everywhere) with the reference's; the last stage compares the loss.

The worker also checks, on the first stage, that its forward ran ``n + 1`` times on the first step of
a scenario with inferred shapes (the schedule's shape-inference forward) and ``n`` times otherwise, and
that every call consumed the media chunk of the microbatch whose rows it got (a mismatch in counts
would already raise in ``adapter.merge``), and that every media view it consumed covers exactly the
rows of its replica's microbatch in the GLOBAL batch's tensors. It counts the calls of the decoder
layers (twice per microbatch with activation checkpointing). A failed check raises in the worker,
which fails the run.

Results come back as a :class:`ParityReport` (per family: a per-microbatch table and, per scenario and
step, both losses, the max gradient differences split into vision and language model, wall times).

One module per concern; this package keeps every public name: ``scenarios`` (what a run asks for),
``launch`` (:func:`run_parity` and ``python -m ppmedia.testing.parity``), ``groups`` (the processes and
their groups), ``worker`` (one worker: every family and scenario, the results gathered), ``build`` (a
rank's pipeline and the reference beside it), ``batches`` (a scenario's batches and microbatches),
``steps`` (a step on both sides and the comparison), ``probes`` (what a worker checks during a step),
``report`` (the report, its pass rules and the merging of every rank's rows).
"""

from .batches import microbatch_table
from .groups import exit_worker, launched_by_torchrun
from .launch import ParityError, main, run_parity
from .report import (BF16_GRAD_RTOL, BF16_LOSS_TOLERANCE, FamilyReport, MicrobatchInfo, ParityReport, ScenarioResult,
                     StepResult)
from .scenarios import ALL_SCENARIOS, DEFAULT_SCENARIOS, FAULTS, VARIANTS, VARLEN_PAD, Scenario, parse_scenarios
from .worker import run_worker

# names the module had outside __all__: the packed scenarios' constants, the benchmarks' free port
from .groups import _free_port  # noqa: F401
from .scenarios import PACKED_FAULTS, PACKED_PER_ROW  # noqa: F401

__all__ = [
    "ALL_SCENARIOS",
    "BF16_GRAD_RTOL",
    "BF16_LOSS_TOLERANCE",
    "DEFAULT_SCENARIOS",
    "FAULTS",
    "FamilyReport",
    "MicrobatchInfo",
    "ParityError",
    "ParityReport",
    "Scenario",
    "ScenarioResult",
    "StepResult",
    "VARIANTS",
    "VARLEN_PAD",
    "exit_worker",
    "launched_by_torchrun",
    "main",
    "microbatch_table",
    "parse_scenarios",
    "run_parity",
    "run_worker",
]
