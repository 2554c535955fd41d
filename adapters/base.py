"""The adapter protocol: what a model family must provide to run on ppmedia's first stage.

An adapter knows one family's media layout. Given a :class:`~ppmedia.VlmMediaChunk` taken by
:func:`~ppmedia.next_vlm_media_chunk`, it runs the model's own vision encoder on exactly that
microbatch's media and scatters the features into that microbatch's placeholder positions.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Union

import torch
from torch import Tensor

from ..chunk import VlmMediaChunk

if TYPE_CHECKING:
    import numpy as np

__all__ = ["Count", "HostCount", "VlmAdapter", "config_value", "inner_model"]


def inner_model(model: torch.nn.Module, attribute: str, expected: str) -> torch.nn.Module:
    """The module that holds ``attribute``: ``model.model`` (a ``...ForConditionalGeneration``), or
    ``model`` itself (the inner ``...Model``, or a remote-code model with the same members).

    Raises ``TypeError`` naming ``expected`` when neither has it.
    """
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, attribute):
        return inner
    if hasattr(model, attribute):
        return model
    raise TypeError(f"{type(model).__name__} has neither .model.{attribute} nor .{attribute}; expected {expected}")


@dataclass(frozen=True)
class HostCount:
    """A feature count that needs tensor data: ``count(tensor.reshape(-1).tolist())``.

    :meth:`VlmAdapter.merge` reads ``tensor`` in the same host read as the placeholder counts, then
    calls ``count`` on the host. For counts whose arithmetic is cheaper on the host than as many small
    device ops (LLaVA-NeXT's per-image token counts from ``image_sizes``).
    """

    tensor: Tensor
    count: Callable[[list[int]], int]


#: what :meth:`VlmAdapter.feature_counts` may return per modality.
Count = Union[int, Tensor, HostCount]


def config_value(config: Any, *names: str) -> Any:
    """Return the first of ``names`` set on ``config`` (a dotted name walks sub-configs).

    Raises ``AttributeError`` naming every name tried when none is set.
    """
    for name in names:
        value: Any = config
        for part in name.split("."):
            value = getattr(value, part, None)
            if value is None:
                break
        if value is not None:
            return value
    raise AttributeError(f"{type(config).__name__} has none of {', '.join(names)}")


class VlmAdapter(abc.ABC):
    """Base class of every family adapter. Subclasses are stateless; one instance serves any model.

    Class attributes:
        name: short family name, e.g. ``"qwen2_5_vl"``.
        model_types: the ``config.model_type`` strings this adapter serves (first is canonical).
        layout: the media layout it reads from a chunk, in words (shown by ``ppmedia adapters``).
    """

    name: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    layout: ClassVar[str]

    # -- token side -------------------------------------------------------------------------
    @abc.abstractmethod
    def media_per_sample(self, input_ids: Tensor, config: Any) -> tuple[Tensor, Tensor]:
        """Count each sample's images and videos from its placeholder tokens.

        Args:
            input_ids: ``[B, S]`` token ids.
            config: the model's config.

        Returns:
            ``(images, videos)``, two ``[B]`` int64 tensors on ``input_ids.device``; pass them to
            :func:`ppmedia.split_media` as ``images_per_sample`` / ``videos_per_sample``.
        """

    @abc.abstractmethod
    def placeholder_masks(self, input_ids: Tensor, config: Any) -> dict[str, Tensor]:
        """``{modality: [B, S] bool}``: where each modality's features go (``"image"``, ``"video"``)."""

    # -- media side -------------------------------------------------------------------------
    @abc.abstractmethod
    def feature_counts(self, chunk: VlmMediaChunk, config: Any) -> dict[str, Count]:
        """``{modality: number of feature rows}`` the chunk will produce, from its metadata.

        An ``int`` when it follows from shapes alone; else a 0-dim tensor computed on the chunk's
        device, or a :class:`HostCount` (metadata to read, and the host arithmetic on it). No host read
        here: :meth:`merge` reads them together with the placeholder counts.
        """

    @abc.abstractmethod
    def encode(self, model: torch.nn.Module, chunk: VlmMediaChunk) -> dict[str, Tensor]:
        """Run the model's own vision encoder on ``chunk``.

        Returns:
            ``{modality: [tokens, hidden]}`` features in placeholder order, already projected to the
            language model's width.
        """

    # -- first stage ------------------------------------------------------------------------
    def merge(
        self,
        model: torch.nn.Module,
        input_ids: Tensor,
        inputs_embeds: Tensor,
        chunk: VlmMediaChunk | None,
    ) -> Tensor:
        """Scatter the chunk's features into ``inputs_embeds`` at the placeholder positions.

        Args:
            model: the ``...ForConditionalGeneration`` model (or one with the same module paths).
            input_ids: ``[b, S]`` the microbatch's token ids.
            inputs_embeds: ``[b, S, hidden]`` their text embeddings.
            chunk: the microbatch's media, or ``None`` for a text-only microbatch.

        Returns:
            ``[b, S, hidden]``: ``inputs_embeds`` itself when ``chunk`` is ``None``, else a new tensor.

        Raises:
            ValueError: before the encoder runs, when a modality's feature count differs from its
                placeholder count (both numbers in the message); or when placeholders are present
                but the chunk has no media for them.
        """
        config = model.config
        masks = self.placeholder_masks(input_ids, config)
        expected = {} if chunk is None else self.feature_counts(chunk, config)
        self._check_counts(masks, expected)
        if chunk is None:
            return inputs_embeds
        return self.scatter(inputs_embeds, masks, self.encode(model, chunk))

    @staticmethod
    def scatter(inputs_embeds: Tensor, masks: Mapping[str, Tensor], features: Mapping[str, Tensor]) -> Tensor:
        """``inputs_embeds`` ``[b, S, H]`` with each modality's features ``[tokens, H]`` at its mask."""
        for modality, feats in features.items():
            mask = masks[modality].unsqueeze(-1).expand_as(inputs_embeds)
            inputs_embeds = inputs_embeds.masked_scatter(mask, feats.to(inputs_embeds.dtype))
        return inputs_embeds

    @staticmethod
    def _check_counts(masks: Mapping[str, Tensor], expected: Mapping[str, "Count"]) -> None:
        # One host read for every count of the microbatch: the placeholder sums, and whatever feature
        # count needs tensor data (a 0-dim tensor, or a HostCount's metadata), are read together.
        names = sorted(set(masks) | set(expected))
        with_mask = [masks[name] for name in names if name in masks]
        pending: list[Tensor] = []
        if with_mask:  # one sum over all masks: [modalities, b, S] -> [modalities]
            pending.append(with_mask[0].sum().reshape(1) if len(with_mask) == 1 else torch.stack(with_mask).sum((1, 2)))
        slots: dict[tuple[str, str], slice] = {}
        offset = len(with_mask)
        for i, name in enumerate(n for n in names if n in masks):
            slots[(name, "placeholders")] = slice(i, i + 1)
        for name in names:
            value = expected.get(name, 0)
            tensor = value.tensor if isinstance(value, HostCount) else value
            if isinstance(tensor, Tensor):
                pending.append(tensor.reshape(-1).to(torch.int64))
                slots[(name, "features")] = slice(offset, offset + tensor.numel())
                offset += tensor.numel()
        values = (torch.cat(pending) if len(pending) > 1 else pending[0]).tolist() if pending else []
        for name in names:
            placeholders = values[slots[(name, "placeholders")]][0] if (name, "placeholders") in slots else 0
            value = expected.get(name, 0)
            if isinstance(value, HostCount):
                features = int(value.count(values[slots[(name, "features")]]))
            elif isinstance(value, Tensor):
                features = values[slots[(name, "features")]][0]
            else:
                features = int(value)
            if placeholders != features:
                raise ValueError(
                    f"{name}: the microbatch has {placeholders} placeholder tokens but its media "
                    f"give {features} feature rows"
                )

    def image_costs(self, patches: "np.ndarray", config: Any) -> "np.ndarray":
        """Relative vision-encoder cost of sequences of ``patches`` patches each (an image, a video or
        a crop: one attention sequence each), for ``split_media(..., balance=...)``.

        Args:
            patches: int64 ``[sequences]`` host array. config: the model's config.

        Returns:
            float ``[sequences]``. The default is :func:`ppmedia.balance.encoder_flops` (linear layers
            per patch plus attention over the sequence, windowed layers over their window); override
            it for an encoder whose cost grows differently.
        """
        from ..balance import encoder_flops

        return encoder_flops(patches, config)

    def position_ids(
        self,
        model: torch.nn.Module,
        input_ids: Tensor,
        chunk: VlmMediaChunk | None,
        attention_mask: Tensor | None = None,
    ) -> Tensor | None:
        """Position ids the language model needs for this microbatch, or ``None`` for the default.

        Families with multimodal rotary positions (Qwen2.5-VL's mrope, ``[3, b, S]``) override this
        and compute them from the chunk's grids (metadata only).
        """
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, model_types={self.model_types!r})"
