"""LoRA parity: ppmedia's pipeline training LoRA adapters vs Hugging Face PEFT's own model in one process.

:func:`run_lora_parity` spawns ONE group of 4 worker processes (gloo on 127.0.0.1, one thread each) that
trains every family's tiny model (``ppmedia.testing.tiny_models``) with LoRA
(:func:`ppmedia.pipeline.apply_lora`, :data:`SETTINGS`) at every layout of :data:`LAYOUTS`, phase by
phase (a phase's layouts side by side on disjoint ranks)::

    phase 0   ranks 0,1: pp2            ranks 2,3: pp1 x dp2 (saves a DCP checkpoint after step 2)
    phase 1   ranks 0-3: pp2 x dp2, FSDP2
    phase 2   ranks 0-3: pp2 x tp2
    phase 3   ranks 0,1: pp2 resumed from phase 0's pp1 x dp2 checkpoint for the last step
              ranks 2,3: pp2 with activation checkpointing, --freeze vision, pre-split microbatches and
              the encoder spread, all at once (Qwen2.5-VL only: the composition check)

Each layout runs :data:`STEPS` AdamW steps (lr :data:`LR`, weight decay :data:`WEIGHT_DECAY`,
clipping at :data:`MAX_GRAD_NORM`) on ``build_batch(seed=step)`` through
:func:`ppmedia.pipeline.train_step`, then writes its adapter with
:func:`ppmedia.pipeline.save_lora_adapter` (every stage's gathered over the pipeline group) and its
losses and the trained pipeline's loss on ``build_batch(seed=STEPS)`` (forward only; ``losses.json``)
under ``out/<family>/<layout>/``. :func:`peft_reference` is the reference:
``peft.get_peft_model`` on the whole model with the same target modules, its ``lora_A`` set to
:func:`ppmedia.pipeline.initial_lora_weight` (``lora_B`` PEFT's own zeros), torch's AdamW, the
model's own loss. The test compares them (``tests/test_lora_mp.py``).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta
from typing import Any

import torch

__all__ = ["FAMILIES", "LAYOUTS", "LR", "MAX_GRAD_NORM", "SETTINGS", "STEPS", "WEIGHT_DECAY", "peft_reference",
           "run_lora_parity"]

#: the families of the run.
FAMILIES = ("qwen2_5_vl", "gemma3", "llava_next")
#: the layouts every family trains at (``pp``, ``dp``, ``tp``, FSDP2), and the composition checks.
LAYOUTS = ("pp2", "pp1xdp2", "pp2xdp2_fsdp", "pp2xtp2", "pp2_resumed")
COMPOSED = ("pp2_checkpointing_freeze_presplit_spread",)
#: rank 4, alpha 16: the update is scaled by 4 (a dropped scaling shows).
STEPS, LR, WEIGHT_DECAY, MAX_GRAD_NORM = 3, 1e-2, 0.01, 1.0
_MICROBATCHES = 2


def _settings() -> Any:
    from ..pipeline import LoraSettings

    return LoraSettings(rank=4, alpha=16.0, dropout=0.0, seed=0)


SETTINGS = _settings()

#: phase -> {rank group: layout}
_PHASES: tuple[tuple[tuple[tuple[int, ...], str], ...], ...] = (
    (((0, 1), "pp2"), ((2, 3), "pp1xdp2")),
    (((0, 1, 2, 3), "pp2xdp2_fsdp"),),
    (((0, 1, 2, 3), "pp2xtp2"),),
    (((0, 1), "pp2_resumed"), ((2, 3), "pp2_checkpointing_freeze_presplit_spread")),
)


def _layout(name: str) -> dict[str, Any]:
    pp = 1 if name.startswith("pp1") else 2
    dp = 2 if "dp2" in name else 1
    tp = 2 if "tp2" in name else 1
    return {"pp": pp, "dp": dp, "tp": tp, "fsdp": "fsdp" in name, "resumed": "resumed" in name,
            "checkpointing": "checkpointing" in name, "presplit": "presplit" in name, "spread": "spread" in name,
            "freeze": "freeze" in name}


class _Groups:
    """Every process group of every phase, made once in the same order on every rank."""

    def __init__(self) -> None:
        import torch.distributed as dist

        from ..pipeline import pipeline_mesh

        self.single = [dist.new_group([r]) for r in range(4)]
        self.pairs = {(0, 1): dist.new_group([0, 1]), (2, 3): dist.new_group([2, 3])}
        self.meshes = {(2, 2, 1): pipeline_mesh(2, 2, 1), (2, 1, 2): pipeline_mesh(2, 1, 2)}

    def of(self, ranks: tuple[int, ...], spec: dict[str, Any]) -> dict[str, Any]:
        import torch.distributed as dist

        rank = dist.get_rank()
        if len(ranks) == 2:
            local = ranks.index(rank)
            pair = self.pairs[ranks]
            if spec["pp"] == 1:  # pp1 x dp2: one-rank pipelines, the pair the replicas
                return {"pp_group": self.single[rank], "dp_group": pair, "world": pair, "pp_rank": 0, "dp_rank": local,
                        "mesh": None}
            return {"pp_group": pair, "dp_group": self.single[rank], "world": pair, "pp_rank": local, "dp_rank": 0, "mesh": None}
        mesh = self.meshes[(spec["pp"], spec["dp"], spec["tp"])]
        return {"pp_group": mesh["pp"].get_group(), "dp_group": mesh["dp"].get_group(), "world": None,
                "pp_rank": mesh["pp"].get_local_rank(), "dp_rank": mesh["dp"].get_local_rank(), "mesh": mesh}


def _stages(family: str, spec: dict[str, Any], g: dict[str, Any]) -> list[Any]:
    from .. import pipeline
    from . import tiny_models

    model = tiny_models.load(family).build_model(0)
    if spec["checkpointing"]:
        model.gradient_checkpointing_enable()
    encoder = "spread" if spec["spread"] else "stage0"
    return pipeline.make_pipeline_stages(model, spec["pp"], [g["pp_rank"]], "cpu", group=g["pp_group"],
                                         encoder=encoder)


def _build(family: str, spec: dict[str, Any], g: dict[str, Any]) -> Any:
    from .. import pipeline

    stages = _stages(family, spec, g)
    if spec["tp"] > 1:
        pipeline.apply_tensor_parallel(stages, g["mesh"]["tp"])
    modules = [s.submod for s in stages]
    pipeline.apply_lora(modules, SETTINGS)
    if spec["freeze"]:
        pipeline.freeze(modules, ["vision"])  # the base is frozen already: nothing changes
    if spec["checkpointing"]:
        pipeline.enable_activation_checkpointing(modules)
    pipeline.train_mode(modules)
    if spec["fsdp"]:
        pipeline.apply_fsdp(stages, g["mesh"]["dp"])
    spread = pipeline.encoder_spread_of(stages) if spec["spread"] else None
    return pipeline.PipelineParts(
        schedule=pipeline.build_schedule("1f1b", stages, _MICROBATCHES), first=next((s for s in stages if s.is_first), None),
        modules=modules, optimizers=pipeline.stage_adamw(modules, LR, WEIGHT_DECAY), tied=list(modules[0].tied),
        pp_group=g["pp_group"], dp_group=g["dp_group"], sharded=spec["fsdp"], max_grad_norm=MAX_GRAD_NORM,
        spread=spread, presplit=spec["presplit"], tp_group=g["mesh"]["tp"].get_group() if spec["tp"] > 1 else None,
        world_group=g["world"],
    )


def _run_layout(family: str, layout: str, ranks: tuple[int, ...], groups: _Groups, out: str) -> None:
    import torch.distributed as dist

    from .. import pipeline
    from ..registry import get_adapter
    from . import tiny_models

    spec = _layout(layout)
    g = groups.of(ranks, spec)
    parts = _build(family, spec, g)
    module = tiny_models.load(family)
    config = parts.modules[0].config
    adapter = get_adapter(config)
    folder = os.path.join(out, family, layout)
    saved = os.path.join(out, family, "pp1xdp2", "dcp")
    start = 0
    if spec["resumed"]:
        start = int(pipeline.load_checkpoint(os.path.join(saved, f"step{STEPS - 1}"), parts.modules,
                                             parts.optimizers, process_group=g["world"])["step"])
    losses = []
    dp = spec["dp"]
    for step in range(start, STEPS):
        stages_media = parts.first is not None or spec["presplit"] or spec["spread"]
        share = pipeline.share_of_global_batch(module.build_batch(step), config, adapter, g["dp_rank"], dp,
                                               _MICROBATCHES, stages_media=stages_media)
        losses.append(pipeline.train_step(parts, share, step).loss)
        if layout == "pp1xdp2" and step + 1 == STEPS - 1:
            pipeline.save_checkpoint(saved, step + 1, parts.modules, parts.optimizers, process_group=g["world"])
    share = pipeline.share_of_global_batch(module.build_batch(STEPS), config, adapter, g["dp_rank"], dp,
                                           _MICROBATCHES, stages_media=parts.first is not None or spec["presplit"])
    held_out = pipeline.eval_loss(parts, [share]) if not spec["spread"] else None
    pipeline.save_lora_adapter(parts.modules, folder, group=g["pp_group"])
    if dist.get_rank() == ranks[0]:
        with open(os.path.join(folder, "losses.json"), "w") as fh:
            json.dump({"start": start, "losses": losses, "held_out": held_out}, fh)


def _worker(rank: int, port: int, out: str, families: list[str]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4,
                           timeout=timedelta(seconds=60))
    try:
        groups = _Groups()
        for family in families:
            for phase in _PHASES:
                for ranks, layout in phase:
                    if rank in ranks and (layout not in COMPOSED or family == "qwen2_5_vl"):
                        _run_layout(family, layout, ranks, groups, out)
                dist.barrier()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    from .parity import exit_worker

    exit_worker(0)


def run_lora_parity(out: str, families: tuple[str, ...] = FAMILIES) -> None:
    """Train every family at every layout in one spawned group of 4 processes, writing under ``out``
    (``out/<family>/<layout>/adapter_model.safetensors``, ``adapter_config.json``, ``losses.json``).

    Raises:
        RuntimeError: a worker failed (its traceback on stderr).
    """
    import torch.multiprocessing as mp

    from .parity import _free_port

    try:
        mp.spawn(_worker, args=(_free_port(), out, list(families)), nprocs=4, join=True)
    except mp.ProcessExitedException as exc:
        raise RuntimeError(f"run_lora_parity: a worker failed: {exc}") from exc


def peft_reference(family: str, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor], Any]:
    """PEFT's own model of the tiny ``family`` in this process: ``get_peft_model`` with
    :data:`SETTINGS` over the modules :func:`~ppmedia.pipeline.lora_targets` names, ``lora_A`` from
    :func:`~ppmedia.pipeline.initial_lora_weight`, torch's AdamW and clipping; ``steps`` steps on
    ``build_batch(seed=step)``.

    Returns:
        (the loss of each step, ``peft.get_peft_model_state_dict`` after the last step, the PEFT model).
    """
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from ..pipeline import initial_lora_weight, lora_targets, make_labels
    from ..registry import get_adapter
    from . import tiny_models

    module = tiny_models.load(family)
    model = module.build_model(0)
    targets = lora_targets(model, SETTINGS)
    peft_model = get_peft_model(model, LoraConfig(r=SETTINGS.rank, lora_alpha=SETTINGS.alpha,
                                                  lora_dropout=SETTINGS.dropout, target_modules=targets))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_A." in name:
                key = name.removeprefix("base_model.model.").replace(".lora_A.default.", ".lora_A.")
                param.copy_(initial_lora_weight(key, param.shape, SETTINGS.seed))
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    config, adapter = model.config, get_adapter(model.config)
    losses = []
    for step in range(steps):
        batch = dict(module.build_batch(step))
        labels = make_labels(batch["input_ids"], config, adapter, attention_mask=batch["attention_mask"], shift=False)
        optimizer.zero_grad(set_to_none=True)
        inputs = dict(module.reference_inputs(batch))
        inputs.setdefault("use_cache", False)
        loss = peft_model(**inputs, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        optimizer.step()
        losses.append(float(loss))
    return losses, {k: v.detach().clone() for k, v in get_peft_model_state_dict(peft_model).items()}, peft_model
