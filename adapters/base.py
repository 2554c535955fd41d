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
metadata on the host); :mod:`ppmedia.adapters._helpers` holds what the built-ins share. ``merge`` checks
what ``encode`` returned against what ``feature_counts`` promised (modalities and rows) before the
scatter, so an encoder giving one row too many or too few is an error naming the family, the modality
and the microbatch, never a silently dropped or misplaced feature.

Besides its media, a family may declare per-sample inputs (:class:`SampleInput`, ``[B, ...]`` tensors
of the batch such as PaliGemma's ``token_type_ids``: split with the samples, handed to the first stage
in ``chunk.extras`` and, with ``every_stage=True``, sent along with the hidden states to every stage)
and where its language model sits (``language_model_path``).

**State that crosses stage boundaries.** Between pipeline stages travel the hidden states, the
attention mask and the tensors the adapter declares for the receiving stage
(:meth:`VlmAdapter.wire_tensors`, each a :class:`WireTensor`). A wire tensor is made either by the
first stage (:meth:`VlmAdapter.first_stage`: positions, deepstack features) or by a decoder layer on
any stage: state one layer hands to a later one (Mistral Large 4's DSA top-k indices and shared
latent KV, Inkling 2's attention-residual block states). For the latter a stage runs its layers with
the hooks of :meth:`VlmAdapter.stage_hooks` (:class:`LayerHook`), which read what the stage received
from ``state`` and hand it to the model's own code where that code expects it, and store into
``state`` what the stage's layers made; the stage then sends every tensor of ``wire_tensors(config,
its_stop)`` from ``state``. :meth:`VlmAdapter.decoder_kwargs` turns the received tensors into the
language model's keyword arguments, :meth:`VlmAdapter.prune_stage` edits a stage's copy of the
language model (modules only the last stage runs), :meth:`VlmAdapter.logits` is the last stage's head.
The worked examples: ``ppmedia.adapters.qwen3_vl`` (made on the first stage) and
``ppmedia.adapters.mistral_large4`` (made by layers), documented in ``docs/state-families.md``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, MutableMapping, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from ..chunk import CURSOR_ATTRIBUTE, VlmMediaChunk
from ..planning.costs import encoder_flops
from ..producer.hostreads import HostReader

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "HostValues",
    "LayerHook",
    "SampleInput",
    "VlmAdapter",
    "WireTensor",
    "config_get",
    "config_value",
    "inner_model",
    "read_host",
]


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
        floating: ``True``: the hidden states' dtype, and its gradient flows back to the stage that
            made it (deepstack features: the first stage, so the vision tower gets their gradient;
            shared KV or block states: the stage of the layer that made them); ``False``: int64, no
            gradient (positions, masks, token types, top-k indices).
        dtype: for a tensor without gradient (``floating=False``), its dtype when not int64, as a
            ``torch`` dtype name (an addition): ``"float32"`` for Qwen3-Omni's positions, which may be
            fractional (a video's frames ``0.5`` seconds apart at 25 positions a second).
    """

    name: str
    shape: tuple[Union[int, str], ...]
    floating: bool = False
    dtype: str = "int64"


#: ``before(module, args, kwargs) -> (args, kwargs) | None``: torch's forward pre-hook with kwargs.
BeforeHook = Callable[[torch.nn.Module, tuple[Any, ...], dict[str, Any]], Optional[tuple[tuple[Any, ...], dict[str, Any]]]]
#: ``after(module, args, kwargs, output) -> output | None``: torch's forward hook with kwargs.
AfterHook = Callable[[torch.nn.Module, tuple[Any, ...], dict[str, Any], Any], Any]


@dataclass(frozen=True)
class LayerHook:
    """A hook a stage puts on one of its modules while its language model runs one microbatch
    (:meth:`VlmAdapter.stage_hooks`), then removes.

    Attributes:
        module: a module of the stage, usually one of its decoder layers
            (``stage.stage_language_model.layers``), or another child of its language model.
        before: called before ``module`` runs, with the positional and keyword arguments the language
            model's own ``forward`` passes it; returns replacements ``(args, kwargs)`` or ``None``
            (registered with ``register_forward_pre_hook(..., with_kwargs=True)``).
        after: called after it ran, with the same arguments and its output; returns a replacement
            output or ``None`` (``register_forward_hook(..., with_kwargs=True)``).

    The hooks sit outside transformers' activation checkpointing (it checkpoints ``forward``, not
    ``__call__``), so a recomputed layer sees the arguments the hook gave it on the forward.
    """

    module: torch.nn.Module
    before: BeforeHook | None = None
    after: AfterHook | None = None


@dataclass(frozen=True)
class SampleInput:
    """A per-sample (``[B, ...]``) or per-token (``[B, S]``) input a family needs besides its media.

    :meth:`VlmAdapter.media_counts` hands the batch's value to :func:`ppmedia.split_media`, which pops
    it, splits it with the samples (and reorders it with them when balancing) and stages microbatch
    ``k``'s rows as views in ``chunk.extras[key]``: what the first stage's ``encode`` reads. With
    ``every_stage`` the first stage also sends it on with the hidden states, so every stage's
    :meth:`VlmAdapter.decoder_kwargs` finds it in ``wire[key]`` (and, with ``kwarg``, the language
    model's ``forward`` gets it as that keyword on every stage).

    Attributes:
        key: the batch key; also the ``chunk.extras`` and ``wire`` key.
        shape: as :class:`WireTensor`: ``"b"`` first (the microbatch's samples), then ``"S"``, ``"H"``
            or ints (``("b", "S")`` for token types); checked on every stage when ``every_stage``.
        every_stage: carry it to every stage (prefix-LM token types, MoE routing token types).
        kwarg: the language model ``forward`` keyword to pass it as on every stage (needs
            ``every_stage``), e.g. ERNIE 4.5 VL's ``moe_mm_token_type_ids``; ``None``: not passed
            (the adapter's ``decoder_kwargs`` reads ``wire[key]`` itself).
        floating: travels in the hidden states' dtype with a gradient (else int64, as sent).

    A batch without ``key`` stages nothing for it (:meth:`VlmAdapter.sample_input_values` leaves it
    out): with ``every_stage`` the first stage then raises ``ValueError`` naming the key and the
    microbatch (:meth:`VlmAdapter.add_sample_inputs`); otherwise ``chunk.extras`` simply lacks it and
    the adapter's ``encode`` decides.
    """

    key: str
    shape: tuple[Union[int, str], ...] = ("b",)
    every_stage: bool = False
    kwarg: str | None = None
    floating: bool = False

    def problem(self) -> str | None:
        """What is wrong with this declaration, in words, or ``None``."""
        if not isinstance(self.key, str) or not self.key:
            return f"key {self.key!r}; expected a batch key (non-empty str)"
        shape = self.shape
        if not isinstance(shape, tuple) or not shape or shape[0] != "b":
            return f"{self.key}: shape {shape!r}; expected a tuple starting with 'b' (one row per sample)"
        if any(not (d in ("b", "S", "H") or (isinstance(d, int) and not isinstance(d, bool) and d >= 0)) for d in shape):
            return f"{self.key}: shape {shape!r}; expected 'b', 'S', 'H' or ints >= 0 as dims"
        if self.kwarg is not None and (not isinstance(self.kwarg, str) or not self.kwarg.isidentifier() or not self.every_stage):
            return f"{self.key}: kwarg {self.kwarg!r}; expected a keyword name, with every_stage=True (every stage runs the language model)"
        return None

    def wire(self) -> WireTensor:
        """The :class:`WireTensor` it travels as between stages."""
        return WireTensor(self.key, self.shape, self.floating)


def _microbatch_label(model: Any) -> str:
    """``" in microbatch k"`` when ``model`` is a staged first stage (its cursor says which), else ``""``."""
    state = getattr(model, "__dict__", None)
    cursor = state.get(CURSOR_ATTRIBUTE) if isinstance(state, dict) else None
    return f" in microbatch {cursor - 1}" if isinstance(cursor, int) and cursor > 0 else ""


def read_host(masks: Mapping[str, Tensor], inputs: Mapping[str, Tensor]) -> HostValues:
    """Read every mask's per-sample sum and every tensor of ``inputs`` to the host, in one read
    (:class:`ppmedia.producer.hostreads.HostReader`; one per device when they live on several).

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


def _per_sample_rope(
    adapter: "VlmAdapter", model: torch.nn.Module, input_ids: Tensor, chunk: VlmMediaChunk | None, segments: Tensor
) -> Tensor:
    """The family's own positions (:meth:`VlmAdapter.position_ids`) for every sample of packed rows alone.

    The samples become the rows of a right-padded batch (the same order: the chunk's media are in
    sample order either way), ``position_ids`` runs on it once, and each sample's positions go back
    to its place in the packed rows ``[3, b, S]`` (padding 0). One host read of ``segments``.
    """
    from ..packing.isolation import rows_as_samples

    runs = rows_as_samples(segments)
    b, S = input_ids.shape
    longest = max([stop - start for _, start, stop in runs] + [1])
    ids = input_ids.new_zeros((max(len(runs), 1), longest))
    mask = torch.zeros_like(ids)
    for j, (r, start, stop) in enumerate(runs):
        ids[j, : stop - start] = input_ids[r, start:stop]
        mask[j, : stop - start] = 1
    alone = adapter.position_ids(model, ids, chunk, mask)
    if alone is None:
        raise ValueError(f"{type(adapter).__name__}.position_ids returned None for a packed microbatch")
    out = alone.new_zeros((alone.shape[0], b, S))
    for j, (r, start, stop) in enumerate(runs):
        out[:, r, start:stop] = alone[:, j, : stop - start]
    return out


class VlmAdapter(abc.ABC):
    """Base class of every family adapter. Subclasses are stateless; one instance serves any model.

    Class attributes:
        name: short family name, e.g. ``"qwen2_5_vl"``.
        model_types: the ``config.model_type`` strings this adapter serves (first is canonical).
        layout: the media layout it reads from a chunk, in words (shown by ``ppmedia adapters``).
        sample_inputs: the family's per-sample inputs (:class:`SampleInput`); default none.
        language_model_path: dotted path of the decoder stack (the module holding ``layers``) inside
            the model, e.g. ``"language_model.model"`` (Llama 4) or ``"model.text_model"``
            (Idefics3); ``None`` (default): the first of
            :data:`ppmedia.pipeline.surgery.LANGUAGE_MODEL_PATHS` that holds a ``layers`` list. The
            output head is found wherever it sits (``model.get_output_embeddings()``). A module of
            the decoder stack other than its layers, embedding and norm is on every stage unless
            :meth:`prune_stage` drops it (or :attr:`merge_path` names it).
        merge_path: where the family merges, as the dotted path inside the model of the module whose
            OUTPUT is the merged embeddings ``[B, S, hidden]``, e.g. ``"model.embed_tokens_extend"``
            (Phi-4-multimodal: both encoders and the merge sit inside the decoder stack); ``None``
            (default): the merge is the decoder stack's input (the ``inputs_embeds`` its ``forward``
            gets). Everything of ppmedia that needs the merge reads it here: the testing kit's reference
            (``check_adapter``, goldens, stage check), the stage cutter (the module and everything under
            it on the first stage only, its parameters on the vision side) and the encoder spread's
            :func:`~ppmedia.pipeline.vision_replica`.
        packing_refusal: why the family's samples cannot share a packed row, in words (refused by
            :func:`ppmedia.packing.enable_packing`); ``None`` (default): its layer types decide.
        context_refusal: why the family's decoder cannot be sharded over context-parallel ranks, in
            words (refused by :func:`ppmedia.pipeline.enable_context_parallel`: state that indexes keys
            across layers); ``None`` (default): its layer types decide.
        attention_blocks_windowed: whether a sliding layer's window also limits the bidirectional
            blocks of :meth:`attention_blocks` (Gemma 3, default) or they are added after it (PaliGemma 2).
        prefix_lm_key: the per-token input whose 0 marks a bidirectional prefix and 1 the causal rest
            (PaliGemma's ``token_type_ids``); :class:`ppmedia.data.SampleProcessor` (given the
            config) sets it from the labels: 0 up to the first answer token, 1 from it on (a
            processor called without a ``suffix`` marks the whole sample prefix, so every answer
            token would see the tokens after it). ``None`` (default): no such input.
        sample_axis_keys: the processor's output keys that hold one entry per SAMPLE of the batch on
            axis 0 (Idefics3's ``pixel_values`` ``[B, max_crops, C, H, W]``): the processor's batch
            gives a sample without media an all-zero entry, so :func:`ppmedia.data.collate_samples`
            does too. ``()`` (default): media keys hold one entry per item (concatenated).

    A subclass implements :meth:`media_per_sample`, :meth:`placeholder_masks`,
    :meth:`feature_counts` and :meth:`encode`; it may override :meth:`host_inputs` (integer metadata
    it needs on the host) and :meth:`position_ids`. :meth:`merge` is the same for every family:
    masks, one host read (:meth:`check_counts`), encoder, scatter.
    """

    name: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    layout: ClassVar[str]
    sample_inputs: ClassVar[tuple[SampleInput, ...]] = ()
    language_model_path: ClassVar[str | None] = None
    merge_path: ClassVar[str | None] = None
    packing_refusal: ClassVar[str | None] = None
    context_refusal: ClassVar[str | None] = None
    attention_blocks_windowed: ClassVar[bool] = True
    prefix_lm_key: ClassVar[str | None] = None
    sample_axis_keys: ClassVar[tuple[str, ...]] = ()

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
        ``videos_per_sample`` from :meth:`media_per_sample` (and ``audios_per_sample`` from
        :meth:`audios_per_sample` for a family with audio), leaving out each count the batch already
        holds (``n_images_per_sample`` / ``n_videos_per_sample`` / ``n_audios_per_sample``:
        ``split_media`` takes those); ``sample_inputs`` when the family declares any. Adapters whose
        tokens alone cannot count some medium read the batch's metadata here (Qwen3-VL videos:
        ``video_grid_thw``).
        """
        images, videos = self.media_per_sample(batch["input_ids"], config, media=batch)
        counts: dict[str, Any] = {"images_per_sample": images, "videos_per_sample": videos}
        audios = self.audios_per_sample(batch["input_ids"], config, media=batch)
        if audios is not None:  # families with audio: audios_per_sample too
            counts["audios_per_sample"] = audios
        for key, arg in (("n_images_per_sample", "images_per_sample"), ("n_videos_per_sample", "videos_per_sample"),
                         ("n_audios_per_sample", "audios_per_sample")):
            if batch.get(key) is not None:
                counts.pop(arg, None)
        if self.sample_inputs:
            values = self.sample_input_values(batch, config)
            if values:
                counts["sample_inputs"] = values
        return counts

    def audios_per_sample(
        self, input_ids: Tensor, config: Any, *, media: Mapping[str, Any] | None = None
    ) -> Tensor | None:
        """``[B]`` int64 audio clips per sample, counted from the placeholder tokens, for
        :func:`ppmedia.split_media`'s ``audios_per_sample`` (:meth:`media_counts` passes it on).

        ``None`` (the default) for a family without audio. A family with audio counts its audio
        blocks (e.g. Gemma 4's ``<boa> <audio> * n <eoa>``, one block per clip); ``media`` is the batch,
        for families whose tokens alone cannot tell clips apart.
        """
        return None

    def sample_input_values(self, batch: Mapping[str, Any], config: Any) -> dict[str, Tensor | None]:
        """``split_media``'s ``sample_inputs`` for a batch: ``{key: None}`` (stage the batch's own
        ``[B, ...]`` value) for each of :attr:`sample_inputs` the batch holds. Override it to stage a
        value of your own instead, ``{key: [B, ...] tensor}`` (the batch's key is popped either way),
        e.g. to turn a processor's ``[samples with images]`` counts into ``[B]``.
        """
        return {spec.key: None for spec in self.sample_inputs if batch.get(spec.key) is not None}

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
        return self._merged(model, input_ids, inputs_embeds, chunk, with_outputs=False)[0]

    def merge_with_outputs(
        self,
        model: torch.nn.Module,
        input_ids: Tensor,
        inputs_embeds: Tensor,
        chunk: VlmMediaChunk | None,
    ) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]:
        """:meth:`merge` for a :meth:`first_stage` that needs more of the microbatch's media than the
        merged embeddings (Qwen3-VL's deepstack sets, Gemma 4's per-layer inputs).

        The encoder runs through :meth:`encoder_outputs` (what the encoder spread hands back); of its
        outputs, each modality's own entry is checked and scattered as :meth:`merge` does with
        :meth:`encode`'s.

        Returns:
            ``(hidden, masks, outputs)``: the merged embeddings ``[b, S, hidden]`` (``inputs_embeds``
            itself for a text-only microbatch), the placeholder masks ``{modality: [b, S] bool}`` and
            everything :meth:`encoder_outputs` gave, by name (``{}`` for a text-only microbatch).

        Raises:
            ValueError: as :meth:`merge`.
        """
        return self._merged(model, input_ids, inputs_embeds, chunk, with_outputs=True)

    def _merged(
        self, model: torch.nn.Module, input_ids: Tensor, inputs_embeds: Tensor, chunk: VlmMediaChunk | None, *,
        with_outputs: bool,
    ) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]:
        """:meth:`merge`'s steps: ``(hidden, masks, outputs)``, the outputs :meth:`encode`'s or (with
        ``with_outputs``) :meth:`encoder_outputs`'s."""
        if chunk is not None and chunk.extras is not None and not chunk.has_media:  # only per-sample inputs: text-only
            chunk = None
        masks, host = self.check_counts(input_ids, chunk, model.config)
        if chunk is None:
            return inputs_embeds, masks, {}
        if with_outputs:
            outputs = self.encoder_outputs(model, chunk, host)
            features = {m: outputs[m] for m in masks if m in outputs}
        else:
            outputs = features = self.encode(model, chunk, host)
        self.check_features(features, masks, host, inputs_embeds.shape[-1], _microbatch_label(model))
        return self.scatter(inputs_embeds, masks, features), masks, outputs

    def check_features(
        self, features: Mapping[str, Tensor], masks: Mapping[str, Tensor], host: HostValues, hidden: int, where: str = ""
    ) -> None:
        """What :meth:`encode` returned against what :meth:`feature_counts` promised (shapes only, no host read).

        Every modality of ``features`` must be one of :meth:`placeholder_masks`, hold ``[rows, hidden]``
        with ``rows`` its placeholder tokens in the microbatch, and every modality with placeholders
        must be there.

        Raises:
            ValueError: naming the family, the modality, the rows expected and got, and ``where`` (the
                microbatch, when the first stage is staged).
        """
        if not isinstance(features, Mapping):
            raise TypeError(f"{self.name} adapter: encode returned {type(features).__name__}{where}; expected a dict of modality to [rows, {hidden}] features")
        for modality, feats in features.items():
            if modality not in masks:
                raise ValueError(
                    f"{self.name} adapter: encode returned {modality!r} features{where}, a modality placeholder_masks "
                    f"does not declare (it declares {', '.join(map(repr, masks)) or 'none'}); expected only those"
                )
            expected = host.total(modality)
            shape = list(feats.shape) if isinstance(feats, Tensor) else None
            if shape is None or len(shape) != 2 or shape[0] != expected or shape[1] != hidden:
                seen = f"a {type(feats).__name__}" if shape is None else f"{shape[0] if shape else 0} rows (shape {shape})"
                raise ValueError(
                    f"{self.name} adapter: encode returned {seen} of {modality} features{where}; expected {expected} "
                    f"rows, [{expected}, {hidden}] (the {modality} placeholder tokens, as feature_counts promised)"
                )
        for modality in masks:
            if modality not in features and host.total(modality):
                raise ValueError(
                    f"{self.name} adapter: encode returned no {modality} features{where}; expected "
                    f"{host.total(modality)} rows (the {modality} placeholder tokens, as feature_counts promised)"
                )

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
            float ``[sequences]``. The default is :func:`ppmedia.balance.encoder_flops` (from :mod:`ppmedia.planning.costs`; linear layers
            per patch plus attention over the sequence, windowed layers over their window); override
            it for an encoder whose cost grows differently.
        """
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

    def packed_position_ids(
        self,
        model: torch.nn.Module,
        segments: Tensor,
        input_ids: Tensor | None = None,
        chunk: VlmMediaChunk | None = None,
    ) -> Tensor | None:
        """Per-sample positions of a packed microbatch (several samples per row; see :mod:`ppmedia.packing`).

        The pipeline's stages call it on packed rows: the first stage with ``input_ids`` ``[b, S]`` and
        the microbatch's chunk, later stages without them.

        Args:
            model: the stage module (``model.config``).
            segments: ``[b, S]`` the packed ``attention_mask``: each token's sample number in its row
                (1, 2, ...), 0 on padding.
            input_ids, chunk: the first stage's tokens and media (``None`` on later stages).

        Returns:
            Default: for a family whose positions travel on the wire (it overrides :meth:`position_ids`:
            the mrope families), its own rope index computed per sample and laid back into the rows,
            ``[3, b, S]`` (first stage; later stages ``None``: they receive them); otherwise 1-D
            positions ``[b, S]`` restarting at 0 at every sample (:func:`ppmedia.packing.sample_positions`).
            Override it for a family whose 1-D positions start elsewhere (PaliGemma: at 1).
        """
        from ..packing.positions import sample_positions

        if not any(spec.name == "position_ids" for spec in self.wire_tensors(model.config, 0)):
            return sample_positions(segments)
        if input_ids is None:
            return None
        return _per_sample_rope(self, model, input_ids, chunk, segments)

    # -- pipeline wire format ---------------------------------------------------------------
    # ppmedia.pipeline's stages call these; an adapter overrides them when its language model needs
    # more than hidden states, attention mask and (optionally) positions on every stage. Cross-layer
    # state (deepstack features, Gemma 4's per-layer inputs and shared KV) is declared in wire_tensors,
    # made by first_stage or by a stage's own layers (stored through stage_hooks), and read in
    # decoder_kwargs or by the hooks.

    def wire_tensors(self, config: Any, first_layer: int) -> tuple[WireTensor, ...]:
        """The tensors a stage whose first decoder layer is ``first_layer`` needs from earlier stages.

        Besides the hidden states and attention mask, in send order. ``first_layer`` is a full-model
        layer index (a stage with no layers passes its successor's). A stage whose layers are
        ``j .. k-1`` sends ``wire_tensors(config, k)``: each of them it either received
        (``wire_tensors(config, j)``) or its layers made (stored by :meth:`stage_hooks`); without
        stage hooks that means a subset of what it got. Default: the mrope positions ``[b, 3, S]``
        for adapters that override :meth:`position_ids`, else nothing.
        """
        if type(self).position_ids is VlmAdapter.position_ids:
            return ()
        return (WireTensor("position_ids", ("b", 3, "S")),)

    def stage_wire_tensors(self, config: Any, first_layer: int) -> tuple[WireTensor, ...]:
        """What a stage whose first layer is ``first_layer`` really receives besides hidden states and
        mask: :meth:`wire_tensors`, then every ``every_stage`` :class:`SampleInput` it does not name.
        The pipeline's stages call this; override :meth:`wire_tensors` instead."""
        own = tuple(self.wire_tensors(config, first_layer))
        named = {spec.name for spec in own}
        return own + tuple(spec.wire() for spec in self.sample_inputs if spec.every_stage and spec.key not in named)

    def add_sample_inputs(self, wire: dict[str, Tensor], chunk: VlmMediaChunk | None, where: str = "") -> None:
        """Put every ``every_stage`` :class:`SampleInput` the adapter's ``first_stage`` did not fill into
        ``wire``, from ``chunk.extras`` (int64 unless ``floating``: one device cast, no host read).

        Raises:
            ValueError: one was not staged (the batch lacked it, or was split without
                ``**adapter.media_counts(batch, config)``).
        """
        for spec in self.sample_inputs:
            if not spec.every_stage or spec.key in wire:
                continue
            extras = None if chunk is None else chunk.extras
            tensor = None if extras is None else extras.get(spec.key)
            if tensor is None:
                raise ValueError(
                    f"{self.name} adapter: per-sample input {spec.key!r} was not staged{where}; expected the batch's "
                    f"{spec.key} {list(spec.shape)} split with the media: split_media(batch, n, "
                    f"**adapter.media_counts(batch, config))"
                )
            wire[spec.key] = tensor if spec.floating or tensor.dtype == torch.int64 else tensor.to(torch.int64)

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
            wire["position_ids"] = self._wire_positions(model, input_ids, chunk, attention_mask)
        return hidden, wire

    def _wire_positions(
        self, model: torch.nn.Module, input_ids: Tensor, chunk: VlmMediaChunk | None, attention_mask: Tensor
    ) -> Tensor:
        """:meth:`position_ids` ``[3, b, S]`` as they travel, batch first ``[b, 3, S]``."""
        positions = self.position_ids(model, input_ids, chunk, attention_mask)
        if positions is None:
            raise ValueError(f"{type(self).__name__}.position_ids returned None for a microbatch")
        return positions.transpose(0, 1)  # [3, b, S] -> batch first

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

    def attention_blocks(self, config: Any, wire: Mapping[str, Tensor]) -> Tensor | None:
        """Bidirectional blocks of the family's mask over a WHOLE row, for context parallelism (whose
        attention evaluates the mask from index vectors): ``[b, S]`` int64 block ids, a query seeing
        every key of its own block (id >= 0) besides the causal ones; -1 elsewhere.

        Args:
            config: the model's config.
            wire: the stage's integer ``[b, S]`` wire tensors of the whole row by name (e.g. ``token_type_ids``).

        Returns:
            Default ``None``: the mask is causal (plus the layer's window, padding, packed samples).
        """
        return None

    def stage_hooks(
        self, stage: torch.nn.Module, layers: range, state: MutableMapping[str, Tensor]
    ) -> Sequence[LayerHook]:
        """Hooks on the stage's modules for one run of its language model (one microbatch): how state
        that one decoder layer hands to a later one crosses stage boundaries.

        Called on every stage that runs its language model (all but a middle stage without decoder
        layers), once per forward, before it runs; the stage registers the hooks, runs the language
        model, removes them.

        Args:
            stage: the stage module (``stage.config``, ``stage.stage_language_model`` whose ``layers``
                are the stage's decoder layers in order, ``stage.is_first`` / ``is_last``).
            layers: the full-model indices of those layers (contiguous; empty on a last stage
                without decoder layers, which still runs the final norm).
            state: this microbatch's wire tensors by name: on entry what the stage received
                (``wire_tensors(config, layers.start)``; the first stage: what :meth:`first_stage`
                made); the hooks read it to hand the model's own code what earlier stages' layers
                made (a ``before`` hook replacing a layer's argument), and store into it what this
                stage's layers make (an ``after`` hook reading a layer's output, or a ``before``
                hook reading a container the language model passes every layer). After the run the
                stage sends ``wire_tensors(config, layers.stop)`` from ``state``; a name there that
                is neither received nor stored is a ``TypeError`` naming it. Store floating state as
                the graph gives it (its gradient flows back to the layer that made it).

        Returns:
            :class:`LayerHook` objects; default none (no state made by layers).
        """
        return ()

    def prune_stage(self, language_model: torch.nn.Module, *, layers: range, first: bool, last: bool) -> None:
        """Edit a stage's copy of the language model in place, after ppmedia kept its decoder layers
        (under their original indices), removed the embedding from later stages and replaced the final
        norm by ``Identity`` on all but the last.

        Override it when the language model's ``forward`` runs another module only the last stage
        should (Inkling 2's final block-attention residual): replace it by a parameter-free stand-in
        on the other stages (``language_model._modules[name] = ...``); or drop modules only the first
        stage runs from the others (Gemma 4's per-layer-embedding tables, used once to make state that
        then travels on the wire). The copy shares its modules with the model; do not modify them,
        replace or remove entries. Default: nothing.
        """

    def tp_plan(self, config: Any) -> Mapping[str, str] | None:
        """The language model's tensor-parallel plan when its text config has no
        ``base_model_tp_plan`` (:func:`~ppmedia.pipeline.apply_tensor_parallel`).

        Keys are module paths inside the language model, ``*`` matching a decoder layer's index
        (``"layers.*.self_attn.q_proj"``); values are transformers' style names: ``colwise``,
        ``rowwise`` or ``replicated_with_grad_allreduce``. Default: ``None`` (no plan of its own).
        """
        return None

    def logits(self, stage: torch.nn.Module, hidden: Tensor) -> Tensor:
        """The last stage's output: logits ``[b, S, vocab]`` from the final hidden states ``[b, S, H]``.

        Default: the model's output head (``lm_head``). Override it when the model's own forward does
        more after the head (logit soft-capping, slicing a padded vocabulary); then also
        :meth:`logits_width` if the width changes.
        """
        head: Any = getattr(stage, "output_head")  # the head wherever it sits (Llama 4: language_model.lm_head)
        return head(hidden)

    def logits_width(self, config: Any, head_width: int) -> int:
        """The vocabulary width of :meth:`logits` for a head of ``head_width`` outputs (static shapes).
        Default: ``head_width``."""
        return head_width

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, model_types={self.model_types!r})"
