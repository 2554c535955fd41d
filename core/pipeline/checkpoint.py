"""Distributed checkpoints of pipeline stages (``torch.distributed.checkpoint``): full-model names,
published atomically, resumable on any ``pp x dp`` layout, with or without FSDP2.

A checkpoint is a folder ``step{N}/`` under a save directory, holding DCP's files (``.metadata`` and
one ``__{rank}_0.distcp`` per rank) and ``ppmedia.json`` (the step, the model type, every parameter
name, the tied names, the caller's ``extra``). The state it stores, by key:

* with LoRA adapters on the stages (:func:`~ppmedia.pipeline.apply_lora`), the adapters alone (and
  their optimizer state): the base comes from the model; ``ppmedia.json`` records the LoRA settings
  (``"lora"``), and a checkpoint whose settings differ from the stages' is refused, naming the options;
* every parameter and persistent buffer under its FULL-MODEL name (``model.language_model.layers.3.mlp.up_proj.weight``,
  ``lm_head.weight``): :func:`torch.distributed.checkpoint.state_dict.get_model_state_dict` of each
  stage module (ppmedia's stage modules keep the full model's names); FSDP2 shards are saved as the
  pieces of one tensor, so the names and shapes are those of the unsharded model;
* ``optimizer.state.<name>.<key>`` and ``optimizer.param_groups.<name>.<key>``: each stage's optimizer,
  flattened by parameter name (``flatten_optimizer_state_dict=True``); a parameter with several names
  (a tied embedding on one stage) is saved under each of them, so a layout that splits the names over
  two stages finds both.

Because nothing is keyed by rank or stage, a checkpoint written at ``pp x dp`` loads at any other
``pp' x dp'``: DCP reads, for each rank, the pieces of the tensors that rank holds.

Saving writes into ``step{N}.partial/``; rank 0 adds ``ppmedia.json`` after DCP has written its
``.metadata`` (last, once every rank's data is on disk) and renames the folder to ``step{N}/``. A
save killed half way leaves only ``step{N}.partial/``, which :func:`latest_checkpoint` never takes.
Loading checks first, on every rank, that the checkpoint holds exactly this model's names with these
shapes, and refuses a mismatch (another family, another config, another optimizer) with the names,
before any tensor is overwritten. The save directory must be one filesystem that every rank sees.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from torch import nn

__all__ = [
    "CHECKPOINT_INFO",
    "HYPERPARAMETER_MODES",
    "check_checkpoint",
    "checkpoint_path",
    "claim_save_dir",
    "latest_checkpoint",
    "load_checkpoint",
    "lora_mismatch",
    "new_run_id",
    "save_checkpoint",
    "stage_optimizers",
]

#: the file ppmedia writes into every checkpoint folder (after DCP's own files).
CHECKPOINT_INFO = "ppmedia.json"
_FORMAT = "ppmedia-dcp/1"
_STEP = re.compile(r"step(\d+)")
_OPTIMIZER = "optimizer"
_SHOWN = 8  # names listed per kind of mismatch
#: what :func:`load_checkpoint` does with the optimizers' hyperparameters (``lr``, ``betas``, ...):
#: ``"saved"`` restores the checkpoint's (torch's own ``load_state_dict``: a learning-rate schedule's
#: current ``lr`` comes back), ``"current"`` keeps the values this job's optimizers were built with
#: (reported in the returned info's ``"hyperparameters_changed"``), ``"refuse"`` raises on a difference
#: before anything is loaded.
HYPERPARAMETER_MODES = ("saved", "current", "refuse")


def checkpoint_path(save_dir: str | os.PathLike[str], step: int) -> Path:
    """``save_dir/step{step}``: where :func:`save_checkpoint` publishes step ``step``."""
    return Path(save_dir) / f"step{int(step)}"


def _is_complete(folder: Path) -> bool:
    return (folder / ".metadata").is_file() and (folder / CHECKPOINT_INFO).is_file()


def latest_checkpoint(save_dir: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``save_dir`` (highest ``N`` of a ``step{N}/`` folder that
    holds DCP's ``.metadata`` and ``ppmedia.json``), or ``None``. ``step{N}.partial/`` folders (a save
    that did not finish) and anything else are ignored."""
    root = Path(save_dir)
    if not root.is_dir():
        return None
    found = []
    for folder in root.iterdir():
        match = _STEP.fullmatch(folder.name)
        if match and folder.is_dir() and _is_complete(folder):
            found.append((int(match.group(1)), folder))
    return max(found)[1] if found else None


