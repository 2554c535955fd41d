"""The built-in media planners, and the pieces every planner (a plugin's too) is built from.

A planner serves one media layout (:class:`ppmedia.producer.layouts.MediaLayout`): ``split_media`` selects the
layouts that fit the batch's keys and calls each one's planner in two phases around the producer's
single host read:

1. ``plan(ctx, media, counts)`` checks everything that shapes and dtypes tell (no tensor data read)
   and registers the integer metadata it needs with ``ctx.reader``; it returns a ``finish`` callable.
   ``counts`` are the per-sample item counts of the layout's modality (the batch's
   ``n_<modality>s_per_sample`` or the ``<modality>s_per_sample=`` argument), checked but not read yet,
   or ``None`` when neither was given.
2. After ``ctx.reader.read()``, ``finish()`` checks the values with exact integer arithmetic and
   returns a :class:`Part`: for each chunk field, the batch tensor and one ``(start, stop)`` range
   along dim 0 per microbatch.

Nothing here modifies the batch: :func:`ppmedia.split_media` pops the keys only after every planner
finished and every view was made.

Built-in layouts (registered in :mod:`ppmedia.producer.layouts`):

* patch rows (:func:`patch_rows_planner`, ``image_grid_thw``/``image_grid_hws``): flat patch rows
  ``[patches, D]`` or patch-major ``[patches, C, ph, pw]``; rows per image = its grid product;
* image-major (:func:`image_major_planner`): one row per image (complete images, padded patches with
  ``image_position_ids``, LLaVA-NeXT crops with ``image_sizes``); :func:`plan_pan_and_scan`:
  ``1 + num_crops`` rows per image (Gemma 3 pan-and-scan);
* videos (:func:`plan_videos`): patch rows per ``video_grid_thw`` row, with ``second_per_grid_ts`` (or
  the Qwen Omnis' ``video_second_per_grid``);
* Step3 crops (:func:`plan_step3`): ``num_patches`` crop patches per sample.
"""

from __future__ import annotations

import bisect
import math
import numbers
import operator
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from .assemble import FIELD_KINDS, FieldSplit, Part
from .hostreads import HostReader

__all__ = [
    "Context",
    "Counts",
    "FIELD_KINDS",
    "FieldSplit",
    "IMAGE_GRID_KEYS",
    "Part",
    "TIMING_KEYS",
    "check_counts",
    "check_range",
    "default_counts",
    "exact_sum",
    "image_major_planner",
    "media_part",
    "no_media",
    "offsets",
    "patch_rows_planner",
    "plan_pan_and_scan",
    "plan_step3",
    "plan_videos",
    "require_integer",
    "require_readable",
    "require_shape",
    "require_tensor",
    "shape_of",
]

Range = tuple[int, int]
#: int64 arrays: what the host read gives and what every offset is kept in.
Ints = npt.NDArray[np.int64]
Media = Mapping[str, Any]
#: a per-sample counts argument: a ``[B]`` integer tensor or a sequence of ints.
CountsArgument = Tensor | Sequence[int] | None

#: batch keys that hold per-image metadata; at most one may be present.
IMAGE_GRID_KEYS: tuple[str, ...] = (
    "image_grid_thw",
    "image_grid_hws",
    "image_sizes",
    "image_position_ids",
    "num_crops",
)
_INT64_MAX = 2**63 - 1
#: batch keys of the video timing ``[videos]``, staged as the chunk's ``second_per_grid_ts``: Qwen2.5-VL's
#: name, and the Qwen Omni processors' ``video_second_per_grid``; at most one per batch.
TIMING_KEYS: tuple[str, ...] = ("second_per_grid_ts", "video_second_per_grid")
_STRIDED = torch.strided
_INTEGER_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32})
# the ufuncs themselves: their reduce skips numpy's Python wrappers (a few hundred ns per call)
_add, _max, _min, _multiply = np.add, np.maximum, np.minimum, np.multiply


