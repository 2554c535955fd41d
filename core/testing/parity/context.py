"""Context-parallel parity: pipelines at ``pp x cp`` against the model's own single-process run.

One spawned group of 4 processes (gloo) runs every :data:`CP_SCENARIOS` entry: ``pp2 x cp2`` on the
``(dp, pp, cp, tp)`` mesh, and ``pp1 x cp2`` on each ``cp`` pair of it with a one-rank pipeline group.
Each scenario compares, after one step, the loss (summed over the ``cp`` ranks), every gradient (summed
over ``cp``, tied copies synced) and the logits of the last stage gathered over ``cp`` (all
microbatches, valid positions) with the model's own forward and backward on the whole batch. It also
records whether a media-token run straddles a shard boundary (head-tail chunks of different ranks).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

__all__ = ["CP_SCENARIOS", "CpScenario", "run_context_parity"]


@dataclass(frozen=True)
class CpScenario:
    """One run: a tiny family, a schedule, the pipeline length (2: pp2 x cp2; 1: pp1 x cp2), packed rows."""

    family: str
    schedule: str
    pp: int
    packed: bool = False
    vision: str = "replicate"  # stage 0's tower over cp: "replicate" or "shard" (frame sharding)

    @property
    def name(self) -> str:
        tail = " vision-shard" if self.vision == "shard" else ""
        return f"{self.family}{'/packed' if self.packed else ''} pp{self.pp}xcp2 {self.schedule}{tail}"


#: every scenario of the parity run (the families of docs/context-parallel.md, every schedule at pp1 and pp2)
CP_SCENARIOS: tuple[CpScenario, ...] = (
    CpScenario("qwen2_5_vl", "1f1b", 2),
    CpScenario("qwen3_vl", "ZBVZeroBubble", 2),
    CpScenario("gemma3", "interleaved", 2),
    CpScenario("paligemma", "gpipe", 2),
    CpScenario("llava_next", "1f1b", 2),
    CpScenario("qwen2_5_vl", "gpipe", 2, packed=True),
    CpScenario("qwen2_5_vl", "gpipe", 1),
    CpScenario("gemma3", "1f1b", 1),
    CpScenario("qwen3_vl", "interleaved", 1),
    CpScenario("llava_next", "ZBVZeroBubble", 1),
    CpScenario("qwen2_5_vl", "1f1b", 2, vision="shard"),  # images and videos divided over cp, gathered back
)

N_MICROBATCHES = 2


def _straddles(ids: torch.Tensor, mask: set[int], shard: Any) -> bool:
    """Whether a run of placeholder tokens crosses from one cp rank's chunk into another's."""
    from ...pipeline.context_parallel import padded_length

    S = padded_length(ids.shape[1], shard.size)
    chunk = S // (2 * shard.size)
    owner = [min(k, 2 * shard.size - 1 - k) for k in range(2 * shard.size)]
    for row in ids.tolist():
        for t in range(1, len(row)):
            a, b = (t - 1) // chunk, t // chunk
            if row[t] == row[t - 1] and row[t] in mask and owner[a] != owner[b]:
                return True
    return False


def _count_encoded(modules: list[Any]) -> list[int]:
    """``[patch rows]`` this rank's vision tower encodes in the step (updated by a forward hook; ``[0]``
    on a rank without the tower)."""
    count = [0]
    for module in modules:
        visual = next((m for name, m in module.named_modules() if name.endswith("visual")), None)
        if visual is not None:
            visual.register_forward_hook(lambda mod, args, out: count.__setitem__(0, count[0] + int(args[0].shape[0])))
            break
    return count


def _scenario(sc: CpScenario, shard: Any, pp_group: Any, pp_rank: int) -> dict[str, Any]:
    from ... import packing, pipeline, split_media, stage_media
    from ...registry import get_adapter
    from .. import tiny_models
    from ..packed import in_order_rows, pack_batch

    fam = tiny_models.load(sc.family)
    model, ref = fam.build_model(seed=0).train(), fam.build_model(seed=0).train()
    batch = fam.build_batch(seed=0)
    adapter = get_adapter(model)
    labels = pipeline.make_labels(batch["input_ids"], model.config, adapter, attention_mask=batch["attention_mask"])
    count = pipeline.count_valid_tokens(labels)
    out = ref(**fam.reference_inputs(batch))
    ref_loss = pipeline.pipeline_loss(out.logits, labels, count)
    ref_loss.backward()
    if sc.packed:
        batch = pack_batch(batch, in_order_rows(int(batch["input_ids"].shape[0]), 2), int(getattr(
            model.config.get_text_config(), "pad_token_id", 0) or 0))
        labels = pipeline.make_labels(batch["input_ids"], model.config, adapter, attention_mask=batch["attention_mask"])
    layout = pipeline.schedule_layout(sc.schedule)
    n_stages, idx = layout.n_stages(sc.pp), layout.stage_indices(pp_rank, sc.pp)
    modules = pipeline.build_stage_modules(model, n_stages, stages=idx)
    if sc.packed:
        packing.enable_packing(modules)
    pipeline.enable_context_parallel(modules, shard, vision=sc.vision)
    encoded = _count_encoded(modules)
    stages = pipeline.make_pipeline_stages(modules, n_stages, idx, "cpu", group=pp_group)
    schedule = pipeline.build_schedule(sc.schedule, stages, N_MICROBATCHES, loss_fn=pipeline.context_loss(shard))
    staged = split_media(batch, N_MICROBATCHES, **adapter.media_counts(batch, model.config))
    first = next((s for s in stages if s.is_first), None)
    losses: list[torch.Tensor] = []
    with stage_media(first, staged) if first is not None else contextlib.nullcontext():
        logits = schedule.step(batch["input_ids"], batch["attention_mask"], target=labels, losses=losses,
                               loss_kwargs={"num_valid_tokens": count}, return_outputs=True)
    pipeline.reduce_context_gradients(modules, shard.group)
    pipeline.sync_tied_gradients(modules, modules[0].tied, group=pp_group)
    result: dict[str, Any] = {"scenario": sc.name, "ref_loss": float(ref_loss.detach()), "encoded": encoded[0]}
    if losses:
        total = torch.stack([loss.detach() for loss in losses]).sum().double().reshape(1)
        torch.distributed.all_reduce(total, group=shard.group)
        result["loss"] = float(total)
        if not sc.packed:  # packed rows hold other rows than the model's batch
            full = shard.gather(logits.detach(), 1)[:, : batch["input_ids"].shape[1]]
            valid = batch["attention_mask"].bool()
            result["logits"] = float((full[valid] - out.logits.detach()[valid]).abs().max())
    own = dict(ref.named_parameters())
    worst, where, compared = 0.0, "", 0
    for module in modules:
        for name, param in module.named_parameters():
            if name not in own:
                continue
            mine = param.grad if param.grad is not None else torch.zeros_like(param)
            theirs = own[name].grad if own[name].grad is not None else torch.zeros_like(param)
            diff = float((mine - theirs).abs().max())
            compared += 1
            if diff >= worst:
                worst, where = diff, name
    result.update(grad=worst, grad_name=where, compared=compared)
    token_ids = {int(v) for k, v in model.config.to_dict().items() if k in ("image_token_id", "video_token_id",
                                                                            "image_token_index") and v is not None}
    result["straddles"] = _straddles(batch["input_ids"], token_ids, shard)
    return result


def _worker(rank: int, world: int, port: int, out_dir: str, scenarios: tuple[CpScenario, ...]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        from ...pipeline import ContextShard, pipeline_mesh

        mesh = pipeline_mesh(2, 1, 1, cp=2)  # rank = pp_rank * 2 + cp_rank
        shard = ContextShard(2, mesh["cp"].get_local_rank(), mesh["cp"].get_group())
        singles = [dist.new_group([r]) for r in range(world)]  # pp1: each rank its own pipeline
        results = []
        for sc in scenarios:
            if sc.pp == 2:
                results.append(_scenario(sc, shard, mesh["pp"].get_group(), mesh["pp"].get_local_rank()))
            else:
                results.append(_scenario(sc, shard, singles[rank], 0))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump(results, fh)
    finally:
        dist.destroy_process_group()


def run_context_parity(out_dir: str, scenarios: tuple[CpScenario, ...] = CP_SCENARIOS) -> list[list[dict[str, Any]]]:
    """Spawn the 4 processes, run ``scenarios`` in each, return every rank's results (a list per rank)."""
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    mp.spawn(_worker, args=(4, port, out_dir, scenarios), nprocs=4)
    out = []
    for rank in range(4):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as fh:
            out.append(json.load(fh))
    return out
