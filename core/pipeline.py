"""Pipeline stages for a vision-language model: the first stage encodes and merges the staged media.

:func:`build_stage_modules` cuts a ``...ForConditionalGeneration`` model with a registered adapter into
``n_stages`` modules for :class:`torch.distributed.pipelining.PipelineStage`:

* the first stage embeds the text, takes its microbatch's media with
  :func:`~ppmedia.next_vlm_media_chunk`, runs the family's vision encoder and merges the features
  (``adapter.merge``), computes the positions the family needs (Qwen2.5-VL's mrope, from
  ``adapter.position_ids``), then runs its share of the decoder layers;
* a middle stage runs its share of the decoder layers;
* the last stage runs its share of the decoder layers, the final norm and ``lm_head``: logits.

Between stages travels a flat tuple of contiguous tensors (``b`` = microbatch size, ``S`` = sequence
length, ``H`` = text hidden size)::

    hidden_states   [b, S, H]   float, requires grad
    attention_mask  [b, S]      int64 (the batch's own mask)
    *wire tensors               what the adapter declares for the receiving stage
                                (``adapter.wire_tensors(config, first_layer)``, each a
                                :class:`~ppmedia.adapters.base.WireTensor`: name, batch-first static
                                shape, int64 or float-with-gradient), in declared order

The default declaration is empty, or the mrope positions ``position_ids`` ``[b, 3, S]`` (batch-first:
the ``[3, b, S]`` positions transposed) for adapters that override ``position_ids`` (Qwen2.5-VL).
Qwen3-VL adds its visual position mask ``[b, S]`` and one ``[b, S, H]`` tensor per deepstack level
still ahead (the level's features scattered to the visual positions, zeros elsewhere), so features of
decoder layers on later stages cross the boundary and their gradients flow back to the vision tower.
The first stage builds every wire tensor (``adapter.first_stage``); each stage turns what it holds into
its language model's keyword arguments (``adapter.decoder_kwargs``) and passes on what later stages need.

A stage module keeps only what its stage runs: the first stage the vision tower, projector and
embedding; every stage its decoder layers (under their ORIGINAL indices) and the language model's
rotary embedding; the last stage the final norm and ``lm_head`` (the norm is ``Identity`` elsewhere).
Parameter names are the full model's (``model.language_model.layers.3.mlp.up_proj.weight`` stays
that on whichever stage holds layer 3), so gradients compare one to one with the full model.
The modules share parameters with ``model``; drop your reference to ``model`` to free the rest.

The decoder layers run through the language model's own ``forward`` (called with
``inputs_embeds=``), so its masks and rotary embeddings are the model's own. That forward indexes
``config.layer_types`` by the position of a layer in ``self.layers``; each stage's language model
therefore gets a shallow copy of its config whose ``layer_types`` lists only the stage's layers.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .adapters.base import VlmAdapter, WireTensor, config_value
from .chunk import next_vlm_media_chunk

__all__ = [
    "IGNORE_INDEX",
    "SCHEDULES",
    "StageModule",
    "TiedParameters",
    "build_schedule",
    "build_stage_modules",
    "count_valid_tokens",
    "default_layer_split",
    "find_language_model",
    "make_labels",
    "make_pipeline_stages",
    "pipeline_loss",
    "stage_indices_for_rank",
    "static_stage_args",
    "sync_tied_gradients",
    "tied_parameters",
]

#: label value ignored by the loss (padding, media placeholders, the last position).
IGNORE_INDEX = -100

#: schedule names :func:`build_schedule` knows, with the number of stages each rank holds.
SCHEDULES: dict[str, int] = {"gpipe": 1, "1f1b": 1, "interleaved": 2}

#: where the language model sits inside a ``...ForConditionalGeneration`` model, tried in order.
_LANGUAGE_MODEL_PATHS: tuple[str, ...] = ("model.language_model", "language_model", "model.model")


# --------------------------------------------------------------------------------------------------
# module surgery


class _KeptLayers(nn.ModuleList):
    """A subset of a decoder-layer list, each layer registered under its ORIGINAL index.

    Iteration, ``len`` and positional indexing (``layers[0]`` is the first KEPT layer, slices give a
    plain ``ModuleList``) behave as for the list of kept layers, which is all a language model's
    ``forward`` does with ``self.layers``; ``named_parameters()`` keeps the full model's names.
    """

    def __init__(self, layers: Mapping[int, nn.Module] | Iterable[nn.Module] = ()) -> None:
        super().__init__()
        items = sorted(layers.items()) if isinstance(layers, Mapping) else enumerate(layers)
        for index, layer in items:
            self.add_module(str(index), layer)

    def __getitem__(self, idx: int | slice) -> Any:
        values = list(self._modules.values())
        if isinstance(idx, slice):
            return nn.ModuleList(values[idx])
        return values[idx]

    @property
    def original_indices(self) -> tuple[int, ...]:
        """The full model's indices of the kept layers, in order."""
        return tuple(int(k) for k in self._modules)


