"""ppmedia.producer.hostreads: HostReadCounter counts every kind of host read (and nothing else); HostReader
reads any number of integer tensors in one read per device.

Only the CPU exists on this machine: the several-devices path of HostReader (one read per device) is
not exercised here.
"""

import operator

import numpy as np
import pytest
import torch

from ppmedia import HostReadCounter
from ppmedia.producer.hostreads import HostReader

READS = [
    ("item", lambda t: t.sum().item()),
    ("tolist", lambda t: t.tolist()),
    ("__bool__", lambda t: bool(t[0])),
    ("__bool__", lambda t: 1 if t[0] else 0),  # an `if` on a tensor
    ("__int__", lambda t: int(t[0])),
    ("__float__", lambda t: float(t[0])),
    ("__index__", lambda t: list(range(t[0]))),
    ("__index__", lambda t: operator.index(t[0])),
    ("numpy", lambda t: t.numpy()),
    ("__array__", lambda t: np.asarray(t)),
    ("__complex__", lambda t: complex(t[0])),
    ("__format__", lambda t: f"{t[0]}"),
    ("__repr__", lambda t: str(t)),
    ("__repr__", lambda t: repr(t)),
    ("__contains__", lambda t: 3 in t),
]


@pytest.mark.parametrize("name, read", READS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(READS)])
def test_each_kind_of_host_read_counts_once(name, read):
    t = torch.tensor([3, 1, 2])
    with HostReadCounter() as reads:
        read(t)
    assert dict(reads.counts) == {name: 1} and reads.total == 1


def test_metadata_and_device_ops_are_not_reads():
    t = torch.arange(12).reshape(3, 4)
    with HostReadCounter() as reads:
        assert t.numel() == 12 and t.shape == (3, 4) and t.dim() == 2 and t.dtype == torch.int64
        u = torch.cat([t, t]).to(torch.int32).sum(0) * 2
        mask = t == 5
        t.split_with_sizes([1, 2])
        repr(t.device)
    assert reads.total == 0
    assert u.shape == (4,) and mask.shape == (3, 4)


def test_counts_accumulate_and_stop_at_exit():
    t = torch.tensor([1, 2])
    with HostReadCounter() as reads:
        for _ in range(3):
            t.tolist()
        t[0].item()
    t.tolist()  # outside: not counted
    assert dict(reads.counts) == {"tolist": 3, "item": 1} and reads.total == 4


def test_reader_reads_every_tensor_in_one_read():
    parts = [
        torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32),  # 2-D, int32
        torch.tensor(7),  # 0-dim
        torch.zeros(0, 3, dtype=torch.int64),  # empty
        torch.tensor([8, 9], dtype=torch.uint8),
        torch.tensor([-7], dtype=torch.int8),  # negative values survive the widening
        torch.arange(10, 14).reshape(2, 2)[:, 1],  # a non-contiguous view
    ]
    reader = HostReader()
    handles = [reader.add(p) for p in parts]
    with HostReadCounter() as reads:
        reader.read()
    assert reads.total == 1 and dict(reads.counts) == {"numpy": 1}
    got = [reader.values[h] for h in handles]
    assert [g.tolist() for g in got] == [[1, 2, 3, 4, 5, 6], [7], [], [8, 9], [-7], [11, 13]]
    assert all(g.dtype == np.int64 for g in got)


def test_reader_with_one_tensor_or_none():
    reader = HostReader()
    with HostReadCounter() as reads:
        reader.read()
    assert reads.total == 0 and reader.values == []
    handle = reader.add(torch.tensor([[5, 6]]))
    with HostReadCounter() as reads:
        reader.read()
    assert reads.total == 1 and reader.values[handle].tolist() == [5, 6]


def test_read_lists_gives_python_ints_in_one_read():
    parts = [
        torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32),
        torch.zeros(0, 3, dtype=torch.int64),
        torch.tensor([-7], dtype=torch.int8),
        torch.arange(10, 14).reshape(2, 2)[:, 1],  # a non-contiguous view
    ]
    reader = HostReader()
    handles = [reader.add(p) for p in parts]
    with HostReadCounter() as reads:
        got = reader.read_lists()
    assert reads.total == 1 and dict(reads.counts) == {"tolist": 1}
    assert [got[h] for h in handles] == [[1, 2, 3, 4, 5, 6], [], [-7], [11, 13]]
    assert all(type(v) is int for h in handles for v in got[h])
    one = HostReader()
    one.add(torch.tensor([[2**40, 3]], dtype=torch.int64))
    with HostReadCounter() as reads:
        assert one.read_lists() == [[2**40, 3]]
    assert reads.total == 1
    with HostReadCounter() as reads:
        assert HostReader().read_lists() == []
    assert reads.total == 0
