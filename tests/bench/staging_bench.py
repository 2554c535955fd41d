"""Split + stage + consume of one batch: ppmedia, NeMo Automodel 0.7.0 and the floor, side by side.

The batch is Qwen-like: flat patch rows ``pixel_values`` ``[patches, 1176]`` (1176 = 3 channels x 2
frames x 14 x 14 pixels, Qwen2.5-VL's row width), ``image_grid_thw`` ``[images, 3]`` with ``t = 1`` and
even ``h, w`` in 2..16 patches, 0-2 images per sample, and ``n_images_per_sample`` ``[B]`` (Automodel
needs it to map images to samples; ppmedia reads it too). Pixel contents are never read by either side,
so the pixel tensor is allocated uninitialised. Every microbatch holds at least one image (a
microbatch whose samples all drew 0 gets one image on its first sample): Automodel's consumers do not
advance their cursor on a text-only microbatch, and the sides are compared on work both do correctly.

The three sides, each timed from the collated batch to the last microbatch's media in hand:

* ``ppmedia``: ``split_media`` + ``stage_media`` on the first stage's module + ``n`` calls of
  ``next_vlm_media_chunk``;
* ``automodel``: ``prepare_vlm_media_for_pp`` + ``stage_vlm_media_for_pp`` (its own staging context,
  given a minimal stand-in for its ``pp`` object) + ``n`` calls of :func:`automodel_consume`, a
  faithful minimal copy of the consumer its model code inlines;
* ``floor``: what any implementation has to do at least: one host read of the same integer metadata
  and one view per microbatch and media tensor (the offsets are precomputed, untimed).
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import torch

import ppmedia
from ppmedia import HostReadCounter, next_vlm_media_chunk, split_media, stage_media

from timing import Side, interleaved

__all__ = ["automodel_consume", "qwen_like_batch", "run_chunk_call", "run_split_stage_consume", "stage_like_automodel"]

#: Qwen2.5-VL's ids (only the image one matters here).
IMAGE_TOKEN_ID = 151655
VISION_START_TOKEN_ID = 151652
VISION_END_TOKEN_ID = 151653
PAD_TOKEN_ID = 151643
PATCH_DIM = 3 * 2 * 14 * 14
MERGE = 2
TEXT_TOKENS = 4


def qwen_like_batch(batch_size: int, n_microbatches: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A collated Qwen-like batch (see the module docstring), deterministic for ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 3, (batch_size,), generator=gen)
    for rows in torch.tensor_split(torch.arange(batch_size), n_microbatches):
        if int(counts[rows].sum()) == 0:
            counts[rows[0]] = 1
    images = int(counts.sum())
    hw = torch.randint(1, 9, (images, 2), generator=gen) * 2
    grid = torch.cat([torch.ones(images, 1, dtype=torch.int64), hw], dim=1)
    tokens = (grid.prod(dim=-1) // (MERGE * MERGE)).tolist()
    sequences: list[list[int]] = []
    image = 0
    for count in counts.tolist():
        ids = [PAD_TOKEN_ID + 1] * TEXT_TOKENS
        for _ in range(count):
            ids += [VISION_START_TOKEN_ID] + [IMAGE_TOKEN_ID] * tokens[image] + [VISION_END_TOKEN_ID]
            image += 1
        sequences.append(ids)
    seq = max(len(ids) for ids in sequences)
    input_ids = torch.full((batch_size, seq), PAD_TOKEN_ID, dtype=torch.int64)
    for i, ids in enumerate(sequences):
        input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    rows = int(grid.prod(dim=-1).sum())
    return {
        "input_ids": input_ids,
        "attention_mask": (input_ids != PAD_TOKEN_ID).to(torch.int64),
        "pixel_values": torch.empty(rows, PATCH_DIM, dtype=torch.float32),
        "image_grid_thw": grid,
        "n_images_per_sample": counts,
    }


# ------------------------------------------------------------------------------------------------
# the three sides


def ppmedia_side(batch: dict[str, Any], n: int, module: torch.nn.Module) -> list[Any]:
    staged = split_media(batch, n)
    taken = []
    with stage_media(module, staged):
        for _ in range(n):
            taken.append(next_vlm_media_chunk(module))
    return taken


def automodel_consume(module: torch.nn.Module, input_ids: torch.Tensor, image_token_id: int) -> tuple[Any, Any]:
    """One microbatch's media, taken the way Automodel 0.7.0's model code takes them inline.

    A minimal, faithful copy of the pattern its first-stage forwards inline (e.g.
    ``components/models/kimi_k25_vl/model.py`` and the Gemma/Mistral forwards in
    ``components/distributed/pipelining/hf_utils.py``; the Qwen3-VL forwards do the same per
    modality): only when ``pixel_values`` was not passed and chunks are staged, test the microbatch's
    ``input_ids`` for image tokens (``(input_ids == image_token_id).any()`` used in an ``if``: one host
    read per microbatch); if there are any, read the cursor ``_vlm_chunk_idx``, take entry ``idx`` of
    ``_vlm_pixel_values_chunks`` and ``_vlm_image_grid_hws_chunks``, turn an ``[N, 2]`` grid into
    ``[N, 3]`` by prepending ``t = 1`` (a new tensor; the grids here are already ``[N, 3]``, passed
    through as in the models), and advance the cursor. Only then would the model run its encoder.

    Returns:
        ``(pixel_values, image_grid_thw)`` handed to the model (``None``, ``None`` for none).
    """
    pixel_values = None
    image_grid_thw = None
    if getattr(module, "_vlm_pixel_values_chunks", None) is not None:
        has_media_tokens = input_ids is not None and (input_ids == image_token_id).any()
        if has_media_tokens:
            chunk_idx = getattr(module, "_vlm_chunk_idx", 0)
            if chunk_idx < len(module._vlm_pixel_values_chunks):
                pixel_values = module._vlm_pixel_values_chunks[chunk_idx]
                image_grid_hws = module._vlm_image_grid_hws_chunks[chunk_idx]
                if image_grid_hws.shape[-1] == 2:
                    ones = torch.ones(
                        image_grid_hws.shape[0], 1, dtype=image_grid_hws.dtype, device=image_grid_hws.device
                    )
                    image_grid_thw = torch.cat([ones, image_grid_hws], dim=-1)
                else:
                    image_grid_thw = image_grid_hws
                module._vlm_chunk_idx = chunk_idx + 1
    return pixel_values, image_grid_thw


def automodel_pp_stub() -> Any:
    """The attributes of Automodel's ``pp`` object that ``stage_vlm_media_for_pp`` reads.

    A first stage on this rank, and no schedule (so no shape-inference forward hook is registered,
    matching ppmedia's bare-module staging, which installs no hook either).
    """
    return types.SimpleNamespace(info=types.SimpleNamespace(has_first_stage=True, schedule=None, stages=[]))


def automodel_side(
    ref: Any, batch: dict[str, Any], batch_size: int, n: int, module: torch.nn.Module, pp: Any, ids: list[torch.Tensor]
) -> list[Any]:
    ref.prepare_vlm_media_for_pp(batch, batch_size=batch_size, n_microbatches=n)
    taken = []
    with ref.stage_vlm_media_for_pp(pp, [module], batch):
        for k in range(n):
            taken.append(automodel_consume(module, ids[k], IMAGE_TOKEN_ID))
    return taken


def floor_side(batch: dict[str, Any], row_ranges: list[tuple[int, int]], image_ranges: list[tuple[int, int]]) -> list[Any]:
    pixels, grid = batch["pixel_values"], batch["image_grid_thw"]
    torch.cat([batch["n_images_per_sample"], grid.reshape(-1)]).tolist()  # the one host read
    return [pixels[a:b] for a, b in row_ranges] + [grid[a:b] for a, b in image_ranges]


# ------------------------------------------------------------------------------------------------


def _storages(batch: dict[str, Any]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in batch.values() if isinstance(t, torch.Tensor)}


def _copied_bytes(tensors: list[torch.Tensor | None], storages: set[int]) -> int:
    return sum(
        t.numel() * t.element_size()
        for t in tensors
        if t is not None and t.untyped_storage().data_ptr() not in storages
    )


def _same_view(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return (a is None or a.numel() == 0) and (b is None or b.numel() == 0)
    return a.shape == b.shape and a.data_ptr() == b.data_ptr() and a.stride() == b.stride()


def run_split_stage_consume(ref: Any | None, batch_size: int, n: int, repeats: int) -> dict[str, Any]:
    """One (B, n) configuration: timings (medians, seconds), host reads, bytes copied, cross-check."""
    batch = qwen_like_batch(batch_size, n)
    ids = list(batch["input_ids"].tensor_split(n))  # the schedule's per-microbatch input_ids
    module = torch.nn.Module()
    am_module = torch.nn.Module()
    pp = automodel_pp_stub()

    # Untimed: the floor's offsets, and a check that the floor's views are ppmedia's.
    reference = split_media(dict(batch), n)
    row_ranges = list(reference.ranges["pixel_values"])
    image_ranges = list(reference.ranges["image_grid"])

    sides = {
        "floor": Side(lambda b: floor_side(b, row_ranges, image_ranges), prepare=lambda: dict(batch)),
        "ppmedia": Side(lambda b: ppmedia_side(b, n, module), prepare=lambda: dict(batch)),
    }
    if ref is not None:
        sides["automodel"] = Side(
            lambda b: automodel_side(ref, b, batch_size, n, am_module, pp, ids), prepare=lambda: dict(batch)
        )
    timings = interleaved(sides, repeats=repeats, warmup=max(3, repeats // 20))

    storages = _storages(batch)
    with HostReadCounter() as reads:
        chunks = ppmedia_side(dict(batch), n, module)
    pp_tensors = [
        getattr(c, f) for c in chunks if c is not None for f in ("pixel_values", "image_grid", "pixel_values_videos", "video_grid")
    ]
    result: dict[str, Any] = {
        "batch_size": batch_size,
        "n_microbatches": n,
        "images": int(batch["image_grid_thw"].shape[0]),
        "patch_rows": int(batch["pixel_values"].shape[0]),
        "median_s": {name: timings.median(name) for name in sides},
        "ppmedia_over_floor": timings.ratio("ppmedia", "floor"),
        "host_reads": {"floor": 1, "ppmedia": reads.total},
        "host_read_kinds": {"ppmedia": dict(reads.counts)},
        "bytes_copied": {"floor": 0, "ppmedia": _copied_bytes(pp_tensors, storages)},
        "ppmedia_chunks_share_storage": all(
            t.untyped_storage().data_ptr() in storages for t in pp_tensors if t is not None
        ),
    }
    if ref is not None:
        with HostReadCounter() as am_reads:
            am_chunks = automodel_side(ref, dict(batch), batch_size, n, am_module, pp, ids)
        am_tensors = [t for pair in am_chunks for t in pair]
        result["automodel_over_ppmedia"] = timings.ratio("automodel", "ppmedia")
        result["host_reads"]["automodel"] = am_reads.total
        result["host_read_kinds"]["automodel"] = dict(am_reads.counts)
        result["bytes_copied"]["automodel"] = _copied_bytes(am_tensors, storages)
        result["same_chunks_as_automodel"] = all(
            _same_view(None if c is None else c.pixel_values, pv) and _same_view(None if c is None else c.image_grid, g)
            for c, (pv, g) in zip(chunks, am_chunks, strict=True)
        )
    return result


def stage_like_automodel(module: torch.nn.Module, staged: Any, later_step: bool = False) -> None:
    """Set what Automodel 0.7.0's ``stage_vlm_media_for_pp`` sets for an image batch, by hand.

    Its five image-side lists (three of them ``None`` here) and the cursor. On its first step the video
    lists are not set at all; from the second step on they are ``None`` (its first step's exit set all
    seven to ``None``), so only ``second_per_grid_ts`` is absent. Used when the Automodel reference is
    not installed.
    """
    chunks = staged.chunks
    if later_step:
        module._vlm_pixel_values_videos_chunks = None
        module._vlm_video_grid_thw_chunks = None
    module._vlm_pixel_values_chunks = chunks["pixel_values"]
    module._vlm_image_grid_hws_chunks = chunks["image_grid"]
    module._vlm_num_patches_chunks = None
    module._vlm_patch_pixel_values_chunks = None
    module._vlm_patch_newline_mask_chunks = None
    module._vlm_chunk_idx = 0


def _stage_partial(stack: contextlib.ExitStack, ref: Any | None, batch: dict[str, Any], n: int,
                   module: torch.nn.Module, later_step: bool) -> str:
    """Stage ``batch`` on ``module`` as Automodel does (on its first step, or a later one); who staged it."""
    if ref is None:
        stage_like_automodel(module, split_media(dict(batch), n), later_step)
        return "by hand, in automodel's layout (reference not installed)"
    batch_size = batch["input_ids"].shape[0]
    if later_step:  # one whole step before: its exit leaves the seven lists set to None
        first = ref.prepare_vlm_media_for_pp(dict(batch), batch_size=batch_size, n_microbatches=n)
        with ref.stage_vlm_media_for_pp(automodel_pp_stub(), [module], first):
            pass
    am_batch = ref.prepare_vlm_media_for_pp(dict(batch), batch_size=batch_size, n_microbatches=n)
    stack.enter_context(ref.stage_vlm_media_for_pp(automodel_pp_stub(), [module], am_batch))
    return "with automodel's stage_vlm_media_for_pp"


def run_chunk_call(ref: Any | None, batch_size: int, n: int, repeats: int) -> dict[str, Any]:
    """One consumer call per microbatch (seconds, median), four sides interleaved.

    * ``ppmedia_full``: ``next_vlm_media_chunk`` on ppmedia's own staging (every list set);
    * ``ppmedia_partial``: ``next_vlm_media_chunk`` on Automodel's first-step staging, which sets only
      some lists (the video lists and ``second_per_grid_ts`` are absent from the module);
    * ``ppmedia_partial_later``: the same on Automodel's staging of a later step (only
      ``second_per_grid_ts`` absent: the first step's exit set the other lists to ``None``);
    * ``anchor``: :func:`automodel_consume`, the consumer Automodel inlines, on the first-step module.

    ``partial_staged_by`` says who staged the partial modules: Automodel's ``stage_vlm_media_for_pp``
    when the reference is installed, else :func:`stage_like_automodel` (the same attributes, by hand).
    """
    batch = qwen_like_batch(batch_size, n)
    ids = list(batch["input_ids"].tensor_split(n))
    cursor = ppmedia.CURSOR_ATTRIBUTE
    own, partial, later = torch.nn.Module(), torch.nn.Module(), torch.nn.Module()

    def rewinder(module: torch.nn.Module) -> Any:
        def rewind() -> bool:
            module.__dict__[cursor] = 0
            return True

        return rewind

    def take_all(module: torch.nn.Module) -> None:
        take = next_vlm_media_chunk
        for _ in range(n):
            take(module)

    def anchor_all() -> None:
        for k in range(n):
            automodel_consume(partial, ids[k], IMAGE_TOKEN_ID)

    sides = {
        "ppmedia_full": Side(lambda _: take_all(own), prepare=rewinder(own), divide=n),
        "ppmedia_partial": Side(lambda _: take_all(partial), prepare=rewinder(partial), divide=n),
        "ppmedia_partial_later": Side(lambda _: take_all(later), prepare=rewinder(later), divide=n),
        "anchor": Side(lambda _: anchor_all(), prepare=rewinder(partial), divide=n),
    }
    with contextlib.ExitStack() as stack:
        stack.enter_context(stage_media(own, split_media(dict(batch), n)))
        staged_by = _stage_partial(stack, ref, batch, n, partial, later_step=False)
        _stage_partial(stack, ref, batch, n, later, later_step=True)
        absent = [name for name in ppmedia.STAGED_ATTRIBUTES.values() if name not in partial.__dict__]
        absent_later = [name for name in ppmedia.STAGED_ATTRIBUTES.values() if name not in later.__dict__]
        timings = interleaved(sides, repeats=repeats, warmup=20)
        own.__dict__[cursor] = n  # stage_media checks that every microbatch was consumed
    return {
        "batch_size": batch_size,
        "n_microbatches": n,
        "partial_staged_by": staged_by,
        "partial_absent_lists": absent,
        "partial_later_absent_lists": absent_later,
        "median_s_per_call": {name: timings.median(name) for name in sides},
        "partial_over_anchor": timings.ratio("ppmedia_partial", "anchor"),
        "partial_later_over_anchor": timings.ratio("ppmedia_partial_later", "anchor"),
        "partial_over_full": timings.ratio("ppmedia_partial", "ppmedia_full"),
    }