class Context:
    """What every planner shares: the batch size, the microbatch sample offsets, the host reader."""

    __slots__ = ("batch_size", "bounds", "at", "reader")

    def __init__(self, batch_size: int, bounds: Sequence[int], at: Ints | None = None) -> None:
        self.batch_size = batch_size
        self.bounds = bounds  # microbatch_bounds(B, n): n + 1 sample offsets
        # the same, as an index array (``at``: one made already, e.g. a cached read-only one)
        self.at: Ints = np.asarray(bounds, dtype=np.int64) if at is None else at
        self.reader = HostReader()

    def where(self, sample: int) -> str:
        """``"sample s (microbatch k)"`` for error messages."""
        return f"sample {sample} (microbatch {bisect.bisect_right(self.bounds, sample) - 1})"

    def where_item(self, per_sample: Ints, item: int) -> str:
        """``"sample s, microbatch k"`` holding item ``item`` (an image or video), given counts per sample."""
        sample = int(np.searchsorted(offsets(per_sample), item, side="right")) - 1
        return f"sample {sample}, microbatch {bisect.bisect_right(self.bounds, sample) - 1}"


# --------------------------------------------------------------------------------------------------
# checks of one value (no data read)


def shape_of(t: Tensor) -> str:
    return str(list(t.shape))


