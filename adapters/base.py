"""The adapter protocol: what a model family must provide to run on ppmedia's first stage.

An adapter knows one family's media layout. Given a :class:`~ppmedia.VlmMediaChunk` taken by
:func:`~ppmedia.next_vlm_media_chunk`, it runs the model's own vision encoder on exactly that
microbatch's media and scatters the features into that microbatch's placeholder positions.

:meth:`VlmAdapter.merge` is the same for every family::

    masks = placeholder_masks(input_ids, config)            # {modality: [b, S] bool}
    host  = read_host(masks, host_inputs(chunk, config))    # the one host read (HostReader)
    feature_counts(chunk, config, host) == host.totals      # else ValueError, before the encoder
    scatter(inputs_embeds, masks, encode(model, chunk, host))

A family supplies the four abstract methods (and :meth:`VlmAdapter.host_inputs` when it needs chunk
metadata on the host); :mod:`ppmedia.adapters._helpers` holds what the built-ins share.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, NamedTuple, Union

import torch
from torch import Tensor

from ..chunk import VlmMediaChunk
from ..hostreads import HostReader

if TYPE_CHECKING:
    import numpy as np

__all__ = ["HostValues", "VlmAdapter", "WireTensor", "config_get", "config_value", "inner_model", "read_host"]


def inner_model(model: torch.nn.Module, attribute: str, expected: str) -> Any:
    """The module that holds ``attribute``: ``model.model`` (a ``...ForConditionalGeneration``), or
    ``model`` itself (the inner ``...Model``, or a remote-code model with the same members).

    Typed ``Any``: what the caller uses on it are the family's own members (``visual``,
    ``get_image_features``), which ``nn.Module`` does not declare.

    Raises ``TypeError`` naming ``expected`` when neither has it.
    """
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, attribute):
        return inner
    if hasattr(model, attribute):
        return model
    raise TypeError(f"{type(model).__name__} has neither .model.{attribute} nor .{attribute}; expected {expected}")


class HostValues(NamedTuple):
    """What :meth:`VlmAdapter.check_counts` read to the host, in one read, for one microbatch.

    Handed to :meth:`VlmAdapter.feature_counts` and :meth:`VlmAdapter.encode`, so nothing there reads
    tensor data again. Plain Python ints: the arithmetic on them is a few numbers per microbatch.

    Attributes:
        placeholders: ``{modality: [b]}``, each sample's placeholder tokens, one entry per mask of
            :meth:`VlmAdapter.placeholder_masks`.
        totals: ``{modality: int}``, the microbatch's placeholder tokens (the sums of ``placeholders``).
        values: ``{name: [n]}``, each tensor the adapter asked for in :meth:`VlmAdapter.host_inputs`,
            flattened row by row: an ``[images, 2]`` grid gives ``2 * images`` numbers
            (:meth:`rows` gives the rows back).
    """

    placeholders: Mapping[str, list[int]]
    totals: Mapping[str, int]
    values: Mapping[str, list[int]]

    def total(self, modality: str) -> int:
        """Placeholder tokens of ``modality`` in the microbatch (0 when the adapter has no such mask)."""
        return self.totals.get(modality, 0)

    def rows(self, name: str, width: int) -> list[list[int]]:
        """``values[name]`` as rows of ``width`` numbers: the ``[n, width]`` tensor it was read from."""
        flat = self.values[name]
        return [flat[i : i + width] for i in range(0, len(flat), width)]


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


def read_host(masks: Mapping[str, Tensor], inputs: Mapping[str, Tensor]) -> HostValues:
    """Read every mask's per-sample sum and every tensor of ``inputs`` to the host, in one read
    (:class:`ppmedia.hostreads.HostReader`; one per device when they live on several).

    Args:
        masks: ``{modality: [b, S] bool}``, all of one shape.
        inputs: ``{name: integer tensor of any shape}``.

    Raises:
        TypeError: a tensor of ``inputs`` is not of an integer dtype (named in the message).
    """
    reader = HostReader()
    add = reader.add
    for mask in masks.values():
        add(mask.sum(dim=-1))
    for name, tensor in inputs.items():
        dtype = tensor.dtype
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise TypeError(f"{name}: dtype {dtype}, shape {list(tensor.shape)}; expected an integer dtype")
        add(tensor)
    lists = reader.read_lists()  # one flat list of ints per add(), in order
    placeholders: dict[str, list[int]] = {}
    totals: dict[str, int] = {}
    for name, per_sample in zip(masks, lists):
        placeholders[name] = per_sample
        totals[name] = sum(per_sample)
    return HostValues(placeholders, totals, dict(zip(inputs, lists[len(masks) :])))


_MISSING = object()


def config_get(obj: Any, name: str) -> Any:
    """``getattr(obj, name, None)``, reading the instance ``__dict__`` first.

    transformers' configs route every attribute read through two Python ``__getattribute__``
    overrides (aliases, per-layer checks; about 2 us a read); merge reads a few config fields per
    microbatch. A plain field set on the instance is found in its ``__dict__`` with the same value,
    and so is an alias of the class's ``attribute_map`` (``image_token_id`` -> ``image_token_index``),
    which those overrides resolve the same way; anything else (properties, class attributes) takes
    ``getattr``.
    """
    try:
        state = object.__getattribute__(obj, "__dict__")
    except AttributeError:  # no instance __dict__ (slots)
        return getattr(obj, name, None)
    found = state.get(name, _MISSING)
    if found is _MISSING:
        cls = type(obj)
        aliases = getattr(cls, "attribute_map", None)
        if type(aliases) is dict and name in aliases:
            found = state.get(aliases[name], _MISSING)
        elif not hasattr(cls, name) and _plain_misses(cls):  # not set anywhere: getattr would give None
            return None
    return getattr(obj, name, None) if found is _MISSING else found


_PLAIN_MISSES: dict[type, bool] = {}
_OBJECT_GETATTRIBUTE: Any = object.__getattribute__


def _plain_misses(cls: type) -> bool:
    """Whether a name found neither in an instance's ``__dict__`` nor on ``cls`` is missing for
    ``getattr`` too: no ``__getattr__``, and either no ``__getattribute__`` override or transformers'
    config overrides (which only resolve ``attribute_map`` aliases and guard per-layer fields)."""
    plain = _PLAIN_MISSES.get(cls)
    if plain is None:
        plain = not hasattr(cls, "__getattr__") and (
            getattr(cls, "__getattribute__") is _OBJECT_GETATTRIBUTE
            or type(getattr(cls, "attribute_map", None)) is dict
        )
        if len(_PLAIN_MISSES) > 1024:  # classes made on the fly: keep the cache bounded
            _PLAIN_MISSES.clear()
        _PLAIN_MISSES[cls] = plain
    return plain


def config_value(config: Any, *names: str) -> Any:
    """Return the first of ``names`` set (not ``None``) on ``config``; a dotted name walks sub-configs.

    Raises ``AttributeError`` naming every name tried when none is set.
    """
    for name in names:
        if "." not in name:
            value: Any = config_get(config, name)
        else:
            value = config
            for part in name.split("."):
                value = config_get(value, part)
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

    A subclass implements :meth:`media_per_sample`, :meth:`placeholder_masks`,
    :meth:`feature_counts` and :meth:`encode`; it may override :meth:`host_inputs` (integer metadata
    it needs on the host) and :meth:`position_ids`. :meth:`merge` is the same for every family:
    masks, one host read (:meth:`check_counts`), encoder, scatter.
    """

    name: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    layout: ClassVar[str]

    # -- token side -------------------------------------------------------------------------
    @abc.abstractmethod
    def media_per_sample(
        self, input_ids: Tensor, config: Any, *, media: Mapping[str, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Count each sample's images and videos from its placeholder tokens, for :func:`ppmedia.split_media`.

        Args:
            input_ids: ``[B, S]`` token ids.
            config: the model's config.
            media: optional, the batch's media tensors (e.g. the batch itself, before
                ``split_media``). A family whose tokens cannot always separate images uses them: two
                LLaVA-NeXT images written back to back form one run of placeholder tokens, which
                their ``image_sizes`` split. Families that need nothing from it ignore it.

        Returns:
            ``(images, videos)``, two ``[B]`` int64 tensors on ``input_ids.device``; pass them to
            :func:`ppmedia.split_media` as ``images_per_sample`` / ``videos_per_sample``.

        Raises:
            ValueError: the tokens (and ``media``) cannot be mapped to images; the message says why and
                names the way out (``n_images_per_sample`` ``[B]`` in the batch).
        """

    def media_counts(self, batch: Mapping[str, Any], config: Any) -> dict[str, Any]:
        """The count arguments of :func:`ppmedia.split_media` for a processor batch, from its tokens.

        ``split_media(batch, n, **adapter.media_counts(batch, config))``. ``images_per_sample`` /
        ``videos_per_sample`` from :meth:`media_per_sample`, leaving out each count the batch already
        holds (``n_images_per_sample`` / ``n_videos_per_sample``: ``split_media`` takes those).
        Adapters whose tokens alone cannot count some medium read the batch's metadata here (Qwen3-VL
        videos: ``video_grid_thw``).
        """
        images, videos = self.media_per_sample(batch["input_ids"], config, media=batch)
        counts = {"images_per_sample": images, "videos_per_sample": videos}
        for key, arg in (("n_images_per_sample", "images_per_sample"), ("n_videos_per_sample", "videos_per_sample")):
            if batch.get(key) is not None:
                del counts[arg]
        return counts

    @abc.abstractmethod
    def placeholder_masks(self, input_ids: Tensor, config: Any) -> dict[str, Tensor]:
        """``{modality: [B, S] bool}``: where each modality's features go (``"image"``, ``"video"``)."""

    # -- media side -------------------------------------------------------------------------
    def host_inputs(self, chunk: VlmMediaChunk, config: Any) -> dict[str, Tensor]:
        """``{name: integer tensor}``: the chunk's metadata the adapter needs on the host (grids,
        image sizes, per-sample counts). :meth:`check_counts` reads them in the same single read as the
        placeholder counts and hands them to :meth:`feature_counts` and :meth:`encode` as
        ``host.values[name]``. Check shapes here (no host read); the default asks for nothing.
        """
        return {}

    @abc.abstractmethod
    def feature_counts(self, chunk: VlmMediaChunk, config: Any, host: HostValues) -> dict[str, int]:
        """``{modality: feature rows}`` the chunk will give, from its shapes and ``host``.

        Runs on the host, after the one read and before the encoder. Raise ``ValueError`` here for
        anything the encoder would otherwise fail on deep inside (metadata that does not cover the
        pixels) or checks finer than the per-modality totals (Step3 checks every sample).
        """

    @abc.abstractmethod
    def encode(self, model: torch.nn.Module, chunk: VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        """Run the model's own vision encoder on ``chunk``.

        Args:
            model: the ``...ForConditionalGeneration`` model (or one with the same module paths).
            chunk: the microbatch's media.
            host: what :meth:`check_counts` read for this chunk (placeholders and :meth:`host_inputs`).

        Returns:
            ``{modality: [tokens, hidden]}`` features in placeholder order, already projected to the
            language model's width; only the modalities the chunk has.
        """

    # -- first stage ------------------------------------------------------------------------
    def check_counts(
        self, input_ids: Tensor, chunk: VlmMediaChunk | None, config: Any
    ) -> tuple[dict[str, Tensor], HostValues]:
        """The checks :meth:`merge` runs before the encoder, with its one host read.

        Args:
            input_ids: ``[b, S]`` the microbatch's token ids.
            chunk: its media, or ``None`` for a text-only microbatch.
            config: the model's config.

        Returns:
            ``(masks, host)``: :meth:`placeholder_masks` and the :class:`HostValues` read.

        Raises:
            ValueError: a modality's feature count differs from its placeholder count (both numbers in
                the message), e.g. placeholders in a microbatch without media.
        """
        masks = self.placeholder_masks(input_ids, config)
        host = read_host(masks, {} if chunk is None else self.host_inputs(chunk, config))
        features = {} if chunk is None else self.feature_counts(chunk, config, host)
        for modality in (*masks, *features):
            placeholders, rows = host.totals.get(modality, 0), features.get(modality, 0)
            if placeholders != rows:
                per_sample = host.placeholders.get(modality)
                raise ValueError(
                    f"{modality}: the microbatch has {placeholders} placeholder tokens but its media give "
                    f"{rows} feature rows" + (" (no media: a text-only chunk)" if chunk is None else "")
                    + ("" if per_sample is None else f"; placeholders per sample: {per_sample}")
                )
        return masks, host

    def merge(
        self,
        model: torch.nn.Module,
        input_ids: Tensor,
        inputs_embeds: Tensor,
        chunk: VlmMediaChunk | None,
    ) -> Tensor:
        """Scatter the chunk's features into ``inputs_embeds`` at the placeholder positions.

        :meth:`check_counts` (one host read) first, then :meth:`encode`, then :meth:`scatter`.

        Args:
            model: the ``...ForConditionalGeneration`` model (or one with the same module paths).
            input_ids: ``[b, S]`` the microbatch's token ids.
            inputs_embeds: ``[b, S, hidden]`` their text embeddings.
            chunk: the microbatch's media, or ``None`` for a text-only microbatch.

        Returns:
            ``[b, S, hidden]``: ``inputs_embeds`` itself when ``chunk`` is ``None``, else a new tensor.

        Raises:
            ValueError: before the encoder runs, when the chunk does not fit its placeholders (see
                :meth:`check_counts` and :meth:`feature_counts`).
        """
        masks, host = self.check_counts(input_ids, chunk, model.config)
        if chunk is None:
            return inputs_embeds
        return self.scatter(inputs_embeds, masks, self.encode(model, chunk, host))

    @staticmethod
    def scatter(inputs_embeds: Tensor, masks: Mapping[str, Tensor], features: Mapping[str, Tensor]) -> Tensor:
        """``inputs_embeds`` ``[b, S, H]`` with each modality's features ``[tokens, H]`` at its mask."""
        for modality, feats in features.items():
            mask = masks[modality].unsqueeze(-1).expand_as(inputs_embeds)
            inputs_embeds = inputs_embeds.masked_scatter(mask, feats.to(inputs_embeds.dtype))
        return inputs_embeds

    def encoder_outputs(self, model: torch.nn.Module, chunk: VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        """Everything the first stage takes from the vision side for one chunk, by name, each
        ``[tokens, H]`` (``H`` the text hidden size) with one row per placeholder of its modality.

        The encoder spread (:mod:`ppmedia.pipeline.encoder`) runs this on whichever pipeline rank
        encodes the chunk, sends the tensors to the first stage and hands them back through an
        override of this method (and of :meth:`encode`), so the first stage never runs the tower.
        The names are :meth:`encoder_output_names` of each modality the chunk has. Default:
        :meth:`encode` (names = modalities); a family whose first stage needs more (Qwen3-VL's
        deepstack sets) overrides both and reads its outputs through this method in
        :meth:`first_stage`.
        """
        return self.encode(model, chunk, host)

    def encoder_output_names(self, config: Any, modality: str) -> tuple[str, ...]:
        """The names :meth:`encoder_outputs` gives for ``modality`` when a chunk has it; each is
        ``[placeholders of modality, H]``. Default: ``(modality,)``."""
        return (modality,)

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
