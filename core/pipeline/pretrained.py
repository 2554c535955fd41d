"""Pipeline stages straight from a Hugging Face checkpoint: build on meta, cut, load only the stage.

:func:`stages_from_pretrained` does for a rank's stages what ``from_pretrained`` does for the whole
model, with transformers' own machinery at every step, so that each stage equals the same stage cut
from ``from_pretrained(path, dtype=...)`` tensor for tensor (parameters and every buffer):

1. the config (``AutoConfig``; ``dtype`` set on it and its sub-configs as ``from_pretrained`` does) and
   the model class (``config.architectures[0]``);
2. the whole model built on the meta device inside the class's own ``from_pretrained`` init context
   (``get_init_context``: default dtype, no weight tying, meta device): no tensor is allocated;
3. :func:`~ppmedia.pipeline.build_stage_modules` cuts the requested stages out of it;
4. every checkpoint name is mapped to the model's names by transformers' conversion mapping for that
   class (``get_model_conversion_mapping`` + ``rename_source_key``: renamings such as Qwen2.5-VL's
   ``model.layers.N`` -> ``model.language_model.layers.N``, converters such as Qwen3.5-MoE's per-expert
   ``experts.N.gate_proj.weight`` merged into ``experts.gate_up_proj``); the stage needs the checkpoint
   tensors whose targets it holds, and the files that hold them (the index says which) are the only
   shards opened;
5. those tensors go through ``convert_and_load_state_dict_in_model`` (transformers' loader: dtype and
   ``_keep_in_fp32`` plan, the converter operations) into the meta model, so only they are allocated;
6. tied weights: a stage holding the target of a tie (``lm_head.weight`` tied to the embedding on the
   first stage) gets the tensor the checkpoint holds for the tie (the embedding's), as
   ``tie_weights`` does;
7. non-persistent buffers (rotary ``inv_freq`` / ``original_inv_freq``, vision ``position_ids``, ...)
   are in no file: they are allocated on ``device`` and computed by the model's own
   ``initialize_weights()``, which writes every tensor not marked as loaded, exactly as
   ``from_pretrained`` computes them after loading;
8. the stages are put in eval mode, as ``from_pretrained`` leaves a model.

With ``tp_mesh`` the stages are made tensor-parallel (:func:`~ppmedia.pipeline.apply_tensor_parallel`)
while still on the meta device, between steps 3 and 5: their planned parameters are then meta
``DTensor`` s, for which transformers' loader reads through each safetensors slice only this rank's
rows or columns (``DtensorShardOperation``: ``get_slice(name)[rows, cols]``); the tensors left whole
(norms, the vision tower, a tied embedding) are read whole on every ``tp`` rank.

Unlike ``from_pretrained``, nothing is initialised at random: a tensor the stages need that the
checkpoint lacks, a checkpoint tensor the model has no place for (unless the class declares it
ignorable, e.g. Qwen3.5's ``mtp.*``), a shape mismatch or a failed conversion is a ``ValueError``
naming the tensor and the checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import torch
from torch import nn

from .safetensors_files import CheckpointFiles, open_tensors, read_checkpoint_files
from .stages import StageModule, build_stage_modules
from .tied import TiedParameters

__all__ = ["build_meta_model", "checkpoint_dtype", "load_pretrained_config", "stages_from_pretrained", "tied_groups",
           "vision_from_pretrained"]


def checkpoint_dtype(path: str | os.PathLike[str]) -> torch.dtype:
    """The dtype a checkpoint was saved in: ``config.json``'s ``dtype`` (or the older ``torch_dtype``),
    of the text config when the top level has none; float32 when it names none.

    Raises:
        ValueError: the name is not a floating torch dtype.
    """
    import json

    with open(os.path.join(os.fspath(path), "config.json")) as fh:
        config = json.load(fh)
    text = config.get("text_config") or {}
    name = next((c.get(k) for c in (config, text) for k in ("dtype", "torch_dtype") if c.get(k)), "float32")
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{path}/config.json: dtype {name!r}; expected a floating torch dtype such as 'bfloat16'")
    return dtype


def load_pretrained_config(path: str | os.PathLike[str], dtype: torch.dtype | None = None) -> Any:
    """The checkpoint's config as ``from_pretrained(path, dtype=dtype)`` prepares it.

    ``dtype=None`` keeps the checkpoint's dtype, as ``from_pretrained``'s default (``"auto"``) does:
    the ``dtype`` its ``config.json`` records (a bfloat16 checkpoint loads as bfloat16), else the
    default dtype (float32). The dtype is set on the config and its sub-configs; ``name_or_path`` is
    ``path``.

    Raises:
        FileNotFoundError: ``path`` is not a directory (nothing is looked up on the hub).
        ValueError: ``config.json`` names a model type transformers does not know (remote code is
            not supported), a quantized checkpoint, or a ``model_type`` that contradicts its
            ``architectures`` (a relabelled config would load with another family's adapter).
    """
    import transformers

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"{path}: no such directory (stages_from_pretrained reads a local checkpoint folder, as save_pretrained "
            f"writes it; nothing is downloaded)"
        )
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except (ValueError, KeyError) as exc:
        raise ValueError(
            f"{path}: transformers {transformers.__version__} cannot read its config.json ({exc}); "
            f"checkpoints that need trust_remote_code are not supported"
        ) from exc
    if getattr(config, "quantization_config", None) is not None:
        raise ValueError(f"{path}: a quantized checkpoint ({config.quantization_config}); not supported yet")
    _check_architectures(path, config)
    dtype = _saved_dtype(config) if dtype is None else dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype: got {dtype!r}; expected a floating torch.dtype such as torch.bfloat16, or None")
    config.dtype = dtype
    for key in getattr(config, "sub_configs", {}):
        sub = getattr(config, key, None)
        if sub is not None:
            sub.dtype = dtype
    config.name_or_path = path
    return config


def _saved_dtype(config: Any) -> torch.dtype:
    """The dtype ``config.json`` records (``dtype`` / ``torch_dtype``), if a floating one; else the default."""
    value = getattr(config, "dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) and value.is_floating_point else torch.get_default_dtype()


def _check_architectures(path: str, config: Any) -> None:
    """Refuse a ``model_type`` that contradicts the class ``architectures`` names (its config class)."""
    import transformers

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        wanted = getattr(cls, "config_class", None) if isinstance(cls, type) else None
        if isinstance(wanted, type) and not isinstance(config, wanted):
            raise ValueError(
                f"{os.path.join(path, 'config.json')}: model_type {config.model_type!r} contradicts architectures "
                f"{config.architectures} ({name} takes a {wanted.__name__}, model_type {getattr(wanted, 'model_type', '?')!r}, "
                f"not a {type(config).__name__}); the adapter is chosen by model_type: correct one of the two"
            )


def _model_class(config: Any) -> Any:
    """The class ``save_pretrained`` recorded (``config.architectures[0]``), else the image-text-to-text
    auto class's class for the config."""
    import transformers

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls
    mapping: Any = transformers.AutoModelForImageTextToText._model_mapping
    try:
        return mapping[type(config)]
    except KeyError:
        raise ValueError(
            f"config {type(config).__name__}: its architectures {getattr(config, 'architectures', None)} are not "
            f"transformers classes, and AutoModelForImageTextToText has no class for it"
        ) from None


def build_meta_model(config: Any, dtype: torch.dtype | None = None) -> Any:
    """The model of ``config`` on the meta device, built in its class's own ``from_pretrained`` init
    context (default dtype ``dtype``, weights untied, meta device): no tensor is allocated."""
    from transformers.monkey_patching import patch_output_recorders
    from transformers.utils.generic import ContextManagers

    cls = _model_class(config)
    dtype = torch.get_default_dtype() if dtype is None else dtype
    with ContextManagers(cls.get_init_context(dtype, False, False, None)):
        model = cls(copy.deepcopy(config))
        patch_output_recorders(model)
    return model


def tied_groups(model: Any) -> list[TiedParameters]:
    """The model's tied parameters as transformers declares them (``all_tied_weights_keys``: target ->
    source), one group per source, names in the model's parameter order; works on an untied meta model."""
    ties: dict[str, str] = dict(getattr(model, "all_tied_weights_keys", None) or {})
    order = {name: i for i, (name, _) in enumerate(model.named_parameters(remove_duplicate=False))}
    groups: dict[str, list[str]] = {}
    for target, source in ties.items():
        groups.setdefault(source, [source]).append(target)
    out = []
    for source, names in groups.items():
        param = model.get_parameter(source)
        ordered = sorted(set(names), key=lambda n: order.get(n, len(order)))
        out.append(TiedParameters(tuple(ordered), tuple(param.shape), param.dtype))
    return out


@dataclass
class _NameMap:
    """The checkpoint's names mapped to the model's, by transformers' conversion mapping."""

    mapping: list[Any]
    targets: dict[str, list[str]] = field(default_factory=dict)  # checkpoint name -> model names
    unexpected: list[str] = field(default_factory=list)  # checkpoint names the model has no place for

    @property
    def available(self) -> set[str]:
        return {t for names in self.targets.values() for t in names}


def _map_names(model: Any, names: Iterable[str]) -> _NameMap:
    """Rename every checkpoint name as ``convert_and_load_state_dict_in_model`` does (renamings, then
    at most one converter; the base-model prefix added or stripped); a converter with several targets
    (a fused ``qkv`` split into three) yields them all. Unexpected names pass transformers' own
    ignore rules (``_keys_to_ignore_on_load_unexpected``, legacy rotary buffers)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta_state = model.state_dict()
    prefix = model.base_model_prefix
    out = _NameMap(mapping)
    unexpected = set()
    for name in names:
        renamed, pattern = rename_source_key(name, renamings, converters, prefix, meta_state)
        if renamed not in meta_state and name in meta_state:
            renamed, pattern = rename_source_key(name, [], [], prefix, meta_state)
        targets = [renamed]
        if pattern is not None:
            first, *_ = by_pattern[pattern].target_patterns
            targets = [renamed.replace(first, t) for t in by_pattern[pattern].target_patterns]
        if any(t in meta_state for t in targets):
            out.targets[name] = [t for t in targets if t in meta_state]
        else:
            unexpected.add(name)
    out.unexpected = sorted(_drop_ignorable(model, unexpected, unexpected=True))
    return out


def _drop_ignorable(model: Any, keys: set[str], *, unexpected: bool) -> set[str]:
    """``keys`` without those the model's own rules let a checkpoint miss / carry extra."""
    from transformers.utils.loading_report import LoadStateDictInfo

    info = LoadStateDictInfo(
        missing_keys=set() if unexpected else set(keys), unexpected_keys=set(keys) if unexpected else set(),
        mismatched_keys=set(), error_msgs=[], conversion_errors={}, skipped_pp_keys=set(),
    )
    model._adjust_missing_and_unexpected_keys(info)
    return set(info.unexpected_keys if unexpected else info.missing_keys)


@dataclass
class _Plan:
    """What the stages need from the checkpoint."""

    load: list[str]  # checkpoint names to read
    model_names: set[str]  # model names they fill
    carriers: dict[str, str]  # stage name absent from the checkpoint -> the tied name that carries it
    computed: set[str]  # persistent buffers the checkpoint may lack (the model's rules) and init computes


def _plan(model: Any, modules: Sequence[nn.Module], names: _NameMap, checkpoint: CheckpointFiles,
          what: str | None = None) -> _Plan:
    """The checkpoint tensors the stages need; a stage name the checkpoint lacks must be carried by a
    tie (``lm_head.weight`` <- the embedding), else it is missing: ``ValueError`` naming it."""
    available = names.available
    wanted = {k for m in modules for k in m.state_dict()}
    group_of: dict[str, list[str]] = {}
    for group in tied_groups(model):
        for name in group.names:
            group_of[name] = list(group.names)
    needed, carriers, absent = set(), {}, set()
    for name in sorted(wanted):
        if name in available:
            needed.add(name)
            continue
        carrier = next((n for n in group_of.get(name, ()) if n in available), None)
        if carrier is None:
            absent.add(name)
        else:
            needed.add(carrier)
            carriers[name] = carrier
    buffers = {k for m in modules for k, _ in m.named_buffers(remove_duplicate=False)}
    missing = _drop_ignorable(model, absent, unexpected=False)
    missing |= {k for k in absent - missing if k not in buffers}  # a parameter is never computed
    if missing:
        shown = ", ".join(sorted(missing)[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        where = checkpoint.index or os.path.join(checkpoint.directory, checkpoint.files[0] if checkpoint.files else "")
        who = what or f"stage(s) {[getattr(m, 'stage_index', None) for m in modules]}"
        raise ValueError(
            f"{where}: the checkpoint lacks {len(missing)} tensor(s) {who} "
            f"need: {shown} (names as the model has them; nothing is initialised at random)"
        )
    load = sorted(k for k, targets in names.targets.items() if needed.intersection(targets))
    return _Plan(load, needed, carriers, absent)


def _no_progress_bars() -> Any:
    import contextlib

    from transformers.utils import logging as hf_logging

    @contextlib.contextmanager
    def quiet() -> Any:
        was = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            yield
        finally:
            if was:
                hf_logging.enable_progress_bar()

    return quiet()


def _load_tensors(
    model: Any, checkpoint: CheckpointFiles, plan: _Plan, names: _NameMap, dtype: torch.dtype, device: torch.device
) -> None:
    """Read ``plan.load`` (opening only their files) into ``model`` with transformers' loader."""
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    load_config = LoadStateDictConfig(
        pretrained_model_name_or_path=checkpoint.directory,
        device_map={"": device},
        dtype=dtype,
        dtype_plan=model._get_dtype_plan(dtype),
        weight_mapping=names.mapping,
    )
    with open_tensors(checkpoint, plan.load) as slices, _no_progress_bars(), _transpose_to_local_shards():
        try:
            info, _ = convert_and_load_state_dict_in_model(model, slices, load_config)
        except _read_errors() as exc:  # a slice read past a damaged file's data
            raise ValueError(f"{checkpoint.directory}: reading the tensors failed: {type(exc).__name__}: {exc}") from exc
    _check_loaded(checkpoint, plan, names, info)


@contextlib.contextmanager
def _transpose_to_local_shards() -> Iterator[None]:
    """transformers 5.23's ``Transpose(check_dims=True)`` (Qwen3-VL-MoE's experts) decides whether to
    transpose by comparing the tensor read with the parameter's GLOBAL shape; for a ``DTensor`` sharded
    on read (expert shards) the tensor read is the local shard, so it would transpose a tensor already
    in place. While ppmedia loads, such a parameter is compared with its local shard's shape."""
    from torch.distributed.tensor import DTensor
    from transformers.core_model_loading import Transpose

    original = Transpose.convert

    def convert(self: Any, input_dict: Any, source_patterns: Any, target_patterns: Any, **kwargs: Any) -> Any:
        param = kwargs["model"].get_parameter(kwargs["full_layer_name"]) if self.check_dims else None
        if isinstance(param, DTensor):
            target = self.get_target_pattern(input_dict, source_patterns, target_patterns)
            tensors = next(iter(input_dict.values()))
            tensor = tensors[0] if isinstance(tensors, list) else tensors
            if tensor.shape == param.to_local().shape:
                return {target: tensor}
            return {target: torch.transpose(tensor, self.dim0, self.dim1).contiguous()}
        return original(self, input_dict, source_patterns, target_patterns, **kwargs)

    Transpose.convert = convert
    try:
        yield
    finally:
        Transpose.convert = original


def _read_errors() -> tuple[type[BaseException], ...]:
    from safetensors import SafetensorError

    return (SafetensorError, OSError)


def _check_loaded(checkpoint: CheckpointFiles, plan: _Plan, names: _NameMap, info: Any) -> None:
    import transformers

    def files_of(target: str) -> str:
        sources = [k for k in plan.load if target in names.targets[k]]
        shown = ", ".join(f"{k!r} in {checkpoint.weight_map[k]}" for k in sources[:4]) or "?"
        return shown + (f" and {len(sources) - 4} more" if len(sources) > 4 else "")

    if info.conversion_errors:
        target, message = sorted(info.conversion_errors.items())[0]
        reason = " / ".join(message.strip().splitlines()[-2:]) or "?"
        raise ValueError(
            f"{checkpoint.directory}: transformers {transformers.__version__}'s checkpoint conversion fails for "
            f"{target} (from {files_of(target)}): {reason}; from_pretrained cannot load this checkpoint either"
        )
    if info.mismatched_keys:
        target, seen, expected = sorted(info.mismatched_keys, key=str)[0]
        raise ValueError(
            f"{checkpoint.directory}: {target} has shape {list(seen)} in the checkpoint ({files_of(target)}); "
            f"the model expects {list(expected)}"
        )
    missing = sorted(plan.model_names & set(info.missing_keys))
    if missing:
        raise ValueError(f"{checkpoint.directory}: {missing[0]} was not loaded (from {files_of(missing[0])})")


def _set_tensor(root: nn.Module, name: str, value: torch.Tensor) -> None:
    parent, _, leaf = name.rpartition(".")
    module = root.get_submodule(parent) if parent else root
    if leaf in module._parameters:
        module._parameters[leaf] = value if isinstance(value, nn.Parameter) else nn.Parameter(value)
    else:
        module._buffers[leaf] = value


def _computed_buffers(model: Any, modules: Sequence[nn.Module], plan: _Plan, device: torch.device) -> None:
    """Allocate the stages' non-persistent buffers (and persistent ones the checkpoint may lack) on
    ``device`` and let the model's own ``initialize_weights()`` compute them, as ``from_pretrained``
    does after loading: it writes every tensor not marked as loaded, and the rest of the model is meta."""
    for module in modules:
        for path, sub in module.named_modules(remove_duplicate=False):
            for leaf, buffer in sub._buffers.items():
                name = f"{path}.{leaf}" if path else leaf
                if buffer is not None and (leaf in sub._non_persistent_buffers_set or name in plan.computed):
                    current = model.get_buffer(name)
                    if current.is_meta:
                        _set_tensor(model, name, torch.empty_like(current, device=device))
    model.initialize_weights()


def _into_stages(model: Any, modules: Sequence[nn.Module]) -> None:
    """Point every stage tensor at the model's loaded one (the stages' modules are the model's, or
    shallow copies of them whose registries must follow)."""
    for module in modules:
        for path, sub in module.named_modules(remove_duplicate=False):
            owner = model.get_submodule(path) if path else model
            for leaf in [k for k, v in sub._parameters.items() if v is not None]:
                sub._parameters[leaf] = owner._parameters[leaf]
            for leaf in [k for k, v in sub._buffers.items() if v is not None]:
                sub._buffers[leaf] = owner._buffers[leaf]


def _open_on_meta(path: str, dtype: Any) -> tuple[Any, Any, nn.Module, CheckpointFiles, _NameMap]:
    """The checkpoint's config (its dtype unless ``dtype``), the model built on meta in that dtype, the
    checkpoint's files and the model's names mapped onto its tensors: nothing read but the index."""
    config = load_pretrained_config(path, dtype)
    model = build_meta_model(config, config.dtype)
    checkpoint = read_checkpoint_files(path)
    return config, config.dtype, model, checkpoint, _map_names(model, checkpoint.weight_map)


def stages_from_pretrained(
    path: str | os.PathLike[str],
    n_stages: int,
    *,
    stages: Iterable[int] | None = None,
    layers_per_stage: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    tp_mesh: Any = None,
    ep_mesh: Any = None,
) -> list[StageModule]:
    """This rank's pipeline stages, loaded from the Hugging Face checkpoint in ``path`` alone.

    The model is built on the meta device; only the requested stages are allocated, and only the
    safetensors files holding their tensors are opened (see the module docstring for each step).
    Each stage equals the same stage cut from ``from_pretrained(path, dtype=dtype)`` with
    :func:`build_stage_modules`, tensor for tensor, buffers included.

    Args:
        path: a checkpoint directory (``config.json`` and ``model.safetensors`` or shards with
            ``model.safetensors.index.json``), as ``save_pretrained`` writes it.
        n_stages: the pipeline length.
        stages: the stage indices to build (default: all); each rank passes its own.
        layers_per_stage: decoder layers per stage (default :func:`default_layer_split`).
        dtype: the parameters' dtype, as ``from_pretrained``'s ``dtype`` (``None``: float32).
        device: where the stages' tensors are allocated.
        tp_mesh: the tensor-parallel ``DeviceMesh`` (``pipeline_mesh(...)["tp"]``): the stages come
            back tensor-parallel over it, each rank having read only its shards of the split
            tensors (do not call :func:`~ppmedia.pipeline.apply_tensor_parallel` again; FSDP2 may
            follow). Call it on every rank of the mesh. ``None``: whole stages.
        ep_mesh: the expert-parallel ``DeviceMesh`` (``pipeline_mesh(..., ep=)["ep"]``): the routed
            experts come back sharded over it (:func:`~ppmedia.pipeline.apply_expert_parallel`), each
            rank having read only its experts' rows (fused on disk: a slice; per-expert files: only
            its experts' tensors). Do not apply expert parallelism again.

    Returns:
        The :class:`StageModule` objects in the order of ``stages``, in eval mode; ``module.tied``
        lists the model's tied parameters (the same on every rank, for
        :func:`sync_tied_gradients`).

    Raises:
        ValueError: a tensor the stages need is missing, a checkpoint tensor is unexpected, a shape
            does not match, a conversion fails, a file is damaged or truncated (each naming it);
            anything :func:`~ppmedia.pipeline.check_tensor_parallel` refuses (before any read).
        FileNotFoundError: no safetensors checkpoint in ``path``, or a shard the index names is absent.
    """
    path = os.fspath(path)
    config, dtype, model, checkpoint, names = _open_on_meta(path, dtype)
    if names.unexpected:
        shown = ", ".join(f"{k!r} ({checkpoint.weight_map[k]})" for k in names.unexpected[:5])
        raise ValueError(
            f"{path}: {len(names.unexpected)} checkpoint tensor(s) the {type(model).__name__} has no place for: {shown}"
        )
    modules = build_stage_modules(model, n_stages, stages=stages, layers_per_stage=layers_per_stage)
    plan = _plan(model, modules, names, checkpoint)
    tied = tuple(tied_groups(model))
    if tp_mesh is not None:  # meta DTensors: the loader reads only this rank's shards
        from .tensor_parallel import apply_tensor_parallel

        for module in modules:
            module.tied = tied  # which head is tied (kept whole) decides the plan
        apply_tensor_parallel(modules, tp_mesh)
    if ep_mesh is not None:  # meta DTensors Shard(0) over ep: the loader reads only this rank's experts
        from .expert_parallel import apply_expert_parallel

        apply_expert_parallel(modules, ep_mesh)
    device = torch.device(device)
    _load_tensors(model, checkpoint, plan, names, dtype, device)
    for name, carrier in plan.carriers.items():  # tie_weights: the target is the source's tensor
        _set_tensor(model, name, model.get_parameter(carrier))
    _computed_buffers(model, modules, plan, device)
    _into_stages(model, modules)
    for module in modules:
        module.tied = tied
        module.eval()
    return modules


def vision_from_pretrained(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    adapter: Any = None,
) -> nn.Module:
    """The vision side of the checkpoint in ``path`` (tower, projector, root-level parameters; no
    decoder layer, embedding or head), loaded from it alone: what a pipeline rank without stage 0
    holds for the encoder spread (``make_pipeline_stages(stages, ..., encoder="spread", vision=...)``).

    The same steps as :func:`stages_from_pretrained` (meta model, transformers' name mapping and
    loader, computed buffers), for :func:`~ppmedia.pipeline.vision_replica`'s module of the meta
    model: only the checkpoint tensors it holds are read, and only the shards holding them are
    opened. Its tensors equal those of ``vision_replica(from_pretrained(path, dtype=dtype))``, under
    the full model's names, so they pair with the first stage's vision parameters.

    Args:
        path: a checkpoint directory, as for :func:`stages_from_pretrained`.
        dtype: the parameters' dtype (``None``: float32).
        device: where its tensors are allocated.
        adapter: the family adapter (default: the registry's), which says where the language model
            sits and where it merges.

    Returns:
        The vision module, in eval mode.

    Raises:
        ValueError: a vision tensor is missing from the checkpoint, has another shape, or fails to
            convert (naming it); nothing is initialised at random.
    """
    from .encoder import vision_replica

    path = os.fspath(path)
    config, dtype, model, checkpoint, names = _open_on_meta(path, dtype)
    replica = vision_replica(model, adapter)
    plan = _plan(model, [replica], names, checkpoint, what="the vision side")
    device = torch.device(device)
    _load_tensors(model, checkpoint, plan, names, dtype, device)
    _computed_buffers(model, [replica], plan, device)
    _into_stages(model, [replica])
    return replica.eval()