def require_tensor(key: str, value: object) -> Tensor:
    """``value`` as a dense tensor, else ``TypeError`` naming ``key``."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{key}: got {type(value).__name__}; expected a torch.Tensor")
    if value.is_nested or value.layout is not _STRIDED:
        layout = "nested" if value.is_nested else str(value.layout)
        raise TypeError(f"{key}: a {layout} tensor; expected a dense (strided) torch.Tensor")
    return value


def require_integer(key: str, t: Tensor) -> None:
    """``t`` has an integer dtype that converts exactly to int64."""
    if t.dtype in _INTEGER_DTYPES:
        return
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{key}: dtype {t.dtype}; expected an integer dtype")
    if t.dtype == torch.uint64:
        raise TypeError(f"{key}: dtype torch.uint64; expected a signed integer dtype (int64 holds every count)")


def require_readable(key: str, t: Tensor) -> Tensor:
    """An integer tensor whose values the split needs: not on the ``meta`` device (it has no data)."""
    require_integer(key, t)
    if t.is_meta:
        raise ValueError(
            f"{key}: shape {shape_of(t)} on the meta device; expected a tensor with data (cpu or an "
            f"accelerator): the split reads its values"
        )
    return t


def require_shape(key: str, t: Tensor, expected: tuple[int | None, ...], words: str) -> None:
    """``t.shape`` matches ``expected`` (``None``: any size), else ``ValueError`` naming both."""
    shape = t.shape
    if len(shape) == len(expected):
        for size, want in zip(shape, expected):
            if want is not None and size != want:
                break
        else:
            return
    raise ValueError(f"{key}: shape {shape_of(t)}; expected {words}")


# --------------------------------------------------------------------------------------------------
# exact integer arithmetic: every check before a number is trusted, sums never wrap


def offsets(sizes: Ints) -> Ints:
    """``[0, s0, s0 + s1, ...]``. Callers check first that the total fits (it equals a tensor dim)."""
    out = np.zeros(sizes.size + 1, dtype=np.int64)
    _add.accumulate(sizes, out=out[1:])
    return out


def exact_sum(values: Ints, high: int | None = None) -> int:
    """The sum of non-negative ``values`` as a Python int, never wrapped (``high``: a known maximum)."""
    if values.size == 0:
        return 0
    if (int(_max.reduce(values)) if high is None else high) <= _INT64_MAX // values.size:
        return int(_add.reduce(values))
    return sum(values.tolist())


def check_range(key: str, values: Ints, high: int, what: str, locate: Callable[[int], str]) -> None:
    """Every value in ``0..high``; else ``ValueError`` naming the first bad entry via ``locate(i)``."""
    # one reduction: as uint64, a negative value is above any int64 ``high``
    if values.size and int(_max.reduce(values.view(np.uint64))) > high:
        i = int(np.flatnonzero((values < 0) | (values > high))[0])
        raise ValueError(f"{key}: {locate(i)} has {int(values[i])} {what}; expected 0..{high} (the whole batch has {high})")


def exact_products(key: str, table: Ints, limit: int, locate: Callable[[int], str]) -> tuple[Ints, int] | None:
    """Offsets of the row products of a positive grid ``table`` ``[items, c]`` (``items + 1``, from 0) and
    their exact sum; ``None`` when a row's product alone exceeds ``limit`` (the pixel rows).

    A row with an entry <= 0 is a ``ValueError``. The offsets are exact whenever the sum fits in int64.
    """
    if table.size == 0:
        return np.zeros(table.shape[0] + 1, dtype=np.int64), 0
    if int(_min.reduce(table, axis=None)) <= 0:
        i = int(np.flatnonzero((table <= 0).any(axis=1))[0])
        raise ValueError(f"{key}: row {i} ({locate(i)}) is {table[i].tolist()}; expected positive entries")
    biggest = int(_max.reduce(table, axis=None))
    if biggest ** table.shape[1] <= _INT64_MAX // table.shape[0]:  # no product and no sum can wrap
        at = offsets(_row_products(table))
        return at, int(at[-1])
    exact = [math.prod(row) for row in table.tolist()]
    if max(exact) > limit:
        return None
    total = sum(exact)
    return (offsets(np.asarray(exact, dtype=np.int64)) if total <= _INT64_MAX else np.zeros(0, dtype=np.int64)), total


def _row_products(table: Ints) -> Ints:
    """Each row's product (the caller checked that none wraps); column by column for the usual 2 or 3
    columns, which is about twice as fast as a reduction along rows on arrays this small."""
    columns = table.shape[1]
    if columns == 3:
        return table[:, 0] * table[:, 1] * table[:, 2]
    if columns == 2:
        return table[:, 0] * table[:, 1]
    return _multiply.reduce(table, axis=1)


def first_oversized(table: Ints, limit: int) -> int | None:
    """The first row whose exact product exceeds ``limit``."""
    for i, row in enumerate(table.tolist()):
        if math.prod(row) > limit:
            return i
    return None


# --------------------------------------------------------------------------------------------------
# per-sample counts (images, videos)


@dataclass
class Counts:
    """Per-sample counts given in the batch or as an argument: on the host already, or a reader slot."""

    key: str  # the batch key or argument name, for messages
    from_argument: bool
    host: Ints | None = None
    slot: int | None = None

    def values(self, reader: HostReader) -> Ints:
        if self.host is not None:
            return self.host
        assert self.slot is not None
        return reader.values[self.slot]


def _list_counts(key: str, value: Sequence[Any], ctx: Context) -> Ints:
    """A sequence of ints as int64; floats, bools, ``None`` and values beyond int64 refused per sample."""
    if len(value) != ctx.batch_size:
        raise ValueError(f"{key}: {len(value)} counts; expected {ctx.batch_size} (one count per sample)")
    out = []
    for s, v in enumerate(value):
        if type(v) is not int and (isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral)):
            raise TypeError(f"{key}: {ctx.where(s)} is {v!r} ({type(v).__name__}); expected an int")
        count = int(v)
        if not 0 <= count <= _INT64_MAX:
            raise ValueError(f"{key}: {ctx.where(s)} has {count}; expected a count >= 0 (at most 2**63 - 1)")
        out.append(count)
    return np.asarray(out, dtype=np.int64)


def pending_counts(ctx: Context, media: Media, batch_key: str, arg_name: str, argument: object) -> Counts | None:
    """The counts from ``media[batch_key]`` or ``argument`` (not both), checked but not read yet."""
    in_batch = media.get(batch_key)
    if in_batch is not None and argument is not None:
        raise ValueError(f"{batch_key}: given both in the batch and as {arg_name}=; expected one")
    if in_batch is None and argument is None:
        return None
    key, value = (batch_key, in_batch) if in_batch is not None else (arg_name, argument)
    if isinstance(value, Tensor):
        require_readable(key, require_tensor(key, value))
        if value.dim() != 1 or value.shape[0] != ctx.batch_size:  # the message is built only on an error
            require_shape(key, value, (ctx.batch_size,), f"[{ctx.batch_size}] (one count per sample)")
        return Counts(key, in_batch is None, slot=ctx.reader.add(value))
    if isinstance(value, np.ndarray) and value.ndim == 1:  # its items as Python scalars, checked one by one
        value = value.tolist()
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return Counts(key, in_batch is None, host=_list_counts(key, value, ctx))
    raise TypeError(f"{key}: got {type(value).__name__}; expected a [B] integer tensor or a sequence of ints")


def default_counts(ctx: Context, pixels_key: str, items: int, what: str, batch_key: str, arg_name: str) -> Counts:
    """One item per sample, when there are exactly ``B`` items (none when there are none); else the
    error saying what to pass."""
    if items == 0:
        return Counts(batch_key, False, host=np.zeros(ctx.batch_size, dtype=np.int64))
    if items != ctx.batch_size:
        raise ValueError(
            f"{pixels_key}: {items} {what} for a batch of {ctx.batch_size} samples and nothing maps them "
            f"to samples; expected {batch_key} [{ctx.batch_size}] in the batch or {arg_name}= "
            f"(e.g. an adapter's media_per_sample(input_ids, config))"
        )
    return Counts(batch_key, False, host=np.ones(ctx.batch_size, dtype=np.int64))


def check_counts(ctx: Context, counts: Counts, values: Ints, total: int, what: str) -> Ints:
    """Counts in ``0..total`` summing exactly to ``total``; returns their offsets (``B + 1``, from 0).

    The message says which sample is wrong and, for counts passed as an argument, why counts taken from
    placeholder tokens can be wrong and what to pass instead.
    """
    try:
        check_range(counts.key, values, total, what, ctx.where)
    except ValueError as error:
        raise ValueError(f"{error}{_tokens_hint(counts, what, fewer=False)}") from None
    at = offsets(values) if total <= _INT64_MAX // max(values.size, 1) else None  # no partial sum can wrap
    got = int(at[-1]) if at is not None else sum(values.tolist())
    if got == total:
        return at if at is not None else offsets(values)
    raise ValueError(
        f"{counts.key}: counts sum to {got}; expected {total}, the number of {what} (whole batch)"
        f"{_tokens_hint(counts, what, fewer=got < total)}"
    )


def _tokens_hint(counts: Counts, what: str, fewer: bool) -> str:
    if counts.from_argument and what == "images" and fewer:
        return (
            ". If these counts come from placeholder runs (an adapter's media_per_sample), images written "
            "back to back form one run and cannot be told apart from the tokens: put n_images_per_sample "
            "[B] (the images of each sample) in the batch instead"
        )
    if counts.from_argument and what == "videos":
        return (
            ". If these counts come from placeholder runs (an adapter's media_per_sample), videos written "
            "back to back, or a video written as one block per temporal step (Qwen3-VL), cannot be "
            "counted from the tokens: put n_videos_per_sample [B] (the videos of each sample) in the batch instead"
        )
    return ""


# --------------------------------------------------------------------------------------------------
# parts


def _cut(at: Ints) -> tuple[tuple[Range, ...], tuple[int, ...]]:
    """``n + 1`` offsets -> the ``n`` ``(start, stop)`` ranges and their lengths."""
    values = at.tolist()
    stops = values[1:]
    return tuple(zip(values, stops)), tuple(map(operator.sub, stops, values))


def media_part(
    pixels: tuple[str, str, Tensor], meta: list[tuple[str, str, Tensor]], item_at: Ints, row_at: Ints
) -> Part:
    """A part whose pixel field follows ``row_at`` and whose per-item fields follow ``item_at``."""
    name, source, tensor = pixels
    row_ranges, rows = _cut(row_at)
    item_ranges, items = _cut(item_at)
    fields = [FieldSplit(name, source, tensor, row_ranges, rows)]
    fields += [FieldSplit(n, s, t, item_ranges, items) for n, s, t in meta]
    return Part(fields, items, rows)


def no_media(ctx: Context, counts: Counts, what: str) -> Callable[[], Part]:
    """Counts given for a batch without that media (``what``: ``"images"``): they must all be 0."""
    zero = (0,) * (len(ctx.bounds) - 1)

    def finish() -> Part:
        check_counts(ctx, counts, counts.values(ctx.reader), 0, what)
        return Part([], zero, zero)

    return finish


# --------------------------------------------------------------------------------------------------
# images


def _pixels(media: Media) -> Tensor:
    pixels: Tensor = media["pixel_values"]
    if pixels.dim() < 2:
        raise ValueError(f"pixel_values: shape {shape_of(pixels)}; expected at least 2 dims (images or patches first)")
    return pixels


def _image_counts(ctx: Context, counts: Counts | None, items: int) -> Counts:
    if counts is not None:
        return counts
    return default_counts(ctx, "pixel_values", items, "images", "n_images_per_sample", "images_per_sample")


Planner = Callable[[Context, Media, "Counts | None"], Callable[[], Part]]


def image_major_planner(grid_key: str | None) -> Planner:
    """The planner of ``pixel_values`` with one row per image (complete images, padded patches,
    LLaVA-NeXT crops) and ``grid_key`` (``image_sizes``, ``image_position_ids`` or ``None``) as the
    chunk's ``image_grid``."""

    def plan(ctx: Context, media: Media, counts: Counts | None) -> Callable[[], Part]:
        return _plan_image_major(ctx, media, grid_key, counts)

    return plan