def _shallow(module: nn.Module, *, keep_members: bool) -> nn.Module:
    """A new module object of ``module``'s class sharing its attributes, parameters and children.

    The registries (children, parameters, buffers) are new dicts, so entries can be replaced or
    removed without touching ``module``. With ``keep_members=False`` they start empty.
    """
    new = copy.copy(module)  # shallow: a new __dict__ whose values are module's own
    state = new.__dict__
    if keep_members:
        state["_modules"] = dict(module._modules)
        state["_parameters"] = dict(module._parameters)
        state["_buffers"] = dict(module._buffers)
        state["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
    else:
        state["_modules"] = {}
        state["_parameters"] = {}
        state["_buffers"] = {}
        state["_non_persistent_buffers_set"] = set()
    return new


def _get_path(root: nn.Module, path: str) -> nn.Module | None:
    module: Any = root
    for part in path.split("."):
        module = module._modules.get(part) if isinstance(module, nn.Module) else None
        if module is None:
            return None
    return module


def find_language_model(model: nn.Module) -> tuple[str, Any]:
    """``(dotted path, module)`` of the decoder stack inside ``model``.

    The first of ``model.language_model`` (transformers 5 VLMs), ``language_model``, ``model.model``
    that has a ``layers`` list.

    Raises:
        TypeError: none of them exists.
    """
    for path in _LANGUAGE_MODEL_PATHS:
        module = _get_path(model, path)
        if module is not None and isinstance(getattr(module, "layers", None), nn.ModuleList):
            return path, module
    raise TypeError(
        f"{type(model).__name__}: no language model with a `layers` list at any of "
        f"{', '.join(_LANGUAGE_MODEL_PATHS)}"
    )


def _child_name(parent: nn.Module, child: nn.Module | None, what: str) -> str:
    for name, module in parent._modules.items():
        if module is child and child is not None:
            return name
    raise TypeError(f"{type(parent).__name__}: cannot find its {what} among its children")


def default_layer_split(num_layers: int, n_stages: int) -> list[int]:
    """Decoder layers per stage: as even as possible, extra layers to the stages after the first.

    The first stage already runs the vision encoder, so it is the last to get a remainder layer.
    With fewer layers than stages some stages hold none (2 layers, 4 stages: ``[0, 1, 1, 0]``).
    """
    if n_stages < 1:
        raise ValueError(f"n_stages: got {n_stages}; expected >= 1")
    base, extra = divmod(num_layers, n_stages)
    sizes = [base] * n_stages
    order = list(range(1, n_stages)) + [0]
    for i in range(extra):
        sizes[order[i]] += 1
    return sizes


def _layer_ranges(num_layers: int, n_stages: int, layers_per_stage: Sequence[int] | None) -> list[tuple[int, int]]:
    sizes = list(layers_per_stage) if layers_per_stage is not None else default_layer_split(num_layers, n_stages)
    if len(sizes) != n_stages or any(s < 0 for s in sizes) or sum(sizes) != num_layers:
        raise ValueError(
            f"layers_per_stage: got {sizes}; expected {n_stages} non-negative counts summing to "
            f"{num_layers} (the model's decoder layers)"
        )
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    return list(zip(bounds, bounds[1:]))


def _stage_language_config(config: Any, kept: Sequence[int], total: int) -> Any:
    """A shallow copy of the language model's config whose per-layer lists cover only ``kept``."""
    new = copy.copy(config)
    for name in ("layer_types",):
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)) and len(value) == total:
            setattr(new, name, [value[i] for i in kept])
    return new


