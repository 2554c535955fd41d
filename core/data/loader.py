"""The per-replica loader: this data-parallel replica's share of every global batch, resumable to the
sample, with media read only on the pipeline rank that encodes them."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ..pipeline.loss import IGNORE_INDEX, SHIFTED_MARK
from .batching import collate_samples, pad_to_length
from .errors import DataError
from .grouped import grouped_order, record_length_key
from .packed import Packing, pack_steps
from .processor import TOKEN_KEYS, SampleProcessor, TooLong
from .sources import RecordDataset

__all__ = ["ReplicaLoader", "epoch_order"]

log = logging.getLogger("ppmedia.data")


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The sample order of ``epoch``: ``range(n)``, or a permutation drawn from ``seed`` and ``epoch``
    alone (the same on every rank and at every layout)."""
    if not shuffle:
        return list(range(n))
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=gen).tolist()


@dataclass
class _Skip:
    where: str
    problem: str
    too_long: bool


@dataclass
class _Sample:
    where: str
    tensors: dict[str, Any]


class _Samples(torch.utils.data.Dataset[Any]):
    """Record ``i`` processed, or a :class:`_Skip` (a too long sample always; a bad one when skipping)."""

    def __init__(self, dataset: RecordDataset, processor: SampleProcessor, skip_bad: bool) -> None:
        self.dataset, self.processor, self.skip_bad = dataset, processor, skip_bad

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        try:
            return _Sample(self.dataset.where(i), self.processor(self.dataset[i]))
        except TooLong as e:
            return _Skip(e.where, e.problem, True)
        except DataError as e:
            if not self.skip_bad:
                raise
            return _Skip(e.where, e.problem, False)