def _plan_image_major(ctx: Context, media: Media, grid_key: str | None, counts: Counts | None) -> Callable[[], Part]:
    """One ``pixel_values`` row per image: complete images, padded patches, LLaVA-NeXT crops."""
    pixels = _pixels(media)
    grid: Tensor | None = media.get(grid_key) if grid_key else None
    n_images = pixels.shape[0]
    if grid_key == "image_sizes":
        assert grid is not None
        require_integer(grid_key, grid)
        require_shape(grid_key, grid, (n_images, 2), f"[{n_images}, 2] (height, width of each image of pixel_values {shape_of(pixels)})")
    elif grid_key == "image_position_ids":
        assert grid is not None
        require_integer(grid_key, grid)
        require_shape(grid_key, grid, (None, None, 2), "[images, max_patches, 2]")
        want = f"[{grid.shape[0]}, {grid.shape[1]}, D] (padded patches matching image_position_ids {shape_of(grid)})"
        require_shape("pixel_values", pixels, (grid.shape[0], grid.shape[1], None), want)
    counts = _image_counts(ctx, counts, n_images)
    meta = [("image_grid", grid_key, grid)] if grid is not None and grid_key is not None else []

    def finish() -> Part:
        per_sample = counts.values(ctx.reader)
        item_at = check_counts(ctx, counts, per_sample, n_images, "images")[ctx.at]
        return media_part(("pixel_values", "pixel_values", pixels), meta, item_at, item_at)

    return finish