# --------------------------------------------------------------------------------------------------
# the stage module


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
            out.append(tensor.contiguous())
        return tuple(out)

    def _embed_and_merge(self, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        lm = self.stage_language_model
        embeds = lm.get_input_embeddings()(input_ids)  # [b, S, H]
        chunk = next_vlm_media_chunk(self)
        hidden, wire = self.adapter.first_stage(self, input_ids, attention_mask, embeds, chunk)
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
    layers_per_stage: Sequence[int] | None = None,
    adapter: VlmAdapter | None = None,
) -> list[StageModule]:
    """Cut ``model`` into pipeline stage modules.

    Args:
        model: a ``...ForConditionalGeneration`` whose ``config.model_type`` has a registered adapter.
        n_stages: the number of pipeline stages (>= 1).
        stages: which stage indices to build (default: all); each rank builds only its own.
        layers_per_stage: decoder layers per stage (default :func:`default_layer_split`).
        adapter: the family adapter (default: ``ppmedia.registry.get_adapter(model)``).

    Returns:
        The requested :class:`StageModule` objects in the order of ``stages``. They share parameters
        with ``model`` and hold only what their stages run.
    """
    if adapter is None:
        from .registry import get_adapter

        adapter = get_adapter(model)
    lm_path, lm = find_language_model(model)
    num_layers = len(lm.layers)
    ranges = _layer_ranges(num_layers, n_stages, layers_per_stage)
    wanted = list(range(n_stages)) if stages is None else [int(s) for s in stages]
    for s in wanted:
        if not 0 <= s < n_stages:
            raise ValueError(f"stages: {s} out of range for {n_stages} stages")

    embed = lm.get_input_embeddings()
    embed_name = _child_name(lm, embed, "input embedding")
    norm_name = "norm" if isinstance(lm._modules.get("norm"), nn.Module) else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None  # type: ignore[operator]
    head_name = _child_name(model, head, "output head (lm_head)")
    path = lm_path.split(".")

    modules = []
    for s in wanted:
        first, last = s == 0, s == n_stages - 1
        start, stop = ranges[s]
        # the language model: its layers, embedding (first), norm (last), rotary embedding (always)
        lm_shell = _shallow(lm, keep_members=True)
        lm_shell._modules["layers"] = _KeptLayers({i: lm.layers[i] for i in range(start, stop)})
        if not first:
            del lm_shell._modules[embed_name]
        if norm_name is not None and not last:
            lm_shell._modules[norm_name] = nn.Identity()
        lm_shell.__dict__["config"] = _stage_language_config(lm.config, range(start, stop), num_layers)

        # the modules between the root and the language model: everything else (vision) only on
        # the first stage
        node: nn.Module = lm_shell
        for depth in range(len(path) - 1, 0, -1):
            parent = _get_path(model, ".".join(path[:depth]))
            assert parent is not None
            shell = _shallow(parent, keep_members=first)
            shell._modules[path[depth]] = node
            node = shell

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


# --------------------------------------------------------------------------------------------------
# PipelineStage construction