def new_run_id(process_group: Any = None) -> str:
    """A fresh run identity (32 hex digits), rank 0's, the same on every rank of ``process_group``
    (a collective when ``torch.distributed`` is initialised). :func:`save_checkpoint` records it."""
    import uuid

    import torch.distributed as dist

    ident = [uuid.uuid4().hex]
    if _distributed():
        src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        dist.broadcast_object_list(ident, src=src, group=process_group)
    return str(ident[0])


def _run_of(folder: Path) -> str | None:
    try:
        with open(folder / CHECKPOINT_INFO) as fh:
            return json.load(fh).get("run_id")
    except (OSError, ValueError):
        return None


def claim_save_dir(
    save_dir: str | os.PathLike[str], run_id: str | None, *, overwrite: bool = False, process_group: Any = None
) -> list[Path]:
    """Make ``save_dir`` this run's: refuse it while it holds another run's checkpoints, or, with
    ``overwrite``, delete those (complete ``step{N}/`` folders, the ones :func:`latest_checkpoint`
    takes, whose ``ppmedia.json`` records another ``run_id``, or none; unfinished saves are ignored
    as there). A collective over ``process_group``: rank 0 looks, every
    rank returns or raises alike.

    Without it a fresh run writing ``step2/`` into a folder that holds another run's ``step2/`` and
    ``step4/`` replaces the first and leaves the second, which ``latest_checkpoint`` (``--resume
    auto``) then takes: the other run's weights.

    Returns:
        The folders deleted (with ``overwrite``).

    Raises:
        FileExistsError: another run's checkpoints are there and ``overwrite`` is false.
    """
    import torch.distributed as dist

    found: list[Any] = [None]
    if _rank(process_group) == 0:
        root = Path(save_dir)
        others = sorted(
            folder for folder in (root.iterdir() if root.is_dir() else ())
            if _STEP.fullmatch(folder.name) and folder.is_dir() and _is_complete(folder) and _run_of(folder) != run_id
        )
        if others and overwrite:
            for folder in others:
                shutil.rmtree(folder)
        found = [[str(f) for f in others]]
    if _distributed():
        src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        dist.broadcast_object_list(found, src=src, group=process_group)
    others = [Path(f) for f in found[0]]
    if others and not overwrite:
        names = ", ".join(f.name for f in others[:_SHOWN]) + (f" and {len(others) - _SHOWN} more" if len(others) > _SHOWN else "")
        raise FileExistsError(
            f"{save_dir} holds checkpoints of another run ({names}); a fresh run would mix its checkpoints with "
            f"them (and a later resume take theirs): resume that run, choose another folder, or overwrite them"
        )
    return others


def stage_optimizers(
    modules: Sequence[nn.Module], factory: Callable[[Iterable[nn.Parameter]], Any]
) -> list[Any]:
    """One optimizer per stage module, ``factory(module.parameters())`` (what DCP's optimizer state
    dict needs: each optimizer's parameters named by its module).

    A parameter object shared by two of this rank's modules (a V-shaped schedule's first and last
    stage with a tied embedding, without FSDP2) would be stepped twice; the later module gets its own
    copy first (equal values; :func:`~ppmedia.pipeline.sync_tied_gradients` sums the copies'
    gradients, so they stay equal). Call it after :func:`~ppmedia.pipeline.apply_fsdp`, if any.

    Raises:
        ValueError: a module without parameters (a stage given no decoder layer because there are more
            stages than layers), instead of torch's bare "optimizer got an empty parameter list".
    """
    from .fsdp import _untie_across_modules
    from .tied import stage_parameters

    _untie_across_modules(modules)
    from .layer_split import refuse_empty_stages

    refuse_empty_stages(modules, "stage_optimizers")
    return [factory(stage_parameters([module])) for module in modules]


