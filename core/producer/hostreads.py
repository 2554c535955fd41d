"""Count reads of tensor data by the host (each one a device sync on an accelerator)."""

from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["HostReadCounter", "HostReader"]

_EMPTY: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)
_INT64 = torch.int64

_READS = {
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.__bool__: "__bool__",
    torch.Tensor.__int__: "__int__",
    torch.Tensor.__float__: "__float__",
    torch.Tensor.__index__: "__index__",
    torch.Tensor.numpy: "numpy",
    torch.Tensor.__array__: "__array__",  # np.asarray(t), np.array(t)
    torch.Tensor.__complex__: "__complex__",
    torch.Tensor.__format__: "__format__",  # f"{t}"
    torch.Tensor.__repr__: "__repr__",  # repr(t), str(t), print(t)
    torch.Tensor.__contains__: "__contains__",  # x in t
}


class HostReadCounter(TorchFunctionMode):
    """A ``TorchFunctionMode`` that counts calls reading tensor data on the host.

    Counted: ``item``, ``tolist``, ``__bool__``, ``__int__``, ``__float__``, ``__index__``, ``numpy``,
    and the conversions that read data too: ``__array__`` (``np.asarray(t)``), ``__complex__``,
    ``__format__`` (``f"{t}"``), ``__repr__`` (``str(t)``, ``print(t)``), ``__contains__`` (``x in t``).

    Example::

        with HostReadCounter() as reads:
            staged = ppmedia.split_media(batch, 4)
        assert reads.total <= 1
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    @property
    def total(self) -> int:
        """Host reads seen so far."""
        return sum(self.counts.values())

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = _READS.get(func)
        if name is not None:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


class HostReader:
    """Collects integer tensors and reads them to the host together: one read per device.

    ``handle = reader.add(t)`` for each tensor (any integer dtype, any shape), then ``reader.read()``
    once; afterwards ``reader.values[handle]`` is ``t``'s data, flattened, as an int64 numpy array.
    The producer (:func:`ppmedia.split_media`) and the adapters' count check both read through it.
    """

    def __init__(self) -> None:
        self._parts: list[Tensor] = []  # each flattened to 1-D: its length is its size
        self.values: list[npt.NDArray[np.int64]] = []

    def add(self, t: Tensor) -> int:
        parts = self._parts
        parts.append(t if t.dim() == 1 else t.reshape(-1))
        return len(parts) - 1

    def read(self) -> None:
        """Read every tensor added: ``values[handle]`` is then its data as a flat int64 numpy array."""
        self.values = [_EMPTY] * len(self._parts)
        for indices, joined in self._joined():
            self._spread(indices, joined.cpu().numpy())  # the host read

    def read_lists(self) -> list[list[int]]:
        """Like :meth:`read`, but returns the values as Python lists of ints (``result[handle]``),
        with one ``tolist()`` per device instead of a numpy array per tensor; ``values`` is left alone."""
        parts = self._parts
        if len(parts) == 1:  # one tensor (a single placeholder mask's sums): read it as it is
            only = parts[0]
            return [(only if only.dtype is _INT64 else only.to(_INT64)).tolist()]  # the host read
        out: list[list[int]] = [[] for _ in parts]
        for indices, joined in self._joined():
            whole = joined.tolist()  # the host read
            offset = 0
            for i in indices:
                stop = offset + parts[i].shape[0]
                out[i] = whole[offset:stop]
                offset = stop
        return out

    def _joined(self) -> list[tuple[Sequence[int], Tensor]]:
        """The parts as int64, joined per device: ``(their handles, one 1-D tensor)``; one group when
        everything is on one device (the usual case)."""
        parts = [p if p.dtype is _INT64 else p.to(_INT64) for p in self._parts]
        if len(parts) <= 1:
            return [((0,), parts[0])] if parts else []
        try:
            return [(range(len(parts)), torch.cat(parts))]
        except RuntimeError:  # metadata on several devices: one read per device
            by_device: dict[torch.device, list[int]] = {}
            for i, part in enumerate(parts):
                by_device.setdefault(part.device, []).append(i)
            return [(indices, torch.cat([parts[i] for i in indices])) for indices in by_device.values()]

    def _spread(self, indices: Sequence[int], flat: npt.NDArray[np.int64]) -> None:
        """Hand out ``flat``, the parts ``indices`` read together, as one view per part."""
        values, parts, offset = self.values, self._parts, 0
        for i in indices:
            stop = offset + parts[i].shape[0]
            values[i] = flat[offset:stop]
            offset = stop
