"""Malformed batches of every layout (hypothesis): split_media refuses them all or nothing.

Each example builds a valid batch of one layout (checked to split), breaks it in one way (overflow,
wrong dtype, meta device, wrong length, a value only exact arithmetic catches, a key left over with the
wrong dim 0, ...) and asserts: only ValueError/TypeError, the message names the broken key, and the
batch is exactly as it was (same keys, same objects, same data).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, settings, strategies as st

from ppmedia import split_media

EXAMPLES = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# 2**64 + 1 = 274177 * 67280421310721: a grid row [p, 274177, 67280421310721] has the product
# p * (2**64 + 1), which int64 arithmetic wraps to exactly p. Only an exact check refuses it.
WRAP_A, WRAP_B = 274177, 67280421310721
INT64_MAX = 2**63 - 1


@dataclass
class Case:
    """A valid batch, the split's arguments, and which key plays which role."""

    batch: dict[str, Any]
    n: int
    kwargs: dict[str, Any] = field(default_factory=dict)
    pixels: str = "pixel_values"
    grid: str | None = None  # metadata whose values the split reads (a patch grid, num_crops, ...)
    unread: str | None = None  # metadata checked by shape only (image_sizes, image_position_ids)
    counts: str | None = None  # the counts' key in the batch, or the argument's name
    patch_rows: bool = False  # the grid's products give the rows

    @property
    def B(self) -> int:
        return self.batch["input_ids"].shape[0]

    def counts_value(self) -> Any:
        return self.batch[self.counts] if self.counts in self.batch else self.kwargs.get(self.counts)

    def set_counts(self, value: Any) -> None:
        if self.counts in self.batch:
            self.batch[self.counts] = value
        else:
            self.kwargs[self.counts] = value


def _counts(draw: Any, B: int, high: int) -> list[int]:
    return draw(st.lists(st.integers(0, high), min_size=B, max_size=B))


def _place_counts(draw: Any, case: Case, counts: list[int], batch_key: str, arg: str) -> None:
    where = draw(st.sampled_from(["batch", "tensor", "list"]))
    if where == "batch":
        case.batch[batch_key], case.counts = torch.tensor(counts), batch_key
    else:
        case.kwargs[arg], case.counts = (torch.tensor(counts) if where == "tensor" else list(counts)), arg


def _base(draw: Any) -> tuple[int, int, dict[str, Any]]:
    B = draw(st.integers(1, 6))
    n = draw(st.integers(1, B))
    return B, n, {"input_ids": torch.zeros(B, 3, dtype=torch.long), "labels": torch.zeros(B, 3, dtype=torch.long)}


@st.composite
def patch_rows(draw: Any) -> Case:
    """Qwen-style flat patch rows [patches, D] with image_grid_thw, or Kimi patch-major with image_grid_hws."""
    B, n, batch = _base(draw)
    counts = _counts(draw, B, 2)
    key = draw(st.sampled_from(["image_grid_thw", "image_grid_hws"]))
    cols = 3 if key == "image_grid_thw" else 2
    grid = [[draw(st.integers(1, 2)) for _ in range(cols)] for _ in range(sum(counts))]
    rows = sum(torch.tensor(g).prod().item() for g in grid)
    batch["pixel_values"] = torch.randn(rows, 4) if cols == 3 else torch.randn(rows, 3, 2, 2)
    batch[key] = torch.tensor(grid, dtype=torch.long).reshape(-1, cols)
    case = Case(batch, n, grid=key, patch_rows=True)
    _place_counts(draw, case, counts, "n_images_per_sample", "images_per_sample")
    return case


@st.composite
def image_major(draw: Any) -> Case:
    """One row per image: LLaVA-NeXT crops + image_sizes, Mistral padded images + image_sizes, padded
    patches + image_position_ids, or complete images without metadata (one per sample)."""
    B, n, batch = _base(draw)
    kind = draw(st.sampled_from(["llava_next", "mistral3", "positions", "plain"]))
    counts = [1] * B if kind == "plain" else _counts(draw, B, 2)
    images = sum(counts)
    case = Case(batch, n)
    if kind == "llava_next":
        batch["pixel_values"] = torch.randn(images, 3, 3, 4, 4)
    elif kind == "positions":
        batch["pixel_values"] = torch.randn(images, 5, 6)
        batch["image_position_ids"], case.unread = torch.zeros(images, 5, 2, dtype=torch.long), "image_position_ids"
    else:
        batch["pixel_values"] = torch.randn(images, 3, 8, 8)
    if kind in ("llava_next", "mistral3"):
        batch["image_sizes"], case.unread = torch.randint(4, 9, (images, 2)), "image_sizes"
    if kind != "plain" or draw(st.booleans()):
        _place_counts(draw, case, counts, "n_images_per_sample", "images_per_sample")
    return case


