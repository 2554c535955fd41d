"""Where a training run's steps come from: ``--data`` through :mod:`ppmedia.data` (:class:`DataSource`), or the
tiny family's two fixed stand-in batches (:class:`StandIn`)."""

from __future__ import annotations

import argparse
from typing import Any, Iterator

import torch.distributed as dist

from .. import pipeline
from ..testing import tiny_models

#: the model types that cannot train through ``--data``, with why (docs/data.md, "Families"): refused
#: by name before anything starts
DATA_REFUSED: dict[str, str] = {
    "step3p7": "its processor (Step3p7Processor) gives the crops as pixel_values_local with num_local_patches per "
               "image, and ppmedia's step3 layout reads Step3-VL's patch_pixel_values with num_patches per sample",
}


def data_refusal(model: str) -> str | None:
    """Why ``--data`` cannot train the checkpoint in ``model`` (its ``config.json``'s ``model_type`` in
    :data:`DATA_REFUSED`), as one line naming the family; ``None`` when it can."""
    import json
    import os

    try:
        with open(os.path.join(model, "config.json"), encoding="utf-8") as fh:
            model_type = json.load(fh).get("model_type")
    except (OSError, ValueError):
        return None  # the loader names a missing or bad config itself
    reason = DATA_REFUSED.get(str(model_type))
    return None if reason is None else f"--model {model}: {model_type} cannot train through --data: {reason}"


#: the seed of the held-out batch ``--eval-every`` evaluates (the training batches use seeds 0 and 1).
HELD_OUT_SEED = 1000


def say(message: str) -> None:
    """Print ``message`` on global rank 0 only."""
    if dist.get_rank() == 0:
        print(message, flush=True)


class StandIn:
    """The tiny family's two fixed batches (seeds 0 and 1, alternating), the same global batch on every
    rank, each replica's share cut from it: a stand-in for a data loader."""

    def __init__(self, ctx: dict[str, Any], args: argparse.Namespace) -> None:
        self.ctx, self.args, self.module = ctx, args, tiny_models.load(args.family)

    def share(self, seed: int, step: int | None = None) -> pipeline.ReplicaShare:
        ctx = self.ctx
        batch = pipeline.batch_to(self.module.build_batch(seed), ctx["device"], ctx["dtype"])
        if step is not None and not self.args.no_batch_check:  # every rank must hold the same global batch
            pipeline.check_batch_agreement(batch, step=step)
        return pipeline.share_of_global_batch(batch, ctx["config"], ctx["adapter"], ctx["dp_rank"], self.args.dp,
                                              self.args.microbatches)

    def shares(self, start: int) -> Iterator[pipeline.ReplicaShare]:
        step = start
        while True:
            yield self.share(step % 2, step)
            step += 1

    def held_out(self) -> list[pipeline.ReplicaShare]:
        return [self.share(HELD_OUT_SEED)]

    def total_steps(self) -> int:
        return int(self.args.steps)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        return None


def length_grouping(args: argparse.Namespace) -> int:
    """The training loader's ``group_by_length``: ``--group-by-length`` on the shuffled order; 1 (none)
    with ``--no-shuffle`` (each step holds the next ``--batch-size`` records of the file, in order) and
    with ``--pack`` (packed rows). The held-out data is never grouped."""
    return 1 if args.no_shuffle or args.pack else int(args.group_by_length)