def patch_rows_planner(grid_key: str) -> Planner:
    """The planner of ``pixel_values`` patch rows, ``grid_key`` (``image_grid_thw`` or
    ``image_grid_hws``) giving each image's rows (the grid's product)."""

    def plan(ctx: Context, media: Media, counts: Counts | None) -> Callable[[], Part]:
        return _plan_patch_rows(ctx, media, grid_key, counts)

    return plan


def _plan_patch_rows(ctx: Context, media: Media, grid_key: str, counts: Counts | None) -> Callable[[], Part]:
    """Rows per image = its ``image_grid_thw``/``image_grid_hws`` product; one row when rows == images."""
    pixels = _pixels(media)
    grid = require_readable(grid_key, media[grid_key])
    if grid.dim() != 2 or grid.shape[1] not in (2, 3):
        raise ValueError(f"{grid_key}: shape {shape_of(grid)}; expected [images, 3] (t, h, w) or [images, 2] (h, w)")
    counts = _image_counts(ctx, counts, grid.shape[0])
    slot = ctx.reader.add(grid)

    def finish() -> Part:
        per_sample = counts.values(ctx.reader)
        item_at = check_counts(ctx, counts, per_sample, grid.shape[0], "images")[ctx.at]
        table = ctx.reader.values[slot].reshape(grid.shape[0], grid.shape[1])
        rows_at = row_offsets("pixel_values", grid_key, table, pixels.shape[0], lambda i: ctx.where_item(per_sample, i))
        row_at = rows_at[item_at]
        return media_part(("pixel_values", "pixel_values", pixels), [("image_grid", grid_key, grid)], item_at, row_at)

    return finish


