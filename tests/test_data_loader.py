"""ppmedia.data.ReplicaLoader: per-replica shares and order, shuffle from seed and epoch, resuming to
the exact next sample (also at another dp size), DataLoader workers equal to none."""

from __future__ import annotations

import pytest
import torch

import data_fixtures as fx
from ppmedia import data

pytestmark = pytest.mark.usefixtures("one_thread")
N = 12


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    ds = data.open_dataset(fx.write_jsonl(str(root / "train.jsonl"), fx.llava_records(str(root), N)))
    return {"ds": ds, "proc": data.SampleProcessor(fx.save_qwen_processor(str(root / "processor")))}


def loaders(world, dp, **kwargs):
    return [data.ReplicaLoader(world["ds"], world["proc"], dp_rank=r, dp_size=dp, **kwargs) for r in range(dp)]


def global_names(replicas, steps=None):
    """Per global batch, the sample names of all replicas in replica order."""
    rows = [list(r) for r in replicas]
    return [sum((rep[i]["sample_names"] for rep in rows), []) for i in range(len(rows[0]))][:steps]


def test_without_shuffle_batch_i_holds_samples_i_b_to_i_plus_1_b(world):
    ds = world["ds"]
    replicas = loaders(world, 2, global_batch_size=4, shuffle=False)
    assert len(replicas[0]) == 3
    batches = [list(r) for r in replicas]
    for i in range(3):
        assert batches[0][i]["sample_names"] == [ds.where(4 * i), ds.where(4 * i + 1)]
        assert batches[1][i]["sample_names"] == [ds.where(4 * i + 2), ds.where(4 * i + 3)]
        assert batches[0][i]["input_ids"].shape[0] == 2


def test_shuffle_from_seed_and_epoch_the_same_at_every_dp(world):
    one = loaders(world, 1, global_batch_size=4, seed=3)[0]
    epoch0, epoch1 = global_names([one]), global_names([one])
    assert sorted(sum(epoch0, [])) == sorted(world["ds"].where(i) for i in range(N)) and epoch0 != epoch1
    assert sum(epoch0, []) == [world["ds"].where(i) for i in data.epoch_order(N, 3, 0, True)]
    assert global_names(loaders(world, 2, global_batch_size=4, seed=3)) == epoch0
    assert global_names(loaders(world, 4, global_batch_size=4, seed=3)) == epoch0
    assert global_names(loaders(world, 1, global_batch_size=4, seed=4)) != epoch0


@pytest.mark.parametrize("dp_after", [1, 2])
def test_resume_to_the_exact_next_sample_at_another_dp(world, dp_after):
    straight = loaders(world, 1, global_batch_size=4, seed=5)[0]
    expected = global_names([straight]) + global_names([straight])  # two epochs uninterrupted
    first = loaders(world, 2, global_batch_size=4, seed=5)
    its = [iter(r) for r in first]
    seen = [sum((next(it)["sample_names"] for it in its), []) for _ in range(2)]
    states = [r.state_dict() for r in first]
    assert states[0] == states[1] == {"epoch": 0, "next_sample": 8, "seed": 5, "shuffle": True, "dataset_len": N,
                                      "skipped": 0, "group_by_length": 1}
    resumed = loaders(world, dp_after, global_batch_size=4, seed=0)  # the saved seed wins
    for r in resumed:
        r.load_state_dict(states[0])
    rest = global_names(resumed) + global_names(resumed)
    assert seen + rest == expected


def test_workers_give_the_same_batches(world):
    base = list(loaders(world, 2, global_batch_size=4, seed=1)[1])
    with_workers = list(loaders(world, 2, global_batch_size=4, seed=1, workers=2)[1])
    assert len(base) == len(with_workers) == 3
    for a, b in zip(base, with_workers):
        assert a.keys() == b.keys()
        for k, v in a.items():
            assert torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k], k


