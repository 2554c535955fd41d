"""Adapter overhead and the whole first stage, on the four tiny seeded models (``ppmedia.testing.tiny_models``).

Each family's 8-sample tiny batch is split in 4 microbatches (``torch.tensor_split`` rows 2, 2, 2, 2;
microbatch 2 is text-only). Everything runs under ``torch.no_grad()``.

* ``merge``: ``adapter.merge`` on every media-bearing microbatch, against the **direct** call on the
  same microbatch: the model's own ``get_image_features`` (``get_video_features`` for Qwen videos),
  ``torch.cat`` of its ``pooler_output`` as the model's forward does, and ``masked_scatter`` into the
  placeholder positions (``input_ids == image_token_id``). The direct side is handed the media in
  the model's own argument form, prepared untimed (Qwen/Kimi ``image_grid_thw``, LLaVA-NeXT
  ``image_sizes``, Step3 ``num_local_patches`` per image); the adapter starts from the
  :class:`~ppmedia.VlmMediaChunk` and checks feature counts against placeholders (one host read).
  For context, ``model_checked_ratio`` sets ``adapter.merge`` against the merge of the model's own
  forward: the encoder, then ``get_placeholder_mask`` (its count check, one host read, after the
  encoder), then ``masked_scatter``.
* ``first stage``: embedding + media merge of the whole batch, microbatch by microbatch.
  *With* ppmedia: ``adapter.media_per_sample`` + ``split_media`` + ``stage_media`` on the model, then
  per microbatch the embedding, ``next_vlm_media_chunk`` and ``adapter.merge``. *Without*: the caller
  counts media per sample from the tokens, reads counts (and grid products) to the host once, slices
  the media by hand per microbatch and calls the direct merge above.
"""

from __future__ import annotations

import importlib
import statistics
import time
from typing import Any, Callable

import torch
from torch import Tensor

import ppmedia
from ppmedia import HostReadCounter, next_vlm_media_chunk, split_media, stage_media
from ppmedia.testing.tiny_models import FAMILIES, load

from timing import Side, interleaved

__all__ = ["FamilySetup", "run_first_stage", "run_merge", "setup_family"]

N_MICROBATCHES = 4

_ADAPTERS = {
    "qwen2_5_vl": ("ppmedia.adapters.qwen2_5_vl", "Qwen2_5_VLAdapter"),
    "llava_next": ("ppmedia.adapters.llava_next", "LlavaNextAdapter"),
    "step3": ("ppmedia.adapters.step3", "Step3Adapter"),
    "kimi_vl": ("ppmedia.adapters.kimi_vl", "KimiVLAdapter"),
    "gemma3": ("ppmedia.adapters.gemma3", "Gemma3Adapter"),
    "mistral3": ("ppmedia.adapters.mistral3", "Mistral3Adapter"),
}


def _adapter(family: str) -> Any:
    module, name = _ADAPTERS[family]
    return getattr(importlib.import_module(module), name)()


def _bounds(batch_size: int, n: int) -> list[int]:
    """Sample offsets of ``torch.tensor_split(range(B), n)``, written out by hand."""
    q, r = divmod(batch_size, n)
    out = [0]
    for k in range(n):
        out.append(out[-1] + q + (1 if k < r else 0))
    return out


def _offsets(sizes: list[int]) -> list[int]:
    out = [0]
    for size in sizes:
        out.append(out[-1] + size)
    return out


def _scatter(embeds: Tensor, input_ids: Tensor, token_id: int, features: Tensor) -> Tensor:
    mask = (input_ids == token_id).unsqueeze(-1).expand_as(embeds)
    return embeds.masked_scatter(mask, features.to(embeds.dtype))


# ------------------------------------------------------------------------------------------------
# per family: the direct merge (model's own encoder + masked_scatter) and the hand split