def row_offsets(key: str, grid_key: str, table: Ints, rows: int, locate: Callable[[int], str]) -> Ints:
    """Offsets of each item's pixel rows (``items + 1``, from 0): by the grid products when they add up
    to ``rows`` (patch rows), else one row each when there is one row per item (image-major); any
    other total is a ``ValueError``."""
    items = table.shape[0]
    exact = exact_products(grid_key, table, rows, locate)
    if exact is not None and exact[1] == rows:
        return exact[0]
    if rows == items:
        return np.arange(items + 1, dtype=np.int64)
    i = first_oversized(table, rows)
    if i is not None:
        raise ValueError(
            f"{grid_key}: row {i} ({locate(i)}) is {table[i].tolist()}: its product {math.prod(table[i].tolist())} "
            f"exceeds the {rows} rows of {key}; expected grids whose products sum to {rows}"
        )
    assert exact is not None
    raise ValueError(
        f"{key}: dim 0 is {rows}; expected {exact[1]} (the sum of the {grid_key} products, patch rows) "
        f"or {items} (one row per item) for {grid_key} of shape [{items}, {table.shape[1]}] (whole batch)"
    )


def plan_pan_and_scan(ctx: Context, media: Media, counts: Counts | None) -> Callable[[], Part]:
    """Gemma 3 pan-and-scan: each image is ``1 + num_crops[i]`` rows of ``pixel_values`` (itself, then its
    crops). Counts per sample may count images, or rows (each crop is its own placeholder block)."""
    pixels = _pixels(media)
    crops = require_readable("num_crops", media["num_crops"])
    require_shape("num_crops", crops, (None,), "[images] (crops of each image)")
    n_images, n_rows = crops.shape[0], pixels.shape[0]
    counts = _image_counts(ctx, counts, n_images)
    slot = ctx.reader.add(crops)

    def finish() -> Part:
        per_image_crops = ctx.reader.values[slot]
        per_sample = counts.values(ctx.reader)
        check_range(counts.key, per_sample, n_rows, "images", ctx.where)
        given = exact_sum(per_sample, n_rows)
        check_range("num_crops", per_image_crops, n_rows, "crops", lambda i: f"image {i}")
        if exact_sum(per_image_crops, n_rows) + n_images != n_rows:
            raise ValueError(
                f"num_crops: {n_images} images + {exact_sum(per_image_crops)} crops = "
                f"{exact_sum(per_image_crops) + n_images} rows; expected {n_rows}, the rows of pixel_values {shape_of(pixels)}"
            )
        image_at = offsets(per_image_crops + 1)
        if given == n_images:  # counts of images
            item_at = offsets(per_sample)[ctx.at]
            row_at = image_at[item_at]
        else:  # counts of rows (placeholder blocks): every sample must start on an image
            if given != n_rows:
                check_counts(ctx, counts, per_sample, n_images, "images")
            sample_at = offsets(per_sample)
            item_of = np.searchsorted(image_at, sample_at)
            cut = np.flatnonzero(image_at[np.minimum(item_of, n_images)] != sample_at)
            if cut.size:
                s = int(cut[0])
                raise ValueError(
                    f"{counts.key}: {ctx.where(s)} starts at row {int(sample_at[s])} of pixel_values, inside an "
                    f"image's crops (num_crops); expected counts of images, or of rows that keep each image with its crops"
                )
            item_at, row_at = item_of[ctx.at], sample_at[ctx.at]
        return media_part(("pixel_values", "pixel_values", pixels), [("image_grid", "num_crops", crops)], item_at, row_at)

    return finish