def stage_indices_for_rank(rank: int, world_size: int, stages_per_rank: int = 1) -> list[int]:
    """The stages a rank holds in a looped layout: ``rank, rank + world_size, ...``.

    This is the layout ``torch.distributed.pipelining``'s multi-stage schedules (Interleaved1F1B)
    expect: stage ``i`` lives on rank ``i % world_size``.
    """
    return [rank + k * world_size for k in range(stages_per_rank)]


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
    layers_per_stage: Sequence[int] | None = None,
    static_microbatch: tuple[int, int] | None = None,
    adapter: VlmAdapter | None = None,
) -> list[Any]:
    """``PipelineStage`` objects for the stages a rank owns (see :func:`build_stage_modules`).

    Args:
        model: the full model (each rank builds the same one; its modules are then pruned per stage).
        n_stages: pipeline length.
        stage_indices: the stages of this rank (:func:`stage_indices_for_rank`).
        device: where the stages run.
        group: the pipeline process group (default: the world).
        layers_per_stage: decoder layers per stage.
        static_microbatch: ``(microbatch_size, seq_len)``: give every stage static
            ``input_args``/``output_args`` (no shape-inference forward); ``None`` infers shapes on the
            first step (pass the first stage to :func:`ppmedia.stage_media` so it costs no chunk).

    Returns:
        One ``torch.distributed.pipelining.PipelineStage`` per index, in order; ``stage.submod`` is
        the :class:`StageModule`.
    """
    from torch.distributed.pipelining import PipelineStage

    modules = build_stage_modules(
        model, n_stages, stages=stage_indices, layers_per_stage=layers_per_stage, adapter=adapter
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
    return stages


def build_schedule(
    name: str,
    stages: Sequence[Any],
    n_microbatches: int,
    loss_fn: Callable[..., Tensor] | None = None,
) -> Any:
    """A ``torch.distributed.pipelining`` schedule by name: ``gpipe``, ``1f1b`` or ``interleaved``.

    Gradients are not scaled by the number of microbatches (``scale_grads=False``):
    :func:`pipeline_loss` already divides by the valid tokens of the whole batch.
    """
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    loss_fn = pipeline_loss if loss_fn is None else loss_fn
    if name not in SCHEDULES:
        raise ValueError(f"schedule: got {name!r}; expected one of {', '.join(SCHEDULES)}")
    if len(stages) != SCHEDULES[name]:
        raise ValueError(f"schedule {name}: got {len(stages)} stages on this rank; expected {SCHEDULES[name]}")
    if name == "interleaved":
        return ScheduleInterleaved1F1B(list(stages), n_microbatches, loss_fn=loss_fn, scale_grads=False)
    cls = ScheduleGPipe if name == "gpipe" else Schedule1F1B
    return cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)


# --------------------------------------------------------------------------------------------------
# labels and loss


def make_labels(
    input_ids: Tensor,
    config: Any,
    adapter: VlmAdapter | None = None,
    *,
    pad_id: int | None = None,
    attention_mask: Tensor | None = None,
    shift: bool = True,
) -> Tensor:
    """Next-token labels ``[B, S]`` int64: position ``t`` is labelled with token ``t + 1``.

    A label is :data:`IGNORE_INDEX` where the target token is padding (``pad_id``, default the
    config's ``pad_token_id``, or ``attention_mask == 0``) or a media placeholder (any mask of
    ``adapter.placeholder_masks``), and at the last position.

    Args:
        input_ids: ``[B, S]`` token ids.
        config: the model's config.
        adapter: the family adapter (default: looked up from ``config``).
        pad_id: the padding id; ``None`` reads ``pad_token_id`` from the config (text config too).
        attention_mask: ``[B, S]``, 0 marks padding.
        shift: ``False`` returns the UNshifted targets ``[B, S]`` (the ids with ignored tokens set to
            :data:`IGNORE_INDEX`), the form transformers' own ``labels=`` argument takes.
    """
    if adapter is None:
        from .registry import get_adapter

        adapter = get_adapter(config)
    if pad_id is None:
        try:
            pad_id = int(config_value(config, "pad_token_id", "text_config.pad_token_id"))
        except AttributeError:
            pad_id = None
    ignore = torch.zeros_like(input_ids, dtype=torch.bool)
    if pad_id is not None:
        ignore |= input_ids == pad_id
    if attention_mask is not None:
        ignore |= attention_mask == 0
    for mask in adapter.placeholder_masks(input_ids, config).values():
        ignore |= mask
    targets = input_ids.masked_fill(ignore, IGNORE_INDEX).to(torch.int64)
    if not shift:
        return targets
    labels = torch.full_like(targets, IGNORE_INDEX)
    labels[:, :-1] = targets[:, 1:]
    return labels