# -- state dicts ------------------------------------------------------------------------------------
def _options(strict: bool = True) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True, strict=strict)


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _aliases(module: nn.Module) -> dict[str, list[str]]:
    """First name -> the other names of each parameter that has several in ``module``."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {group[0]: group[1:] for group in names.values() if len(group) > 1}


def _model_state(modules: Sequence[nn.Module]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from .lora import has_lora

    state: dict[str, Any] = {}
    for module in modules:
        for name, value in get_model_state_dict(module, options=_options()).items():
            if has_lora(module) and not _is_adapter(name):  # LoRA: the base comes from the model, not the checkpoint
                continue
            if name in state and state[name] is not value:
                raise ValueError(f"checkpoint: two stages on this rank hold different tensors named {name!r}")
            state[name] = value
    return state


def _optimizer_state(modules: Sequence[nn.Module], optimizers: Sequence[Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if len(optimizers) != len(modules):
        raise ValueError(
            f"checkpoint: {len(optimizers)} optimizers for {len(modules)} stage modules; expected one per "
            f"module (stage_optimizers)"
        )
    state: dict[str, Any] = {}
    for module, optimizer in zip(modules, optimizers):
        flat = get_optimizer_state_dict(module, optimizer, options=_options())
        for first, others in _aliases(module).items():
            for key in [k for k in flat if _param_of(k) == first]:
                head, rest = key.split(".", 1)
                for other in others:
                    flat[f"{head}.{other}{rest[len(first):]}"] = flat[key]
        state.update(flat)
    return state


def _param_of(key: str) -> str:
    """``state.<name>.<field>`` / ``param_groups.<name>.<field>`` -> ``<name>``."""
    return key.split(".", 1)[1].rsplit(".", 1)[0]


def _state(modules: Sequence[nn.Module], optimizers: Sequence[Any] | None) -> dict[str, Any]:
    state = _model_state(modules)
    if optimizers is not None:
        state[_OPTIMIZER] = _optimizer_state(modules, optimizers)
    return state


# -- process group helpers ----------------------------------------------------------------------------
def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _rank(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_rank(group) if _distributed() else 0


def _barrier(group: Any) -> None:
    import torch.distributed as dist

    if _distributed():
        dist.barrier(group=group)


def _gather(obj: Any, group: Any) -> list[Any]:
    import torch.distributed as dist

    if not _distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _lora(modules: Sequence[nn.Module]) -> dict[str, Any] | None:
    """The LoRA settings of the stages (:meth:`~ppmedia.pipeline.LoraSettings.record`), or ``None``."""
    from .lora import lora_settings_of

    settings = lora_settings_of(modules)
    return settings.record() if settings is not None else None


_LORA_OPTIONS = {"rank": "--lora-rank", "alpha": "--lora-alpha", "dropout": "--lora-dropout",
                 "targets": "--lora-targets", "vision": "--lora-vision"}


def lora_mismatch(saved: dict[str, Any] | None, here: dict[str, Any] | None) -> str | None:
    """What differs between a checkpoint's LoRA settings (its ``ppmedia.json``'s ``"lora"``) and this
    run's (:meth:`~ppmedia.pipeline.LoraSettings.record`, or ``None`` without LoRA), naming the
    options; ``None`` when they agree."""
    if saved == here:
        return None
    if saved is None:
        return (f"it holds a full model's weights (trained without LoRA) and this run trains LoRA adapters "
                f"(--lora-rank {here['rank'] if here else '?'}); resume without the --lora-* options, or start a fresh run")
    if here is None:
        return (f"it holds LoRA adapters (--lora-rank {saved['rank']}) and this run trains the full model; "
                f"resume with the same --lora-* options")
    diffs = [f"{_LORA_OPTIONS.get(k, k)}: saved {saved.get(k)}, this run {here.get(k)}"
             for k in _LORA_OPTIONS if saved.get(k) != here.get(k)]
    return "its LoRA configuration differs (" + "; ".join(diffs) + ")"


def _config_model_type(modules: Sequence[nn.Module]) -> str | None:
    config = getattr(modules[0], "config", None) if modules else None
    return getattr(config, "model_type", None)


# -- save ---------------------------------------------------------------------------------------------
def save_checkpoint(
    save_dir: str | os.PathLike[str],
    step: int,
    modules: Sequence[nn.Module],
    optimizers: Sequence[Any] | None,
    *,
    extra: dict[str, Any] | None = None,
    run_id: str | None = None,
    process_group: Any = None,
) -> Path:
    """Write this rank's share of a checkpoint of step ``step`` and publish ``save_dir/step{step}/``.

    A collective over ``process_group`` (default: the world; every rank of the training job calls it,
    each with its own stage modules and their optimizers, one per module). Works without
    ``torch.distributed`` initialised too (one process).

    Args:
        save_dir: the folder holding the ``step{N}/`` checkpoints (created if missing).
        step: the step the checkpoint continues at.
        modules: this rank's stage modules (``[s.submod for s in stages]``), sharded or not.
        optimizers: one optimizer per module (:func:`stage_optimizers`), or ``None`` (weights only).
        extra: JSON-serialisable values to keep with it (e.g. the data loader's position); returned by
            :func:`load_checkpoint` under ``"extra"``.
        run_id: the run's identity (:func:`new_run_id`; a resumed run keeps the checkpoint's), kept as
            ``"run_id"``; :func:`claim_save_dir` tells this run's checkpoints from another's by it.

    Returns:
        The published folder. An existing ``step{step}/`` is replaced.
    """
    import torch.distributed.checkpoint as dcp

    final = checkpoint_path(save_dir, step)
    partial = final.with_name(final.name + ".partial")
    rank0 = _rank(process_group) == 0
    if rank0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier(process_group)
    state = _state(modules, optimizers)
    names = sorted(set().union(*_gather(sorted(k for k in state if k != _OPTIMIZER), process_group)))
    settings = _merge_hyperparameters(_gather(_hyperparameters(optimizers), process_group))
    dcp.save(state, checkpoint_id=str(partial), process_group=process_group, no_dist=not _distributed())
    if rank0:
        info = {"format": _FORMAT, "step": int(step), "model_type": _config_model_type(modules), "lora": _lora(modules),
                "names": names, "optimizer": optimizers is not None, "hyperparameters": settings,
                "run_id": run_id, "extra": extra or {}}
        _write_json(partial / CHECKPOINT_INFO, info)
        _publish(partial, final)
    _barrier(process_group)
    return final


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w") as fh:
        json.dump(data, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())


def _publish(partial: Path, final: Path) -> None:
    """Rename ``partial`` to ``final`` (replacing an older ``final``), then make the rename durable."""
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(partial, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    shutil.rmtree(old, ignore_errors=True)


# -- optimizer hyperparameters ---------------------------------------------------------------------
def _plain(value: Any) -> Any:
    """``value`` as JSON holds it (tuples as lists, a 0-d tensor as its number)."""
    from torch import Tensor

    if isinstance(value, Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _hyperparameters(optimizers: Sequence[Any] | None) -> dict[str, list[Any]]:
    """Every hyperparameter of the optimizers' param groups -> its distinct values (JSON values)."""
    out: dict[str, list[Any]] = {}
    for optimizer in optimizers or ():
        for group in optimizer.param_groups:
            for key, value in group.items():
                if key != "params":
                    plain = _plain(value)
                    if plain not in out.setdefault(key, []):
                        out[key].append(plain)
    return out


