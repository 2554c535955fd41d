"""Pieces the built-in adapters share: grids, placeholder runs, dtype casts, refusing videos.

Private to ``ppmedia.adapters``; the public adapter protocol is in :mod:`ppmedia.adapters.base`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from ..chunk import VlmMediaChunk
from ..hostreads import HostReader

__all__ = [
    "as_tower_dtype",
    "check_video_chunks",
    "count_runs",
    "grid_products",
    "grid_thw",
    "images_from_runs",
    "refuse_videos",
    "run_lengths",
    "shape",
    "tower_dtype",
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


def check_video_chunks(per_video: Any, per_sample: Any, grid: Tensor | None) -> None:
    """A processor's ``num_chunks_per_video`` ``[videos]`` against the video grid rows (chunks) per
    sample ``[B]``: every sample holds whole videos (its chunk boundaries are video boundaries), and the
    chunks add up to ``grid``'s rows. Reads both counts to the host (a few numbers, once a batch).

    Raises:
        ValueError: the chunks do not add up, or a video's chunks would be split between samples.
    """
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