class _Collate:
    """One read's items -> its steps' batches: one padded batch, or (packing) the packed batches of the
    read's ``steps`` shares, each with ``members`` (its samples' positions in the read)."""

    def __init__(self, pad_id: int, packing: Packing | None, share: int, sample_axis_keys: tuple[str, ...] = ()) -> None:
        self.pad_id, self.packing, self.share, self.sample_axis_keys = pad_id, packing, share, sample_axis_keys

    def __call__(self, items: list[Any]) -> list[dict[str, Any]]:
        samples = [None if isinstance(s, _Skip) else s.tensors for s in items]
        if self.packing is None:
            names = [None if isinstance(s, _Skip) else s.where for s in items]
            batches: list[dict[str, Any]] = [collate_samples(samples, self.pad_id, names=names,
                                                             sample_axis_keys=self.sample_axis_keys)]
            batches[0]["members"] = list(range(len(items)))
        else:
            batches = []
            for batch, members in pack_steps(samples, len(items) // self.share, self.packing, self.pad_id):
                batch["members"] = members
                batches.append(batch)
        batches[0]["skipped_samples"] = [(i, s.where, s.problem, s.too_long) for i, s in enumerate(items)
                                         if isinstance(s, _Skip)]
        return batches


#: the per-batch values the reading rank of a pipeline group broadcasts with the token keys.
_SHARED_STATS = ("n_samples", "packed_rows", "sample_names", "n_skipped")


def _worker_init(_: int) -> None:
    torch.set_num_threads(1)


class ReplicaLoader:
    """This replica's share of each global batch, collated, with host-side stats.

    Global batch ``i`` of an epoch holds the samples at positions ``[i*B, (i+1)*B)`` of the epoch's
    order (:func:`epoch_order`: dataset order without ``shuffle``); replica ``dp_rank`` gets the
    contiguous ``B / dp_size`` of them at ``[dp_rank*b, (dp_rank+1)*b)``. An incomplete last batch is
    dropped. Iterating yields the rest of the current epoch, then moves to the next one.

    Each batch is a dict: the token keys ``[b, S]`` (``labels`` shifted and marked for
    :func:`~ppmedia.pipeline.pipeline_loss`), the media keys in the processor's layout (only where
    ``reads_media``), and ``n_samples`` (real samples; a skipped one leaves a filler row without
    labels), ``n_label_tokens`` (this replica's), ``skipped`` (samples skipped so far: the records left
    out when the dataset was opened, counted once, plus the samples skipped since, over all replicas
    with ``dp_group``, else this replica's own), ``sample_names`` (``FILE:LINE`` per row, ``None`` for
    fillers); with ``dp_group`` also ``global_label_tokens`` and ``global_samples`` (the global batch's).

    With ``packing`` (:class:`~ppmedia.data.Packing`) each batch's kept samples are packed into rows of
    at most ``packing.max_length`` tokens instead (:func:`ppmedia.packing.pack_samples`: ``[R, S]``
    token keys, ``attention_mask`` holding each token's sample number within its row, 0 on padding;
    ``R`` a multiple of ``packing.microbatches``); a step holds the same samples as unpacked.
    ``sample_names`` then names the step's samples (skipped ones left out) and ``packed_rows`` lists
    per row the indices into ``sample_names`` of its samples. With ``packing.across_batches = W > 1``
    the replica's shares of ``W`` consecutive global batches are packed together (batches ``[kW,
    (k+1)W)`` of the epoch) and their rows dealt to those ``W`` steps: which samples share a step then
    changes, within the window and within the replica. The state keeps its meaning (``next_sample``
    counts ``B`` per step); a resumed position inside a window reads the window again and continues
    at the same step.

    With ``group_by_length = W > 1`` (and no ``packing``) the epoch's order is grouped by length
    (:func:`~ppmedia.data.grouped_order`): each window of ``W`` global batches of the order is sorted
    by the records' length keys (:func:`~ppmedia.data.record_length_key`: text characters and a fixed
    count per media item, from the records alone, no media opened) and cut into its ``W`` batches, taken in
    an order drawn from the seed, the epoch and the window. A step's rows are then of similar length, so
    the padding to its longest row shrinks; which samples share a step changes within the window. The
    grouped order is a function of the seed, the epoch and the records only: the same on every rank and
    at every ``pp x dp`` layout, and resumed to the sample as the plain one.

    Args:
        dataset: from :func:`~ppmedia.data.open_dataset`.
        processor: a :class:`~ppmedia.data.SampleProcessor`.
        global_batch_size: ``B``, samples per step over all replicas; a multiple of ``dp_size``.
        dp_rank, dp_size: this replica and the replica count.
        seed, shuffle: the order (:func:`epoch_order`).
        workers: ``DataLoader`` worker processes (0: in this process).
        pp_group: this replica's pipeline group. With it, only the member with ``reads_media`` reads
            and processes; it broadcasts the token keys and stats to the others, which open no media.
        reads_media: ``False`` on the pipeline ranks that do not encode (stage 0's rank reads).
        tp_group: the tensor-parallel group of a rank with ``reads_media`` (stage 0's ``tp`` peers, which
            hold the same rows). With it, only ``tp`` rank 0 reads and processes; one
            ``broadcast_object_list`` per batch sends the whole collated batch (token keys, media, stats)
            to its peers, which open no media: every file is opened once per replica.
        adapter: the family adapter; with it each batch also holds ``media_counts``
            (``adapter.media_counts(batch, config)``: the counts :func:`ppmedia.split_media` takes).
        skip_bad_samples: skip records that fail when processed (missing or undecodable media, a
            template that refuses the turns), each logged once and counted, instead of raising.
        dp_group: the data-parallel group (the replicas at this rank's pipeline position). With it,
            one ``all_reduce`` per batch sums the label tokens, samples and new skips over the
            replicas, so ``skipped`` and :meth:`state_dict` hold the global count (needed to resume
            it at ``dp_size > 1``); without it at ``dp_size > 1`` they hold this replica's own.
        packing: pack each step's samples into rows (see above); ``packing.max_length`` must be at
            least the processor's ``max_length`` (which must be set: every sample then fits a row).
        group_by_length: ``W``, global batches per window of length grouping (see above); 1: none,
            each step holds its share of the order as it is. Not with ``packing``.
    """

    def __init__(self, dataset: RecordDataset, processor: SampleProcessor, *, global_batch_size: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0, shuffle: bool = True, workers: int = 0,
                 pp_group: Any = None, reads_media: bool = True, adapter: Any = None,
                 skip_bad_samples: bool = False, dp_group: Any = None, packing: Packing | None = None,
                 group_by_length: int = 1, tp_group: Any = None) -> None:
        if global_batch_size < dp_size or global_batch_size % dp_size:
            raise ValueError(f"global_batch_size={global_batch_size} is not a positive multiple of dp_size={dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} outside 0..{dp_size - 1}")
        if not reads_media and pp_group is None:
            raise ValueError("reads_media=False needs pp_group: the rank that reads media broadcasts the tokens")
        if packing is not None and (processor.max_length is None or processor.max_length > packing.max_length):
            raise ValueError(f"packing.max_length={packing.max_length}, but the processor's max_length is "
                             f"{processor.max_length}: set SampleProcessor(max_length=) to at most the row length, "
                             f"so that every sample fits a packed row")
        if isinstance(group_by_length, bool) or not isinstance(group_by_length, int) or group_by_length < 1:
            raise ValueError(f"group_by_length={group_by_length!r}; expected an int >= 1 (1: no grouping)")
        if packing is not None and group_by_length > 1:
            raise ValueError(f"group_by_length={group_by_length} with packing: packed rows are not grouped; pool "
                             f"batches for packing with Packing(across_batches=)")
        self.dataset, self.processor, self.adapter, self.packing = dataset, processor, adapter, packing
        self.group_by_length = group_by_length
        self._length_keys: list[int] | None = None
        self.global_batch_size, self.dp_rank, self.dp_size = global_batch_size, dp_rank, dp_size
        self.seed, self.shuffle, self.workers, self.skip_bad_samples = seed, shuffle, workers, skip_bad_samples
        self.pp_group, self.reads_media, self.dp_group = pp_group, reads_media, dp_group
        if tp_group is not None and not reads_media:
            raise ValueError("tp_group goes with reads_media=True: stage 0's tp peers share the rows they read")
        self.tp_group: Any = tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None
        #: whether this rank reads and processes (stage 0's rank, its tp rank 0)
        self.reads = reads_media and (self.tp_group is None or dist.get_rank(self.tp_group) == 0)
        self.epoch, self.next_sample, self.skipped = 0, 0, len(dataset.skipped)
        self._named: set[str] = set()
        self._source = self._find_source() if pp_group is not None else None

    def _find_source(self) -> int:
        flags: list[Any] = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(flags, (dist.get_rank(), self.reads_media), group=self.pp_group)
        readers = [rank for rank, reads in flags if reads]
        if len(readers) != 1:
            raise ValueError(f"exactly one rank of the pipeline group reads media, got ranks {readers}")
        return int(readers[0])

    def __len__(self) -> int:
        """Global batches left in the current epoch."""
        return (len(self.dataset) - self.next_sample) // self.global_batch_size

    def _order(self) -> list[int]:
        """The current epoch's order: :func:`epoch_order`, grouped by length with ``group_by_length``."""
        order = epoch_order(len(self.dataset), self.seed, self.epoch, self.shuffle)
        if self.group_by_length == 1:
            return order
        if self._length_keys is None:  # the records alone: no media opened, the same on every rank
            self._length_keys = [record_length_key(record) for record in self.dataset]
        return grouped_order(order, self._length_keys, self.global_batch_size, self.group_by_length, seed=self.seed,
                             epoch=self.epoch)

    def _shares(self) -> list[list[int]]:
        order = self._order()
        b, shares = self.global_batch_size // self.dp_size, []
        for start in range(self.next_sample, len(order) - self.global_batch_size + 1, self.global_batch_size):
            first = start + self.dp_rank * b
            shares.append(order[first : first + b])
        return shares

    def _reads(self) -> list[tuple[list[int], int]]:
        """The rest of the epoch as reads: ``(samples, steps to drop)``. Unpooled: one share a read.
        Pooled (``packing.across_batches = W``): the shares of batches ``[kW, (k+1)W)`` of the epoch
        (counted from its start, or from ``next_sample`` when that is no multiple of the batch size), the
        first read dropping the steps before ``next_sample`` (a resumed position inside a window)."""
        window = 1 if self.packing is None else self.packing.across_batches
        if window == 1:
            return [(share, 0) for share in self._shares()]
        B, order = self.global_batch_size, self._order()
        base = 0 if self.next_sample % B == 0 else self.next_sample
        b, reads = B // self.dp_size, []
        starts = list(range(base, len(order) - B + 1, B))
        for k in range(0, len(starts), window):
            group = starts[k : k + window]
            if group[-1] < self.next_sample:
                continue
            samples = [i for start in group for i in order[start + self.dp_rank * b : start + (self.dp_rank + 1) * b]]
            reads.append((samples, sum(start < self.next_sample for start in group)))
        return reads

    def _log_skips(self, skips: list[tuple[int, str, str, bool]]) -> None:
        for _, where, problem, too_long in skips:
            if where not in self._named:  # each named once in the log
                self._named.add(where)
                log.warning("skipped %s: %s%s", where, problem, " (longer than max_length)" if too_long else "")

    def _read(self) -> Iterator[dict[str, Any]]:
        reads, b = self._reads(), self.global_batch_size // self.dp_size
        loader = DataLoader(_Samples(self.dataset, self.processor, self.skip_bad_samples),
                            batch_sampler=[samples for samples, _ in reads], num_workers=self.workers,
                            collate_fn=_Collate(self.processor.pad_id, self.packing, b, self.processor.sample_axis_keys),
                            worker_init_fn=_worker_init if self.workers else None)
        for (samples, drop), batches in zip(reads, loader):
            skips = batches[0].pop("skipped_samples")
            self._log_skips(skips)
            skipped = {position for position, _, _, _ in skips}
            for step, batch in enumerate(batches):
                if step < drop:  # read again after a resume: counted and yielded before it
                    continue
                batch["n_skipped"] = sum(position // b == step for position in skipped)
                members = batch.pop("members")
                batch["sample_names"] = [None if m in skipped else self.dataset.where(samples[m]) for m in members]
                batch["n_samples"] = sum(m not in skipped for m in members)
                yield batch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        shares = self._shares()
        source = self._read() if self.reads else iter(())
        for _ in shares:
            batch = next(source) if self.reads else {}
            if self.tp_group is not None:  # stage 0's tp peers: the reader's whole batch
                batch = self._from_tp_reader(batch)
            if self.pp_group is not None:
                batch = self._broadcast(batch)
            labels = batch["labels"]
            batch["n_label_tokens"] = int(((labels != IGNORE_INDEX) & (labels != SHIFTED_MARK)).sum())
            new = int(batch.pop("n_skipped"))
            if self.dp_group is not None:
                new = self._sum_over_replicas(batch, new)
            self.skipped += new
            batch["skipped"] = self.skipped
            if self.adapter is not None and self.reads_media:
                batch["media_counts"] = self._media_counts(batch)
            self.next_sample += self.global_batch_size
            yield batch
        self.epoch, self.next_sample = self.epoch + 1, 0

    def _media_counts(self, batch: dict[str, Any]) -> Any:
        """The adapter's counts of the batch; its complaint names the batch's records."""
        try:
            return self.adapter.media_counts(batch, self.processor.config)
        except (ValueError, TypeError) as e:
            names = ", ".join(str(n) for n in batch["sample_names"] if n is not None)
            raise DataError(names, f"the batch of these records does not fit the {self.adapter.name} layout "
                                   f"({type(e).__name__}: {e})") from None

    def _from_tp_reader(self, batch: dict[str, Any]) -> dict[str, Any]:
        shared: list[Any] = [batch]
        dist.broadcast_object_list(shared, src=dist.get_global_rank(self.tp_group, 0), group=self.tp_group)
        return dict(shared[0])

    def _broadcast(self, batch: dict[str, Any]) -> dict[str, Any]:
        shared: list[Any] = [{k: v for k, v in batch.items() if k in TOKEN_KEYS or k in _SHARED_STATS}]
        dist.broadcast_object_list(shared, src=self._source, group=self.pp_group)
        return batch if self.reads_media else dict(shared[0])

    def _sum_over_replicas(self, batch: dict[str, Any], new_skips: int) -> int:
        """One ``all_reduce`` over ``dp_group`` of [label tokens, samples, new skips, each replica's row
        length]: the global counts go into ``batch`` and its token rows are padded to the longest
        replica's (every replica's stages then see the same shapes: FSDP2's collectives inside torch's
        stage re-initialisation, which follows the shapes, run on every replica or on none); returns
        the replicas' new skips together."""
        device = torch.device("cpu")
        if dist.get_backend(self.dp_group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        # slot 3 + dp_rank carries this replica's row length, so the one reduction also gives the longest
        lengths = [0] * self.dp_size
        lengths[self.dp_rank] = int(batch["input_ids"].shape[1])
        sums = torch.tensor([batch["n_label_tokens"], batch["n_samples"], new_skips, *lengths], dtype=torch.int64,
                            device=device)
        dist.all_reduce(sums, group=self.dp_group)
        tokens, samples, skips, *seen = (int(v) for v in sums.tolist())
        pad_to_length(batch, max(seen), self.processor.pad_id)
        batch["global_label_tokens"], batch["global_samples"] = tokens, samples
        return skips

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch yielded: ``epoch``, ``next_sample`` (in the epoch's
        order), the order's ``seed`` and ``shuffle`` (the RNG: the order is drawn from them alone),
        ``dataset_len``, ``skipped`` (the global count with ``dp_group`` or at ``dp_size`` 1) and
        ``group_by_length`` (the windows of the order; a state saved without it had none). The
        same on every rank; independent of ``pp x dp``."""
        return {"epoch": self.epoch, "next_sample": self.next_sample, "seed": self.seed, "shuffle": self.shuffle,
                "dataset_len": len(self.dataset), "skipped": self.skipped, "group_by_length": self.group_by_length}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (any layout, any batch size): the next batch starts at its
        ``next_sample``; its seed, shuffle and grouping replace this loader's."""
        if int(state["dataset_len"]) != len(self.dataset):
            raise ValueError(f"the loader state is of a dataset of {state['dataset_len']} samples, this one has "
                             f"{len(self.dataset)}")
        self.epoch, self.next_sample = int(state["epoch"]), int(state["next_sample"])
        self.seed, self.shuffle, self.skipped = int(state["seed"]), bool(state["shuffle"]), int(state["skipped"])
        if self.packing is None:
            self.group_by_length = int(state.get("group_by_length", 1))