def _merge_hyperparameters(per_rank: Sequence[dict[str, list[Any]]]) -> dict[str, list[Any]]:
    merged: dict[str, list[Any]] = {}
    for settings in per_rank:
        for key, values in settings.items():
            for value in values:
                if value not in merged.setdefault(key, []):
                    merged[key].append(value)
    return {key: merged[key] for key in sorted(merged)}


def _hyperparameter_changes(saved: dict[str, list[Any]], here: dict[str, list[Any]]) -> list[str]:
    """``"lr: saved 0.01, this job 0.001"`` for each hyperparameter whose values differ."""
    show = lambda values: values[0] if len(values) == 1 else values  # noqa: E731
    return [
        f"{key}: saved {show(saved[key]) if key in saved else 'none'}, this job {show(here[key]) if key in here else 'none'}"
        for key in sorted(set(saved) | set(here))
        if (key in saved and key in here and saved[key] != here[key]) or (key in saved) != (key in here)
    ]


def _restore_hyperparameters(optimizers: Sequence[Any], groups: list[list[dict[str, Any]]]) -> None:
    for optimizer, kept in zip(optimizers, groups):
        for group, values in zip(optimizer.param_groups, kept):
            group.update(values)


# -- check and load -----------------------------------------------------------------------------------
def _read_info(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise ValueError(f"checkpoint {path}: no such folder")
    if not _is_complete(path):
        present = sorted(p.name for p in path.iterdir())
        raise ValueError(
            f"checkpoint {path}: not a complete ppmedia checkpoint (holds {present}); expected DCP's "
            f".metadata and {CHECKPOINT_INFO} (a save that did not finish leaves step{{N}}.partial/)"
        )
    try:
        with open(path / CHECKPOINT_INFO) as fh:
            info: dict[str, Any] = json.load(fh)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"checkpoint {path}: {path / CHECKPOINT_INFO} is damaged (not JSON: {exc})") from exc
    if not isinstance(info, dict) or info.get("format") != _FORMAT:
        got = info.get("format") if isinstance(info, dict) else type(info).__name__
        raise ValueError(f"checkpoint {path}: {path / CHECKPOINT_INFO} has format {got!r}; expected {_FORMAT!r}")
    return info


