"""Property tests over random batches: chunk k holds exactly the media of tensor_split row group k."""

import torch
from hypothesis import given, settings, strategies as st

from conftest import same_storage
from ppmedia import HostReadCounter, next_vlm_media_chunk, split_media, stage_media


@st.composite
def batches(draw):
    B = draw(st.integers(1, 12))
    n = draw(st.integers(1, B))
    images = draw(st.lists(st.integers(0, 3), min_size=B, max_size=B))
    videos = draw(st.lists(st.integers(0, 1), min_size=B, max_size=B))
    grid = [[1, draw(st.integers(1, 3)), draw(st.integers(1, 3))] for _ in range(sum(images))]
    vgrid = [[draw(st.integers(1, 2)), draw(st.integers(1, 2)), 2] for _ in range(sum(videos))]
    with_counts_tensor = draw(st.booleans())
    return B, n, images, videos, grid, vgrid, with_counts_tensor


def _rows(grid):
    return [t * h * w for t, h, w in grid]


@settings(max_examples=150, deadline=None)
@given(batches())
def test_chunks_follow_tensor_split(case):
    B, n, images, videos, grid, vgrid, as_tensor = case
    pv = torch.randn(sum(_rows(grid)), 5)
    vpv = torch.randn(sum(_rows(vgrid)), 5)
    batch = {"input_ids": torch.arange(B * 2).reshape(B, 2)}
    if grid:
        batch["pixel_values"], batch["image_grid_thw"] = pv, torch.tensor(grid)
    if vgrid:
        batch["pixel_values_videos"], batch["video_grid_thw"] = vpv, torch.tensor(vgrid)
    counts = (torch.tensor(images), torch.tensor(videos)) if as_tensor else (images, videos)
    with HostReadCounter() as reads:
        staged = split_media(batch, n, images_per_sample=counts[0], videos_per_sample=counts[1])
    assert reads.total <= 1

    module = torch.nn.Linear(1, 1)
    got = []
    with stage_media(module, staged):
        for _ in range(n):
            got.append(next_vlm_media_chunk(module))
    assert len(got) == n

    image_rows, video_rows = _rows(grid), _rows(vgrid)
    pieces = {"pv": [], "vpv": []}
    for k, samples in enumerate(torch.tensor_split(torch.arange(B), n)):
        s = samples.tolist()
        lo, hi = (s[0], s[-1] + 1) if s else (0, 0)
        i0, i1 = sum(images[:lo]), sum(images[:hi]) if s else 0
        v0, v1 = sum(videos[:lo]), sum(videos[:hi]) if s else 0
        if not s:
            i0 = i1 = v0 = v1 = 0
        want_pv = pv[sum(image_rows[:i0]):sum(image_rows[:i1])]
        want_vpv = vpv[sum(video_rows[:v0]):sum(video_rows[:v1])]
        chunk = got[k]
        if want_pv.numel() == 0 and want_vpv.numel() == 0:
            assert chunk is None  # text-only microbatch
            continue
        for attr, want, grid_attr, want_grid, key in (
            ("pixel_values", want_pv, "image_grid", grid[i0:i1], "pv"),
            ("pixel_values_videos", want_vpv, "video_grid", vgrid[v0:v1], "vpv"),
        ):
            value = getattr(chunk, attr)
            if want.numel() == 0:
                assert value is None and getattr(chunk, grid_attr) is None
            else:
                assert torch.equal(value, want) and same_storage(value, want)
                assert getattr(chunk, grid_attr).tolist() == want_grid
                pieces[key].append(value)
    # the non-empty chunks concatenate back to the originals
    if pieces["pv"]:
        assert torch.equal(torch.cat(pieces["pv"]), pv)
    if pieces["vpv"]:
        assert torch.equal(torch.cat(pieces["vpv"]), vpv)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 10), st.integers(1, 6), st.data())
def test_step3_crops_follow_samples(B, n, data):
    n = min(n, B)
    has_image = data.draw(st.lists(st.booleans(), min_size=B, max_size=B))
    crops = [data.draw(st.integers(0, 3)) if img else 0 for img in has_image]
    pv = torch.randn(sum(has_image), 3, 4, 4)
    cp = torch.randn(sum(crops), 3, 2, 2)
    batch = {"input_ids": torch.zeros(B, 2), "pixel_values": pv, "patch_pixel_values": cp,
             "num_patches": torch.tensor(crops), "patch_newline_mask": torch.zeros(sum(crops), dtype=torch.bool),
             "n_images_per_sample": torch.tensor([int(x) for x in has_image])}
    staged = split_media(batch, n)
    for k, samples in enumerate(torch.tensor_split(torch.arange(B), n)):
        s = samples.tolist()
        chunk = staged.chunk(k)
        n_img = sum(has_image[i] for i in s)
        n_crop = sum(crops[i] for i in s)
        if n_img == 0 and n_crop == 0:
            assert chunk is None
            continue
        assert (chunk.pixel_values.shape[0] if chunk.pixel_values is not None else 0) == n_img
        assert chunk.num_patches.tolist() == [crops[i] for i in s]
        assert (chunk.patch_pixel_values.shape[0] if chunk.patch_pixel_values is not None else 0) == n_crop
