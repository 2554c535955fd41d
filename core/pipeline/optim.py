"""The optimizer side of fine-tuning: weight-decay groups, AdamW per stage, learning-rate schedules.

* :func:`decay_groups` splits a stage module's parameters into two optimizer groups: with weight decay,
  and without it for biases, normalisation weights and embedding tables (``nn.Embedding`` weights,
  and anything tied to one, such as a tied ``lm_head.weight``: decided by name, so the copy of a tie on
  the last stage gets what the embedding on the first gets).
* :func:`stage_adamw` builds one ``torch.optim.AdamW`` per stage module with those groups (the
  layout :func:`~ppmedia.pipeline.save_checkpoint` stores by parameter name).
* :func:`learning_rate` is the learning rate of a step under a schedule with linear warm-up
  (``constant``, ``linear`` or ``cosine`` decay to 0 at ``total_steps``), a pure function of the step,
  so a resumed run continues it exactly; :func:`set_learning_rate` writes it into the optimizers.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from torch import nn

__all__ = ["LR_SCHEDULES", "decay_groups", "learning_rate", "no_decay", "set_learning_rate", "stage_adamw"]

#: the learning-rate schedules :func:`learning_rate` knows.
LR_SCHEDULES = ("constant", "linear", "cosine")


def no_decay(name: str, param: nn.Parameter, owner: nn.Module, tied_names: Sequence[str] = ()) -> bool:
    """Whether ``param`` (``name`` in its stage module, held by the module ``owner``) is left out of
    weight decay: a tensor of fewer than 2 dimensions (a bias, a norm weight, a scalar), the weight of a
    normalisation module (its class name holds ``Norm``), of an ``nn.Embedding``, or a parameter tied
    to a name holding ``embed`` (``tied_names``: every name of its tie group)."""
    if param.dim() < 2 or "norm" in type(owner).__name__.lower() or isinstance(owner, nn.Embedding):
        return True
    return any("embed" in tied.rsplit(".", 1)[0].rsplit(".", 1)[-1] for tied in tied_names if tied != name)


def decay_groups(module: nn.Module, weight_decay: float, *, trainable_only: bool = False) -> list[dict[str, Any]]:
    """``module``'s parameters as optimizer groups: ``[{"params": [...], "weight_decay": weight_decay},
    {"params": [...], "weight_decay": 0.0}]`` (an empty group left out), each parameter once, in
    ``named_parameters`` order; which go without decay: :func:`no_decay`. The tie groups come from
    ``module.tied`` (a :class:`~ppmedia.pipeline.StageModule`'s list of
    :class:`~ppmedia.pipeline.TiedParameters`), if it has one. ``trainable_only``: leave out parameters
    with ``requires_grad=False`` (LoRA: only the adapters reach the optimizer)."""
    ties = {name: group.names for group in getattr(module, "tied", ()) for name in group.names}
    owners = {f"{prefix}.{n}" if prefix else n: sub for prefix, sub in module.named_modules()
              for n, _ in sub.named_parameters(recurse=False)}
    decay: list[nn.Parameter] = []
    plain: list[nn.Parameter] = []
    for name, param in module.named_parameters():
        if trainable_only and not param.requires_grad:
            continue
        (plain if no_decay(name, param, owners.get(name, module), ties.get(name, ())) else decay).append(param)
    groups = [{"params": decay, "weight_decay": float(weight_decay)}, {"params": plain, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def stage_adamw(modules: Sequence[nn.Module], lr: float, weight_decay: float, **adamw: Any) -> list[Any]:
    """One ``torch.optim.AdamW(decay_groups(module, weight_decay), lr=lr, **adamw)`` per stage module,
    torch's fused implementation where every parameter allows it (plain tensors on the CPU or a GPU;
    ``fused=False`` or ``foreach=`` in ``adamw`` choose otherwise).

    Call it after :func:`~ppmedia.pipeline.apply_fsdp`, if any. As
    :func:`~ppmedia.pipeline.stage_optimizers`, a parameter object shared by two of this rank's
    modules gets its own copy in the later one first. Frozen parameters (``requires_grad=False``) stay
    in the groups: AdamW skips a parameter without a gradient, and the checkpoint keeps one layout;
    except on stages with LoRA adapters (:func:`~ppmedia.pipeline.apply_lora`), whose optimizers hold
    the adapters alone (the base is frozen and not checkpointed).

    Raises:
        ValueError: a module without parameters (a middle stage given no decoder layer), naming it.
    """
    import torch

    from .fsdp import _untie_across_modules
    from .layer_split import refuse_empty_stages

    from .lora import has_lora

    _untie_across_modules(modules)
    refuse_empty_stages(modules, "stage_adamw")  # not torch's bare "optimizer got an empty parameter list"
    return [torch.optim.AdamW(decay_groups(module, weight_decay, trainable_only=has_lora(module)), lr=lr, **_implementation(module, adamw))
            for module in modules]


def _implementation(module: nn.Module, adamw: dict[str, Any]) -> dict[str, Any]:
    """``adamw`` with ``fused=True`` added where :func:`_fusable` allows it and the caller chose none."""
    if "fused" in adamw or "foreach" in adamw or not _fusable(module):
        return adamw
    return {**adamw, "fused": True}


def _fusable(module: nn.Module) -> bool:
    """Whether torch's fused AdamW (one pass per parameter instead of a dozen: measured a third of the
    for-loop's time on this CPU) runs ``module``: every parameter a plain floating tensor on the CPU or
    a GPU (not DTensor parameters of FSDP2 or tensor parallelism)."""
    from torch.distributed.tensor import DTensor

    params = list(module.parameters())
    return bool(params) and all(not isinstance(p, DTensor) and p.is_floating_point() and p.device.type in
                                ("cpu", "cuda") for p in params)


def learning_rate(step: int, lr: float, *, schedule: str = "constant", warmup_steps: int = 0,
                  total_steps: int | None = None) -> float:
    """The learning rate of step ``step`` (0-based): ``lr * step / warmup_steps`` during the warm-up,
    then ``lr`` (``constant``), or decayed from ``lr`` at the end of the warm-up to 0 at
    ``total_steps``, linearly (``linear``) or along half a cosine (``cosine``).

    Raises:
        ValueError: an unknown ``schedule``, a negative ``warmup_steps``, or a decaying schedule
            without ``total_steps``.
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"learning rate schedule {schedule!r}; expected one of {', '.join(LR_SCHEDULES)}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps {warmup_steps}; expected 0 or more")
    if step < warmup_steps:
        return lr * step / warmup_steps
    if schedule == "constant":
        return lr
    if total_steps is None:
        raise ValueError(f"the {schedule} schedule decays to 0 at total_steps: give total_steps")
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return lr * (1.0 - progress)
    return lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_learning_rate(optimizers: Sequence[Any], lr: float) -> None:
    """Set ``lr`` in every parameter group of every optimizer (before its ``step()``)."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr
