"""Pipeline stage modules: :class:`StageModule`, :func:`build_stage_modules` (the stage cutter) and
:func:`static_stage_args`. The ``PipelineStage`` objects around them are
:func:`ppmedia.pipeline.rank_stages.make_pipeline_stages`'s (which also hangs the encoder spread on
them): this module imports neither the encoder spread nor anything built on the pipeline.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Mapping, Protocol, Sequence

import torch
from torch import Tensor, nn

from ..adapters.base import VlmAdapter, WireTensor, config_value
from ..chunk import CURSOR_ATTRIBUTE, VlmMediaChunk, next_vlm_media_chunk
from ..producer.presplit import MicrobatchMedia
from .surgery import (
    _child_name,
    _get_path,
    _layer_ranges,
    _stage_children,
    find_language_model,
    find_merge_module,
    find_output_head,
)
from .tied import TiedParameters, tied_parameters

__all__ = ["LayerSplitRequest", "StageModule", "build_stage_modules", "refuse_router_loss", "stage_modules_of", "static_stage_args"]

#: where :class:`ppmedia.pipeline.encoder.EncoderSpread` hangs a step's precomputed features on the
#: first stage's module (an object with ``adapter_for(microbatch, chunk) -> VlmAdapter``)
FEATURES_ATTRIBUTE = "_ppmedia_encoder_features"


class LayerSplitRequest(Protocol):
    """What ``layers_per_stage="auto"`` asks its ``auto_split`` for (:class:`ppmedia.planning.stepmodel.AutoSplit`
    is one: the step model's best split for a representative batch). The cutter depends only on this,
    never on the planner that answers it."""

    def split_layers(self, config: Any, n_stages: int, adapter: Any = None, num_layers: int | None = None) -> list[int]:
        """Decoder layers per stage (``n_stages`` counts summing to ``num_layers``)."""
        ...


class StageModule(nn.Module):
    """One pipeline stage of a vision-language model (see the module docstring for what travels).

    Attributes:
        stage_index, n_stages: this stage and the pipeline length.
        layer_range: ``(start, stop)`` of the decoder layers it runs (full-model indices).
        is_first, is_last: whether it embeds and merges media / produces logits.
        wire_in, wire_out: the extra tensors it receives / sends (besides hidden states and mask), as the
            adapter declares them for its first layer / its successor's first layer; each one sent is
            either received or made by the stage's layers (``adapter.stage_hooks``).
        adapter: the family adapter (first stage: merge and positions).
        config: the full model's config (plain attribute, read by the adapter).
        language_model_path: dotted path of the language model (``model.language_model``).
        tied: the FULL model's tied parameter groups (the same on every rank; pass them to
            :func:`sync_tied_gradients`), found before the split.
        head_name: dotted path of the output head (``lm_head``; Llama 4: ``language_model.lm_head``).
        merge_path: the adapter's ``merge_path`` (``None``: the merge is the decoder's input); its
            parameters are the vision side's even inside the language model.
        packed: whether its microbatches are packed rows (:func:`ppmedia.packing.enable_packing`): the
            ``attention_mask`` holds sample numbers, the stage gives its language model per-sample
            positions and a mask that keeps every sample to itself.
    """

    def __init__(
        self,
        children: Mapping[str, nn.Module],
        parameters: Mapping[str, nn.Parameter],
        *,
        config: Any,
        adapter: VlmAdapter,
        stage_index: int,
        n_stages: int,
        layer_range: tuple[int, int],
        language_model_path: str,
        head_name: str,
        merge_path: str | None = None,
    ) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)
        for name, param in parameters.items():
            self.register_parameter(name, param)
        self.config = config
        self.adapter = adapter
        self.stage_index = stage_index
        self.n_stages = n_stages
        self.layer_range = layer_range
        self.is_first = stage_index == 0
        self.is_last = stage_index == n_stages - 1
        self.language_model_path = language_model_path
        self.head_name = head_name
        self.merge_path = merge_path
        self.tied: tuple[TiedParameters, ...] = ()
        self.packed = False
        self.context: Any = None  # a ContextShard: the decoder's sequence divided over cp (enable_context_parallel)
        self.context_vision = "replicate"  # under cp: "shard" divides stage 0's media items over cp (cp_vision)

    # -- helpers -------------------------------------------------------------------------------
    @property
    def stage_language_model(self) -> Any:
        """This stage's (pruned) language model."""
        module = _get_path(self, self.language_model_path)
        assert module is not None
        return module

    @property
    def output_head(self) -> Any:
        """The output head (last stage only)."""
        return _get_path(self, self.head_name)

    @property
    def wire_in(self) -> tuple[WireTensor, ...]:
        """The extra tensors this stage receives after hidden states and mask (none on the first stage)."""
        if self.is_first:
            return ()
        return self.adapter.stage_wire_tensors(self.config, self.layer_range[0])

    @property
    def wire_out(self) -> tuple[WireTensor, ...]:
        """The extra tensors this stage sends after hidden states and mask (none on the last stage)."""
        if self.is_last:
            return ()
        return self.adapter.stage_wire_tensors(self.config, self.layer_range[1])

    @property
    def carries_position_ids(self) -> bool:
        """Whether mrope positions ``[b, 3, S]`` travel into or out of this stage."""
        return any(spec.name == "position_ids" for spec in self.wire_in + self.wire_out)

    def token_positions(self, hidden: Tensor) -> Tensor:
        """``[1, S]`` the global index of each token this stage holds of its row (``arange(S)``; under
        context parallelism this rank's head-tail share of the padded row)."""
        if self.context is None:
            return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        return self.context.indices(hidden.shape[1] * self.context.size, device=hidden.device).unsqueeze(0)

    @property
    def num_layers(self) -> int:
        return self.layer_range[1] - self.layer_range[0]

    def is_language_parameter(self, name: str) -> bool:
        """Whether parameter ``name`` belongs to the language side (decoder, embedding, norm, head); the
        merge module's (``merge_path``, e.g. encoders inside the decoder stack) do not."""
        if self.merge_path is not None and name.startswith(self.merge_path + "."):
            return False
        return name.startswith(self.language_model_path + ".") or name.startswith(self.head_name + ".")

    def extra_repr(self) -> str:
        return (
            f"stage={self.stage_index}/{self.n_stages}, layers={self.layer_range}, "
            f"first={self.is_first}, last={self.is_last}, "
            f"wire_in={[w.name for w in self.wire_in]}, wire_out={[w.name for w in self.wire_out]}"
        )

    # -- forward -------------------------------------------------------------------------------
    def forward(self, *args: Tensor, media: MicrobatchMedia | None = None) -> Tensor | tuple[Tensor, ...]:
        """First stage: ``(input_ids [b, S], attention_mask [b, S])``; later stages: the previous
        stage's tuple ``(hidden, attention_mask, *wire_in)``. Returns ``(hidden, attention_mask,
        *wire_out)`` for the next stage, or logits ``[b, S, vocab]`` on the last.

        ``media``: the microbatch's pre-split media (:func:`ppmedia.microbatch_inputs`), which the first
        stage merges; every other stage ignores it (torch hands keyword inputs to every stage of the
        rank). Without it, the first stage takes the media staged on it (:func:`ppmedia.stage_media`)."""
        if media is not None and not isinstance(media, MicrobatchMedia):
            raise TypeError(
                f"stage {self.stage_index}: media is a {type(media).__name__}; expected ppmedia.MicrobatchMedia "
                f"(ppmedia.microbatch_inputs(...).kwarg_mbs)"
            )
        if self.is_first:
            if len(args) != 2:
                raise TypeError(
                    f"stage 0 takes (input_ids, attention_mask); got {len(args)} positional arguments"
                )
            input_ids, attention_mask = args
            if self.context is not None:  # merged and positioned on the full (padded) row, then sharded
                from .cp_stage import pad_row

                input_ids, attention_mask = pad_row(self, input_ids, attention_mask)
            hidden, wire = self._embed_and_merge(input_ids, attention_mask, media)
            if self.context is not None:
                from .cp_stage import shard_first_stage

                hidden, attention_mask, wire = shard_first_stage(self, hidden, attention_mask, wire)
        else:
            specs = self.wire_in
            if len(args) != 2 + len(specs):
                names = ", ".join(["hidden_states", "attention_mask"] + [w.name for w in specs])
                raise TypeError(
                    f"stage {self.stage_index} takes {2 + len(specs)} tensors from the previous stage "
                    f"({names}); got {len(args)}"
                )
            hidden, attention_mask = args[0], args[1]
            wire = {spec.name: tensor for spec, tensor in zip(specs, args[2:])}
        hidden, wire = self._decode(hidden, attention_mask, wire)
        if self.is_last:
            return self.adapter.logits(self, hidden)
        out = [hidden.contiguous(), attention_mask.contiguous()]
        for spec in self.wire_out:
            tensor = wire.get(spec.name)
            if tensor is None:
                raise TypeError(
                    f"stage {self.stage_index}: {type(self.adapter).__name__}.wire_tensors declares "
                    f"{spec.name!r} for stage {self.stage_index + 1}, but this stage does not hold it "
                    f"(it has {sorted(wire)}): a stage sends what it received or what its layers "
                    f"stored through {type(self.adapter).__name__}.stage_hooks"
                )
            if spec.floating and not tensor.requires_grad and tensor.is_leaf and torch.is_grad_enabled():
                # e.g. a text-only microbatch's zero deepstack features: keep a gradient slot, so the
                # schedule's metadata (taken from whichever microbatch comes first) fits every microbatch
                tensor = tensor.detach().requires_grad_()
            # a copy, never the input or a view of it: split-backward schedules (ZBV, DualPipeV)
            # detach_() every stage output in place, which a view refuses
            out.append(tensor.clone(memory_format=torch.contiguous_format))
        return tuple(out)

    def _microbatch_media(self, media: MicrobatchMedia | None) -> tuple[int | None, VlmMediaChunk | None]:
        """``(microbatch, chunk)``: the pre-split ``media``, else the next staged chunk (cursor moved)."""
        if media is None:
            k = self.__dict__.get(CURSOR_ATTRIBUTE)
            return k, next_vlm_media_chunk(self)
        if self.__dict__.get(CURSOR_ATTRIBUTE) is not None:
            raise ValueError(
                f"stage 0: got media= for microbatch {media.index} (pre-split) while media are also staged on "
                f"the module (stage_media, cursor {self.__dict__[CURSOR_ATTRIBUTE]}); expected one of the two"
            )
        return media.index, media.chunk

    def _embed_and_merge(
        self, input_ids: Tensor, attention_mask: Tensor, media: MicrobatchMedia | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        lm = self.stage_language_model
        embeds = lm.get_input_embeddings()(input_ids)  # [b, S, H]
        features = self.__dict__.get(FEATURES_ATTRIBUTE)  # set for one step by an encoder spread
        k, chunk = self._microbatch_media(media)
        adapter = self.adapter if features is None else features.adapter_for(k, chunk)
        if self.context is not None and self.context_vision == "shard" and features is None:
            from .cp_vision import vision_sharded  # each cp rank encodes its share of the items, gathered

            adapter = vision_sharded(adapter, self.context)
        segments = attention_mask
        if self.packed:
            attention_mask = segments.ne(0).to(segments.dtype)
        hidden, wire = adapter.first_stage(self, input_ids, attention_mask, embeds, chunk)
        if self.packed and "position_ids" in wire:
            positions = self.adapter.packed_position_ids(self, segments, input_ids, chunk)
            if positions is None:
                raise ValueError(f"{type(self.adapter).__name__}.packed_position_ids returned None on the first stage")
            wire["position_ids"] = positions.transpose(0, 1)
        if self.adapter.sample_inputs:
            self.adapter.add_sample_inputs(wire, chunk, f" for microbatch {k}" if isinstance(k, int) else "")
            if self.context is not None:  # per-sample inputs come at the batch's length: padded like the row
                from .cp_stage import pad_sample_inputs

                pad_sample_inputs(self, wire, input_ids.shape[1])
        b, S = input_ids.shape
        for spec in self.adapter.stage_wire_tensors(self.config, 0):
            tensor = wire.get(spec.name)
            expected = _wire_shape(spec, b, S, hidden.shape[-1])
            if tensor is None or list(tensor.shape) != expected:
                seen = "missing" if tensor is None else f"shape {list(tensor.shape)}"
                raise ValueError(
                    f"{type(self.adapter).__name__}.first_stage: wire tensor {spec.name!r} is {seen}; "
                    f"expected {expected} ({list(spec.shape)})"
                )
        return hidden, wire

    def _decode(
        self, hidden: Tensor, attention_mask: Tensor, wire: Mapping[str, Tensor]
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Run the stage's layers; returns the hidden states and the wire tensors after them (what the
        stage received or made, plus what its layers stored through ``adapter.stage_hooks``)."""
        state = dict(wire)
        if self.num_layers == 0 and not self.is_last:
            # Nothing to run; a fresh tensor keeps the stage's output distinct from its input.
            return (hidden if self.is_first else hidden.clone()), state
        layers = range(*self.layer_range)
        segments = attention_mask
        if self.packed:
            attention_mask = segments.ne(0).to(segments.dtype)
        kwargs: dict[str, Any] = {"attention_mask": attention_mask}
        for spec in self.adapter.sample_inputs:  # per-sample inputs the language model takes as keywords
            if spec.kwarg is not None:
                kwargs[spec.kwarg] = wire[spec.key]
        kwargs.update(self.adapter.decoder_kwargs(self, layers, hidden, attention_mask, wire))
        scope: Any = contextlib.nullcontext()
        if self.context is not None:  # global positions, the mask as index vectors over the whole row
            from .cp_stage import context_decoder_kwargs

            scope = context_decoder_kwargs(self, kwargs, hidden, segments, wire)
        elif self.packed:
            self._isolate_samples(kwargs, hidden, segments)
        handles = []
        try:
            for hook in self.adapter.stage_hooks(self, layers, state):
                if hook.before is not None:
                    handles.append(hook.module.register_forward_pre_hook(hook.before, with_kwargs=True))
                if hook.after is not None:
                    handles.append(hook.module.register_forward_hook(hook.after, with_kwargs=True))
            with scope:
                out = self.stage_language_model(inputs_embeds=hidden, use_cache=False, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        return (out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]), state


    def _isolate_samples(self, kwargs: dict[str, Any], hidden: Tensor, segments: Tensor) -> None:
        """Packed rows: per-sample positions (the adapter's hook) and masks that keep each sample to itself."""
        from ..packing.isolation import isolate

        positions = self.adapter.packed_position_ids(self, segments)
        if positions is not None:
            kwargs["position_ids"] = positions
        kwargs["attention_mask"] = isolate(self.config, hidden, kwargs["attention_mask"], segments)


def _router_loss_configs(config: Any, where: str = "config") -> list[tuple[str, Any]]:
    """``(path, config)`` of ``config`` and every sub-config (``text_config``, ``thinker_config``, ...)
    that asks for the routers' auxiliary loss (``output_router_logits=True``)."""
    found = [(where, config)] if getattr(config, "output_router_logits", False) is True else []
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if sub is not None and sub is not config and hasattr(sub, "to_dict"):
            found += _router_loss_configs(sub, f"{where}.{key}")
    return found


def refuse_router_loss(config: Any) -> None:
    """Refuse a config that asks for the MoE routers' auxiliary load-balancing loss.

    With ``output_router_logits=True`` the model's own forward adds ``router_aux_loss_coef`` times the
    load-balancing loss of all decoder layers' router logits (e.g. GLM-4.5V: 4.938794 against 4.938581
    without it). That loss couples every layer (one mean over all of them), stages return logits only,
    and :func:`~ppmedia.pipeline.pipeline_loss` would drop it without a word: refused instead.

    Raises:
        ValueError: naming the config key, its coefficient, and what to set.
    """
    for path, sub in _router_loss_configs(config):
        coef = getattr(sub, "router_aux_loss_coef", None)
        raise ValueError(
            f"{path}.output_router_logits is True: the model's own loss adds router_aux_loss_coef ({coef}) x the MoE "
            f"routers' load-balancing loss over all decoder layers, which ppmedia's pipeline stages do not carry "
            f"(they return logits only); set output_router_logits=False on that config to train without it"
        )


def stage_modules_of(stages: Sequence[Any], caller: str) -> list["StageModule"]:
    """The :class:`StageModule` of each of ``stages`` (``PipelineStage`` objects or the modules
    themselves); anything else is refused with a ``TypeError`` naming ``caller``."""
    modules = []
    for stage in stages:
        module = getattr(stage, "submod", stage)
        if not isinstance(module, StageModule):
            raise TypeError(
                f"{caller}: got {type(stage).__name__}; expected PipelineStage objects or StageModules "
                f"(make_pipeline_stages / build_stage_modules)"
            )
        modules.append(module)
    return modules


def build_stage_modules(
    model: nn.Module,
    n_stages: int,
    *,
    stages: Iterable[int] | None = None,
    layers_per_stage: Sequence[int] | str | None = None,
    adapter: VlmAdapter | None = None,
    auto_split: Any = None,
) -> list[StageModule]:
    """Cut ``model`` into pipeline stage modules.

    Args:
        model: a ``...ForConditionalGeneration`` whose ``config.model_type`` has a registered adapter.
        n_stages: the number of pipeline stages (>= 1).
        stages: which stage indices to build (default: all); each rank builds only its own.
        layers_per_stage: decoder layers per stage (default :func:`default_layer_split`), or
            ``"auto"``: the split with the shortest predicted step for ``auto_split``
            (:func:`ppmedia.planning.stepmodel.auto_layer_split`: option (b) of ``ppmedia plan``).
        adapter: the family adapter (default: ``ppmedia.registry.get_adapter(model)``).
        auto_split: with ``layers_per_stage="auto"``, a :class:`ppmedia.planning.stepmodel.AutoSplit` (a
            representative batch, the schedule, optionally calibrated costs).

    Returns:
        The requested :class:`StageModule` objects in the order of ``stages``. They share parameters
        with ``model`` and hold only what their stages run.

    Raises:
        ValueError: a config asking for the MoE routers' auxiliary loss (:func:`refuse_router_loss`);
            a stage index out of range.
    """
    if adapter is None:
        from ..registry import get_adapter

        adapter = get_adapter(model)
    refuse_router_loss(model.config)
    lm_path, lm = find_language_model(model, adapter)
    num_layers = len(lm.layers)

    if isinstance(layers_per_stage, str):
        layers_per_stage = _auto_layers(model, n_stages, layers_per_stage, auto_split, adapter, num_layers)
    ranges = _layer_ranges(num_layers, n_stages, layers_per_stage)
    wanted = list(range(n_stages)) if stages is None else [int(s) for s in stages]
    for s in wanted:
        if not 0 <= s < n_stages:
            raise ValueError(f"stages: {s} out of range for {n_stages} stages")

    embed_name = _child_name(lm, lm.get_input_embeddings(), "input embedding")
    norm_name = "norm" if isinstance(lm._modules.get("norm"), nn.Module) else None
    head_name = find_output_head(model, lm_path)
    merge_path = find_merge_module(model, adapter)[0]
    tied = tuple(tied_parameters(model))

    modules = []
    for s in wanted:
        first, last = s == 0, s == n_stages - 1
        start, stop = ranges[s]
        children = _stage_children(model, lm, lm_path, head_name, (start, stop), first=first, last=last,
                                   embed_name=embed_name, norm_name=norm_name, merge_path=merge_path)
        parameters = {k: v for k, v in model._parameters.items() if v is not None} if first else {}
        module = StageModule(
            children,
            parameters,
            config=model.config,
            adapter=adapter,
            stage_index=s,
            n_stages=n_stages,
            layer_range=(start, stop),
            language_model_path=lm_path,
            head_name=head_name,
            merge_path=merge_path,
        )
        module.tied = tied
        adapter.prune_stage(module.stage_language_model, layers=range(start, stop), first=first, last=last)
        modules.append(module)
    return modules


def _auto_layers(model: nn.Module, n_stages: int, value: str, auto_split: Any, adapter: VlmAdapter,
                 num_layers: int) -> list[int]:
    """``layers_per_stage="auto"``: the split ``auto_split`` (a :class:`LayerSplitRequest`, e.g. a
    :class:`ppmedia.planning.stepmodel.AutoSplit`, the step model's best split) gives for this model."""
    if value != "auto":
        raise ValueError(f"layers_per_stage: got {value!r}; expected a list of counts or 'auto'")
    if not callable(getattr(auto_split, "split_layers", None)):
        raise TypeError(
            f"layers_per_stage='auto' needs auto_split=ppmedia.planning.stepmodel.AutoSplit(batch, n_microbatches, ...); "
            f"got {type(auto_split).__name__}"
        )
    request: LayerSplitRequest = auto_split
    return list(request.split_layers(model.config, n_stages, adapter, num_layers))


def _wire_shape(spec: WireTensor, b: int, S: int, H: int) -> list[int]:
    """``spec.shape`` with ``"b"``, ``"S"``, ``"H"`` replaced by the microbatch's sizes."""
    sizes = {"b": b, "S": S, "H": H}
    shape = []
    for dim in spec.shape:
        if isinstance(dim, str) and dim not in sizes:
            raise ValueError(
                f"wire tensor {spec.name!r}: dim {dim!r} in {list(spec.shape)}; expected an int, 'b', 'S' or 'H'"
            )
        shape.append(sizes[dim] if isinstance(dim, str) else int(dim))
    return shape


def _text_dims(config: Any) -> tuple[int, int]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(config_value(text, "hidden_size"))
    vocab = int(config_value(text, "vocab_size"))
    return hidden, vocab


def static_stage_args(
    module: StageModule,
    microbatch_size: int,
    seq_len: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """Example ``(input_args, output_args)`` of one microbatch for a static-shape ``PipelineStage``.

    Hidden states ``[b, S, H]`` and mask ``[b, S]``, then the stage's ``wire_in`` / ``wire_out`` in their
    declared shapes. Float tensors require grad (the stage metadata records it: a received activation only gets a
    gradient if its example does). With these on every stage the schedule runs no shape-inference
    forward.

    Args:
        module: the stage module.
        microbatch_size: ``b``, rows per microbatch (the schedule needs them equal).
        seq_len: ``S``.
        dtype: the dtype of the hidden states and logits.
    """
    b, S = microbatch_size, seq_len
    hidden_size, vocab = _text_dims(module.config)
    head = module.output_head if module.is_last else None
    if isinstance(head, nn.Linear):
        vocab = head.out_features
    vocab = module.adapter.logits_width(module.config, vocab)

    def ints(*shape: int) -> Tensor:
        return torch.zeros(shape, dtype=torch.int64, device=device)

    def floats(*shape: int) -> Tensor:
        return torch.zeros(shape, dtype=dtype, device=device, requires_grad=True)

    def between(wire: Sequence[WireTensor], S: int = S) -> tuple[Tensor, ...]:
        extra = []
        for spec in wire:
            shape = _wire_shape(spec, b, S, hidden_size)
            if spec.floating:
                extra.append(floats(*shape))
            else:  # int64, or the no-gradient dtype the spec names (Qwen3-Omni's float positions)
                extra.append(torch.zeros(shape, dtype=getattr(torch, spec.dtype), device=device))
        return (floats(b, S, hidden_size), ints(b, S), *extra)

    if module.context is not None:  # the stages agree on the local length, taken in one place
        from .context_parallel import local_length

        inputs = (ints(b, S), ints(b, S)) if module.is_first else between(module.wire_in, local_length(S, module.context.size))
        outputs = ((floats(b, local_length(S, module.context.size), vocab),) if module.is_last
                   else between(module.wire_out, local_length(S, module.context.size)))
        return inputs, outputs
    inputs = (ints(b, S), ints(b, S)) if module.is_first else between(module.wire_in)
    outputs = (floats(b, S, vocab),) if module.is_last else between(module.wire_out)
    return inputs, outputs
