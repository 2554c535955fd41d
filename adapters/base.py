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

__all__ = ["Count", "HostCount", "VlmAdapter", "WireTensor", "config_value", "inner_model"]


def inner_model(model: torch.nn.Module, attribute: str, expected: str) -> Any:
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


@dataclass(frozen=True)
class WireTensor:
    """One tensor that travels from a pipeline stage to the next, besides the hidden states ``[b, S, H]``
    and the attention mask ``[b, S]`` (see :meth:`VlmAdapter.wire_tensors`).

    Attributes:
        name: its key in the ``wire`` dict that :meth:`VlmAdapter.first_stage` fills and
            :meth:`VlmAdapter.decoder_kwargs` reads (``"position_ids"``, ``"deepstack_1"``).
        shape: batch first; each dim an ``int`` or one of ``"b"`` (microbatch rows), ``"S"`` (sequence
            length), ``"H"`` (the text hidden size). Static: the same for every microbatch.
        floating: ``True``: the hidden states' dtype, and its gradient flows back to the first stage
            (e.g. deepstack features, so the vision tower gets their gradient); ``False``: int64, no
            gradient (positions, masks, token types).
    """

    name: str
    shape: tuple[Union[int, str], ...]
    floating: bool = False


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

    def media_counts(self, batch: Mapping[str, Any], config: Any) -> dict[str, Tensor]:
        """The count arguments of :func:`ppmedia.split_media` for a processor batch, from its tokens.

        ``split_media(batch, n, **adapter.media_counts(batch, config))``. ``images_per_sample`` /
        ``videos_per_sample`` from :meth:`media_per_sample`, leaving out each count the batch already
        holds (``n_images_per_sample`` / ``n_videos_per_sample``: ``split_media`` takes those).
        Adapters whose tokens alone cannot count some medium read the batch's metadata here (Qwen3-VL
        videos: ``video_grid_thw``).
        """
        images, videos = self.media_per_sample(batch["input_ids"], config)
        counts = {"images_per_sample": images, "videos_per_sample": videos}
        for key, arg in (("n_images_per_sample", "images_per_sample"), ("n_videos_per_sample", "videos_per_sample")):
            if batch.get(key) is not None:
                del counts[arg]
        return counts

    @abc.abstractmethod
    def placeholder_masks(self, input_ids: Tensor, config: Any) -> dict[str, Tensor]:
        """``{modality: [B, S] bool}``: where each modality's features go (``"image"``, ``"video"``)."""

    # -- media side -------------------------------------------------------------------------
    @abc.abstractmethod
    def feature_counts(self, chunk: VlmMediaChunk, config: Any) -> Mapping[str, Count]:
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

    # -- pipeline wire format ---------------------------------------------------------------
    # ppmedia.pipeline's stages call these three; an adapter overrides them when its language model
    # needs more than hidden states, attention mask and (optionally) positions on every stage.

    def wire_tensors(self, config: Any, first_layer: int) -> tuple[WireTensor, ...]:
        """The tensors a stage whose first decoder layer is ``first_layer`` needs from earlier stages.

        Besides the hidden states and attention mask, in send order. ``first_layer`` is a full-model
        layer index (a stage with no layers passes its successor's). ``wire_tensors(config, k)`` must
        be a subset of ``wire_tensors(config, j)`` for ``j <= k``: a stage passes on a subset of what
        it got. Default: the mrope positions ``[b, 3, S]`` for adapters that override
        :meth:`position_ids`, else nothing.
        """
        if type(self).position_ids is VlmAdapter.position_ids:
            return ()
        return (WireTensor("position_ids", ("b", 3, "S")),)

    def first_stage(
        self,
        model: torch.nn.Module,
        input_ids: Tensor,
        attention_mask: Tensor,
        inputs_embeds: Tensor,
        chunk: VlmMediaChunk | None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The first stage's media work on one microbatch.

        Returns:
            ``(hidden [b, S, H], wire)``: the merged embeddings and every tensor of
            ``wire_tensors(config, 0)`` by name, in its declared shape. Default: :meth:`merge`, plus
            :meth:`position_ids` transposed to ``[b, 3, S]`` when declared.
        """
        hidden = self.merge(model, input_ids, inputs_embeds, chunk)
        wire: dict[str, Tensor] = {}
        if any(spec.name == "position_ids" for spec in self.wire_tensors(model.config, 0)):
            positions = self.position_ids(model, input_ids, chunk, attention_mask)
            if positions is None:
                raise ValueError(f"{type(self).__name__}.position_ids returned None for a microbatch")
            wire["position_ids"] = positions.transpose(0, 1)  # [3, b, S] -> batch first
        return hidden, wire

    def decoder_kwargs(
        self,
        stage: torch.nn.Module,
        layers: range,
        hidden: Tensor,
        attention_mask: Tensor,
        wire: Mapping[str, Tensor],
    ) -> dict[str, Any]:
        """Keyword arguments for a stage's language model ``forward``, from the tensors it received.

        Args:
            stage: the stage module (``stage.config``, ``stage.stage_language_model``).
            layers: the full-model indices of the decoder layers it runs (contiguous).
            hidden: ``[b, S, H]`` its input hidden states (``inputs_embeds`` of the call).
            attention_mask: ``[b, S]`` the batch's mask.
            wire: the tensors of ``wire_tensors(config, layers.start)`` by name (the first stage: all
                that :meth:`first_stage` made).

        Returns:
            Keywords added to ``inputs_embeds=hidden, attention_mask=attention_mask, use_cache=False``
            (an ``attention_mask`` here replaces the plain one, e.g. with a dict of prepared masks).
            Default: ``position_ids`` ``[3, b, S]`` when received.
        """
        if "position_ids" in wire:
            return {"position_ids": wire["position_ids"].transpose(0, 1)}
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, model_types={self.model_types!r})"
