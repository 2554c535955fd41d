"""Pieces the built-in adapters share: grids, placeholder runs, dtype casts, refusing videos, the
checks and encoder calls of fixed-size image rows (and :class:`ImageRowsAdapter`, the families made of
them alone), the calls of grid families' own encoders and ``get_rope_index``, token ids and head
settings from configs, and the check of audio features' masks.

Private to ``ppmedia.adapters``; the public adapter protocol is in :mod:`ppmedia.adapters.base`.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, ClassVar, Mapping, Sequence

import torch
from torch import Tensor

from ..chunk import VlmMediaChunk
from ..producer.hostreads import HostReader
from .base import HostValues, VlmAdapter, config_get, config_value, inner_model

__all__ = [
    "ImageRowsAdapter",
    "anyres_geometry",
    "as_tower_dtype",
    "check_audio_mask",
    "check_image_rows",
    "check_video_chunks",
    "count_runs",
    "encode_grid_modalities",
    "grid_products",
    "grid_rope_positions",
    "grid_thw",
    "images_from_runs",
    "pooled_image_features",
    "refuse_grid",
    "refuse_videos",
    "rows_from_tokens",
    "run_lengths",
    "shape",
    "softcapped",
    "text_config",
    "token_ids",
    "tower_dtype",
    "tower_image_rows",
    "unpadded_logits",
    "unpadded_width",
]


def shape(tensor: Tensor | None) -> str:
    """``[2, 3]`` for a tensor of that shape, ``None`` for ``None`` (for error messages)."""
    return "None" if tensor is None else str(list(tensor.shape))


def grid_thw(grid: Tensor, what: str) -> Tensor:
    """``grid`` as ``[n, 3]`` ``(t, h, w)``: an ``[n, 2]`` ``(h, w)`` grid gets a ``t = 1`` column on its
    own device (one small device op); an ``[n, 3]`` grid is returned as is.

    Raises:
        ValueError: ``grid`` is not ``[n, 2]`` or ``[n, 3]`` (``what`` names it).
    """
    if grid.dim() != 2 or grid.shape[1] not in (2, 3):
        raise ValueError(f"{what}: shape {shape(grid)}; expected [n, 3] (t, h, w) or [n, 2] (h, w)")
    if grid.shape[1] == 3:
        return grid
    return torch.nn.functional.pad(grid, (1, 0), value=1)


def grid_products(flat: Sequence[int], columns: int) -> list[int]:
    """Patches per grid row, from a grid read to the host flattened (``columns`` 2 or 3).

    Python integers, so no product wraps around, however large the entries.
    """
    if columns == 2:
        return [h * w for h, w in zip(flat[0::2], flat[1::2])]
    return [t * h * w for t, h, w in zip(flat[0::3], flat[1::3], flat[2::3])]


def tower_dtype(tower: object) -> torch.dtype | None:
    """The dtype of a vision tower's first parameter when it is a floating-point one, else ``None``.

    Follows first children down to the first module holding parameters (the patch embedding, in
    every tower here), which costs a few dict lookups per call where ``parameters()`` walks
    generators; falls back to ``parameters()`` when that chain holds none.
    """
    if not isinstance(tower, torch.nn.Module):
        return None
    module: torch.nn.Module | None = tower
    while module is not None:
        for param in module._parameters.values():
            if param is not None:
                return param.dtype if param.dtype.is_floating_point else None
        module = next(iter(module._modules.values()), None)
    for param in tower.parameters():
        return param.dtype if param.dtype.is_floating_point else None
    return None


def as_tower_dtype(pixels: Tensor, tower: object) -> Tensor:
    """``pixels`` in ``tower``'s dtype (:func:`tower_dtype`); the same tensor when it already is, or
    when the tower has no floating-point first parameter."""
    dtype = tower_dtype(tower)
    return pixels if dtype is None or pixels.dtype == dtype else pixels.to(dtype)


def refuse_videos(chunk: VlmMediaChunk, family: str) -> None:
    """Raise ``ValueError`` (shapes in the message) when ``chunk`` carries video media."""
    if chunk.pixel_values_videos is not None or chunk.video_grid is not None:
        raise ValueError(
            f"{family} takes images only, but the chunk carries videos: pixel_values_videos "
            f"{shape(chunk.pixel_values_videos)}, video_grid {shape(chunk.video_grid)}"
        )


def refuse_grid(chunk: VlmMediaChunk, family: str, what: str = "image grid", note: str = "") -> None:
    """Raise ``ValueError`` when ``chunk`` carries an image grid: ``"{family} takes no {what}, but the
    chunk carries image_grid [n, k]{note}"``."""
    if chunk.image_grid is not None:
        raise ValueError(f"{family} takes no {what}, but the chunk carries image_grid {shape(chunk.image_grid)}{note}")


