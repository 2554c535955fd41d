"""``ppmedia demo``: the main job on the built-in tiny seeded models.

For each family (several per set of spawned processes): the tiny model and its 8-sample mixed batch (``ppmedia.testing.tiny_models``, the models behind
``fixtures/``), a real ``pp x dp`` process layout (default 2 x 1; gloo on 127.0.0.1, or the
``torchrun`` launcher's processes) running the chosen schedule (any torch ships) with shapes inferred
on the first step and with static shapes, and the single-process full-batch run of the same model as
the reference. With ``dp > 1`` each replica runs the pipeline on its share of the batch (its samples'
media only) and the gradients are summed across replicas.

The whole demo (``--family all``) ends with a short fine-tune (:func:`finetune`): the tiny Qwen2.5-VL
saved with its real processor, a generated image-chat dataset, ``ppmedia.data``'s loader and
``ppmedia.pipeline``'s training step in this process (2 pipeline stages on one rank), its loss falling.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Sequence

from ..testing import parity
from ..testing import tiny_models as tiny

__all__ = ["finetune", "run", "runs_finetune", "selected_families"]


def _say(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, flush=True)


def _layout(args: argparse.Namespace) -> tuple[int, int, str]:
    """``(pp, dp, where)``: under torchrun the launcher's world is ``pp x dp`` (``--dp`` given)."""
    dp = getattr(args, "dp", 1)
    if parity.launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world % dp:
            raise ValueError(f"--dp {dp} does not divide the {world} processes torchrun started")
        return world // dp, dp, f"torchrun, {world} processes"
    pp = getattr(args, "pp", 2)
    return pp, dp, f"{pp * dp} processes, gloo on 127.0.0.1"


#: families per spawned set of processes: starting a pair costs seconds (imports), running a family
#: about one; progress is printed after every group
GROUP = 8


def selected_families(family: str | Sequence[str] | None) -> list[str]:
    """The families ``--family`` names (repeatable), in order, each once; ``all`` or none: every built-in."""
    names = [family] if isinstance(family, str) else list(family or ["all"])
    if "all" in names:
        return list(tiny.FAMILIES)
    return list(dict.fromkeys(names))


def runs_finetune(family: str | Sequence[str] | None) -> bool:
    """Whether the demo ends with :func:`finetune`: for the whole demo (``--family`` not given, or ``all``
    among the ones given; ``--family`` is a list, None when absent)."""
    names = [family] if isinstance(family, str) else list(family or ["all"])
    return "all" in names


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns 0 when every family matched its reference within 1e-5."""
    families = selected_families(args.family)
    pp, dp, where = _layout(args)
    suffix = f"/dp{dp}" if dp > 1 else ""
    scenarios = [f"{args.schedule}/inferred{suffix}", f"{args.schedule}/static{suffix}"]
    _say(
        f"ppmedia demo: {len(families)} tiny VLM(s), {args.microbatches} microbatches per replica, schedule "
        f"{args.schedule}, pp={pp} x dp={dp} (shapes inferred on the first step, then static input/output "
        f"args), {args.steps} steps, {where}; {GROUP} families per set of processes"
    )
    failed = []
    started = time.perf_counter()
    for first in range(0, len(families), GROUP):
        group = families[first:first + GROUP]
        span = f"[{first + 1}-{first + len(group)}/{len(families)}]" if len(group) > 1 else f"[{first + 1}/{len(families)}]"
        _say(f"{span} {', '.join(group)}: building stages and spawning the pipeline ...")
        t0 = time.perf_counter()
        report = parity.run_parity(
            group, scenarios, steps=args.steps, n_microbatches=args.microbatches, world_size=pp * dp
        )
        _say(report.format())
        bad = [family for family in group if not report.family_ok(family)]
        failed += bad
        _say(f"{span} {'parity ok' if not bad else 'PARITY FAILED for ' + ', '.join(bad)} in {time.perf_counter() - t0:.1f} s\n")
    total = time.perf_counter() - started
    if failed:
        _say(f"ppmedia demo: parity FAILED for {', '.join(failed)} ({total:.1f} s)")
        return 1
    _say(f"ppmedia demo: all {len(families)} families match the single-process run within 1e-5 ({total:.1f} s)")
    if runs_finetune(args.family) and not parity.launched_by_torchrun():
        t0 = time.perf_counter()
        losses = finetune()
        _say(f"ppmedia demo: fine-tuned the tiny qwen2_5_vl on 16 generated images, {len(losses)} steps: loss "
             f"{losses[0]:.3f} -> {losses[-1]:.3f} ({time.perf_counter() - t0:.1f} s)")
        if not losses[-1] < losses[0]:
            return 1
    return 0


def finetune(steps: int = 12, lr: float = 5e-3) -> list[float]:
    """Fine-tune the tiny Qwen2.5-VL (saved with its processor) on 16 generated image-chat records
    (batches of 4, shuffled) for ``steps`` steps in this process: a one-rank gloo group, the
    interleaved schedule's 2 stages, 2 microbatches; returns the losses (the global token mean)."""
    import tempfile

    import torch
    import torch.distributed as dist
    import transformers

    from .. import data, pipeline
    from ..testing.datasets import save_tiny_checkpoint, write_image_chat_dataset
    from ..testing.word_tokenizer import text_words

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()  # save_pretrained's shard bar
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with tempfile.TemporaryDirectory() as folder:
            checkpoint = save_tiny_checkpoint("qwen2_5_vl", os.path.join(folder, "ckpt"))
            processor = transformers.AutoProcessor.from_pretrained(checkpoint)
            path = write_image_chat_dataset(os.path.join(folder, "data"), 16, words=text_words(processor.tokenizer))
            layout = pipeline.schedule_layout("interleaved")
            modules = pipeline.stages_from_pretrained(checkpoint, layout.n_stages(1), stages=layout.stage_indices(0, 1))
            pipeline.train_mode(modules)
            stages = pipeline.make_pipeline_stages(modules, layout.n_stages(1), layout.stage_indices(0, 1), "cpu")
            parts = pipeline.PipelineParts(pipeline.build_schedule("interleaved", stages, 2), stages[0],
                                           modules, pipeline.stage_adamw(modules, lr, 0.01), list(modules[0].tied))
            config, adapter = modules[0].config, modules[0].adapter
            loader = data.ReplicaLoader(data.open_dataset(str(path)),
                                        data.SampleProcessor(processor, max_length=64, config=config),
                                        global_batch_size=4, dp_rank=0, dp_size=1, seed=0, shuffle=True, adapter=adapter)
            shares = pipeline.loader_shares(loader, config, adapter, 2, stages_media=True)
            return [pipeline.train_step(parts, next(shares)).loss for _ in range(steps)]
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
        transformers.utils.logging.enable_progress_bar()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run(argparse.Namespace(family=None, microbatches=4, schedule="1f1b", steps=2, pp=2, dp=1)))
