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

Around the stages: :func:`schedule_layout` / :func:`build_schedule` take any schedule torch ships by
name (torch's ``get_schedule_class``) and place the stages as it wants (looped or V-shaped);
:func:`shard_batch`, :func:`all_reduce_gradients` and :func:`clip_grad_norm` add data parallelism
(``pp x dp``: each replica a full pipeline on its share of the batch, gradients summed over replicas)
and global-norm clipping; :func:`sync_tied_gradients` sums a tied embedding's two copies.

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
    "SCHEDULE_ALIASES",
    "ScheduleLayout",
    "StageModule",
    "TiedParameters",
    "all_reduce_gradients",
    "build_schedule",
    "build_stage_modules",
    "clip_grad_norm",
    "count_valid_tokens",
    "default_layer_split",
    "find_language_model",
    "make_labels",
    "make_pipeline_stages",
    "pipeline_loss",
    "schedule_layout",
    "schedule_names",
    "shard_batch",
    "stage_indices_for_rank",
    "static_stage_args",
    "sync_tied_gradients",
    "tied_parameters",
]

#: label value ignored by the loss (padding, media placeholders, the last position).
IGNORE_INDEX = -100

#: ppmedia's short schedule names with the number of stages each rank holds (every schedule torch
#: ships works too, by its own name: :func:`schedule_names`, :func:`schedule_layout`).
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

    Every hook dict (forward/backward pre/post hooks, their ``with_kwargs`` and ``always_call``
    flags, state-dict and load-state-dict hooks) is a new dict too: the hooks ``module`` had are
    carried over, but a hook registered later on the copy (FSDP, activation checkpointing, a user's
    probe) fires on the copy only, and one registered on ``module`` never reaches the copy.
    """
    new = copy.copy(module)  # shallow: a new __dict__ whose values are module's own
    state = new.__dict__
    for name, value in module.__dict__.items():
        if "hook" in name and isinstance(value, (dict, set)):
            state[name] = copy.copy(value)  # keeps OrderedDict / set type and current entries
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
            # a copy, never the input or a view of it: split-backward schedules (ZBV, DualPipeV)
            # detach_() every stage output in place, which a view refuses
            out.append(tensor.clone(memory_format=torch.contiguous_format))
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


def _stage_tree(
    model: nn.Module,
    lm: nn.Module,
    lm_path: str,
    layer_range: tuple[int, int],
    *,
    first: bool,
    last: bool,
    embed_name: str,
    norm_name: str | None,
) -> nn.Module:
    """The stage's copy of ``model``'s first child on the way to the language model (``model.model``).

    The language model keeps its layers in ``layer_range``, its embedding (first stage), norm (last
    stage) and rotary embedding (always); the modules between the root and the language model keep
    everything else (the vision side) only on the first stage.
    """
    start, stop = layer_range
    layers: Any = lm.layers
    num_layers = len(layers)
    lm_shell = _shallow(lm, keep_members=True)
    lm_shell._modules["layers"] = _KeptLayers({i: layers[i] for i in range(start, stop)})
    if not first:
        del lm_shell._modules[embed_name]
    if norm_name is not None and not last:
        lm_shell._modules[norm_name] = nn.Identity()
    lm_shell.__dict__["config"] = _stage_language_config(lm.config, range(start, stop), num_layers)

    path = lm_path.split(".")
    node: nn.Module = lm_shell
    for depth in range(len(path) - 1, 0, -1):
        parent = _get_path(model, ".".join(path[:depth]))
        assert parent is not None
        shell = _shallow(parent, keep_members=first)
        shell._modules[path[depth]] = node
        node = shell
    return node


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


def stage_indices_for_rank(rank: int, world_size: int, stages_per_rank: int = 1, style: str = "loop") -> list[int]:
    """The stages a rank holds, in increasing order.

    ``style="loop"``: stage ``i`` lives on rank ``i % world_size`` (``rank, rank + world_size, ...``),
    the layout of GPipe, 1F1B, Interleaved1F1B, LoopedBFS and InterleavedZeroBubble. ``style="v"``:
    the stages go down the ranks and come back (2 ranks, 4 stages: rank 0 holds 0 and 3, rank 1 holds
    1 and 2), the layout of ZBVZeroBubble and DualPipeV, whose first and last stage share rank 0.
    The mapping is torch's own (``torch.distributed.pipelining._utils.generate_stage_to_rank_mapping``).
    """
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    if not 0 <= rank < world_size or stages_per_rank < 1:
        raise ValueError(
            f"stage_indices_for_rank: got rank {rank}, world_size {world_size}, stages_per_rank "
            f"{stages_per_rank}; expected 0 <= rank < world_size and stages_per_rank >= 1"
        )
    mapping = generate_stage_to_rank_mapping(world_size, world_size * stages_per_rank, style=style)
    return sorted(stage for stage, owner in mapping.items() if owner == rank)


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


#: ppmedia's short schedule names and the torch schedule each stands for.
SCHEDULE_ALIASES: dict[str, str] = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B"}

#: schedules that torch builds with a V-shaped stage placement (``generate_stage_to_rank_mapping(...,
#: style="v")`` in their ``__init__``); torch exposes the style on no class attribute.
_V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


@dataclass(frozen=True)
class ScheduleLayout:
    """How a torch schedule places stages on the ranks of a pipeline group.

    Attributes:
        name: torch's name of the schedule (``"ZBVZeroBubble"``), as
            ``torch.distributed.pipelining.schedules.get_schedule_class`` takes it.
        schedule_class: the class.
        stages_per_rank: 1 for single-stage schedules (GPipe, 1F1B), else the requested number
            (default 2; V-shaped schedules need exactly 2).
        style: ``"loop"`` or ``"v"`` (see :func:`stage_indices_for_rank`).
    """

    name: str
    schedule_class: type
    stages_per_rank: int
    style: str

    @property
    def multi_stage(self) -> bool:
        """Whether the class takes a list of stages (``PipelineScheduleMulti``) rather than one."""
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle

        return not issubclass(self.schedule_class, PipelineScheduleSingle)

    def n_stages(self, pp_size: int) -> int:
        """The pipeline length on ``pp_size`` ranks."""
        return pp_size * self.stages_per_rank

    def stage_indices(self, pp_rank: int, pp_size: int) -> list[int]:
        """The stages pipeline rank ``pp_rank`` builds, in increasing order."""
        return stage_indices_for_rank(pp_rank, pp_size, self.stages_per_rank, self.style)


def schedule_names() -> list[str]:
    """Every schedule torch ships that :func:`build_schedule` can run (torch's names, e.g. ``GPipe``,
    ``ZBVZeroBubble``): the ``Schedule*`` classes of ``torch.distributed.pipelining.schedules`` that
    its ``get_schedule_class`` knows by name. The abstract bases (``PipelineScheduleSingle``,
    ``PipelineScheduleMulti``) are not schedules and are left out."""
    from torch.distributed.pipelining import schedules

    names = []
    for attr in sorted(vars(schedules)):
        if not attr.startswith("Schedule") or not isinstance(getattr(schedules, attr), type):
            continue
        try:
            if schedules.get_schedule_class(attr[len("Schedule"):]) is getattr(schedules, attr):
                names.append(attr[len("Schedule"):])
        except ValueError:
            continue
    return names


def schedule_layout(name: str, stages_per_rank: int | None = None) -> ScheduleLayout:
    """Resolve a schedule name (ppmedia's short ones or any of torch's, case-insensitive).

    The class comes from torch's own registry (``get_schedule_class``), not a table here.

    Raises:
        ValueError: unknown name (the message lists the known ones); an abstract base class;
            ``stages_per_rank`` other than 1 for a single-stage schedule or other than 2 for a V-shaped one.
    """
    from torch.distributed.pipelining import schedules

    torch_name = SCHEDULE_ALIASES.get(name.lower(), name)
    try:
        cls = schedules.get_schedule_class(torch_name)
    except ValueError:
        known = ", ".join([*SCHEDULE_ALIASES, *schedule_names()])
        raise ValueError(f"schedule: got {name!r}; expected one of {known} (case-insensitive)") from None
    if cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        raise ValueError(
            f"schedule {name!r}: {cls.__name__} is torch's abstract base class, not a schedule (it has no "
            f"order of forwards and backwards to run); pick one of {', '.join(schedule_names())}"
        )
    single = issubclass(cls, schedules.PipelineScheduleSingle)
    style = "v" if cls.__name__ in _V_SHAPED else "loop"
    default = 1 if single else 2
    per_rank = default if stages_per_rank is None else int(stages_per_rank)
    if (single or style == "v") and per_rank != default:
        what = "a single-stage schedule" if single else "a V-shaped schedule"
        raise ValueError(f"schedule {cls.__name__}: stages_per_rank {per_rank}; {what} needs exactly {default}")
    if per_rank < 1:
        raise ValueError(f"schedule {cls.__name__}: stages_per_rank {per_rank}; expected >= 1")
    return ScheduleLayout(cls.__name__[len("Schedule"):], cls, per_rank, style)


def _check_first_stage_order(schedule: Any, name: str) -> None:
    """Refuse a schedule whose first stage does not run its forwards in microbatch order.

    The first stage takes its media by cursor (one chunk per forward, in call order), so microbatch
    ``k``'s forward must be the ``k``-th forward of stage 0. Checked on the schedule's own action
    list (runtime schedules: ``pipeline_order``); single-stage schedules run forwards in order."""
    order = getattr(schedule, "pipeline_order", None)
    if not order:
        return
    seen: list[int] = []

    def visit(action: Any) -> None:
        if action is None:
            return
        for sub in getattr(action, "sub_actions", None) or ():
            visit(sub)
        kind = getattr(getattr(action, "computation_type", None), "value", None)
        if getattr(action, "stage_index", None) == 0 and kind == "F":
            seen.append(action.microbatch_index)

    for rank_actions in order.values():
        for action in rank_actions:
            visit(action)
    if seen != sorted(seen) or len(set(seen)) != len(seen):
        raise ValueError(
            f"schedule {name}: the first stage runs its forwards in microbatch order {seen}; staged media "
            f"are handed out by a cursor in call order, so they would reach the wrong microbatch"
        )


def build_schedule(
    name: str,
    stages: Sequence[Any],
    n_microbatches: int,
    loss_fn: Callable[..., Tensor] | None = None,
    **schedule_kwargs: Any,
) -> Any:
    """A ``torch.distributed.pipelining`` schedule by name.

    ``name`` is one of ppmedia's short names (``gpipe``, ``1f1b``, ``interleaved``) or any schedule
    torch ships, case-insensitively (``GPipe``, ``1F1B``, ``Interleaved1F1B``, ``LoopedBFS``,
    ``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV``: :func:`schedule_names`). ``stages``
    are this rank's ``PipelineStage`` objects, built for the indices of :func:`schedule_layout`
    (``layout.stage_indices(pp_rank, pp_size)``). Extra keyword arguments go to the schedule class.

    Gradients are not scaled by the number of microbatches (``scale_grads=False``):
    :func:`pipeline_loss` already divides by the valid tokens of the whole batch.

    Raises:
        ValueError: unknown or abstract schedule; stages that do not match the schedule's placement;
            a schedule whose first stage would run microbatches out of order (the media cursor
            would hand them the wrong media); torch's own checks (e.g. too few microbatches).
    """
    if not stages:
        raise ValueError("build_schedule: got no stages; expected this rank's PipelineStage objects")
    layout = schedule_layout(name, len(stages))
    pp_rank, pp_size = stages[0].group_rank, stages[0].group_size
    got = [int(st.stage_index) for st in stages]
    want = layout.stage_indices(pp_rank, pp_size)
    if got != want or stages[0].num_stages != layout.n_stages(pp_size):
        raise ValueError(
            f"schedule {layout.name}: pipeline rank {pp_rank} of {pp_size} holds stages {got} of "
            f"{stages[0].num_stages}; this schedule places stages {want} of {layout.n_stages(pp_size)} on it "
            f"({layout.style} layout, {layout.stages_per_rank} per rank): build them with "
            f"schedule_layout({name!r}).stage_indices(pp_rank, pp_size)"
        )
    loss_fn = pipeline_loss if loss_fn is None else loss_fn
    target = list(stages) if layout.multi_stage else stages[0]
    schedule = layout.schedule_class(
        target, n_microbatches, loss_fn=loss_fn, scale_grads=False, **schedule_kwargs
    )
    mapping = getattr(schedule, "stage_index_to_group_rank", None) or {}
    wrong = [i for i in got if i in mapping and mapping[i] != pp_rank]
    if wrong:  # the class placed them elsewhere than schedule_layout predicted
        raise ValueError(
            f"schedule {layout.name}: the schedule puts stages {wrong} on other ranks "
            f"({mapping}); rank {pp_rank} built them"
        )
    _check_first_stage_order(schedule, layout.name)
    return schedule


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
            p.grad = total.to(p.dtype) if len(params) == 1 else total.to(p.dtype, copy=True)


# --------------------------------------------------------------------------------------------------
# data parallel: batch shards, gradient reduction, global-norm clipping


#: media keys with one entry per SAMPLE (dim 0 = batch), sliced with the samples by :func:`shard_batch`.
_PER_SAMPLE_MEDIA_KEYS = frozenset({"num_patches"})


def shard_batch(
    batch: Mapping[str, Any],
    dp_rank: int,
    dp_size: int,
    *,
    images_per_sample: Any = None,
    videos_per_sample: Any = None,
) -> dict[str, Any]:
    """Data-parallel replica ``dp_rank``'s share of a global batch, media included.

    The replica gets the samples ``torch.tensor_split(range(B), dp_size)[dp_rank]`` of every
    ``[B, ...]`` tensor, and of every media tensor exactly its samples' images, videos and crops (cut
    by :func:`ppmedia.split_media`, so a replica's media never hold another replica's): views of the
    batch's tensors, no copy. Split per microbatch afterwards, on the replica's share. Per-sample count
    keys (``n_images_per_sample``) are sliced with the samples; non-tensor values are kept as they are.

    Args:
        batch: a processor/collator batch (not modified).
        dp_rank, dp_size: the replica and the number of replicas.
        images_per_sample, videos_per_sample: as for :func:`ppmedia.split_media` (for the GLOBAL batch).

    Raises:
        ValueError: ``dp_rank`` out of range; anything :func:`ppmedia.split_media` refuses (e.g. a
            non-media tensor whose dim 0 is not the batch size, named with its shape).
    """
    from .split import split_media

    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"shard_batch: dp_rank {dp_rank}; expected 0 <= dp_rank < dp_size ({dp_size})")
    rest = dict(batch)
    counts = {k: rest[k] for k in ("n_images_per_sample", "n_videos_per_sample") if k in rest}
    staged = split_media(rest, dp_size, images_per_sample=images_per_sample, videos_per_sample=videos_per_sample)
    a, b = staged.samples[dp_rank]
    out: dict[str, Any] = {}
    for key, value in rest.items():
        if isinstance(value, Tensor) and value.dim() > 0:  # split_media refused any other dim 0 than B
            value = value[a:b]
        out[key] = value
    for key, value in counts.items():
        out[key] = value[a:b]
    for field_name, key in staged.sources.items():
        # per-sample media metadata (Step3's num_patches [B]) follows the samples, not the media rows
        out[key] = batch[key][a:b] if key in _PER_SAMPLE_MEDIA_KEYS else staged.chunks[field_name][dp_rank]
    return out


def _unique_trainable(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for module in modules:
        for param in module.parameters():
            if param.requires_grad:
                seen.setdefault(id(param), param)
    return list(seen.values())


def all_reduce_gradients(modules: Sequence[nn.Module], group: Any = None) -> None:
    """Sum the gradients of ``modules``' parameters across the data-parallel ``group``.

    Call it on every replica after the pipeline step (and :func:`sync_tied_gradients`), with the
    same stage modules in the same order (the replicas of one pipeline rank hold the same stages).
    A parameter without a gradient (a replica whose share had no images leaves the vision tower's at
    ``None``) contributes zeros and gets the sum. One flat ``all_reduce`` per dtype.

    With :func:`pipeline_loss` normalised by the valid tokens of the GLOBAL batch, the sum is the
    global batch's gradient (no division by the number of replicas).
    """
    import torch.distributed as dist

    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for param in _unique_trainable(modules):
        by_dtype.setdefault(param.dtype, []).append(param)
    for dtype in sorted(by_dtype, key=str):
        params = by_dtype[dtype]
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        )
        dist.all_reduce(flat, group=group)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p)
            offset += n


def clip_grad_norm(
    modules: Sequence[nn.Module],
    max_norm: float,
    *,
    tied: Sequence[TiedParameters] = (),
    group: Any = None,
) -> Tensor:
    """Clip the gradients of a pipeline to a GLOBAL L2 norm, like ``torch.nn.utils.clip_grad_norm_`` on
    the whole model; returns the total norm before clipping (a float32 scalar, equal on every rank).

    Call it after :func:`sync_tied_gradients` and :func:`all_reduce_gradients`: each rank sums the
    squares of its stages' gradients (a tied parameter counted once, on the rank holding its first
    name), ``group`` (the pipeline group) sums them across stages, and every gradient is scaled by
    ``max_norm / (norm + 1e-6)`` when that is below 1. After the data-parallel reduction the replicas
    hold equal gradients, so the pipeline group's sum is the global norm.
    """
    import torch.distributed as dist

    params = _unique_trainable(modules)
    skip: set[int] = set()
    for entry in tied:
        holders = {}
        for module in modules:
            named = dict(module.named_parameters(remove_duplicate=False))
            holders.update({name: named[name] for name in entry.names if name in named})
        if holders and entry.names[0] not in holders:
            skip.update(id(p) for p in holders.values())
    squares = torch.zeros((), dtype=torch.float32, device=params[0].device if params else "cpu")
    for p in params:
        if p.grad is not None and id(p) not in skip:
            squares += p.grad.detach().float().pow(2).sum()
    dist.all_reduce(squares, group=group)
    total = squares.sqrt()
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.detach().mul_(scale.to(p.grad.dtype))
    return total
