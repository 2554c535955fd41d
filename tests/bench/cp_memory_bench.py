"""Saved activations per rank under context parallelism: pp2 x cp2 against pp2 x cp1 (gloo on 127.0.0.1).

One spawn of 4 processes on the ``(dp, pp, cp, tp)`` mesh (``rank = pp_rank * 2 + cp_rank``) builds
both pipelines: pp2 x cp2 on all 4 ranks (``enable_context_parallel``, the gathered attention) and
pp2 x cp1 on the cp-rank-0 pipeline (ranks 0 and 2; ranks 1 and 3 wait at a barrier meanwhile), each
from its own copy of the same seeded model.

Model: Qwen2.5-VL built from a config (no download), tiny but wide enough that the decoder's
activations dominate: text hidden 256, MLP 1024, 4 decoder layers (2 a stage), 4 heads over 2 KV heads,
the tiny family's vocabulary (128) and vision tower. Batch: 2 rows of ``S = 4096`` tokens (one 8 x 8
patch image each, the rest text), 2 microbatches, 1F1B.

Counted: every tensor autograd saves for the backward during one training step's forwards
(``torch.autograd.graph.saved_tensors_hooks``), each storage once, parameters (and views of them) left
out, nothing saved inside a backward (the gathered attention's recomputation, transient) counted. The
counted step follows a warm-up step of each side. ``R = the decoder stage's (stage 1) largest cp rank
at pp2 x cp2 / the same stage at pp2 x cp1`` (goal ``<= 0.60``); stage 0, which embeds and merges the
media on the full row and runs the vision tower replicated over cp, is reported beside it. Step times:
forward + backward + the cp gradient sum (no optimizer), medians of ``REPS`` steps alternated side by
side, the slower rank's.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from datetime import timedelta
from typing import Any

import torch

from spawned import spawn_ranks, write_result

PP, CP = 2, 2
SEQ = 4096
LAYERS = 4
N_MICROBATCHES = 2
REPS = 3
TARGET_R = 0.60
SIDES = ("cp2", "cp1")


def build_config() -> Any:
    """The wide tiny Qwen2.5-VL (see the module docstring)."""
    from transformers import Qwen2_5_VLConfig

    from ppmedia.testing.tiny_models import qwen2_5_vl as tiny

    tower = tiny.build_config().vision_config.to_dict()
    tower["out_hidden_size"] = 256
    text = {
        "vocab_size": tiny.VOCAB, "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": LAYERS,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": SEQ,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [8, 12, 12]},  # head_dim 64
        "pad_token_id": tiny.PAD_TOKEN_ID, "bos_token_id": tiny.BOS_TOKEN_ID, "eos_token_id": tiny.EOS_TOKEN_ID,
    }
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=tower, image_token_id=tiny.IMAGE_TOKEN_ID, video_token_id=tiny.VIDEO_TOKEN_ID,
        vision_start_token_id=tiny.VISION_START_TOKEN_ID, vision_end_token_id=tiny.VISION_END_TOKEN_ID,
    )


def build_batch() -> dict[str, torch.Tensor]:
    """2 rows of ``SEQ`` tokens: BOS, 2 words, an 8 x 8 patch image (16 tokens between its markers), text, EOS."""
    from ppmedia.testing.tiny_models import qwen2_5_vl as tiny
    from ppmedia.testing.tiny_models._qwen import grid_batch

    rest = SEQ - 1 - 2 - 18 - 1
    samples = ((2, ("image", (1, 8, 8)), rest), (2, ("image", (1, 8, 8)), rest))
    batch = grid_batch(samples, 0, family=tiny.MODEL_TYPE, patch_dim=tiny.PATCH_DIM, merge=tiny.MERGE,
                       video_steps=False, seq_len=SEQ)
    return {key: value for key, value in batch.items() if "video" not in key}  # images only


class SavedBytes:
    """``saved_tensors_hooks`` that count the bytes saved for the backward outside any backward, each
    storage once (held until :meth:`reset`, so no address is reused), parameters' storages excluded."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self.skip = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}
        self.held: dict[int, Any] = {}
        self.bytes = 0

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if torch._C._current_graph_task_id() == -1 and tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self.skip and ptr not in self.held:
                self.held[ptr] = storage
                self.bytes += storage.nbytes()
        return tensor

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def reset(self) -> None:
        self.held.clear()
        self.bytes = 0


