"""LoRA adapters on pipeline stage modules, in Hugging Face PEFT's module classes and file format.

:func:`apply_lora` replaces each targeted ``nn.Linear`` of a rank's stage modules by PEFT's own
``peft.tuners.lora.Linear`` (the base layer under ``<module>.base_layer``, the adapter
``<module>.lora_A.default`` ``[r, in]`` and ``<module>.lora_B.default`` ``[out, r]``, output
``base(x) + B(A(dropout(x))) * alpha / r``), freezes everything else and initialises every ``lora_A``
from ``--seed`` and the parameter's full name alone (:func:`initial_lora_weight`; ``lora_B`` is zero),
so any ``pp x dp x tp`` layout starts from the same adapter. Which modules: :func:`lora_targets`
(module-name suffixes or ``all-linear``; default the language model's attention and MLP projections,
:data:`DEFAULT_LORA_TARGETS`; the vision side only with ``vision=True``).

:func:`lora_state_dict` gives this rank's adapter tensors under PEFT's file names
(``base_model.model.<module path>.lora_A.weight``); :func:`save_lora_adapter` gathers every stage's
over the pipeline group and writes ``adapter_model.safetensors`` + ``adapter_config.json`` (PEFT's
``LoraConfig``, every stage's target modules listed), which
``peft.PeftModel.from_pretrained(base_model, path)`` loads; :func:`merged_state_dict` folds the adapters
into the base weights under the base model's names (the rest of the state untouched).
"""

from __future__ import annotations

import difflib
import hashlib
import math
import os
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
from torch import nn

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "ALL_LINEAR",
    "DEFAULT_LORA_TARGETS",
    "LoraSettings",
    "apply_lora",
    "check_lora_targets",
    "has_lora",
    "initial_lora_weight",
    "lora_settings_of",
    "lora_state_dict",
    "lora_targets",
    "merged_state_dict",
    "peft_key",
    "save_lora_adapter",
]

#: the module-name suffixes adapted by default: the language model's attention and MLP projections.
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: the target that takes every ``nn.Linear`` of the adapted parts but the output head (as PEFT's).
ALL_LINEAR = "all-linear"
#: PEFT's file names.
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
_ADAPTER = "default"  # PEFT's adapter name in memory (absent from its files)
_ATTRIBUTE = "_ppmedia_lora"  # a stage module's LoRA record (its settings and targets)


@dataclass(frozen=True)
class LoraSettings:
    """What LoRA a run trains.

    Attributes:
        rank: ``r``, the adapters' inner width (``> 0``).
        alpha: ``lora_alpha``; the update is scaled by ``alpha / rank``.
        dropout: ``lora_dropout`` on the adapter's input, in ``[0, 1)``.
        targets: module-name suffixes (``("q_proj", "v_proj")``), ``("all-linear",)``, or ``None``:
            :data:`DEFAULT_LORA_TARGETS`.
        vision: adapt the vision tower (and projector) too, not only the language model.
        seed: the seed every ``lora_A`` is drawn from (with its name).
    """

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] | None = None
    vision: bool = False
    seed: int = 0

    def record(self) -> dict[str, Any]:
        """The settings a checkpoint keeps and compares (the seed is not: the adapters are stored)."""
        return {"rank": int(self.rank), "alpha": float(self.alpha), "dropout": float(self.dropout),
                "targets": list(self.targets) if self.targets is not None else None, "vision": bool(self.vision)}


def _part(name: str, module: nn.Module) -> str:
    from .finetune import model_part

    return model_part(name + ".weight", module)


def _candidates(model: nn.Module, vision: bool) -> dict[str, nn.Linear]:
    """The ``nn.Linear`` modules LoRA may adapt, by full name: the language model's (not its output
    head), and with ``vision`` the vision tower's and projector's."""
    head = getattr(model, "head_name", None) or "lm_head"
    out: dict[str, nn.Linear] = {}
    for name, sub in model.named_modules():
        if type(sub) is not nn.Linear or name == head or name.endswith("." + head):
            continue
        if vision or _part(name, model) == "language":
            out[name] = sub
    return out


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def lora_targets(model: nn.Module, settings: LoraSettings) -> list[str]:
    """The full names of the modules of ``model`` (a stage module or a whole model) that ``settings``
    adapt, in module order: every candidate (:func:`_candidates`) for ``all-linear``, else those
    whose name ends with a target suffix; the default targets on the vision side mean every linear
    there (its projections are named otherwise: ``qkv``, ``fc1``, ...)."""
    found = _candidates(model, settings.vision)
    targets = settings.targets
    if targets is not None and ALL_LINEAR in targets:
        return list(found)
    chosen = []
    for name in found:
        language = _part(name, model) == "language"
        if targets is None and not language:
            chosen.append(name)
        elif any(_matches(name, t) for t in (targets or DEFAULT_LORA_TARGETS)):
            chosen.append(name)
    return chosen