# -- configs: token ids, the text config, the head ---------------------------------------------------


def text_config(config: Any) -> Any:
    """``config.get_text_config()`` (a multimodal config's text part), or ``config`` itself without it."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def token_ids(config: Any, fields: dict[str, str]) -> dict[str, int]:
    """``{name: int(config.<field>)}`` for each ``name: field`` of ``fields`` (:func:`config_value`:
    a missing field raises naming it)."""
    return {name: int(config_value(config, field)) for name, field in fields.items()}


def softcapped(logits: Tensor, config: Any) -> Tensor:
    """``tanh(logits / c) * c`` with ``c`` = the text config's ``final_logit_softcapping`` (the model's
    own soft-capping), or ``logits`` as they are when it is unset."""
    cap = config_get(text_config(config), "final_logit_softcapping")
    return logits if cap is None else torch.tanh(logits / float(cap)) * float(cap)


def unpadded_logits(logits: Tensor, config: Any) -> Tensor:
    """The first ``unpadded_vocab_size`` (text config) logits of ``logits`` ``[..., vocab]``, or all of
    them when it is unset."""
    width = config_get(text_config(config), "unpadded_vocab_size")
    return logits if width is None else logits[..., : int(width)]


def unpadded_width(config: Any, head_width: int) -> int:
    """The width :func:`unpadded_logits` leaves of a head ``head_width`` wide."""
    width = config_get(text_config(config), "unpadded_vocab_size")
    return head_width if width is None else min(head_width, int(width))


# -- LLaVA-NeXT-style anyres crops ------------------------------------------------------------------


def anyres_geometry(config: Any, family: str) -> tuple[int, int, tuple[tuple[int, int], ...]]:
    """``(crop side in pixels, patches per crop side, pinpoints)`` of a LLaVA-NeXT-style anyres config
    (``vision_config.image_size`` / ``patch_size``, ``image_grid_pinpoints``).

    Raises:
        AttributeError: one of them is unset (the message names all three, and ``family``'s geometry).
    """
    vision = config_get(config, "vision_config")
    crop, patch = config_get(vision, "image_size"), config_get(vision, "patch_size")
    pinpoints = config_get(config, "image_grid_pinpoints")
    if crop is None or patch is None or pinpoints is None:
        raise AttributeError(
            f"{type(config).__name__} lacks vision_config.image_size, vision_config.patch_size or "
            f"image_grid_pinpoints ({family}'s anyres geometry)"
        )
    return int(crop), int(crop) // int(patch), tuple(map(tuple, pinpoints))


# -- audio features ----------------------------------------------------------------------------------


def check_audio_mask(features: Tensor, mask: Tensor | None, *, time_dim: int, message: str) -> Tensor:
    """``mask``, after checking ``features`` is 3-D (``[audios, T, bins]`` or ``[audios, bins, T]``,
    ``T`` at ``time_dim``) and ``mask`` is its ``[audios, T]``. Shapes only.

    Raises:
        ValueError: no mask, or shapes that do not fit; the message is ``message`` formatted with
            ``features`` and ``mask`` (their shapes).
    """
    if (
        mask is None or features.dim() != 3 or mask.dim() != 2
        or mask.shape[0] != features.shape[0] or mask.shape[1] != features.shape[time_dim]
    ):
        raise ValueError(message.format(features=shape(features), mask=shape(mask)))
    return mask


# -- fixed-size image rows (complete images or tiles, a fixed number of tokens each) -----------------


def rows_from_tokens(input_ids: Tensor, token_id: int, per_row: int) -> tuple[Tensor, Tensor]:
    """Rows (images, tiles) per sample ``[B]`` int64 = the placeholder tokens ``token_id`` in each row of
    ``input_ids`` ``[B, S]`` divided by ``per_row``, rounded up: a partial row counts one more, which the
    split or the merge's count check refuses. Device ops only. The second tensor (videos) is zeros."""
    tokens = (input_ids == token_id).sum(dim=-1, dtype=torch.int64)
    rows = torch.div(tokens + per_row - 1, per_row, rounding_mode="floor")
    return rows, torch.zeros_like(rows)


def check_image_rows(pixels: Tensor, family: str, channels: int, height: int, width: int, *, rows: str, note: str) -> None:
    """Check ``pixels`` is ``[n, channels, height, width]`` floating point (``rows`` names ``n`` and
    ``note`` says where the size comes from, in the message).

    Raises:
        ValueError: another shape (seen and expected in the message).
        TypeError: an integer dtype.
    """
    if pixels.dim() != 4 or tuple(pixels.shape[1:]) != (channels, height, width):
        raise ValueError(
            f"{family} pixel_values: shape {shape(pixels)}; expected [{rows}, {channels}, {height}, {width}] ({note})"
        )
    if not pixels.is_floating_point():
        raise TypeError(f"{family} pixel_values: dtype {pixels.dtype}; expected a floating dtype")


def tower_image_rows(
    chunk: VlmMediaChunk, config: Any, family: str, *, rows: str, note: str, what: str = "image grid", grid_note: str = ""
) -> int:
    """The rows of ``chunk.pixel_values`` ``[rows, C, S, S]`` (0 without pixels), after refusing videos
    (:func:`refuse_videos`) and an image grid (:func:`refuse_grid` with ``what`` and ``grid_note``) and
    checking the rows are at the tower's ``vision_config.num_channels`` (3 when unset) and square
    ``vision_config.image_size`` (:func:`check_image_rows` with ``rows`` and ``note``). Shapes only.

    Raises:
        ValueError: videos, a grid, or pixels of another shape.
        TypeError: pixels not floating point.
    """
    refuse_videos(chunk, family)
    refuse_grid(chunk, family, what, grid_note)
    pixels = chunk.pixel_values
    if pixels is None:
        return 0
    vision = config_value(config, "vision_config")
    size, channels = int(config_value(vision, "image_size")), int(config_get(vision, "num_channels") or 3)
    check_image_rows(pixels, family, channels, size, size, rows=rows, note=note)
    return int(pixels.shape[0])


def pooled_image_features(model: torch.nn.Module, pixels: Tensor, expected: str, tower: str = "vision_tower") -> Tensor:
    """The model's own ``get_image_features(pixel_values=pixels)`` (``model.model``'s, or ``model``'s
    when it is the inner model; ``expected`` names the model in the ``TypeError`` when neither has it),
    pixels cast to the dtype of its ``tower`` when it has one: the pooled features flattened to
    ``[rows * tokens, hidden]`` in row order."""
    inner = inner_model(model, "get_image_features", expected)
    pixels = as_tower_dtype(pixels, getattr(inner, tower, None))
    features = inner.get_image_features(pixel_values=pixels, return_dict=True).pooler_output
    return features.reshape(-1, features.shape[-1])


class ImageRowsAdapter(VlmAdapter):
    """A family whose media are image rows alone: ``chunk.pixel_values`` ``[rows, C, S, S]`` (complete
    images, tiles, crops or frames) at the vision tower's size, each filling :meth:`tokens_per_row`
    placeholder tokens of one image token, encoded by the model's own ``get_image_features`` (Aya
    Vision's tiles, PaliGemma's images; Gemma 3, InternVL and Llama 4 take part of it).

    A subclass implements :meth:`tokens_per_row` and names its rows, its image token's config fields
    and its model classes in the class attributes below; it overrides what its family does otherwise.
    """

    #: the config fields holding the image placeholder id, tried in order (:func:`config_value`).
    image_token_fields: ClassVar[tuple[str, ...]] = ("image_token_index", "image_token_id")
    #: what a row is and where its size comes from, in :meth:`feature_counts`'s messages.
    row_name: ClassVar[str] = "images"
    row_note: ClassVar[str] = "complete images at vision_config.image_size"
    #: what an image grid is called in the message refusing one, and a note after it.
    grid_name: ClassVar[str] = "image grid"
    grid_note: ClassVar[str] = ""
    #: the model classes :meth:`encode` expects, named when the model has no ``get_image_features``.
    expected_model: ClassVar[str] = ""

    @abc.abstractmethod
    def tokens_per_row(self, config: Any) -> int:
        """Placeholder tokens (= feature rows) of one image row."""

    def image_token_id(self, config: Any) -> int:
        """The image placeholder id (the first of :attr:`image_token_fields` the config holds)."""
        return int(config_value(config, *self.image_token_fields))

    def media_per_sample(
        self, input_ids: Tensor, config: Any, *, media: Mapping[str, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Rows per sample = image tokens / :meth:`tokens_per_row` (:func:`rows_from_tokens`: rounded up,
        so a partial row counts one more, which the split or the merge's count check refuses); device
        ops only. Videos (zeros): a family whose frames are rows counts them here too."""
        return rows_from_tokens(input_ids, self.image_token_id(config), self.tokens_per_row(config))

    def placeholder_masks(self, input_ids: Tensor, config: Any) -> dict[str, Tensor]:
        return {"image": input_ids == self.image_token_id(config)}

    def feature_counts(self, chunk: VlmMediaChunk, config: Any, host: HostValues) -> dict[str, int]:
        """``{"image": rows * tokens_per_row}``, from shapes only (:func:`tower_image_rows`).

        Raises:
            ValueError: videos or a grid in the chunk, rows not ``[rows, C, S, S]`` at the tower's size.
            TypeError: pixels not floating point.
        """
        rows = tower_image_rows(chunk, config, self.name, rows=self.row_name, note=self.row_note, what=self.grid_name,
                                grid_note=self.grid_note)
        return {"image": rows * self.tokens_per_row(config)}

    def encode(self, model: torch.nn.Module, chunk: VlmMediaChunk, host: HostValues) -> dict[str, Tensor]:
        """The model's own ``get_image_features`` (:func:`pooled_image_features`): ``{"image": [rows *
        tokens_per_row, text_hidden]}`` in row order."""
        if chunk.pixel_values is None:
            return {}
        return {"image": pooled_image_features(model, chunk.pixel_values, self.expected_model)}


# -- grid families' own encoders and positions --------------------------------------------------------


def encode_grid_modalities(inner: Any, chunk: VlmMediaChunk, tower: str, missing_grid: str) -> dict[str, Tensor]:
    """The model's own ``get_image_features`` / ``get_video_features`` (of ``inner``, pixels cast to the
    dtype of ``inner.<tower>``) per modality present in ``chunk``, each ``[rows, D]`` with its grid:
    ``{modality: [tokens, text_hidden]}`` in placeholder order.

    Raises:
        ValueError: patch rows without their grid; the message is ``missing_grid`` formatted with
            ``modality`` and ``shape`` (the rows' shape).
    """
    out: dict[str, Tensor] = {}
    for modality, pixels, grid, encoder in (
        ("image", chunk.pixel_values, chunk.image_grid, inner.get_image_features),
        ("video", chunk.pixel_values_videos, chunk.video_grid, inner.get_video_features),
    ):
        if pixels is None:
            continue
        if grid is None:
            raise ValueError(missing_grid.format(modality=modality, shape=shape(pixels)))
        rows = as_tower_dtype(pixels, getattr(inner, tower))
        features = encoder(rows, grid_thw(grid, f"{modality} grid"), return_dict=True).pooler_output
        out[modality] = torch.cat(list(features), dim=0)
    return out


def grid_rope_positions(
    inner: Any, input_ids: Tensor, chunk: VlmMediaChunk | None, mm_token_type_ids: Tensor, attention_mask: Tensor | None
) -> Tensor:
    """mrope positions ``[3, b, S]`` from ``inner.get_rope_index(input_ids, mm_token_type_ids=,
    image_grid_thw=, video_grid_thw=, attention_mask=)``, with the chunk's grids as ``[n, 3]`` (none for a
    text-only microbatch, ``chunk`` ``None``)."""
    kwargs: dict[str, Any] = {"attention_mask": attention_mask}
    if chunk is not None and chunk.image_grid is not None:
        kwargs["image_grid_thw"] = grid_thw(chunk.image_grid, "image grid")
    if chunk is not None and chunk.video_grid is not None:
        kwargs["video_grid_thw"] = grid_thw(chunk.video_grid, "video grid")
    positions: Tensor = inner.get_rope_index(input_ids, mm_token_type_ids=mm_token_type_ids, **kwargs)[0]
    return positions


# -- placeholder runs ------------------------------------------------------------------------------


def count_runs(mask: Tensor) -> Tensor:
    """``[B]`` int64: the runs of ``True`` in each row of ``mask`` ``[B, S]`` (device ops, no host read)."""
    starts = mask.clone()
    starts[:, 1:] &= ~mask[:, :-1]
    return starts.sum(dim=1, dtype=torch.int64)


def run_lengths(mask: Tensor, max_runs: int) -> tuple[Tensor, Tensor]:
    """Per row, the runs of ``True`` in ``mask`` ``[B, S]``, and the lengths of the first ``max_runs``
    runs of the batch in order (row by row, left to right), all with fixed shapes on ``mask``'s
    device: ``([B], [max_runs])`` int64. Runs past ``max_runs`` are counted but their lengths dropped.
    """
    starts = mask.clone()
    starts[:, 1:] &= ~mask[:, :-1]
    flat = mask.reshape(-1)
    index = starts.reshape(-1).cumsum(0) - 1  # run number of each position, batch order
    index = torch.where(flat, index.clamp(max=max_runs), max_runs)
    lengths = torch.zeros(max_runs + 1, dtype=torch.int64, device=mask.device)
    lengths.scatter_add_(0, index, flat.to(torch.int64))
    return starts.sum(dim=1, dtype=torch.int64), lengths[:max_runs]


def images_from_runs(
    mask: Tensor,
    tokens_per_image: Tensor,
    to_tokens: Callable[[list[int]], Sequence[int]],
    *,
    token: str,
    metadata: str,
) -> Tensor:
    """Images per sample ``[B]`` from the placeholder runs of ``mask`` ``[B, S]`` and each image's token
    count, for prompts where images written back to back form one run.

    ``tokens_per_image`` is the batch's per-image metadata (e.g. ``image_sizes`` ``[images, 2]``);
    ``to_tokens`` turns its values, read to the host (flattened row by row, Python ints), into a token
    count per image. The
    runs and the metadata are read together, once. Each run is matched, in batch order, with the
    next images whose token counts add up to its length.

    Raises:
        ValueError: a run that is not a sum of whole images, placeholders left without images, or
            images left without placeholders; the message names the sample, the run and the way out
            (``n_images_per_sample`` in the batch).
    """
    n_images = int(tokens_per_image.shape[0])
    runs, lengths = run_lengths(mask, n_images)
    reader = HostReader()
    slots = (reader.add(runs), reader.add(lengths), reader.add(tokens_per_image))
    reader.read()
    values: list[Any] = reader.values  # flat int64 numpy arrays, one per add()
    per_sample, lengths_host = values[slots[0]].tolist(), values[slots[1]].tolist()
    tokens = to_tokens(values[slots[2]].tolist())
    counts = _match_runs(per_sample, lengths_host, tokens, token=token, metadata=metadata)
    return torch.tensor(counts, dtype=torch.int64).to(mask.device)


def _match_runs(
    runs_per_sample: Sequence[int], lengths: Sequence[int], tokens: Sequence[int], *, token: str, metadata: str
) -> list[int]:
    way_out = "pass n_images_per_sample [B] in the batch to say how many images each sample holds"
    if sum(runs_per_sample) > len(tokens):
        raise ValueError(
            f"{token}: {sum(runs_per_sample)} runs of placeholder tokens but {metadata} describes "
            f"{len(tokens)} images; {way_out}"
        )
    counts, image, run = [], 0, 0
    for sample, n_runs in enumerate(runs_per_sample):
        first = image
        for _ in range(n_runs):
            run_first, filled = image, 0
            if image == len(tokens):
                raise ValueError(
                    f"{token}: sample {sample} has a run of {lengths[run]} placeholder tokens but all "
                    f"{len(tokens)} images of {metadata} are taken by earlier runs; {way_out}"
                )
            while filled < lengths[run] and image < len(tokens):
                filled += tokens[image]
                image += 1
            if filled != lengths[run]:
                raise ValueError(
                    f"{token}: sample {sample} has a run of {lengths[run]} placeholder tokens, but images "
                    f"{run_first}..{image - 1} of {metadata} (batch order) give {list(tokens[run_first:image])} "
                    f"tokens, which do not add up to it; {way_out}"
                )
            run += 1
        counts.append(image - first)
    if image != len(tokens):
        raise ValueError(
            f"{token}: the placeholder runs hold {image} images but {metadata} describes {len(tokens)}; "
            f"{way_out}"
        )
    return counts


# -- video chunks ----------------------------------------------------------------------------------


def _ints(value: Any) -> list[int]:
    return [int(v) for v in (value.tolist() if isinstance(value, Tensor) else value)]


def check_video_chunks(batch: Mapping[str, Any], counts: Mapping[str, Any]) -> None:
    """The batch's ``num_chunks_per_video`` ``[videos]`` (a processor's; nothing to check without it)
    against the video grid rows (chunks) per sample ``[B]`` (``counts["videos_per_sample"]``, or the
    batch's ``n_videos_per_sample``): every sample holds whole videos (its chunk boundaries are video
    boundaries), and the chunks add up to the rows of the batch's ``video_grid_thw``. Reads both counts
    to the host (a few numbers, once a batch).

    Raises:
        ValueError: the chunks do not add up, or a video's chunks would be split between samples.
    """
    per_video = batch.get("num_chunks_per_video")
    per_sample = counts.get("videos_per_sample", batch.get("n_videos_per_sample"))
    if per_video is None or per_sample is None:
        return
    grid = batch.get("video_grid_thw")
    videos, samples = _ints(per_video), _ints(per_sample)  # host reads of small counts, once a batch
    if grid is not None and sum(videos) != grid.shape[0]:
        raise ValueError(
            f"num_chunks_per_video: {videos} adds up to {sum(videos)} chunks but video_grid_thw has "
            f"{grid.shape[0]} rows (one per chunk)"
        )
    ends, total = set(), 0
    for n in videos:
        total += n
        ends.add(total)
    total = 0
    for sample, n in enumerate(samples):
        total += n
        if n and total not in ends:
            raise ValueError(
                f"num_chunks_per_video: {videos}; sample {sample} holds video chunks up to row {total} of "
                f"video_grid_thw, which ends inside a video (video ends at rows {sorted(ends)}): a video's "
                f"chunks must all be in one sample"
            )