class DataSource:
    """``--data`` through ``ppmedia.data``: the checkpoint's own processor (``AutoProcessor``) per sample,
    this replica's share of every global batch, media read only on the rank holding stage 0."""

    def __init__(self, ctx: dict[str, Any], args: argparse.Namespace) -> None:
        import transformers

        from ppmedia import data

        self.ctx, self.args = ctx, args
        processor = transformers.AutoProcessor.from_pretrained(args.model)
        if args.chat_template:  # a processor saved without one (Phi-4-multimodal's)
            with open(args.chat_template, encoding="utf-8") as fh:
                processor.chat_template = fh.read()
        self.processor = data.SampleProcessor(processor, max_length=args.max_length, config=ctx["config"])
        self.loader = self._loader(args.data, shuffle=not args.no_shuffle)
        self.per_epoch = len(self.loader.dataset) // args.batch_size
        self._held_out: list[pipeline.ReplicaShare] | None = None
        if self.per_epoch == 0:
            raise ValueError(f"--data {args.data}: {len(self.loader.dataset)} usable samples, fewer than one global "
                             f"batch (--batch-size {args.batch_size})")

    def _loader(self, path: str, *, shuffle: bool) -> Any:
        from ppmedia import data

        ctx, args = self.ctx, self.args
        dataset = data.open_dataset(path, media_dir=args.media_dir, skip_bad_samples=args.skip_bad_samples)
        return data.ReplicaLoader(
            dataset, self.processor, global_batch_size=args.batch_size, dp_rank=ctx["dp_rank"], dp_size=args.dp,
            seed=args.seed, shuffle=shuffle, workers=args.workers, pp_group=ctx["parts"].pp_group,
            reads_media=ctx["parts"].first is not None, adapter=ctx["adapter"], skip_bad_samples=args.skip_bad_samples,
            dp_group=ctx["parts"].dp_group,  # the counts (and the saved skip count) over all replicas
            packing=self._packing() if args.pack else None,
            group_by_length=length_grouping(args) if shuffle else 1,
            # --tp: stage 0's tp peers hold the same rows; their tp rank 0 reads, the peers receive the batch
            tp_group=ctx["parts"].tp_group if ctx["parts"].first is not None else None)

    def _packing(self) -> Any:
        """``--pack``: rows of ``--max-length``, a multiple of ``--microbatches``, ordered by vision cost."""
        from ppmedia import data

        args = self.args
        return data.Packing(args.max_length, args.microbatches, max(1, args.pack_across_batches),
                            config=self.ctx["config"])

    def _shares(self, loader: Any, epochs: int | None) -> Iterator[pipeline.ReplicaShare]:
        ctx, parts = self.ctx, self.ctx["parts"]
        return pipeline.loader_shares(loader, ctx["config"], ctx["adapter"], self.args.microbatches,
                                      dp_group=parts.dp_group, stages_media=parts.first is not None,
                                      device=ctx["device"], dtype=ctx["dtype"], epochs=epochs)

    def shares(self, start: int) -> Iterator[pipeline.ReplicaShare]:
        for share in self._shares(self.loader, None):
            if not self.args.no_batch_check:  # the pipeline (and tp) ranks of a replica must hold the same rows
                rows = {"input_ids": share.input_ids, "attention_mask": share.attention_mask, "labels": share.labels}
                for group in (self.ctx["parts"].pp_group, self.ctx["parts"].tp_group):
                    if group is not None:
                        pipeline.check_batch_agreement(rows, group=group)
            yield share

    def held_out(self) -> list[pipeline.ReplicaShare]:
        """``--eval-data`` in order, processed once, kept for every evaluation."""
        if self._held_out is None:
            self._held_out = list(self._shares(self._loader(self.args.eval_data, shuffle=False), 1))
            if not self._held_out:
                raise ValueError(f"--eval-data {self.args.eval_data}: fewer samples than one global batch "
                                 f"(--batch-size {self.args.batch_size})")
        return self._held_out

    def total_steps(self) -> int:
        return int(self.args.steps) if self.args.steps is not None else int(self.args.epochs) * self.per_epoch

    def state_dict(self) -> dict[str, Any]:
        return dict(self.loader.state_dict())

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        if not state:
            raise ValueError(f"the checkpoint of step {step} holds no data loader position (saved without --data)")
        self.loader.load_state_dict(state)


def data_source(ctx: dict[str, Any], args: argparse.Namespace) -> Any:
    """Where the steps' shares come from: ``--data`` through ``ppmedia.data``, else the stand-in."""
    if args.data:
        return DataSource(ctx, args)
    say(f"no --data: training the tiny {args.family} model on its 2 fixed stand-in batches")
    return StandIn(ctx, args)