def check_lora_targets(model: nn.Module, settings: LoraSettings) -> None:
    """Refuse a target suffix that matches no module ``lora_targets`` could take in the WHOLE
    ``model`` (build it on the meta device: :func:`~ppmedia.pipeline.pretrained.build_meta_model`).

    Raises:
        ValueError: ``--lora-targets NAME: matches no linear module of the <part>; did you mean A, B?``
            (the closest module-name suffixes of the model), or that no module matches at all.
    """
    if settings.targets is None or ALL_LINEAR in settings.targets:
        if not lora_targets(model, settings):
            raise ValueError("--lora-targets: no linear module of the model to adapt")
        return
    found = _candidates(model, settings.vision)
    where = "language model or vision tower" if settings.vision else "language model"
    suffixes = sorted({".".join(n.split(".")[-k:]) for n in found for k in (1, 2)})
    for target in settings.targets:
        if not any(_matches(n, target) for n in found):
            close = difflib.get_close_matches(target, suffixes, n=4, cutoff=0.5)
            hint = f"did you mean {', '.join(close)}?" if close else f"its linear modules end in {', '.join(sorted({n.rsplit('.', 1)[-1] for n in found}))}"
            raise ValueError(f"--lora-targets {target}: matches no linear module of the {where}; {hint}")


def peft_key(name: str) -> str:
    """A LoRA parameter's name in PEFT's files: ``a.q_proj.lora_A.default.weight`` ->
    ``base_model.model.a.q_proj.lora_A.weight``."""
    for kind in ("lora_A", "lora_B"):
        name = name.replace(f".{kind}.{_ADAPTER}.", f".{kind}.")
    return "base_model.model." + name