def _features_qwen(model: Any, media: dict[str, Any]) -> dict[str, Tensor]:
    inner, out = model.model, {}
    if "image" in media:
        pixels, grid = media["image"]
        out["image"] = torch.cat(inner.get_image_features(pixels, grid, return_dict=True).pooler_output, dim=0)
    if "video" in media:
        pixels, grid = media["video"]
        out["video"] = torch.cat(inner.get_video_features(pixels, grid, return_dict=True).pooler_output, dim=0)
    return out


def _features_llava(model: Any, media: dict[str, Any]) -> dict[str, Tensor]:
    out = model.model.get_image_features(media["pixel_values"], media["image_sizes"], return_dict=True)
    return {"image": torch.cat(out.pooler_output, dim=0)}


def _features_step3(model: Any, media: dict[str, Any]) -> dict[str, Tensor]:
    out = model.model.get_image_features(
        pixel_values=media["pixel_values"],
        pixel_values_local=media["pixel_values_local"],
        num_local_patches=media["num_local_patches"],
        return_dict=True,
    )
    return {"image": torch.cat(out.pooler_output, dim=0)}


def _features_kimi(model: Any, media: dict[str, Any]) -> dict[str, Tensor]:
    out = model.model.get_image_features(media["pixel_values"], image_grid_thw=media["image_grid_thw"], return_dict=True)
    return {"image": torch.cat(out.pooler_output, dim=0)}


def _features_gemma3(model: Any, media: dict[str, Any]) -> dict[str, Tensor]:
    features = model.model.get_image_features(media["pixel_values"], return_dict=True).pooler_output
    return {"image": features.reshape(-1, features.shape[-1])}


def _features_mistral3(model: Any, media: dict[str, Any]) -> dict[str, Tensor]:
    out = model.model.get_image_features(media["pixel_values"], media["image_sizes"], return_dict=True)
    return {"image": torch.cat(out.pooler_output, dim=0)}


_FEATURES: dict[str, Callable[[Any, dict[str, Any]], dict[str, Tensor]]] = {
    "qwen2_5_vl": _features_qwen,
    "llava_next": _features_llava,
    "step3": _features_step3,
    "kimi_vl": _features_kimi,
    "gemma3": _features_gemma3,
    "mistral3": _features_mistral3,
}


def _direct(family: str, model: Any, input_ids: Tensor, embeds: Tensor, media: dict[str, Any]) -> Tensor:
    """The model's own encoder + ``masked_scatter`` at ``input_ids == token`` (no count check)."""
    for modality, feats in _FEATURES[family](model, media).items():
        token = model.config.image_token_id if modality == "image" else model.config.video_token_id
        embeds = _scatter(embeds, input_ids, token, feats)
    return embeds


def _checked(family: str, model: Any, input_ids: Tensor, embeds: Tensor, media: dict[str, Any]) -> Tensor:
    """As the model's own forward merges: encoder, then ``get_placeholder_mask`` (which checks the
    placeholder count against the features, with a host read, after the encoder ran), then
    ``masked_scatter``."""
    feats = _FEATURES[family](model, media)
    inner = model.model
    if family in ("qwen2_5_vl", "kimi_vl"):
        masks = dict(zip(("image", "video"), inner.get_placeholder_mask(
            input_ids, embeds, image_features=feats.get("image"), video_features=feats.get("video"))))
    else:
        masks = {"image": inner.get_placeholder_mask(input_ids, embeds, feats["image"])}
    for modality, f in feats.items():
        embeds = embeds.masked_scatter(masks[modality], f.to(embeds.dtype))
    return embeds