# --------------------------------------------------------------------------------------------------
# videos


def plan_videos(ctx: Context, media: Media, counts: Counts | None) -> Callable[[], Part]:
    """Plan ``pixel_values_videos`` (patch rows per ``video_grid_thw`` row) and ``second_per_grid_ts``."""
    pixels: Tensor = media["pixel_values_videos"]
    grid: Tensor = media["video_grid_thw"]
    timing_keys = [k for k in TIMING_KEYS if media.get(k) is not None]
    if len(timing_keys) > 1:
        raise ValueError(f"video timing: got {' and '.join(timing_keys)}; expected at most one of them")
    timing_key = timing_keys[0] if timing_keys else "second_per_grid_ts"
    timing = media.get(timing_key)
    check_chunks_per_video(media.get("num_chunks_per_video"))
    if pixels.dim() < 2:
        raise ValueError(f"pixel_values_videos: shape {shape_of(pixels)}; expected at least 2 dims (patches first)")
    require_readable("video_grid_thw", grid)
    require_shape("video_grid_thw", grid, (None, 3), "[videos, 3] (t, h, w)")
    n_videos = grid.shape[0]
    if counts is None:
        counts = default_counts(ctx, "pixel_values_videos", n_videos, "videos", "n_videos_per_sample", "videos_per_sample")
    meta = [("video_grid", "video_grid_thw", grid)]
    if timing is not None:
        meta.append(("second_per_grid_ts", timing_key, video_timing(timing, n_videos, timing_key)))
    slot = ctx.reader.add(grid)
    pending: Counts = counts

    def finish() -> Part:
        per_sample = pending.values(ctx.reader)
        item_at = check_counts(ctx, pending, per_sample, n_videos, "videos")[ctx.at]
        table = ctx.reader.values[slot].reshape(n_videos, 3)
        locate = lambda i: ctx.where_item(per_sample, i)  # noqa: E731
        row_at = row_offsets("pixel_values_videos", "video_grid_thw", table, pixels.shape[0], locate)[item_at]
        return media_part(("pixel_values_videos", "pixel_values_videos", pixels), meta, item_at, row_at)

    return finish


def check_chunks_per_video(value: object) -> None:
    """``num_chunks_per_video`` (MiniMax-M3-VL, Kimi-K2.5: how many ``video_grid_thw`` rows each video
    spans), when present: a 1-D integer tensor or a sequence of ints. Shape only: a grid row is one video
    to the split, nothing stages it, and the adapters' ``media_counts`` check its values against the
    samples."""
    if value is None:
        return
    if isinstance(value, Tensor):
        if value.dim() != 1 or value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(
                f"num_chunks_per_video: shape {shape_of(value)}, dtype {value.dtype}; expected a 1-D integer "
                f"tensor [videos] (video_grid_thw rows per video)"
            )
    elif not isinstance(value, Sequence) or isinstance(value, (str, bytes)) or not all(type(v) is int for v in value):
        raise TypeError(
            f"num_chunks_per_video: got {type(value).__name__}; expected a [videos] integer tensor or a sequence of ints"
        )


def is_empty(value: object) -> bool:
    """An empty tensor or sequence (a batch without videos may carry an empty ``second_per_grid_ts``)."""
    if isinstance(value, Tensor):
        return value.numel() == 0
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes)) and len(value) == 0