@st.composite
def pan_and_scan(draw: Any) -> Case:
    """Gemma 3: images + their crops as rows, num_crops [images]; counts of images or of rows."""
    B, n, batch = _base(draw)
    counts = _counts(draw, B, 2)
    crops = draw(st.lists(st.integers(0, 2), min_size=sum(counts), max_size=sum(counts)))
    batch["pixel_values"] = torch.randn(sum(counts) + sum(crops), 3, 4, 4)
    batch["num_crops"] = torch.tensor(crops, dtype=torch.long)
    case = Case(batch, n, grid="num_crops")
    if draw(st.booleans()):  # rows per sample, as placeholder blocks count them
        it = iter(crops)
        counts = [sum(1 + next(it) for _ in range(c)) for c in counts]
    _place_counts(draw, case, counts, "n_images_per_sample", "images_per_sample")
    return case


@st.composite
def videos(draw: Any) -> Case:
    """Videos: flat patch rows with video_grid_thw and second_per_grid_ts (a tensor or a list)."""
    B, n, batch = _base(draw)
    counts = _counts(draw, B, 2)
    grid = [[draw(st.integers(1, 2)), draw(st.integers(1, 2)), 2] for _ in range(sum(counts))]
    batch["pixel_values_videos"] = torch.randn(sum(t * h * w for t, h, w in grid), 4)
    batch["video_grid_thw"] = torch.tensor(grid, dtype=torch.long).reshape(-1, 3)
    seconds = [draw(st.sampled_from([0.5, 1.0, 2.0])) for _ in grid]
    batch["second_per_grid_ts"] = torch.tensor(seconds) if draw(st.booleans()) else seconds
    case = Case(batch, n, pixels="pixel_values_videos", grid="video_grid_thw", patch_rows=True)
    _place_counts(draw, case, counts, "n_videos_per_sample", "videos_per_sample")
    return case


@st.composite
def step3(draw: Any) -> Case:
    """Step3: one global view per image, crop patches per sample (num_patches), newline mask."""
    B, n, batch = _base(draw)
    has = draw(st.lists(st.booleans(), min_size=B, max_size=B))
    crops = [draw(st.integers(0, 2)) if h else 0 for h in has]
    batch.update(pixel_values=torch.randn(sum(has), 3, 4, 4), patch_pixel_values=torch.randn(sum(crops), 3, 2, 2),
                 num_patches=torch.tensor(crops), patch_newline_mask=torch.zeros(sum(crops), dtype=torch.bool))
    case = Case(batch, n, grid="num_patches")
    _place_counts(draw, case, [int(h) for h in has], "n_images_per_sample", "images_per_sample")
    return case


# -------------------------------------------------------------------------------------- breakages
# Each takes (case, draw) and returns the keys one of which the message must name, or None when it
# does not apply to this case.

Breakage = Callable[[Case, Any], "set[str] | None"]


def wrapping_grid_row(case: Case, draw: Any) -> set[str] | None:
    grid = case.batch.get(case.grid) if case.patch_rows else None
    if grid is None or grid.shape[0] == 0:
        return None
    products = grid.prod(-1)
    assume(int(products.sum()) != grid.shape[0])  # else one row per item is a valid reading
    i = draw(st.integers(0, grid.shape[0] - 1))
    p = int(products[i])
    row = [p, WRAP_A, WRAP_B] if grid.shape[1] == 3 else [p * WRAP_A, WRAP_B]
    assert torch.tensor(row).prod() == p  # int64 wraps to the right product
    grid = grid.clone()
    grid[i] = torch.tensor(row)
    case.batch[case.grid] = grid
    return {case.grid}


def nonpositive_grid_entry(case: Case, draw: Any) -> set[str] | None:
    grid = case.batch.get(case.grid) if case.patch_rows else None
    if grid is None or grid.shape[0] == 0:
        return None
    grid = grid.clone()
    grid[draw(st.integers(0, grid.shape[0] - 1)), draw(st.integers(0, grid.shape[1] - 1))] = draw(st.sampled_from([0, -1, -(2**62)]))
    case.batch[case.grid] = grid
    return {case.grid}