def _native_from_chunk(family: str, chunk: ppmedia.VlmMediaChunk, input_ids: Tensor, config: Any) -> dict[str, Any]:
    """The chunk's media in the model's own argument form (untimed preparation of the direct side)."""
    if family == "qwen2_5_vl":
        media: dict[str, Any] = {}
        if chunk.pixel_values is not None:
            media["image"] = (chunk.pixel_values, chunk.image_grid)
        if chunk.pixel_values_videos is not None:
            media["video"] = (chunk.pixel_values_videos, chunk.video_grid)
        return media
    if family == "llava_next":
        return {"pixel_values": chunk.pixel_values, "image_sizes": chunk.image_grid}
    if family == "step3":
        has_image = (input_ids == config.image_token_id).any(dim=-1).tolist()
        crops = chunk.num_patches.tolist()
        return {
            "pixel_values": chunk.pixel_values,
            "pixel_values_local": chunk.patch_pixel_values,
            "num_local_patches": [c for c, h in zip(crops, has_image) if h],
        }
    if family == "gemma3":
        return {"pixel_values": chunk.pixel_values}
    if family == "mistral3":
        return {"pixel_values": chunk.pixel_values, "image_sizes": chunk.image_grid}
    grid = chunk.image_grid
    thw = torch.cat([grid.new_ones((grid.shape[0], 1)), grid], dim=1) if grid.shape[1] == 2 else grid
    return {"pixel_values": chunk.pixel_values, "image_grid_thw": thw}


def _runs(mask: Tensor) -> Tensor:
    """Per row, the number of runs of True (an image is one run of its placeholder tokens)."""
    starts = mask.clone()
    starts[:, 1:] &= ~mask[:, :-1]
    return starts.sum(dim=1)


def _hand_qwen(model: Any, batch: dict[str, Tensor], n: int) -> list[dict[str, Any] | None]:
    config, ids = model.config, batch["input_ids"]
    opens, following = ids[:, :-1] == config.vision_start_token_id, ids[:, 1:]
    images = (opens & (following == config.image_token_id)).sum(dim=1)
    videos = (opens & (following == config.video_token_id)).sum(dim=1)
    grid, vgrid = batch["image_grid_thw"], batch["video_grid_thw"]
    B, ni, nv = ids.shape[0], grid.shape[0], vgrid.shape[0]
    meta = torch.cat([images, videos, grid.prod(dim=-1), vgrid.prod(dim=-1)]).tolist()  # one host read
    image_at, video_at = _offsets(meta[:B]), _offsets(meta[B : 2 * B])
    row_at, vrow_at = _offsets(meta[2 * B : 2 * B + ni]), _offsets(meta[2 * B + ni : 2 * B + ni + nv])
    bounds = _bounds(B, n)
    out: list[dict[str, Any] | None] = []
    for a, b in zip(bounds, bounds[1:]):
        media: dict[str, Any] = {}
        i0, i1 = image_at[a], image_at[b]
        if i1 > i0:
            media["image"] = (batch["pixel_values"][row_at[i0] : row_at[i1]], grid[i0:i1])
        v0, v1 = video_at[a], video_at[b]
        if v1 > v0:
            media["video"] = (batch["pixel_values_videos"][vrow_at[v0] : vrow_at[v1]], vgrid[v0:v1])
        out.append(media or None)
    return out


def _hand_llava(model: Any, batch: dict[str, Tensor], n: int) -> list[dict[str, Any] | None]:
    ids = batch["input_ids"]
    image_at = _offsets(_runs(ids == model.config.image_token_id).tolist())  # one host read
    bounds = _bounds(ids.shape[0], n)
    out: list[dict[str, Any] | None] = []
    for a, b in zip(bounds, bounds[1:]):
        i0, i1 = image_at[a], image_at[b]
        out.append(
            {"pixel_values": batch["pixel_values"][i0:i1], "image_sizes": batch["image_sizes"][i0:i1]} if i1 > i0 else None
        )
    return out


