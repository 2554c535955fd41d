"""Train a vision-language model with pipeline x data (x tensor) parallelism and ppmedia's staged media.

``examples/train.py`` is this package's :func:`main`; run it with torchrun; the world is ``pp x dp x tp`` processes (gloo on CPU here, nccl on GPUs)::

    torchrun --standalone --nproc-per-node 4 examples/train.py --family qwen2_5_vl --pp 2 --dp 2 \\
        --fsdp --schedule 1f1b --steps 20 --save-dir ckpt --save-every 10
    torchrun --standalone --nproc-per-node 2 examples/train.py --family qwen2_5_vl --pp 1 --dp 2 \\
        --fsdp --schedule 1f1b --steps 20 --save-dir ckpt --resume auto   # continues at step 10
    torchrun --standalone --nproc-per-node 2 examples/train.py --model demo-ckpt --data demo-data/train.jsonl \\
        --pp 2 --batch-size 4 --epochs 2 --lr 1e-3 --export trained   # fine-tune a checkpoint on data
    torchrun --standalone --nproc-per-node 2 examples/train.py --family qwen3_vl --pp 2 \\
        --encoder spread --trace step.svg                        # vision spread over both ranks, timeline
    torchrun --standalone --nproc-per-node 4 examples/train.py --family qwen2_5_vl --pp 2 --tp 2   # tensor parallel

With ``--model DIR --data PATH`` it fine-tunes a Hugging Face checkpoint on a data file or a
``datasets`` folder (``ppmedia.data``: the checkpoint's own processor and chat template, assistant-only
labels, each replica loading its share, media read only on the rank holding stage 0); without
``--data`` the tiny ``--family`` model trains on its 2 fixed stand-in batches (every rank holds the
global batch, replica ``r`` trains on its share). Each replica splits its rows into ``--microbatches``
microbatches for its pipeline. With ``--fsdp`` every stage is
sharded with FSDP2 over the replicas (gradients reduce-scattered as sums); without it every replica
holds whole stages and gradients are summed with one all-reduce. Then: tied embeddings summed across
the pipeline, gradients clipped to a global L2 norm, AdamW (one optimizer per stage module).
``--tp N`` splits every stage's language model over N ranks (``pipeline.apply_tensor_parallel``,
before FSDP2; the ranks laid out by ``pipeline.pipeline_mesh``; docs/tensor-parallel.md); with ``--data`` stage 0's
tp rank 0 reads each batch and sends it to its tp peers. Which options go together is one table,
:mod:`.composition` (docs/composition.md): a refused pair is one argparse line before anything starts.

Checkpoints are torch.distributed.checkpoint folders ``--save-dir/step{N}/`` under full-model names,
published atomically; ``--resume`` takes one written at any ``pp x dp`` layout, with or without
``--fsdp`` (``auto``: the newest complete one under ``--save-dir``, or a fresh start if there is none).
``--encoder spread`` lets every pipeline rank encode a share of each step's media
(``pipeline.EncoderSpread``; see docs/encoder-spread.md; with ``--model`` a rank without stage 0 loads
the checkpoint's vision side alone, and with ``--data`` stage 0's rank, which reads the media, sends
each rank the pixels of its shares), ``--trace FILE.svg`` draws the last step's
measured per-rank timeline. ``--eval-every N`` adds the loss of a held-out batch (forward only) to every N-th step's log line.

Guards (``pipeline.guards``; docs/training.md "Guards"): every option is checked before anything starts
(argparse's one line, exit 2); every step's global batch is compared across the ranks by a fingerprint
(``--no-batch-check`` turns it off); a step whose loss or gradient norm is not finite stops the run before
its optimizer step and before any checkpoint (``--skip-nonfinite N`` skips at most N such steps);
``--resume`` applies this run's ``--lr`` from the resumed step and prints what changed; a fresh run
refuses a ``--save-dir`` holding another run's checkpoints (``--overwrite`` deletes them).

A failed run prints one line on the first rank to fail (``train.py: FILE:LINE: ...`` for a bad record,
else ``train.py: step S: ...``; :mod:`.failures`), every failed rank writes its traceback to its log file
and exits with status 1; a dead peer is noticed at the next communication with it, at the latest after
the 60 s process-group timeout. A run whose first global batch holds no label token stops before its
optimizer step; the last step is checkpointed with ``--save-dir`` and evaluated with ``--eval-every``.

Everything in the loop is a library call (``ppmedia.pipeline``: ``stage_adamw``, ``learning_rate``, ``freeze``,
``train_step``, ``loader_shares``, ``step_record``, ...; docs/training.md "Fine-tuning with
examples/train.py"); this package only wires the flags to them. ``--export`` writes the trained stages
in their dtype with the processor's files.

The package: :mod:`.options` (the parser and the checks before anything starts), :mod:`.composition` (which
features go together), :mod:`.sources` (the
steps' batches: ``--data`` or the stand-in), :mod:`.loop` (build, resume, the steps, checkpoints, export).
"""

from .loop import build, main, resume, run
from .options import DEFAULT_STEPS, bad_option, build_parser, parse_args
from .sources import HELD_OUT_SEED, DataSource, StandIn, data_source, length_grouping

__all__ = [
    "DEFAULT_STEPS",
    "DataSource",
    "HELD_OUT_SEED",
    "StandIn",
    "bad_option",
    "build",
    "build_parser",
    "data_source",
    "length_grouping",
    "main",
    "parse_args",
    "resume",
    "run",
]