def wrapping_counts(case: Case, draw: Any) -> set[str] | None:
    """Counts whose int64 sum wraps to the right total: [2**63 - 1, 2**63 - 1, c0 + c1 + c2 + 2, ...]."""
    value = case.counts_value()
    if case.B < 3 or value is None:
        return None
    c = [int(v) for v in value]
    wrapped = [INT64_MAX, INT64_MAX, c[0] + c[1] + c[2] + 2, *c[3:]]
    assert int(torch.tensor(wrapped).sum()) == sum(c)
    case.set_counts(torch.tensor(wrapped) if isinstance(value, torch.Tensor) else wrapped)
    return {case.counts}


def absurd_count(case: Case, draw: Any) -> set[str] | None:
    value = case.counts_value()
    if value is None:
        return None
    c = [int(v) for v in value]
    s = draw(st.integers(0, case.B - 1))
    c[s] = draw(st.sampled_from([2**63 - 1, 10**6])) if isinstance(value, torch.Tensor) else draw(st.sampled_from([2**64, 2**63, -1]))
    case.set_counts(torch.tensor(c) if isinstance(value, torch.Tensor) else c)
    return {case.counts}


def count_not_an_int(case: Case, draw: Any) -> set[str] | None:
    value = case.counts_value()
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        case.set_counts(value.to(draw(st.sampled_from([torch.float32, torch.bool, torch.uint64]))))
    else:
        c: list[Any] = list(value)
        s = draw(st.integers(0, case.B - 1))
        c[s] = draw(st.sampled_from([float(c[s]) + 0.9, True, None, "1"]))
        case.set_counts(c)
    return {case.counts}


def counts_wrong_length(case: Case, draw: Any) -> set[str] | None:
    value = case.counts_value()
    if value is None:
        return None
    c = [int(v) for v in value]
    c = c[:-1] if draw(st.booleans()) else [*c, 0]
    case.set_counts(torch.tensor(c, dtype=torch.long) if isinstance(value, torch.Tensor) else c)
    return {case.counts}


def counts_off_by_one(case: Case, draw: Any) -> set[str] | None:
    value = case.counts_value()
    if value is None or case.grid == "num_crops":  # with num_crops, rows are also valid counts
        return None
    c = [int(v) for v in value]
    c[draw(st.integers(0, case.B - 1))] += 1
    case.set_counts(torch.tensor(c) if isinstance(value, torch.Tensor) else c)
    return {case.counts}


def metadata_dtype(case: Case, draw: Any) -> set[str] | None:
    keys = [k for k in (case.grid, case.unread) if k is not None and k in case.batch]
    if not keys:
        return None
    key = draw(st.sampled_from(keys))
    case.batch[key] = case.batch[key].to(draw(st.sampled_from([torch.float32, torch.bool, torch.complex64, torch.uint64])))
    return {key}


def metadata_on_meta(case: Case, draw: Any) -> set[str] | None:
    """Metadata whose values the split reads, on the meta device (no data)."""
    keys = [k for k in (case.grid,) if k is not None and k in case.batch]
    value = case.counts_value()
    if isinstance(value, torch.Tensor):
        keys.append(case.counts)
    if not keys:
        return None
    key = draw(st.sampled_from(keys))
    if key == case.counts:
        case.set_counts(value.to("meta"))
    else:
        case.batch[key] = case.batch[key].to("meta")
    return {key}


def pixel_rows_off(case: Case, draw: Any) -> set[str] | None:
    pixels = case.batch.get(case.pixels)
    if pixels is None:
        return None
    extra = 1 if case.patch_rows or pixels.shape[0] == 0 else draw(st.sampled_from([1, -1]))
    rows = pixels.shape[0] + extra
    assume(not (case.patch_rows and rows == case.batch[case.grid].shape[0]))  # one row per item: valid
    assume(rows > 0 or case.counts is not None or bool(case.kwargs))  # no images, nothing counting them: valid
    case.batch[case.pixels] = torch.randn(rows, *pixels.shape[1:])
    return {case.pixels, case.grid, case.unread, case.counts} - {None}  # type: ignore[return-value]


def metadata_rows_off(case: Case, draw: Any) -> set[str] | None:
    keys = [k for k in (case.grid, case.unread, "patch_newline_mask", "second_per_grid_ts") if k is not None and k in case.batch]
    if not keys:
        return None
    key = draw(st.sampled_from(keys))
    value = case.batch[key]
    if isinstance(value, list):
        case.batch[key] = [*value, 1.0]
    else:
        case.batch[key] = torch.cat([value, value[:1]]) if value.shape[0] else torch.zeros(1, *value.shape[1:], dtype=value.dtype)
    return {key, case.pixels, case.counts, "patch_pixel_values"} - {None}  # type: ignore[return-value]