def _hand_step3(model: Any, batch: dict[str, Tensor], n: int) -> list[dict[str, Any] | None]:
    ids = batch["input_ids"]
    B = ids.shape[0]
    has_image = (ids == model.config.image_token_id).any(dim=-1)
    meta = torch.cat([has_image.to(torch.int64), batch["num_patches"].to(torch.int64)]).tolist()  # one host read
    holds, crops = meta[:B], meta[B:]
    image_at, crop_at = _offsets(holds), _offsets(crops)
    bounds = _bounds(B, n)
    out: list[dict[str, Any] | None] = []
    for a, b in zip(bounds, bounds[1:]):
        i0, i1 = image_at[a], image_at[b]
        if i1 == i0:
            out.append(None)
            continue
        c0, c1 = crop_at[a], crop_at[b]
        out.append(
            {
                "pixel_values": batch["pixel_values"][i0:i1],
                "pixel_values_local": batch["patch_pixel_values"][c0:c1] if c1 > c0 else None,
                "num_local_patches": [crops[s] for s in range(a, b) if holds[s]],
            }
        )
    return out


def _hand_kimi(model: Any, batch: dict[str, Tensor], n: int) -> list[dict[str, Any] | None]:
    ids, hws = batch["input_ids"], batch["image_grid_hws"]
    B, ni = ids.shape[0], hws.shape[0]
    meta = torch.cat([_runs(ids == model.config.image_token_id), hws.prod(dim=-1)]).tolist()  # one host read
    image_at, row_at = _offsets(meta[:B]), _offsets(meta[B : B + ni])
    thw = torch.cat([hws.new_ones((ni, 1)), hws], dim=1)
    bounds = _bounds(B, n)
    out: list[dict[str, Any] | None] = []
    for a, b in zip(bounds, bounds[1:]):
        i0, i1 = image_at[a], image_at[b]
        out.append(
            {"pixel_values": batch["pixel_values"][row_at[i0] : row_at[i1]], "image_grid_thw": thw[i0:i1]}
            if i1 > i0
            else None
        )
    return out


def _hand_rows(batch: dict[str, Tensor], n: int, per_sample: Tensor, keys: tuple[str, ...]) -> list[dict[str, Any] | None]:
    """Slices of ``keys`` (one row per image) by images per sample: one host read."""
    image_at = _offsets(per_sample.tolist())
    bounds = _bounds(per_sample.shape[0], n)
    out: list[dict[str, Any] | None] = []
    for a, b in zip(bounds, bounds[1:]):
        i0, i1 = image_at[a], image_at[b]
        out.append({key: batch[key][i0:i1] for key in keys} if i1 > i0 else None)
    return out