def _saved_shapes(path: Path) -> dict[str, tuple[int, ...] | None]:
    """Every key DCP stored, with its tensor shape (``None`` for non-tensor values)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # a truncated or overwritten .metadata: pickle's or torch's error, unnamed
        raise ValueError(
            f"checkpoint {path}: {path / '.metadata'} is damaged ({type(exc).__name__}: {exc}); "
            f"DCP cannot read which tensors the checkpoint holds"
        ) from exc
    return {
        key: tuple(value.size) if isinstance(value, TensorStorageMetadata) else None
        for key, value in metadata.state_dict_metadata.items()
    }


def _flat_shapes(state: dict[str, Any]) -> dict[str, tuple[int, ...] | None]:
    from torch import Tensor

    out: dict[str, tuple[int, ...] | None] = {}
    for key, value in state.items():
        if key == _OPTIMIZER:
            out.update({f"{_OPTIMIZER}.{k}": v for k, v in _flat_shapes(value).items()})
        else:
            out[key] = tuple(value.shape) if isinstance(value, Tensor) else None
    return out


def _problems(wanted: dict[str, tuple[int, ...] | None], saved: dict[str, tuple[int, ...] | None]) -> dict[str, list[str]]:
    """Names this rank needs that ``saved`` lacks (model names; optimizer entries of parameters the
    checkpoint does hold), and shapes that differ."""
    prefix = _OPTIMIZER + "."
    missing = sorted(k for k in wanted if k not in saved and not k.startswith(prefix))
    lost = set(missing)
    optimizer = sorted(
        k[len(prefix):] for k in wanted
        if k.startswith(prefix) and k not in saved and _param_of(k[len(prefix):]) not in lost
    )
    shapes = sorted(
        f"{k}: saved {list(saved[k] or [])}, here {list(v or [])}"
        for k, v in wanted.items()
        if k in saved and v is not None and saved[k] != v
    )
    return {"missing": missing, "optimizer": optimizer, "shapes": shapes}


def _message(path: Path, info: dict[str, Any], here: str | None, problems: dict[str, list[str]]) -> str:
    parts = []
    if info.get("model_type") != here:
        parts.append(f"it was saved from a {info.get('model_type')!r} model, these stages are {here!r}")
    labels = {"missing": "names these stages need that the checkpoint lacks",
              "unexpected": "names in the checkpoint that this model lacks",
              "shapes": "shapes that differ",
              "optimizer": "optimizer entries the checkpoint lacks (another optimizer, or saved without one)"}
    for kind, label in labels.items():
        names = problems.get(kind) or []
        if names:
            more = f" (and {len(names) - _SHOWN} more)" if len(names) > _SHOWN else ""
            parts.append(f"{len(names)} {label}: {', '.join(names[:_SHOWN])}{more}")
    return f"checkpoint {path} does not fit these stages; nothing was loaded: " + "; ".join(parts)


def check_checkpoint(
    path: str | os.PathLike[str],
    modules: Sequence[nn.Module],
    optimizers: Sequence[Any] | None = None,
    *,
    hyperparameters: str = "saved",
    process_group: Any = None,
) -> dict[str, Any]:
    """Check that checkpoint ``path`` fits this job's stages (and optimizers) without loading anything.

    A collective over ``process_group`` (default: the world): every rank checks the names and shapes
    its own stages need; the ranks' findings are gathered, so every rank returns or raises alike
    (no rank is left waiting in a later collective).

    Returns:
        The checkpoint's ``ppmedia.json`` (``step``, ``model_type``, ``names``, ``run_id``,
        ``hyperparameters``, ``extra``), with ``"hyperparameters_changed"``: each optimizer
        hyperparameter whose saved values differ from this job's (``"lr: saved 0.01, this job 0.001"``).

    Raises:
        ValueError: not a complete checkpoint (or a damaged file in it, named); another model type;
            names this job needs that it lacks, parameter names in it that this model lacks, or shapes
            that differ (listed, with counts); with ``hyperparameters="refuse"``, hyperparameters
            that differ.
    """
    if hyperparameters not in HYPERPARAMETER_MODES:
        raise ValueError(f"hyperparameters: got {hyperparameters!r}; expected one of {', '.join(HYPERPARAMETER_MODES)}")
    from .guards import agree

    folder = Path(path)
    problem: Exception | None = None
    try:  # each rank reads the files itself: agree before the gathers below, so none is left waiting
        info, saved = _read_info(folder), _saved_shapes(folder)
    except (OSError, ValueError) as exc:
        problem = exc
    agree(problem, process_group, what=f"reading checkpoint {folder}")
    lora = lora_mismatch(info.get("lora"), _lora(modules))
    if lora is not None:
        raise ValueError(f"checkpoint {folder} does not fit these stages; nothing was loaded: {lora}")
    wanted = _flat_shapes(_state(modules, optimizers))
    mine = _problems(wanted, saved)
    here_settings = _merge_hyperparameters(_gather(_hyperparameters(optimizers), process_group))
    recorded = optimizers is not None and "hyperparameters" in info  # checkpoints from before ppmedia kept them: none
    changes = _hyperparameter_changes(info["hyperparameters"], here_settings) if recorded else []
    info["hyperparameters_changed"] = changes
    if changes and hyperparameters == "refuse":
        raise ValueError(f"checkpoint {folder}: this job's optimizer hyperparameters differ from the saved ones "
                         f"({'; '.join(changes)}); nothing was loaded")
    gathered = _gather((mine, sorted(k for k in wanted if not k.startswith(_OPTIMIZER + "."))), process_group)
    problems: dict[str, list[str]] = {"missing": [], "optimizer": [], "shapes": []}
    model_names: set[str] = set()
    for found, names in gathered:
        for kind in problems:
            problems[kind] = sorted(set(problems[kind]) | set(found[kind]))
        model_names.update(names)
    problems["unexpected"] = sorted(set(info.get("names", ())) - model_names)
    here = _config_model_type(modules)
    if info.get("model_type") != here or any(problems.values()):
        raise ValueError(_message(folder, info, here, problems))
    return info


def _non_finite(state: dict[str, Any]) -> list[str]:
    """Names of the loaded floating tensors (this rank's pieces) holding a NaN or an infinity."""
    import torch

    bad = []
    for name, value in state.items():
        local = value.to_local() if hasattr(value, "to_local") else value
        if isinstance(local, torch.Tensor) and local.is_floating_point() and not bool(torch.isfinite(local).all()):
            bad.append(name)
    return bad


def _refuse_non_finite(path: Path, state: dict[str, Any], process_group: Any) -> None:
    """A checkpoint whose weights load as NaN / inf (damaged ``.distcp`` bytes: DCP keeps no checksums)
    is refused on every rank, naming the tensors, instead of training on with NaN losses."""
    bad = sorted(set().union(*_gather(_non_finite({k: v for k, v in state.items() if k != _OPTIMIZER}), process_group)))
    if bad:
        more = f" and {len(bad) - _SHOWN} more" if len(bad) > _SHOWN else ""
        raise ValueError(
            f"checkpoint {path}: {len(bad)} tensor(s) hold NaN or infinite values after loading: "
            f"{', '.join(bad[:_SHOWN])}{more} (a damaged .distcp file, or a run that diverged before saving); "
            f"the stages now hold them: rebuild them before loading another checkpoint"
        )


def load_checkpoint(
    path: str | os.PathLike[str],
    modules: Sequence[nn.Module],
    optimizers: Sequence[Any] | None = None,
    *,
    hyperparameters: str = "saved",
    process_group: Any = None,
) -> dict[str, Any]:
    """Load checkpoint ``path`` into this rank's stage modules (and their optimizers), any layout.

    A collective over ``process_group`` (default: the world). :func:`check_checkpoint` runs first:
    a checkpoint that does not fit is refused before any tensor is overwritten. ``optimizers``:
    one per module, built like the saving job's (a fresh optimizer gets its state from the checkpoint).
    ``hyperparameters``: one of :data:`HYPERPARAMETER_MODES` (``"saved"``: torch's own behaviour, the
    saved ``lr`` etc. come back; ``"current"``: this job's optimizers keep the values they were built
    with, e.g. a resumed run's new ``--lr``; ``"refuse"``: a difference is an error, nothing loaded).

    Raises:
        ValueError: what :func:`check_checkpoint` refuses; weights that load as NaN or infinity (named,
            on every rank; DCP keeps no checksums, so damaged bytes are seen only this way).

    Returns:
        The checkpoint's ``ppmedia.json``: ``info["step"]``, ``info["run_id"]``, ``info["extra"]``,
        ``info["hyperparameters_changed"]`` (what differed; applied only with ``"current"``), ...
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    from .lora import has_lora

    info = check_checkpoint(path, modules, optimizers, hyperparameters=hyperparameters, process_group=process_group)
    kept = [[{k: v for k, v in g.items() if k != "params"} for g in o.param_groups] for o in optimizers or ()]
    state = _state(modules, optimizers)
    dcp.load(state, checkpoint_id=str(path), process_group=process_group, no_dist=not _distributed())
    _refuse_non_finite(Path(path), state, process_group)
    for module in modules:
        names = {name for name, _ in module.named_parameters(remove_duplicate=False)}
        names |= {name for name, _ in module.named_buffers()}
        set_model_state_dict(module, {k: v for k, v in state.items() if k in names},
                             options=_options(strict=not has_lora(module)))
    if optimizers is not None:
        flat = state[_OPTIMIZER]
        for module, optimizer in zip(modules, optimizers):
            names = {name for name, _ in module.named_parameters()}  # one name per parameter: no aliases
            own = {k: v for k, v in flat.items() if _param_of(k) in names}
            set_optimizer_state_dict(module, optimizer, own, options=_options())
        if hyperparameters == "current":
            _restore_hyperparameters(optimizers, kept)
    return info