def test_batch_stats_and_layout(world):
    batch = next(iter(loaders(world, 1, global_batch_size=4, shuffle=False)[0]))
    labels = batch["labels"]
    assert batch["n_samples"] == 4 and batch["skipped"] == 0
    assert batch["n_label_tokens"] == int((labels >= 0).sum()) > 0
    assert (labels[:, -1] == data.processor.SHIFTED_MARK).all()
    assert labels.shape == batch["input_ids"].shape == batch["attention_mask"].shape
    assert batch["pixel_values"].shape[0] == int(batch["image_grid_thw"].prod(-1).sum())


def test_batches_are_ready_for_split_media(world):
    import ppmedia
    from ppmedia.testing.tiny_models import qwen2_5_vl as tiny

    config = tiny.build_config()
    adapter = ppmedia.get_adapter(config)
    proc = data.SampleProcessor(world["proc"].processor, config=config)
    loader = data.ReplicaLoader(world["ds"], proc, global_batch_size=4, shuffle=False, adapter=adapter)
    batch = next(iter(loader))
    images = int((batch["input_ids"] == tiny.IMAGE_TOKEN_ID).sum())
    staged = ppmedia.split_media({k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}, 2, **batch["media_counts"])
    assert images == int((batch["image_grid_thw"].prod(-1) // 4).sum()) > 0
    per_sample = [int(((row == tiny.IMAGE_TOKEN_ID).long().diff() == 1).sum()) for row in batch["input_ids"]]  # runs = images
    assert list(staged.images) == [sum(per_sample[:2]), sum(per_sample[2:])] and sum(staged.images) == len(batch["image_grid_thw"])


def _pads(batches):
    return sum(int((b["attention_mask"] == 0).sum()) for b in batches)


def test_length_grouping_sorts_windows_of_the_order_the_same_at_every_layout(world):
    """``group_by_length=3``: each window of 3 global batches of the shuffled order is sorted by the
    records' length keys and cut into its batches, taken in a drawn order (every sample once an epoch);
    less padding than ungrouped; the same global batches at dp 1 and 2 (the keys come from the records,
    not from a replica's processed samples); a resume after the first step continues in the grouped
    order at another dp (the saved grouping wins over the new loader's)."""
    ds = world["ds"]
    keys = [data.record_length_key(ds[i]) for i in range(N)]
    plain = global_names(loaders(world, 1, global_batch_size=4, seed=2))
    grouped = list(loaders(world, 1, global_batch_size=4, seed=2, group_by_length=3)[0])
    names = [b["sample_names"] for b in grouped]
    assert sorted(sum(names, [])) == sorted(sum(plain, [])) and names != plain
    index = {ds.where(i): i for i in range(N)}
    step_keys = [[keys[index[n]] for n in step] for step in names]
    assert all(k == sorted(k) for k in step_keys)
    by_step = sorted(step_keys)  # runs of one sorted window: a batch's largest key <= the next one's smallest
    assert all(a[-1] <= b[0] for a, b in zip(by_step, by_step[1:]))
    assert step_keys != by_step  # the window's batches in a drawn order, not shortest first
    assert _pads(grouped) < _pads(list(loaders(world, 1, global_batch_size=4, seed=2)[0]))
    assert global_names(loaders(world, 2, global_batch_size=4, seed=2, group_by_length=3)) == names
    first = loaders(world, 1, global_batch_size=4, seed=2, group_by_length=3)[0]
    head = next(iter(first))["sample_names"]
    state = first.state_dict()
    assert state["group_by_length"] == 3 and state["next_sample"] == 4
    resumed = loaders(world, 2, global_batch_size=4, seed=2)  # built without grouping: the state's wins
    for r in resumed:
        r.load_state_dict(state)
    assert [head] + global_names(resumed) == names
    assert [ds.where(i) for i in range(4)] == global_names(loaders(world, 1, global_batch_size=4, shuffle=False,
                                                                   group_by_length=1))[0]