def count_valid_tokens(labels: Tensor) -> int:
    """The number of labels that count in the loss (not :data:`IGNORE_INDEX`); one host read."""
    return int((labels != IGNORE_INDEX).sum())


def pipeline_loss(logits: Tensor, labels: Tensor, num_valid_tokens: int | Tensor | None = None) -> Tensor:
    """Summed token cross-entropy of a microbatch divided by the valid tokens of the WHOLE batch.

    Summing it over the microbatches gives the full batch's mean token loss, so a schedule with
    ``scale_grads=False`` accumulates exactly the full batch's gradients. Pass the whole batch's
    count with ``schedule.step(..., loss_kwargs={"num_valid_tokens": count_valid_tokens(labels)})``.

    Args:
        logits: ``[b, S, vocab]``.
        labels: ``[b, S]`` (already shifted, :func:`make_labels`), :data:`IGNORE_INDEX` ignored.
        num_valid_tokens: the whole batch's valid labels; ``None`` uses this microbatch's (then the
            per-microbatch losses are means, not parts of one mean).
    """
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        labels.reshape(-1).to(logits.device),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    if num_valid_tokens is None:
        num_valid_tokens = (labels != IGNORE_INDEX).sum()
    if isinstance(num_valid_tokens, Tensor):
        return total / num_valid_tokens.clamp(min=1).to(total.dtype)
    return total / max(int(num_valid_tokens), 1)


# --------------------------------------------------------------------------------------------------
# tied parameters (an embedding tied to lm_head lives on the first AND the last stage)


@dataclass(frozen=True)
class TiedParameters:
    """Parameter names that are one tensor in the full model (e.g. ``lm_head.weight`` and
    ``model.language_model.embed_tokens.weight`` with ``tie_word_embeddings``)."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype


def tied_parameters(model: nn.Module) -> list[TiedParameters]:
    """Groups of names sharing one parameter in ``model`` (call it before splitting; same order on every rank)."""
    by_id: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
        params[id(param)] = param
    return [
        TiedParameters(tuple(names), tuple(params[i].shape), params[i].dtype)
        for i, names in by_id.items()
        if len(names) > 1
    ]


def sync_tied_gradients(
    modules: Sequence[nn.Module], tied: Sequence[TiedParameters], group: Any = None
) -> None:
    """Sum the gradients of tied parameters across the ranks holding their copies.

    After a pipeline step the first stage's copy of a tied embedding holds the embedding's share of
    the gradient and the last stage's copy the head's; the full model's gradient is their sum. A
    collective: every rank of ``group`` must call it with the same ``tied`` list (a rank holding no
    copy contributes zeros). A rank holding several names of one group on one parameter object
    contributes it once.
    """
    import torch.distributed as dist

    for entry in tied:
        local: dict[int, nn.Parameter] = {}
        for module in modules:
            named = dict(module.named_parameters(remove_duplicate=False))
            for name in entry.names:
                if name in named:
                    local[id(named[name])] = named[name]
        params = list(local.values())
        device = params[0].device if params else torch.device("cpu")
        total = torch.zeros(entry.shape, dtype=entry.dtype, device=device)
        for p in params:
            if p.grad is not None:
                total += p.grad
        dist.all_reduce(total, group=group)
        for p in params:
            p.grad = total.clone() if len(params) > 1 else total
