"""Count reads of tensor data by the host (each one a device sync on an accelerator)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["HostReadCounter"]

_READS = {
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.__bool__: "__bool__",
    torch.Tensor.__int__: "__int__",
    torch.Tensor.__float__: "__float__",
    torch.Tensor.__index__: "__index__",
    torch.Tensor.numpy: "numpy",
}


class HostReadCounter(TorchFunctionMode):
    """A ``TorchFunctionMode`` that counts calls reading tensor data on the host.

    Counted: ``item``, ``tolist``, ``__bool__``, ``__int__``, ``__float__``, ``__index__``, ``numpy``.

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