def not_a_tensor(case: Case, draw: Any) -> set[str] | None:
    keys = [k for k in (case.pixels, case.grid, case.unread) if k is not None and k in case.batch]
    key = draw(st.sampled_from(keys))
    value = case.batch[key]
    case.batch[key] = draw(st.sampled_from([value.tolist(), list(value), value.numpy(), value.to_sparse()]))
    return {key}


def bad_timing(case: Case, draw: Any) -> set[str] | None:
    value = case.batch.get("second_per_grid_ts")
    if value is None or len(value) == 0:
        return None
    if isinstance(value, torch.Tensor):
        case.batch["second_per_grid_ts"] = draw(st.sampled_from([value[:-1], value.bool(), value.reshape(-1, 1), value.to(torch.complex64)]))
    else:
        broken = list(value)
        broken[draw(st.integers(0, len(value) - 1))] = draw(st.sampled_from([float("nan"), -1.0, "1", None, True]))
        case.batch["second_per_grid_ts"] = broken
    return {"second_per_grid_ts"}


def left_over_key(case: Case, draw: Any) -> set[str] | None:
    """A tensor that would stay in the batch without B on dim 0."""
    B = case.B
    key, value = draw(st.sampled_from([
        ("position_ids", torch.zeros(3, B, 3, dtype=torch.long)),
        ("vision_attention_mask", torch.ones(B + 1, 4, 4, dtype=torch.bool)),  # (pixel_attention_mask is Idefics3's media)
        ("image_embeds_position_mask", torch.zeros(B + 2, 3)),
        ("num_items_in_batch", torch.tensor(7)),
    ]))
    if value.dim() and value.shape[0] == B:
        return None
    case.batch[key] = value
    return {key}


def bad_microbatches(case: Case, draw: Any) -> set[str] | None:
    case.n = draw(st.sampled_from([0, -1, case.B + 1, 2**62]))
    return {"n_microbatches"}


COMMON: list[Breakage] = [
    wrapping_counts, absurd_count, count_not_an_int, counts_wrong_length, metadata_dtype, metadata_on_meta,
    pixel_rows_off, metadata_rows_off, not_a_tensor, left_over_key, bad_microbatches,
]
GRIDS: list[Breakage] = [wrapping_grid_row, nonpositive_grid_entry, counts_off_by_one]


def _snapshot(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) and v.device.type != "meta" and v.layout == torch.strided else v
            for k, v in batch.items()}


def _refused_all_or_nothing(case: Case, data: st.DataObject, breakages: list[Breakage]) -> None:
    split_media(dict(case.batch), case.n, **case.kwargs)  # the unbroken case splits
    breakage = data.draw(st.sampled_from(breakages))
    keys = breakage(case, data.draw)
    assume(keys is not None)
    assert keys is not None
    event(breakage.__name__)
    before, objects, snapshot = list(case.batch), dict(case.batch), _snapshot(case.batch)
    with pytest.raises((ValueError, TypeError)) as raised:
        split_media(case.batch, case.n, **case.kwargs)
    assert type(raised.value) in (ValueError, TypeError), repr(raised.value)
    message = str(raised.value)
    assert any(key in message for key in keys), (breakage.__name__, keys, message)
    assert list(case.batch) == before
    assert all(case.batch[k] is objects[k] for k in before)
    for k, v in snapshot.items():
        if isinstance(v, torch.Tensor) and v is not objects[k]:
            assert torch.equal(objects[k], v), k  # no in-place change


@EXAMPLES
@given(patch_rows(), st.data())
def test_patch_rows_refused_all_or_nothing(case: Case, data: st.DataObject) -> None:
    _refused_all_or_nothing(case, data, COMMON + GRIDS)


@EXAMPLES
@given(image_major(), st.data())
def test_image_major_refused_all_or_nothing(case: Case, data: st.DataObject) -> None:
    _refused_all_or_nothing(case, data, COMMON + [counts_off_by_one])


@EXAMPLES
@given(pan_and_scan(), st.data())
def test_pan_and_scan_refused_all_or_nothing(case: Case, data: st.DataObject) -> None:
    _refused_all_or_nothing(case, data, COMMON)


@EXAMPLES
@given(videos(), st.data())
def test_videos_refused_all_or_nothing(case: Case, data: st.DataObject) -> None:
    _refused_all_or_nothing(case, data, COMMON + GRIDS + [bad_timing])


@EXAMPLES
@given(step3(), st.data())
def test_step3_refused_all_or_nothing(case: Case, data: st.DataObject) -> None:
    _refused_all_or_nothing(case, data, COMMON + [counts_off_by_one])
