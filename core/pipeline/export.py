"""Pipeline stages back to a Hugging Face checkpoint: :func:`save_pretrained_stages`.

The checkpoint is what ``save_pretrained`` of the full model writes, so that ``from_pretrained(path)``
loads it with no missing, unexpected or mismatched keys:

* names and layouts in the files' own format: transformers' ``revert_weight_conversion`` for the model
  class (Qwen2.5-VL's ``model.language_model.layers.N`` back to ``model.layers.N``, fused MoE experts
  back to per-expert ``experts.N.gate_proj.weight`` where the class stores them so);
* a tied weight once: the target of a tie (``lm_head.weight`` tied to the embedding) is left out, as
  ``save_pretrained`` leaves it out; the copies on different stages must be equal
  (:func:`sync_tied_gradients` keeps them so), else ``ValueError``;
* ``config.json`` (``architectures`` and ``dtype`` set as ``save_pretrained`` sets them),
  ``generation_config.json`` for generative classes, the shards with ``{"format": "pt"}`` metadata and
  ``model.safetensors.index.json`` (one ``model.safetensors`` and no index when everything fits one
  file); weight files of an earlier save in ``path`` that this one does not write are removed.

Before a byte is written, the written names are read back with transformers' own loader on the meta
device: a name the class cannot load back, or a conversion that fails on the way back, is a
``ValueError`` (on every rank), not a checkpoint that ``from_pretrained`` silently half-loads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from .pretrained import build_meta_model, tied_groups
from .safetensors_files import shard_name, stale_files, write_index, write_safetensors
from .stages import StageModule

__all__ = ["LORA_EXPORTS", "PROCESSOR_FILE_PATTERNS", "copy_processor_files", "export_problem", "save_pretrained_stages"]

#: what :func:`save_pretrained_stages` writes of stages with LoRA adapters.
LORA_EXPORTS = ("adapter", "merged")


def _full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective over its mesh: every rank of it must call, in the same order)."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _writes_files(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether this rank writes: with DTensors (FSDP2, tensor parallelism, expert shards) only the rank
    at coordinate 0 of every mesh they are on (with ``tp`` and ``ep`` both: the ``tp``-0, ``ep``-0 rank)."""
    from torch.distributed.tensor import DTensor

    meshes = {id(t.device_mesh): t.device_mesh for t in tensors if isinstance(t, DTensor)}
    for mesh in meshes.values():
        coordinate = mesh.get_coordinate()
        if coordinate is None or any(c != 0 for c in coordinate):
            return False
    return True


def _stage_state(modules: Sequence[StageModule]) -> tuple[dict[str, torch.Tensor], bool]:
    """The stages' persistent tensors by full-model name (DTensors gathered, in sorted name order; LoRA
    adapters folded into their base weights), and whether this rank writes them."""
    from .lora import has_lora, merged_state_dict

    state: dict[str, torch.Tensor] = {}
    writes = _writes_files(t for m in modules for t in m.state_dict(keep_vars=True).values())
    for module in modules:
        own = merged_state_dict(module) if has_lora(module) else module.state_dict(keep_vars=True)
        for name, tensor in own.items():
            state.setdefault(name, tensor)
    return {name: _full_tensor(state[name]).detach() for name in sorted(state)}, writes


@dataclass
class _Exchange:
    """The collective side: the stage indices of every rank, and agreement on failure."""

    group: Any

    @property
    def rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank(self.group) if self.group is not None else 0

    def gather(self, value: Any) -> list[Any]:
        if self.group is None:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, value, group=self.group)
        return out

    def agree(self, error: str | None) -> None:
        """Raise the same ``ValueError`` on every rank when any rank found one."""
        errors = [e for e in self.gather(error) if e]
        if errors:
            raise ValueError(errors[0])

    def barrier(self) -> None:
        if self.group is not None:
            import torch.distributed as dist

            dist.barrier(group=self.group)


def _check_stages(modules: Sequence[StageModule], exchange: _Exchange) -> int:
    """Every stage of the pipeline exactly once across the ranks; returns the pipeline length."""
    local = [(m.stage_index, m.n_stages) for m in modules]
    everyone = [pair for rank_pairs in exchange.gather(local) for pair in rank_pairs]
    lengths = {n for _, n in everyone}
    indices = sorted(i for i, _ in everyone)
    error = None
    if len(lengths) != 1 or indices != list(range(next(iter(lengths)))):
        where = "the group's ranks" if exchange.group is not None else "modules (without a group)"
        error = (
            f"save_pretrained_stages: {where} hold stages {indices} of pipelines of {sorted(lengths)} stages; "
            f"expected every stage exactly once (pass the pipeline group when each rank holds only its own)"
        )
    exchange.agree(error)
    return lengths.pop()


