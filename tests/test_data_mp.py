"""ppmedia.data across real processes (gloo on 127.0.0.1): in a pipeline group only the rank that
encodes reads media; the other receives the same token rows and opens no media file. The loss's
token count is summed over the data-parallel replicas. Packed rows (``packing=``) reach the other rank
the same way, with their per-sample masks and row plan."""

from __future__ import annotations

import builtins
import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import data_fixtures as fx

pytestmark = pytest.mark.multiprocess


def _worker(rank: int, port: int, root: str) -> None:
    torch.set_num_threads(1)
    from ppmedia import data
    from ppmedia.data import media

    opened: list[str] = []
    real_open = builtins.open

    def counting_open(file, *args, **kwargs):  # every open of this process, not only the loader's own
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        processor = data.SampleProcessor(fx.AutoProcessor_from(os.path.join(root, "processor")))
        media.OPENED.clear()
        ds = data.open_dataset(os.path.join(root, "train.jsonl"))
        builtins.open = counting_open
        try:  # one replica, pp = 2: rank 0 holds stage 0 and reads; rank 1 gets the token rows
            loader = data.ReplicaLoader(ds, processor, global_batch_size=4, seed=2, pp_group=dist.group.WORLD,
                                        reads_media=rank == 0)
            batches = list(loader)
        finally:
            builtins.open = real_open
        media_opened = list(media.OPENED)
        # packed rows (issue 26): the other rank gets the segment-numbered masks and the row plan too
        packer = data.SampleProcessor(processor.processor, max_length=96)
        packed = list(data.ReplicaLoader(ds, packer, global_batch_size=4, seed=2, pp_group=dist.group.WORLD,
                                         reads_media=rank == 0, packing=data.Packing(96, 2)))
        # then as two replicas (dp = 2): the loss's token count is the global one
        replica = data.ReplicaLoader(ds, processor, global_batch_size=4, seed=2, dp_rank=rank, dp_size=2)
        first = next(iter(replica))
        counts = [first["n_label_tokens"], data.global_label_tokens(first, dist.group.WORLD)]
        # with dp_group, every replica's rows are padded to the longest replica's (FSDP2 needs one shape)
        synced = next(iter(data.ReplicaLoader(ds, processor, global_batch_size=4, seed=2, dp_rank=rank, dp_size=2,
                                              dp_group=dist.group.WORLD)))
        lengths: list = [None, None]
        dist.all_gather_object(lengths, first["input_ids"].shape[1])
        padded = {"lengths": lengths, "first": first, "synced": synced}
        torch.save({"batches": batches, "packed": packed, "media_opened": media_opened,
                    "pngs_opened": [f for f in opened if f.endswith(".png")], "counts": counts,
                    "skips": _skips_resumed(rank, root, processor), "padded": padded},
                   os.path.join(root, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _skips_resumed(rank: int, root: str, processor) -> dict:
    """dp = 2 over ``skips.jsonl`` (one record left out when opened, two undecodable ones that only
    replica 1 meets, one a batch): ``skipped`` of batch 0, the state after it, ``skipped`` of batch 1
    from loaders resumed from replica 0's state (what a checkpoint holds), and through loader_shares."""
    from ppmedia import data, pipeline

    ds = data.open_dataset(os.path.join(root, "skips", "skips.jsonl"), skip_bad_samples=True)

    def loader():
        return data.ReplicaLoader(ds, processor, global_batch_size=4, shuffle=False, dp_rank=rank, dp_size=2,
                                  skip_bad_samples=True, dp_group=dist.group.WORLD)

    first = loader()
    batch0 = next(iter(first))
    states: list = [None, None]
    dist.all_gather_object(states, first.state_dict())
    resumed = loader()
    resumed.load_state_dict(states[0])
    share = next(pipeline.loader_shares(resumed, None, None, 1, dp_group=dist.group.WORLD, stages_media=False))
    return {"batch0": batch0["skipped"], "states": [s["skipped"] for s in states], "share1": share.skipped,
            "samples1": share.samples}


def _write_skips(root) -> None:
    """skips.jsonl: 8 usable records (a missing image among them, left out when opened); records 3
    and 6 of the usable ones have an undecodable image (replica 1's share at B=4, dp=2)."""
    import json

    root = root / "skips"
    root.mkdir()
    (root / "broken.png").write_bytes(b"not a png at all")
    good = fx.llava_records(str(root), 6, seed=3)
    broken = {"image": "broken.png", "conversations": [{"from": "human", "value": "<image>\nw1"},
                                                       {"from": "gpt", "value": "w2"}]}
    missing = dict(broken, image="no_such.png")
    fx.write_jsonl(str(root / "skips.jsonl"), good[:3] + [broken, missing] + good[3:5] + [broken, good[5]])
    assert json.loads((root / "skips.jsonl").read_text().splitlines()[4])["image"] == "no_such.png"


def test_only_the_encoding_rank_reads_media(tmp_path):
    records = fx.llava_records(str(tmp_path), 8)
    fx.write_jsonl(str(tmp_path / "train.jsonl"), records)
    _write_skips(tmp_path)
    fx.save_qwen_processor(str(tmp_path / "processor"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from ppmedia import data  # noqa: F401  (imported before the fork: the children start in a second)

    fx.AutoProcessor_from(str(tmp_path / "processor"))
    mp.start_processes(_worker, args=(port, str(tmp_path)), nprocs=2, join=True, start_method="fork")
    reader, other = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    images = sum(len(r.get("images", [])) + ("image" in r) for r in records)
    assert len(reader["media_opened"]) == len(reader["pngs_opened"]) == images > 0
    assert other["media_opened"] == [] and other["pngs_opened"] == []
    assert len(reader["batches"]) == len(other["batches"]) == 2
    for mine, theirs in zip(reader["batches"], other["batches"]):
        assert "pixel_values" in mine and "pixel_values" not in theirs
        for key in ("input_ids", "attention_mask", "labels", "mm_token_type_ids"):
            assert torch.equal(mine[key], theirs[key]), key
        for key in ("n_samples", "n_label_tokens", "skipped", "sample_names"):
            assert mine[key] == theirs[key], key
    assert len(reader["packed"]) == len(other["packed"]) == 2
    for mine, theirs in zip(reader["packed"], other["packed"]):
        assert "pixel_values" in mine and "pixel_values" not in theirs
        assert mine["attention_mask"].max() > 1 and mine["input_ids"].shape[0] == 2  # 2 samples share a row
        for key in ("input_ids", "attention_mask", "labels", "mm_token_type_ids"):
            assert torch.equal(mine[key], theirs[key]), key
        for key in ("n_samples", "n_label_tokens", "skipped", "sample_names", "packed_rows"):
            assert mine[key] == theirs[key], key
    assert reader["counts"][1] == other["counts"][1] == reader["counts"][0] + other["counts"][0]
    # the replicas' rows differ in length alone; with dp_group both are the longest's, the extra columns
    # padding (no attention, no label), the rest unchanged
    lengths = reader["padded"]["lengths"]
    assert lengths[0] != lengths[1], lengths
    for rank in (reader, other):
        own, synced = rank["padded"]["first"], rank["padded"]["synced"]
        S = own["input_ids"].shape[1]
        assert synced["input_ids"].shape[1] == max(lengths), (synced["input_ids"].shape, lengths)
        assert torch.equal(synced["input_ids"][:, :S], own["input_ids"])
        assert torch.equal(synced["attention_mask"][:, :S], own["attention_mask"])
        assert not synced["attention_mask"][:, S:].any()
        assert synced["n_label_tokens"] == own["n_label_tokens"] and synced["global_label_tokens"] == reader["counts"][1]
    # skipped: global (every replica's), saved so, and continued so after a resume at dp = 2
    for rank in (reader, other):
        assert rank["skips"]["batch0"] == 2 and rank["skips"]["states"] == [2, 2], rank["skips"]
        assert rank["skips"]["share1"] == 3 and rank["skips"]["samples1"] == 3, rank["skips"]
