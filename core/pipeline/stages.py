"""Pipeline stage modules: :class:`StageModule`, :func:`build_stage_modules`, and the
``torch.distributed.pipelining.PipelineStage`` objects around them (:func:`make_pipeline_stages`).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import Tensor, nn

from ..adapters.base import VlmAdapter, WireTensor, config_value
from ..chunk import CURSOR_ATTRIBUTE, next_vlm_media_chunk
from .surgery import _child_name, _get_path, _layer_ranges, _stage_tree, find_language_model

__all__ = ["StageModule", "build_stage_modules", "make_pipeline_stages", "static_stage_args"]

#: where :class:`ppmedia.pipeline.encoder.EncoderSpread` hangs a step's precomputed features on the
#: first stage's module (an object with ``adapter_for(microbatch, chunk) -> VlmAdapter``)
FEATURES_ATTRIBUTE = "_ppmedia_encoder_features"


class StageModule(nn.Module):
    """One pipeline stage of a vision-language model (see the module docstring for what travels).

    Attributes:
        stage_index, n_stages: this stage and the pipeline length.
        layer_range: ``(start, stop)`` of the decoder layers it runs (full-model indices).
        is_first, is_last: whether it embeds and merges media / produces logits.
        wire_in, wire_out: the extra tensors it receives / sends (besides hidden states and mask), as the
            adapter declares them for its first layer / its successor's first layer.
        adapter: the family adapter (first stage: merge and positions).
        config: the full model's config (plain attribute, read by the adapter).
        language_model_path: dotted path of the language model (``model.language_model``).
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

    # -- helpers -------------------------------------------------------------------------------
    @property
    def stage_language_model(self) -> Any:
        """This stage's (pruned) language model."""
        module = _get_path(self, self.language_model_path)
        assert module is not None
        return module

    @property
    def wire_in(self) -> tuple[WireTensor, ...]:
        """The extra tensors this stage receives after hidden states and mask (none on the first stage)."""
        if self.is_first:
            return ()
        return tuple(self.adapter.wire_tensors(self.config, self.layer_range[0]))

    @property
    def wire_out(self) -> tuple[WireTensor, ...]:
        """The extra tensors this stage sends after hidden states and mask (none on the last stage)."""
        if self.is_last:
            return ()
        return tuple(self.adapter.wire_tensors(self.config, self.layer_range[1]))

    @property
    def carries_position_ids(self) -> bool:
        """Whether mrope positions ``[b, 3, S]`` travel into or out of this stage."""
        return any(spec.name == "position_ids" for spec in self.wire_in + self.wire_out)

    @property
    def num_layers(self) -> int:
        return self.layer_range[1] - self.layer_range[0]

    def is_language_parameter(self, name: str) -> bool:
        """Whether parameter ``name`` belongs to the language side (decoder, embedding, norm, head)."""
        return name.startswith(self.language_model_path + ".") or name.startswith(self.head_name + ".")

    def extra_repr(self) -> str:
        return (
            f"stage={self.stage_index}/{self.n_stages}, layers={self.layer_range}, "
            f"first={self.is_first}, last={self.is_last}, "
            f"wire_in={[w.name for w in self.wire_in]}, wire_out={[w.name for w in self.wire_out]}"
        )

    # -- forward -------------------------------------------------------------------------------
    def forward(self, *args: Tensor) -> Tensor | tuple[Tensor, ...]:
        """First stage: ``(input_ids [b, S], attention_mask [b, S])``; later stages: the previous
        stage's tuple ``(hidden, attention_mask, *wire_in)``. Returns ``(hidden, attention_mask,
        *wire_out)`` for the next stage, or logits ``[b, S, vocab]`` on the last."""
        if self.is_first:
            if len(args) != 2:
                raise TypeError(
                    f"stage 0 takes (input_ids, attention_mask); got {len(args)} positional arguments"
                )
            input_ids, attention_mask = args
            hidden, wire = self._embed_and_merge(input_ids, attention_mask)
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
        hidden = self._decode(hidden, attention_mask, wire)
        if self.is_last:
            return self._modules[self.head_name](hidden)  # type: ignore[misc]
        out = [hidden.contiguous(), attention_mask.contiguous()]
        for spec in self.wire_out:
            tensor = wire.get(spec.name)
            if tensor is None:
                raise TypeError(
                    f"stage {self.stage_index}: {type(self.adapter).__name__}.wire_tensors declares "
                    f"{spec.name!r} for stage {self.stage_index + 1}, but this stage does not hold it "
                    f"(it has {sorted(wire)}); a later stage may only need a subset of an earlier one's"
                )
            if spec.floating and not tensor.requires_grad and tensor.is_leaf and torch.is_grad_enabled():
                # e.g. a text-only microbatch's zero deepstack features: keep a gradient slot, so the
                # schedule's metadata (taken from whichever microbatch comes first) fits every microbatch
                tensor = tensor.detach().requires_grad_()
            # a copy, never the input or a view of it: split-backward schedules (ZBV, DualPipeV)
            # detach_() every stage output in place, which a view refuses
            out.append(tensor.clone(memory_format=torch.contiguous_format))
        return tuple(out)

    def _embed_and_merge(self, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        lm = self.stage_language_model
        embeds = lm.get_input_embeddings()(input_ids)  # [b, S, H]
        features = self.__dict__.get(FEATURES_ATTRIBUTE)  # set for one step by an encoder spread
        k = self.__dict__.get(CURSOR_ATTRIBUTE)
        chunk = next_vlm_media_chunk(self)
        adapter = self.adapter if features is None else features.adapter_for(k, chunk)
        hidden, wire = adapter.first_stage(self, input_ids, attention_mask, embeds, chunk)
        b, S = input_ids.shape
        for spec in self.adapter.wire_tensors(self.config, 0):
            tensor = wire.get(spec.name)
            expected = _wire_shape(spec, b, S, hidden.shape[-1])
            if tensor is None or list(tensor.shape) != expected:
                seen = "missing" if tensor is None else f"shape {list(tensor.shape)}"
                raise ValueError(
                    f"{type(self.adapter).__name__}.first_stage: wire tensor {spec.name!r} is {seen}; "
                    f"expected {expected} ({list(spec.shape)})"
                )
        return hidden, wire

    def _decode(self, hidden: Tensor, attention_mask: Tensor, wire: Mapping[str, Tensor]) -> Tensor:
        if self.num_layers == 0 and not self.is_last:
            # Nothing to run; a fresh tensor keeps the stage's output distinct from its input.
            return hidden if self.is_first else hidden.clone()
        kwargs: dict[str, Any] = {"attention_mask": attention_mask}
        kwargs.update(self.adapter.decoder_kwargs(self, range(*self.layer_range), hidden, attention_mask, wire))
        out = self.stage_language_model(inputs_embeds=hidden, use_cache=False, **kwargs)
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


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
            (:func:`ppmedia.stepmodel.auto_layer_split`: option (b) of ``ppmedia plan``).
        adapter: the family adapter (default: ``ppmedia.registry.get_adapter(model)``).
        auto_split: with ``layers_per_stage="auto"``, a :class:`ppmedia.stepmodel.AutoSplit` (a
            representative batch, the schedule, optionally calibrated costs).

    Returns:
        The requested :class:`StageModule` objects in the order of ``stages``. They share parameters
        with ``model`` and hold only what their stages run.
    """
    if adapter is None:
        from ..registry import get_adapter

        adapter = get_adapter(model)
    lm_path, lm = find_language_model(model)
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
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None  # type: ignore[operator]
    head_name = _child_name(model, head, "output head (lm_head)")
    path = lm_path.split(".")

    modules = []
    for s in wanted:
        first, last = s == 0, s == n_stages - 1
        start, stop = ranges[s]
        node = _stage_tree(model, lm, lm_path, (start, stop), first=first, last=last, embed_name=embed_name,
                           norm_name=norm_name)
        children: dict[str, nn.Module] = {}
        parameters: dict[str, nn.Parameter] = {}
        for name, child in model._modules.items():
            if child is None:
                continue
            if name == path[0]:
                children[name] = node
            elif name == head_name:
                if last:
                    children[name] = child
            elif first:
                children[name] = child
        if first:
            parameters = {k: v for k, v in model._parameters.items() if v is not None}
        modules.append(
            StageModule(
                children,
                parameters,
                config=model.config,
                adapter=adapter,
                stage_index=s,
                n_stages=n_stages,
                layer_range=(start, stop),
                language_model_path=lm_path,
                head_name=head_name,
            )
        )
    return modules


def _auto_layers(model: nn.Module, n_stages: int, value: str, auto_split: Any, adapter: VlmAdapter,
                 num_layers: int) -> list[int]:
    """``layers_per_stage="auto"``: the step model's best split for ``auto_split``."""
    from ..stepmodel import AutoSplit, auto_layer_split

    if value != "auto":
        raise ValueError(f"layers_per_stage: got {value!r}; expected a list of counts or 'auto'")
    if not isinstance(auto_split, AutoSplit):
        raise TypeError(
            f"layers_per_stage='auto' needs auto_split=ppmedia.stepmodel.AutoSplit(batch, n_microbatches, ...); "
            f"got {type(auto_split).__name__}"
        )
    return auto_layer_split(model.config, n_stages, auto_split, adapter, num_layers).layers_per_stage


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
    head = module._modules.get(module.head_name) if module.is_last else None
    if isinstance(head, nn.Linear):
        vocab = head.out_features

    def ints(*shape: int) -> Tensor:
        return torch.zeros(shape, dtype=torch.int64, device=device)

    def floats(*shape: int) -> Tensor:
        return torch.zeros(shape, dtype=dtype, device=device, requires_grad=True)

    def between(wire: Sequence[WireTensor]) -> tuple[Tensor, ...]:
        extra = []
        for spec in wire:
            shape = _wire_shape(spec, b, S, hidden_size)
            extra.append(floats(*shape) if spec.floating else ints(*shape))
        return (floats(b, S, hidden_size), ints(b, S), *extra)

    inputs = (ints(b, S), ints(b, S)) if module.is_first else between(module.wire_in)
    outputs = (floats(b, S, vocab),) if module.is_last else between(module.wire_out)
    return inputs, outputs


def make_pipeline_stages(
    model: nn.Module,
    n_stages: int,
    stage_indices: Sequence[int],
    device: torch.device | str = "cpu",
    *,
    group: Any = None,
    layers_per_stage: Sequence[int] | str | None = None,
    static_microbatch: tuple[int, int] | None = None,
    adapter: VlmAdapter | None = None,
    encoder: str = "stage0",
    auto_split: Any = None,
) -> list[Any]:
    """``PipelineStage`` objects for the stages a rank owns (see :func:`build_stage_modules`).

    Args:
        model: the full model (each rank builds the same one; its modules are then pruned per stage).
        n_stages: pipeline length.
        stage_indices: the stages of this rank (:func:`stage_indices_for_rank`).
        device: where the stages run.
        group: the pipeline process group (default: the world).
        layers_per_stage: decoder layers per stage, or ``"auto"`` with ``auto_split`` (see
            :func:`build_stage_modules`).
        static_microbatch: ``(microbatch_size, seq_len)``: give every stage static
            ``input_args``/``output_args`` (no shape-inference forward); ``None`` infers shapes on the
            first step (pass the first stage to :func:`ppmedia.stage_media` so it costs no chunk).
        encoder: ``"stage0"`` (the first stage runs the vision tower on its microbatches) or
            ``"spread"``: every pipeline rank encodes a share of each step's media
            (:class:`ppmedia.pipeline.EncoderSpread`, hung on every returned stage's module as
            ``encoder_spread``; ranks without stage 0 keep a copy of the vision side). Collective
            over ``group`` then: call it on every pipeline rank.

    Returns:
        One ``torch.distributed.pipelining.PipelineStage`` per index, in order; ``stage.submod`` is
        the :class:`StageModule`.
    """
    from torch.distributed.pipelining import PipelineStage

    from .encoder import ENCODER_MODES

    if encoder not in ENCODER_MODES:
        raise ValueError(f"encoder: got {encoder!r}; expected one of {', '.join(ENCODER_MODES)}")
    modules = build_stage_modules(
        model, n_stages, stages=stage_indices, layers_per_stage=layers_per_stage, adapter=adapter, auto_split=auto_split
    )
    device = torch.device(device)
    stages = []
    for index, module in zip(stage_indices, modules):
        module.to(device)
        kwargs: dict[str, Any] = {}
        if static_microbatch is not None:
            dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
            inputs, outputs = static_stage_args(module, *static_microbatch, dtype=dtype, device=device)
            kwargs.update(input_args=inputs, output_args=outputs)
        stages.append(PipelineStage(module, index, n_stages, device, group=group, **kwargs))
    if encoder != "stage0":
        _attach_spread(model, modules, stages, group, device)
    return stages


def _attach_spread(model: nn.Module, modules: Sequence[StageModule], stages: Sequence[Any], group: Any,
                   device: torch.device) -> None:
    """``encoder="spread"``: this rank's :class:`~ppmedia.pipeline.encoder.EncoderSpread` on every module."""
    from .encoder import SPREAD_ATTRIBUTE, EncoderSpread, vision_replica

    first = next((st for st in stages if st.is_first), None)
    vision = modules[list(stages).index(first)] if first is not None else vision_replica(model).to(device)
    spread = EncoderSpread(vision, modules[0].adapter, first_stage=first, group=group)
    for module in modules:
        module.__dict__[SPREAD_ATTRIBUTE] = spread