def _drop_tie_targets(model: Any, state: dict[str, torch.Tensor], exchange: _Exchange) -> str | None:
    """Leave out the targets of ties (the source is saved); their copies must equal the source's.

    Returns an error message (or ``None``); compares float64 sums across ranks."""
    groups = tied_groups(model)
    local = {
        name: (float(state[name].double().sum()), float(state[name].double().square().sum()))
        for g in groups for name in g.names if name in state
    }
    seen: dict[str, tuple[float, float]] = {}
    for part in exchange.gather(local):
        seen.update(part)
    for group in groups:
        values = {name: seen[name] for name in group.names if name in seen}
        if len(set(values.values())) > 1:
            return (
                f"save_pretrained_stages: the tied parameters {sorted(values)} differ between their stages "
                f"(sums {values}); call sync_tied_gradients after every backward so that they stay one tensor"
            )
        for target in group.names[1:]:
            state.pop(target, None)
    return None


def _to_file_names(model: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` in the files' own names and layouts (transformers' ``revert_weight_conversion``),
    without the names the class does not save (``_keys_to_ignore_on_save``, dropped from ``state`` too)."""
    from transformers.core_model_loading import revert_weight_conversion

    for name in set(getattr(model, "_keys_to_ignore_on_save", None) or ()):
        state.pop(name, None)
    return dict(revert_weight_conversion(model, dict(state)))


def _total_parameters(model: Any) -> int:
    """The model's parameter count, a tie counted once (``num_parameters`` of the tied model)."""
    targets = {t for group in tied_groups(model) for t in group.names[1:]}
    return sum(p.numel() for n, p in model.named_parameters(remove_duplicate=False) if n not in targets)


def _reload_error(model: Any, written: dict[str, torch.Tensor], expected: set[str]) -> str | None:
    """Load ``written`` back into the meta ``model`` with transformers' loader (tensors on the meta
    device: names, shapes and conversions only): ``None`` when it yields ``expected`` with the right
    shapes, else what fails."""
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    from .pretrained import _map_names, _no_progress_bars

    names = _map_names(model, written)
    if names.unexpected:
        return f"transformers cannot place the written tensor(s) {names.unexpected[:5]} in {type(model).__name__}"
    meta = {k: torch.empty_like(v, device="meta") for k, v in written.items()}
    load_config = LoadStateDictConfig(device_map={"": torch.device("meta")}, dtype=None,
                                      weight_mapping=names.mapping)
    with _no_progress_bars():
        info, _ = convert_and_load_state_dict_in_model(model, meta, load_config)
    if info.conversion_errors:
        target, message = sorted(info.conversion_errors.items())[0]
        reason = " / ".join(message.strip().splitlines()[-2:])
        return f"save_pretrained_stages: transformers could not read {target} back from the names it writes: {reason}"
    if info.mismatched_keys:
        target, seen, want = sorted(info.mismatched_keys, key=str)[0]
        return f"{target} reads back with shape {list(seen)}; expected {list(want)}"
    lost = sorted(expected & set(info.missing_keys))
    return f"{lost[:5]} would not load back from the written names" if lost else None


def export_problem(config: Any) -> str | None:
    """Why :func:`save_pretrained_stages` would refuse to write a model of ``config``, found before any
    training: the whole model built on the meta device, its tensors put in the files' names and read back
    with transformers' own loader (names, shapes and conversions only, nothing allocated). ``None`` when
    the export will load with ``from_pretrained``; else the reason (e.g. a transformers conversion that
    cannot read back what it writes, as for the tiny Kimi-VL under transformers 5.23)."""
    model = build_meta_model(config, torch.float32)
    targets = {t for group in tied_groups(model) for t in group.names[1:]}
    state = {k: v for k, v in model.state_dict().items() if k not in targets}
    return _reload_error(model, _to_file_names(model, dict(state)), set(state))


def _plan_shards(written: dict[str, torch.Tensor], max_shard_size: int | str, exchange: _Exchange) -> tuple[list[list[str]], int, int, int]:
    """This rank's shards (tensor names per file), the first file number, the total file count and
    the total byte size over all ranks."""
    from huggingface_hub import split_torch_state_dict_into_shards

    split = split_torch_state_dict_into_shards(written, max_shard_size=max_shard_size) if written else None
    shards = [list(names) for names in split.filename_to_tensors.values()] if split is not None else []
    size = int(split.metadata["total_size"]) if split is not None else 0
    everyone = exchange.gather((len(shards), size))
    first = 1 + sum(count for count, _ in everyone[: exchange.rank])
    return shards, first, sum(count for count, _ in everyone), sum(s for _, s in everyone)


def _write_config(model: Any, directory: str, dtype: torch.dtype) -> None:
    config = model.config
    config.dtype = str(dtype).split(".")[1]
    config.architectures = [type(model).__name__]
    config.save_pretrained(directory)
    if model.can_generate():
        model.generation_config.save_pretrained(directory)


def save_pretrained_stages(
    modules: Sequence[StageModule] | StageModule,
    path: str | os.PathLike[str],
    *,
    group: Any = None,
    max_shard_size: int | str = "50GB",
    lora: str = "adapter",
    base_model: str | None = None,
) -> None:
    """Write the pipeline's stages as one Hugging Face checkpoint that ``from_pretrained(path)`` loads.

    Stages with LoRA adapters (:func:`~ppmedia.pipeline.apply_lora`): ``lora="adapter"`` (default)
    writes the PEFT adapter (``adapter_model.safetensors`` + ``adapter_config.json``, every stage's
    targets; :func:`~ppmedia.pipeline.save_lora_adapter`) that ``peft.PeftModel.from_pretrained(base,
    path)`` loads, ``base_model`` recorded as its ``base_model_name_or_path``; ``lora="merged"`` writes
    the merged full model (each adapted weight ``base + (B @ A) * alpha / r``, every other tensor the
    base's, byte for byte). Without adapters ``lora`` is ignored.

    Without ``group``, ``modules`` are every stage of the pipeline (one process). With ``group`` (the
    pipeline's process group), every rank of it calls with its own stages: each writes its stages'
    tensors (its own shard files), rank 0 of the group the index and the config; the call returns on
    every rank once the checkpoint is complete.

    FSDP2 or tensor parallelism (parameters that are ``DTensor`` s): call it on every rank of the
    stages' meshes (each parameter is gathered with ``full_tensor()``, a collective over its mesh, in
    sorted name order); only the ranks at coordinate 0 of the mesh write, with ``group`` their
    pipeline group (``pipeline_mesh(...)["pp"]``: every ``tp`` slice's pipeline calls, slice 0 writes). With replicated data
    parallelism (plain parameters on every replica), call it on one replica only.

    Args:
        modules: this rank's :class:`StageModule` objects (:func:`stages_from_pretrained`,
            :func:`build_stage_modules`).
        path: the checkpoint directory (created if needed).
        group: the pipeline process group, or ``None`` when ``modules`` hold the whole pipeline.
        max_shard_size: the largest shard file, as ``save_pretrained``'s (``"50GB"``, ``"40KB"``, bytes);
            each rank splits its own tensors.

    Raises:
        ValueError: the stages do not cover the pipeline exactly once, tied copies differ, or
            transformers could not read the written names back (raised on every rank, before
            anything is written).
    """
    mods = [modules] if isinstance(modules, StageModule) else list(modules)
    if not mods or not all(isinstance(m, StageModule) for m in mods):
        raise TypeError(f"save_pretrained_stages: expected StageModule objects; got {type(modules).__name__}")
    directory = os.fspath(path)
    if lora not in LORA_EXPORTS:
        raise ValueError(f"save_pretrained_stages: lora={lora!r}; expected one of {', '.join(LORA_EXPORTS)}")
    exchange = _Exchange(group)
    _check_stages(mods, exchange)
    from .lora import has_lora, save_lora_adapter

    if lora == "adapter" and any(has_lora(m) for m in mods):
        save_lora_adapter(mods, directory, group=group, base_model=base_model)
        return
    state, writes = _stage_state(mods)
    dtype = next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
    model = build_meta_model(mods[0].config, dtype)
    error = _drop_tie_targets(model, state, exchange)
    written = _to_file_names(model, state) if error is None else {}
    if error is None:
        error = _reload_error(model, written, set(state))
    exchange.agree(error)
    shards, first, total, total_size = _plan_shards(written, max_shard_size, exchange)
    names = [shard_name(first + i, total) for i in range(len(shards))]
    if writes:
        os.makedirs(directory, exist_ok=True)
        for name, tensor_names in zip(names, shards):
            write_safetensors(os.path.join(directory, name), {k: written[k] for k in tensor_names})
    weight_map = {k: name for name, tensor_names in zip(names, shards) for k in tensor_names}
    maps = exchange.gather(weight_map)
    if writes and exchange.rank == 0:
        full_map = {k: v for part in maps for k, v in part.items()}
        keep = set(full_map.values())
        if total > 1:
            keep.add(write_index(directory, full_map, total_size, _total_parameters(model)).rsplit(os.sep, 1)[-1])
        for stale in stale_files(directory, keep):
            os.remove(stale)
        _write_config(model, directory, dtype)
    exchange.barrier()


#: the files of a processor in a checkpoint folder (tokenizer, chat template, image / video / audio
#: processor configs), as ``save_pretrained`` of transformers' processors and tokenizers writes them.
PROCESSOR_FILE_PATTERNS = (
    "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "*.model",
    "chat_template*", "processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json",
    "*_processor_config.json", "*feature_extractor*.json",
)


def copy_processor_files(source: str | os.PathLike[str], path: str | os.PathLike[str]) -> list[str]:
    """Copy the processor's files (:data:`PROCESSOR_FILE_PATTERNS`) from the checkpoint folder
    ``source`` into the export ``path``, so that ``AutoProcessor.from_pretrained(path)`` works as it
    did on ``source``; returns the names copied (sorted). Call it on one rank, after
    :func:`save_pretrained_stages`."""
    import fnmatch
    import shutil

    names = sorted(
        name for name in os.listdir(source)
        if os.path.isfile(os.path.join(source, name)) and any(fnmatch.fnmatch(name, p) for p in PROCESSOR_FILE_PATTERNS)
    )
    os.makedirs(path, exist_ok=True)
    for name in names:
        shutil.copyfile(os.path.join(source, name), os.path.join(path, name))
    return names
