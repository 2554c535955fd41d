"""ppmedia.hostreads: HostReader reads many tensors in one host read; HostReadCounter counts reads."""

import torch

from ppmedia.hostreads import HostReadCounter, HostReader


def test_one_read_for_every_tensor_added():
    reader = HostReader()
    slots = [reader.add(torch.tensor([[1, 2], [3, 4]])), reader.add(torch.tensor([5], dtype=torch.int32)),
             reader.add(torch.zeros(0, dtype=torch.int64)), reader.add(torch.tensor([-7], dtype=torch.int8))]
    with HostReadCounter() as reads:
        reader.read()
    assert reads.total == 1 and reads.counts == {"numpy": 1}
    values = [reader.values[s] for s in slots]
    assert [v.tolist() for v in values] == [[1, 2, 3, 4], [5], [], [-7]]
    assert all(v.dtype == "int64" for v in values)


def test_nothing_added_reads_nothing():
    reader = HostReader()
    with HostReadCounter() as reads:
        reader.read()
    assert reads.total == 0 and reader.values == []


def test_counter_counts_each_kind_of_read():
    t = torch.tensor([3])
    with HostReadCounter() as reads:
        t.item(), t.tolist(), bool(t), int(t), float(t), t.numpy()
        _ = [0, 1, 2, 3][t]  # __index__
    assert reads.counts == {"item": 1, "tolist": 1, "__bool__": 1, "__int__": 1, "__float__": 1, "numpy": 1, "__index__": 1}
    assert reads.total == 7