def initial_lora_weight(key: str, shape: Sequence[int], seed: int) -> torch.Tensor:
    """The initial value of the LoRA parameter whose PEFT file name (without ``base_model.model.``) is
    ``key``: ``lora_A`` as PEFT draws it (Kaiming-uniform, ``a = sqrt(5)``) from a generator seeded by
    ``seed`` and ``key`` alone, ``lora_B`` zeros; float32 ``shape``, on the CPU."""
    out = torch.zeros(tuple(shape), dtype=torch.float32)
    if ".lora_A." in f".{key}":
        digest = hashlib.sha256(f"{int(seed)}:{key}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
        nn.init.kaiming_uniform_(out, a=math.sqrt(5), generator=generator)
    return out


def _peft_config(settings: LoraSettings, targets: Iterable[str], base_model: str | None = None, *,
                 init: bool = True) -> Any:
    """PEFT's ``LoraConfig`` of ``settings`` over ``targets`` (``init``: PEFT's own initialisation, as
    written to files; ``False`` in memory, where :func:`initial_lora_weight` initialises)."""
    from peft import LoraConfig

    return LoraConfig(r=int(settings.rank), lora_alpha=settings.alpha,  # type: ignore[arg-type]  # PEFT takes a float alpha
                      lora_dropout=float(settings.dropout), target_modules=sorted(set(targets)), bias="none", init_lora_weights=init,
                      base_model_name_or_path=base_model)


def _replace(module: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(module.get_submodule(parent_name) if parent_name else module, child, new)


def _whole_sizes(layer: Any, base: nn.Linear, rank: int) -> None:
    """PEFT sizes a tensor-parallel base layer's adapter by its local shard; the adapter is made whole
    (the layer's own ``in_features`` x ``out_features``) and sharded afterwards (:func:`_shard_like_base`)."""
    want = {"lora_A": (rank, base.in_features), "lora_B": (base.out_features, rank)}
    for kind, (out_f, in_f) in want.items():
        old = getattr(layer, kind)[_ADAPTER]
        if tuple(old.weight.shape) != (out_f, in_f):
            getattr(layer, kind)[_ADAPTER] = nn.Linear(in_f, out_f, bias=False, dtype=old.weight.dtype,
                                                      device=old.weight.device)
    layer.in_features, layer.out_features = base.in_features, base.out_features


def _shard_like_base(layer: Any, base: nn.Linear) -> None:
    """Tensor parallelism: the adapter laid out as its base layer's plan (colwise: ``lora_B`` split
    over the output rows, ``lora_A`` whole; rowwise: ``lora_A`` split over the input columns, its
    output summed over ``tp``, ``lora_B`` whole)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    weight = base.weight
    if not isinstance(weight, DTensor):
        return
    mesh, placement = weight.device_mesh, weight.placements[0]
    if placement == Shard(0):
        parallelize_module(layer.lora_B[_ADAPTER], mesh, ColwiseParallel())
    elif placement == Shard(1):
        parallelize_module(layer.lora_A[_ADAPTER], mesh, RowwiseParallel())


def apply_lora(modules: Sequence[nn.Module], settings: LoraSettings) -> dict[str, int]:
    """Put LoRA adapters on this rank's stage modules (after
    :func:`~ppmedia.pipeline.apply_tensor_parallel`, before :func:`~ppmedia.pipeline.apply_fsdp` and
    the optimizers): every module :func:`lora_targets` names becomes PEFT's ``lora.Linear`` around it,
    every other parameter ``requires_grad=False``, every adapter initialised by
    :func:`initial_lora_weight` (the same on every layout). Tensor-parallel base layers get their
    adapters sharded to match.

    Returns:
        ``{"modules": adapted modules, "trainable": adapter parameters' elements, "frozen": the rest}``
        on this rank.

    Raises:
        ValueError: a module that has adapters already; ``rank``, ``alpha`` or ``dropout`` out of range.
    """
    from peft.tuners.lora import Linear as LoraLinear

    if settings.rank <= 0 or settings.alpha <= 0 or not 0 <= settings.dropout < 1:
        raise ValueError(f"apply_lora: rank {settings.rank}, alpha {settings.alpha}, dropout {settings.dropout}; "
                         f"expected rank > 0, alpha > 0, 0 <= dropout < 1")
    counts = {"modules": 0, "trainable": 0, "frozen": 0}
    for module in modules:
        if _ATTRIBUTE in module.__dict__:
            raise ValueError("apply_lora: these stage modules have LoRA adapters already")
        names = lora_targets(module, settings)
        config = _peft_config(settings, names, init=False)
        for param in module.parameters():
            param.requires_grad_(False)
        for name in names:
            base: Any = module.get_submodule(name)
            layer = LoraLinear(base, _ADAPTER, config=config, r=int(settings.rank), lora_alpha=settings.alpha,  # type: ignore[arg-type]
                               lora_dropout=float(settings.dropout), init_lora_weights=False)
            _whole_sizes(layer, base, int(settings.rank))
            for kind in ("lora_A", "lora_B"):
                weight = getattr(layer, kind)[_ADAPTER].weight
                key = f"{name}.{kind}.weight"
                with torch.no_grad():
                    weight.copy_(initial_lora_weight(key, weight.shape, settings.seed))
                weight.requires_grad_(True)
            _shard_like_base(layer, base)
            _replace(module, name, layer)
        module.__dict__[_ATTRIBUTE] = {"settings": settings, "targets": names}
        counts["modules"] += len(names)
        for param in module.parameters():
            counts["trainable" if param.requires_grad else "frozen"] += param.numel()
    return counts


def has_lora(module: nn.Module) -> bool:
    """Whether :func:`apply_lora` put adapters on ``module``."""
    return _ATTRIBUTE in module.__dict__


def lora_settings_of(modules: Sequence[nn.Module]) -> LoraSettings | None:
    """The :class:`LoraSettings` of stage modules :func:`apply_lora` adapted, or ``None``."""
    for module in modules:
        if has_lora(module):
            settings: LoraSettings = module.__dict__[_ATTRIBUTE]["settings"]
            return settings
    return None


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def lora_state_dict(modules: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    """This rank's adapter tensors under PEFT's file names (:func:`peft_key`), whole (a ``DTensor`` is
    gathered: a collective over its mesh, in sorted name order on every rank of it)."""
    params = {name: p for module in modules for name, p in module.named_parameters()
              if ".lora_A." in name or ".lora_B." in name}
    return {peft_key(name): _full(params[name]).clone() for name in sorted(params)}


def _writes(modules: Sequence[nn.Module]) -> bool:
    """Whether this rank writes: with DTensor parameters (FSDP2, tensor parallelism) only the rank at
    coordinate 0 of their mesh."""
    from torch.distributed.tensor import DTensor

    for p in (p for m in modules for p in m.parameters()):
        if isinstance(p, DTensor):
            coordinate = p.device_mesh.get_coordinate()
            return coordinate is not None and all(c == 0 for c in coordinate)
    return True


def save_lora_adapter(modules: Sequence[nn.Module], path: str | os.PathLike[str], *, group: Any = None,
                      base_model: str | None = None) -> dict[str, torch.Tensor]:
    """Write the adapters of every stage as one PEFT adapter folder: ``adapter_model.safetensors``
    (every stage's tensors, PEFT's names, the stages' dtype) and ``adapter_config.json`` (PEFT's
    ``LoraConfig``: rank, alpha, dropout, ``target_modules`` = every stage's adapted modules).

    A collective over ``group`` (the pipeline group; ``None``: ``modules`` are the whole pipeline):
    each rank gathers the others' tensors and target names; with FSDP2 or tensor parallelism call it
    on every rank (shards gathered), and only the pipeline at mesh coordinate 0 writes (its group's
    rank 0). Returns the whole adapter (on every rank).

    Raises:
        ValueError: ``modules`` have no adapters.
    """
    import torch.distributed as dist
    from safetensors.torch import save_file

    settings = lora_settings_of(modules)
    if settings is None:
        raise ValueError("save_lora_adapter: these stage modules have no LoRA adapters (apply_lora)")
    tensors = lora_state_dict(modules)
    targets = [t for m in modules for t in m.__dict__.get(_ATTRIBUTE, {}).get("targets", [])]
    writes = _writes(modules)
    mine = ({k: v.cpu() for k, v in tensors.items()}, targets)
    parts = [mine]
    if group is not None:
        parts = [None] * dist.get_world_size(group)  # type: ignore[list-item]
        dist.all_gather_object(parts, mine, group=group)
    whole: dict[str, torch.Tensor] = {}
    names: list[str] = []
    for part_tensors, part_targets in parts:
        whole.update(part_tensors)
        names.extend(part_targets)
    rank0 = group is None or dist.get_rank(group) == 0
    if writes and rank0:
        os.makedirs(path, exist_ok=True)
        save_file({k: whole[k].contiguous() for k in sorted(whole)}, os.path.join(path, ADAPTER_WEIGHTS_FILE),
                  metadata={"format": "pt"})
        _peft_config(settings, names, base_model).save_pretrained(os.fspath(path))
    if group is not None:
        dist.barrier(group=group)
    return whole


def merged_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s persistent tensors under the base model's names with every adapter folded in:
    ``<m>.weight = base + (B @ A) * alpha / r`` (computed in float32, stored in the base's dtype),
    no ``lora_*`` or ``base_layer`` names; every other tensor is the module's own object (``DTensor``
    s are gathered by the caller)."""
    from peft.tuners.lora import Linear as LoraLinear

    state = dict(module.state_dict(keep_vars=True))
    for name, sub in module.named_modules():
        if not isinstance(sub, LoraLinear):
            continue
        for key in [k for k in state if k.startswith(name + ".lora_")]:
            del state[key]
        base = state.pop(f"{name}.base_layer.weight")
        a, b = (_full(getattr(sub, kind)[_ADAPTER].weight).float() for kind in ("lora_A", "lora_B"))
        full = _full(base)
        state[f"{name}.weight"] = (full.float() + (b @ a) * sub.scaling[_ADAPTER]).to(full.dtype)
        if f"{name}.base_layer.bias" in state:
            state[f"{name}.bias"] = state.pop(f"{name}.base_layer.bias")
    return state
