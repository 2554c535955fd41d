"""Data-loader side: split the media inside ``DataLoader`` workers, off the training loop."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from torch import Tensor

from .split import StagedMedia, split_media

if TYPE_CHECKING:  # typing only: importing the adapters here would cost every `import ppmedia`
    from ..adapters.base import VlmAdapter

__all__ = ["PipelineBatch", "collate_for_pipeline"]


@dataclass
class PipelineBatch:
    """A collated batch ready for one pipeline step.

    Attributes:
        text: what is left of the collated batch once the media are popped (``input_ids`` ``[B, S]``,
            ``labels``, ...): safe for the schedule's dim-0 split.
        media: the batch's media, split per microbatch; stage it with :func:`ppmedia.stage_media`.
    """

    text: dict[str, Any]
    media: StagedMedia

    def to(self, device: Any, non_blocking: bool = False) -> "PipelineBatch":
        """Both parts on ``device``: one copy per tensor, the media views rebuilt without a host read."""
        text = {k: v.to(device, non_blocking=non_blocking) if isinstance(v, Tensor) else v for k, v in self.text.items()}
        return PipelineBatch(text, self.media.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "PipelineBatch":
        """Pinned copy (``DataLoader(pin_memory=True)`` calls this)."""
        text = {k: v.pin_memory() if isinstance(v, Tensor) else v for k, v in self.text.items()}
        return PipelineBatch(text, self.media.pin_memory())


class collate_for_pipeline:
    """Wrap a ``collate_fn`` so that ``DataLoader`` workers also split the media.

    ``collate_for_pipeline(collate_fn, n_microbatches)(samples)`` collates, then calls
    :func:`ppmedia.split_media` and returns a :class:`PipelineBatch`. The wrapper and its result are
    picklable (workers send the whole media tensors once; the views are rebuilt on arrival).

    Args:
        collate_fn: the processor's collate function, returning a mapping with ``input_ids`` ``[B, S]``
            and the media keys of :data:`ppmedia.MEDIA_KEYS`.
        n_microbatches: the schedule's ``n_microbatches``.
        adapter: optional :class:`~ppmedia.adapters.base.VlmAdapter`; with ``config``, its
            ``media_counts(batch, config)`` supplies the per-sample image and video counts.
        config: the model config passed to the adapter.
        split_kwargs: any other keyword arguments of :func:`ppmedia.split_media`. ``balance=True``
            with an adapter balances by the adapter's ``image_costs`` (its encoder cost model); the
            ``text`` tensors come reordered and ``media.permutation`` maps them back.

    Example::

        loader = DataLoader(dataset, batch_size=8, num_workers=2,
                            collate_fn=ppmedia.collate_for_pipeline(collate, 4, adapter=a, config=cfg))
        for batch in loader:
            with ppmedia.stage_media(stage, batch.media):
                schedule.step(batch.text["input_ids"], target=batch.text["labels"])
    """

    def __init__(
        self,
        collate_fn: Callable[[list[Any]], Mapping[str, Any]],
        n_microbatches: int,
        *,
        adapter: VlmAdapter | None = None,
        config: Any = None,
        **split_kwargs: Any,
    ) -> None:
        if not callable(collate_fn):
            raise TypeError(f"collate_fn: got {type(collate_fn).__name__}; expected a callable")
        if (adapter is None) != (config is None):
            raise ValueError("collate_for_pipeline: adapter and config go together; got only one of them")
        self.collate_fn = collate_fn
        self.n_microbatches = n_microbatches
        self.adapter = adapter
        self.config = config
        self.split_kwargs = split_kwargs

    def __call__(self, samples: list[Any]) -> PipelineBatch:
        collated = self.collate_fn(samples)
        if not isinstance(collated, Mapping):
            raise TypeError(f"collate_fn returned {type(collated).__name__}; expected a mapping of str to tensors")
        batch = dict(collated)
        kwargs = dict(self.split_kwargs)
        if self.adapter is not None:
            for key, counts in self.adapter.media_counts(batch, self.config).items():
                kwargs.setdefault(key, counts)
            if kwargs.get("balance") is True:  # the family's encoder cost model
                kwargs["balance"] = functools.partial(self.adapter.image_costs, config=self.config)
        media = split_media(batch, self.n_microbatches, **kwargs)
        return PipelineBatch(batch, media)