def _hand_gemma3(model: Any, batch: dict[str, Tensor], n: int) -> list[dict[str, Any] | None]:
    tokens = (batch["input_ids"] == model.config.image_token_id).sum(dim=1)
    return _hand_rows(batch, n, tokens // model.config.mm_tokens_per_image, ("pixel_values",))


def _hand_mistral3(model: Any, batch: dict[str, Tensor], n: int) -> list[dict[str, Any] | None]:
    images = (batch["input_ids"] == 13).sum(dim=1)  # [IMG_END] in Mistral's tokenizer and the tiny model
    return _hand_rows(batch, n, images, ("pixel_values", "image_sizes"))


_HAND: dict[str, Callable[..., list[dict[str, Any] | None]]] = {
    "qwen2_5_vl": _hand_qwen,
    "llava_next": _hand_llava,
    "step3": _hand_step3,
    "kimi_vl": _hand_kimi,
    "gemma3": _hand_gemma3,
    "mistral3": _hand_mistral3,
}


# ------------------------------------------------------------------------------------------------


class FamilySetup:
    """One family's tiny model, batch, adapter and per-microbatch inputs."""

    def __init__(self, family: str) -> None:
        tiny = load(family)
        self.family = family
        self.model = tiny.build_model(seed=0)
        self.batch = tiny.build_batch(seed=0)
        self.adapter = _adapter(family)
        self.config = self.model.config
        self.n = N_MICROBATCHES
        self.ids = list(self.batch["input_ids"].tensor_split(self.n))
        self.embed = self.model.get_input_embeddings()
        with torch.no_grad():
            self.embeds = [self.embed(ids) for ids in self.ids]
        staged = split_media(dict(self.batch), self.n, **self.counts(self.batch["input_ids"]))
        self.chunks = [staged.chunk(k) for k in range(self.n)]
        self.media_microbatches = [k for k, c in enumerate(self.chunks) if c is not None]
        self.native = {
            k: _native_from_chunk(family, self.chunks[k], self.ids[k], self.config) for k in self.media_microbatches
        }
        # what merge's one host read gives each microbatch, for the untimed side of encode_scatter
        self.host = {k: self.adapter.check_counts(self.ids[k], self.chunks[k], self.config)[1] for k in self.media_microbatches}

    def counts(self, input_ids: Tensor) -> dict[str, Tensor]:
        images, videos = self.adapter.media_per_sample(input_ids, self.config)
        kwargs = {"images_per_sample": images}
        if "pixel_values_videos" in self.batch:
            kwargs["videos_per_sample"] = videos
        return kwargs

    # -- section 4 ---------------------------------------------------------------------------
    def merge_adapter(self) -> list[Tensor]:
        merge, model = self.adapter.merge, self.model
        return [merge(model, self.ids[k], self.embeds[k], self.chunks[k]) for k in self.media_microbatches]

    def encode_scatter(self) -> list[Tensor]:
        """``adapter.merge`` without its checks: ``adapter.encode`` + ``masked_scatter`` (diagnostic)."""
        adapter, model, config = self.adapter, self.model, self.config
        out = []
        for k in self.media_microbatches:
            ids, embeds, chunk = self.ids[k], self.embeds[k], self.chunks[k]
            features = adapter.encode(model, chunk, self.host[k])
            for modality, feats in features.items():
                token = config.image_token_id if modality == "image" else config.video_token_id
                embeds = _scatter(embeds, ids, token, feats)
            out.append(embeds)
        return out

    def merge_direct(self) -> list[Tensor]:
        family, model = self.family, self.model
        return [_direct(family, model, self.ids[k], self.embeds[k], self.native[k]) for k in self.media_microbatches]

    def merge_checked(self) -> list[Tensor]:
        """The model's own forward's merge: encoder, its count check, scatter (context, not the target)."""
        family, model = self.family, self.model
        return [_checked(family, model, self.ids[k], self.embeds[k], self.native[k]) for k in self.media_microbatches]

    # -- section 5 ---------------------------------------------------------------------------
    def first_stage_with(self, batch: dict[str, Tensor]) -> list[Tensor]:
        model, adapter, embed = self.model, self.adapter, self.embed
        staged = split_media(batch, self.n, **self.counts(batch["input_ids"]))
        out = []
        with stage_media(model, staged):
            for ids in self.ids:
                embeds = embed(ids)
                out.append(adapter.merge(model, ids, embeds, next_vlm_media_chunk(model)))
        return out

    def first_stage_without(self, batch: dict[str, Tensor]) -> list[Tensor]:
        model, embed, family = self.model, self.embed, self.family
        media = _HAND[family](model, batch, self.n)
        out = []
        for ids, mb_media in zip(self.ids, media, strict=True):
            embeds = embed(ids)
            out.append(_direct(family, model, ids, embeds, mb_media) if mb_media is not None else embeds)
        return out


#: the families with a hand-written direct path (the model's own encoder call and its split by hand)
BENCH_FAMILIES: tuple[str, ...] = tuple(_HAND)


def setup_family(family: str) -> FamilySetup:
    if family not in BENCH_FAMILIES:
        raise ValueError(f"no direct path for family {family!r}; benchmarked: {', '.join(BENCH_FAMILIES)}")
    return FamilySetup(family)


def _max_diff(a: list[Tensor], b: list[Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def _median_time(fn: Callable[[], Any], rounds: int = 7, number: int = 50) -> float:
    """Median over ``rounds`` of the mean time of ``number`` back-to-back calls (seconds)."""
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - start) / number)
    return statistics.median(samples)


def adapter_parts(setup: FamilySetup) -> dict[str, float]:
    """What ``adapter.merge`` does besides the encoder and the scatter, summed over the media
    microbatches (seconds): ``placeholder_masks``; ``feature_counts`` (``host_inputs`` and
    ``feature_counts`` on values already read: host arithmetic and checks); ``count_check``, the whole
    ``check_counts`` (masks, the one host read per microbatch, feature counts, comparison)."""
    adapter, config = setup.adapter, setup.config
    work = [(setup.ids[k], setup.chunks[k], setup.host[k]) for k in setup.media_microbatches]

    def counts() -> None:
        for _, chunk, host in work:
            adapter.host_inputs(chunk, config)
            adapter.feature_counts(chunk, config, host)

    return {
        "placeholder_masks": _median_time(lambda: [adapter.placeholder_masks(ids, config) for ids, _, _ in work]),
        "feature_counts": _median_time(counts),
        "count_check": _median_time(lambda: [adapter.check_counts(ids, c, config) for ids, c, _ in work]),
    }


def run_merge(setup: FamilySetup, repeats: int) -> dict[str, Any]:
    """Section 4: ``adapter.merge`` over the batch's media microbatches against the direct call."""
    with torch.no_grad():
        parts = adapter_parts(setup)
        diff = _max_diff(setup.merge_adapter(), setup.merge_direct())
        with HostReadCounter() as adapter_reads:
            setup.merge_adapter()
        with HostReadCounter() as direct_reads:
            setup.merge_direct()
        diff = max(diff, _max_diff(setup.encode_scatter(), setup.merge_direct()))
        diff = max(diff, _max_diff(setup.merge_checked(), setup.merge_direct()))
        timings = interleaved(
            {
                "adapter": Side(setup.merge_adapter),
                "direct": Side(setup.merge_direct),
                "encode_scatter": Side(setup.encode_scatter),
                "model_checked": Side(setup.merge_checked),
            },
            repeats=repeats,
            warmup=5,
        )
    return {
        "family": setup.family,
        "microbatches": len(setup.media_microbatches),
        "median_s": {name: timings.median(name) for name in ("adapter", "direct", "encode_scatter", "model_checked")},
        "ratio": timings.ratio("adapter", "direct"),
        "encode_scatter_ratio": timings.ratio("encode_scatter", "direct"),
        # context: against the merge of the model's own forward (encoder, its count check, scatter)
        "model_checked_ratio": timings.ratio("adapter", "model_checked"),
        "host_reads": {"adapter": adapter_reads.total, "direct": direct_reads.total},
        "adapter_parts_s": parts,
        "max_abs_diff": diff,
    }


def run_first_stage(setup: FamilySetup, repeats: int) -> dict[str, Any]:
    """Section 5: embedding + media merge of the batch, with and without ppmedia's staging."""
    batch = setup.batch
    with torch.no_grad():
        diff = _max_diff(setup.first_stage_with(dict(batch)), setup.first_stage_without(dict(batch)))
        with HostReadCounter() as with_reads:
            setup.first_stage_with(dict(batch))
        with HostReadCounter() as without_reads:
            setup.first_stage_without(dict(batch))
        timings = interleaved(
            {
                "with": Side(setup.first_stage_with, prepare=lambda: dict(batch)),
                "without": Side(setup.first_stage_without, prepare=lambda: dict(batch)),
            },
            repeats=repeats,
            warmup=5,
        )
    return {
        "family": setup.family,
        "batch_size": int(batch["input_ids"].shape[0]),
        "n_microbatches": setup.n,
        "median_s": {name: timings.median(name) for name in ("with", "without")},
        "ratio": timings.ratio("with", "without"),
        "host_reads": {"with": with_reads.total, "without": without_reads.total},
        "max_abs_diff": diff,
    }