def _side(mesh: Any, cp: int) -> dict[str, Any]:
    from ppmedia import pipeline, split_media
    from ppmedia.registry import get_adapter
    from ppmedia.testing.tiny_models import seeded
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = seeded(Qwen2_5_VLForConditionalGeneration, build_config(), 0).train()
    adapter = get_adapter(model)
    pp_rank = mesh["pp"].get_local_rank()
    shard = pipeline.ContextShard(cp, mesh["cp"].get_local_rank() if cp > 1 else 0,
                                  mesh["cp"].get_group() if cp > 1 else None)
    modules = pipeline.build_stage_modules(model, PP, stages=[pp_rank])
    pipeline.enable_context_parallel(modules, shard)
    stages = pipeline.make_pipeline_stages(modules, PP, [pp_rank], "cpu", group=mesh["pp"].get_group())
    schedule = pipeline.build_schedule("1f1b", stages, N_MICROBATCHES, loss_fn=pipeline.context_loss(shard))
    batch = build_batch()
    labels = pipeline.make_labels(batch["input_ids"], model.config, adapter, attention_mask=batch["attention_mask"])
    return {"modules": modules, "schedule": schedule, "shard": shard, "first": stages[0] if stages[0].is_first else None,
            "batch": batch, "labels": labels, "count": pipeline.count_valid_tokens(labels),
            "staged": split_media(batch, N_MICROBATCHES, **adapter.media_counts(batch, model.config)),
            "counter": SavedBytes(modules)}


def _step(side: dict[str, Any], counting: bool) -> float:
    from ppmedia import pipeline, stage_media

    for module in side["modules"]:
        module.zero_grad(set_to_none=True)
    batch, first, counter = side["batch"], side["first"], side["counter"]
    counter.reset()
    started = time.perf_counter()
    with contextlib.ExitStack() as scope:
        if first is not None:
            scope.enter_context(stage_media(first, side["staged"]))
        if counting:
            scope.enter_context(counter.hooks())
        side["schedule"].step(batch["input_ids"], batch["attention_mask"], target=side["labels"], losses=[],
                              loss_kwargs={"num_valid_tokens": side["count"]})
    if side["shard"].size > 1:
        pipeline.reduce_context_gradients(side["modules"], side["shard"].group)
    elapsed = time.perf_counter() - started
    held = counter.bytes
    counter.reset()
    return held if counting else elapsed


def _worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    import torch.distributed as dist

    from ppmedia import pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        mesh = pipeline.pipeline_mesh(PP, cp=CP)
        in_cp1 = mesh["cp"].get_local_rank() == 0  # ranks 0 and 2 run the pp2 x cp1 pipeline
        sides = {"cp2": _side(mesh, CP), **({"cp1": _side(mesh, 1)} if in_cp1 else {})}
        saved: dict[str, int] = {}
        times: dict[str, list[float]] = {name: [] for name in sides}
        for rep in range(REPS + 2):  # a warm-up step, a counted step, then the timed ones, side by side
            for name in SIDES:
                dist.barrier()
                if name not in sides:
                    continue
                if rep == 1:
                    saved[name] = int(_step(sides[name], counting=True))
                else:
                    elapsed = _step(sides[name], counting=False)
                    if rep > 1:
                        times[name].append(elapsed)
        write_result(out_dir, rank, {"rank": rank, "stage": mesh["pp"].get_local_rank(), "saved": saved,
                                     "step_s": {name: statistics.median(ts) for name, ts in times.items()}})
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run() -> dict[str, Any]:
    """Spawn the 4 ranks; per stage the largest saved bytes of each side, ``R`` (stage 1), stage 0's ratio
    and both step times (the slower rank's median)."""
    ranks = spawn_ranks(_worker, PP * CP, "ppmedia-cp-memory-")
    stages: dict[int, dict[str, int]] = {}
    for r in ranks:
        for name, value in r["saved"].items():
            stage = stages.setdefault(r["stage"], {})
            stage[name] = max(stage.get(name, 0), value)
    ratio = {stage: held["cp2"] / held["cp1"] for stage, held in stages.items()}
    return {"pp": PP, "cp": CP, "seq": SEQ, "layers": LAYERS, "ranks": ranks, "saved": stages,
            "R": ratio[1], "stage0_ratio": ratio[0], "target": TARGET_R,
            "step_s": {side: max(r["step_s"][side] for r in ranks if side in r["step_s"]) for side in SIDES}}


def report(result: dict[str, Any]) -> str:
    lines = [f"cp memory: saved activations per rank, pp2 x cp2 vs pp2 x cp1 (S = {result['seq']}, "
             f"{result['layers']} decoder layers, 2 microbatches, 1F1B)"]
    for stage in sorted(result["saved"], key=int):
        held = result["saved"][stage]
        lines.append(f"  stage {stage}: cp1 {held['cp1'] / 2**20:.1f} MiB, cp2 {held['cp2'] / 2**20:.1f} MiB "
                     f"(largest cp rank), ratio {held['cp2'] / held['cp1']:.3f}")
    step = result["step_s"]
    lines.append(f"  step time (forward + backward): pp2 x cp1 {step['cp1'] * 1e3:.0f} ms, "
                 f"pp2 x cp2 {step['cp2'] * 1e3:.0f} ms")
    lines.append(f"cp-memory: saved activations per rank at pp2 x cp2 / pp2 x cp1 = {result['R']:.3f} "
                 f"(decoder stage; stage 0: {result['stage0_ratio']:.3f}) (goal <= {result['target']})")
    return "\n".join(lines)