def video_timing(value: object, n_videos: int, key: str = "second_per_grid_ts") -> Tensor:
    """``second_per_grid_ts`` as a ``[videos]`` tensor: a tensor as it is (its views are staged), a
    sequence of numbers as one new tensor on the host (as the processor's ``return_tensors="pt"``
    would make it). ``key`` names it in messages (``video_second_per_grid`` for the Qwen Omnis)."""
    if isinstance(value, Tensor):
        t = require_tensor(key, value)
        if t.dtype.is_complex or t.dtype == torch.bool:
            raise TypeError(f"{key}: dtype {t.dtype}; expected a real dtype (seconds per temporal patch)")
        require_shape(key, t, (n_videos,), f"[{n_videos}] (one entry per video of video_grid_thw)")
        return t
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise TypeError(f"{key}: got {type(value).__name__}; expected a [videos] tensor or a sequence of numbers")
    if len(value) != n_videos:
        raise ValueError(f"{key}: {len(value)} entries; expected {n_videos} (one entry per video of video_grid_thw)")
    for i, v in enumerate(value):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
            raise TypeError(f"{key}: video {i} is {v!r} ({type(v).__name__}); expected a number of seconds")
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{key}: video {i} is {v!r}; expected a finite number of seconds >= 0")
    return torch.tensor([float(v) for v in value]) if n_videos else torch.zeros(0)


# --------------------------------------------------------------------------------------------------
# Step3 crop patches


def plan_step3(ctx: Context, media: Media, counts: Counts | None = None) -> Callable[[], Part]:
    """Plan Step3's ``patch_pixel_values`` / ``patch_newline_mask`` by ``num_patches`` crops per sample.

    ``num_patches`` is staged per sample (kind ``"sample"``): a microbatch with neither images nor crops
    gets it empty, so it stays text-only for the consumer. Selected whenever one of the three keys is
    in the batch (the layout requires none), so the checks of missing keys are this planner's.
    """
    crops, num_patches, newline = media.get("patch_pixel_values"), media.get("num_patches"), media.get("patch_newline_mask")
    B = ctx.batch_size
    if num_patches is None:
        if crops is not None:
            raise ValueError(f"patch_pixel_values: shape {shape_of(crops)} given without num_patches; expected num_patches [{B}]")
        assert newline is not None
        raise ValueError(f"patch_newline_mask: shape {shape_of(newline)} given without patch_pixel_values")
    require_readable("num_patches", num_patches)
    require_shape("num_patches", num_patches, (B,), f"[{B}] (crop patches per sample)")
    if crops is not None and crops.dim() < 1:
        raise ValueError(f"patch_pixel_values: shape {shape_of(crops)}; expected [patches, C, h, w]")
    if newline is not None:
        if crops is None:
            raise ValueError(f"patch_newline_mask: shape {shape_of(newline)} given without patch_pixel_values")
        require_shape("patch_newline_mask", newline, (crops.shape[0],), f"[{crops.shape[0]}] (one entry per crop patch)")
    slot = ctx.reader.add(num_patches)
    n_crops = crops.shape[0] if crops is not None else 0

    def finish() -> Part:
        per_sample = ctx.reader.values[slot]
        check_range("num_patches", per_sample, n_crops, "crop patches", ctx.where)
        if exact_sum(per_sample, n_crops) != n_crops:
            raise ValueError(
                f"num_patches: sums to {exact_sum(per_sample)}; expected {n_crops}, the rows of patch_pixel_values "
                f"{shape_of(crops) if crops is not None else '(absent)'} (whole batch)"
            )
        crop_ranges, rows = _cut(offsets(per_sample)[ctx.at])
        sample_ranges, samples = _cut(ctx.at)
        fields = [FieldSplit("num_patches", "num_patches", num_patches, sample_ranges, samples, "sample")]
        for name, t in (("patch_pixel_values", crops), ("patch_newline_mask", newline)):
            if t is not None:
                fields.append(FieldSplit(name, name, t, crop_ranges, rows))
        return Part(fields, (0,) * len(rows), rows)

    return finish
