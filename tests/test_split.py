"""split_media: every layout of the contract, the tensor_split rule, views, one host read, errors."""

import pickle

import pytest
import torch
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

from conftest import same_storage
from ppmedia import HostReadCounter, MEDIA_KEYS, microbatch_bounds, split_media


@pytest.mark.parametrize("B", range(1, 13))
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_bounds_follow_the_schedule_split(B, n):
    rows = torch.arange(B)
    if n <= B:
        chunks, _ = split_args_kwargs_into_chunks((rows,), {}, n)
        expected = [c[0].tolist() for c in chunks]
    else:
        expected = [t.tolist() for t in torch.tensor_split(rows, n)]
    bounds = microbatch_bounds(B, n)
    assert [list(range(a, b)) for a, b in zip(bounds, bounds[1:])] == expected


def _ids(B, S=5):
    return torch.zeros(B, S, dtype=torch.long)


def test_flat_patch_rows_uneven_batch():
    # B=10, n=4 -> samples 3,3,2,2 (tensor_split), not ceil-division's 3,3,3,1
    counts = [1, 0, 2, 1, 1, 0, 0, 1, 1, 1]
    grid = torch.tensor([[1, 2, 2 + i % 3] for i in range(sum(counts))])
    rows = grid.prod(-1)
    pv = torch.randn(int(rows.sum()), 7)
    batch = {"input_ids": _ids(10), "labels": _ids(10), "pixel_values": pv, "image_grid_thw": grid}
    staged = split_media(batch, 4, images_per_sample=counts)
    assert set(batch) == {"input_ids", "labels"}
    assert staged.samples == ((0, 3), (3, 6), (6, 8), (8, 10))
    assert staged.images == (3, 2, 1, 2)
    cum = [0, *torch.cumsum(rows, 0).tolist()]
    assert staged.ranges["pixel_values"] == ((0, cum[3]), (cum[3], cum[5]), (cum[5], cum[6]), (cum[6], cum[8]))
    for k in range(4):
        chunk = staged.chunk(k)
        assert same_storage(chunk.pixel_values, pv) and same_storage(chunk.image_grid, grid)


def test_patch_major_with_hws_grid():
    grid = torch.tensor([[2, 2], [2, 4], [4, 2]])
    pv = torch.randn(20, 3, 4, 4)
    staged = split_media({"input_ids": _ids(3), "pixel_values": pv, "image_grid_hws": grid}, 3)
    assert staged.image_rows == (4, 8, 8) and staged.sources["image_grid"] == "image_grid_hws"
    assert staged.chunk(2).pixel_values.shape == (8, 3, 4, 4)


def test_complete_images_one_per_sample_without_grid():
    pv = torch.randn(4, 3, 8, 8)
    staged = split_media({"input_ids": _ids(4), "pixel_values": pv}, 2)
    assert staged.images == (2, 2) and "image_grid" not in staged.tensors
    assert staged.chunk(1).pixel_values.data_ptr() == pv[2].data_ptr()


def test_image_major_with_thw_grid_when_rows_equal_images():
    grid = torch.tensor([[1, 4, 4], [1, 2, 2]])
    pv = torch.randn(2, 3, 8, 8)  # complete images, grid only describes them
    staged = split_media({"input_ids": _ids(2), "pixel_values": pv, "image_grid_thw": grid}, 2)
    assert staged.image_rows == (1, 1)


def test_padded_patches_with_positions():
    pv = torch.randn(3, 16, 12)
    pos = torch.zeros(3, 16, 2, dtype=torch.long)
    staged = split_media({"input_ids": _ids(4), "pixel_values": pv, "image_position_ids": pos}, 2, images_per_sample=[2, 0, 0, 1])
    assert staged.images == (2, 1)
    assert staged.chunk(0).image_grid.shape == (2, 16, 2)


def test_llava_next_crops_with_sizes():
    pv = torch.randn(3, 5, 3, 16, 16)
    sizes = torch.tensor([[16, 32], [32, 32], [20, 10]])
    staged = split_media({"input_ids": _ids(3), "pixel_values": pv, "image_sizes": sizes}, 3)
    assert [staged.chunk(k).pixel_values.shape[0] for k in range(3)] == [1, 1, 1]
    assert torch.equal(staged.chunk(1).image_grid, sizes[1:2])


def test_step3_crops_per_sample_and_newline_mask():
    pv = torch.randn(3, 3, 8, 8)
    crops = torch.randn(7, 3, 4, 4)
    num = torch.tensor([4, 0, 0, 3])  # sample 1: image without crops; sample 2 text-only
    nl = torch.tensor([0, 1, 0, 1, 0, 0, 1], dtype=torch.bool)
    batch = {"input_ids": _ids(4), "pixel_values": pv, "patch_pixel_values": crops, "num_patches": num,
             "patch_newline_mask": nl, "n_images_per_sample": torch.tensor([1, 1, 0, 1])}
    staged = split_media(batch, 4)
    assert set(batch) == {"input_ids"}
    assert staged.crop_rows == (4, 0, 0, 3)
    c0, c1, c2, c3 = (staged.chunk(k) for k in range(4))
    assert c0.patch_pixel_values.shape[0] == 4 and c0.num_patches.tolist() == [4]
    assert c1.pixel_values.shape[0] == 1 and c1.patch_pixel_values is None and c1.num_patches.tolist() == [0]
    assert c2 is None  # text-only: an empty num_patches, not [0]
    assert torch.equal(c3.patch_newline_mask, nl[4:])


def test_videos_with_their_grid_beside_images():
    grid = torch.tensor([[1, 2, 2]])
    vgrid = torch.tensor([[2, 2, 2], [2, 2, 4]])
    batch = {"input_ids": _ids(2), "pixel_values": torch.randn(4, 6), "image_grid_thw": grid,
             "pixel_values_videos": torch.randn(24, 6), "video_grid_thw": vgrid}
    staged = split_media(batch, 2, images_per_sample=[1, 0], videos_per_sample=torch.tensor([0, 2]))
    assert staged.chunk(0).pixel_values_videos is None and staged.chunk(0).video_grid is None
    assert staged.chunk(1).pixel_values is None and staged.chunk(1).pixel_values_videos.shape[0] == 24


def test_one_host_read_per_batch_for_every_metadata():
    counts = torch.tensor([2, 0, 1, 1])
    grid = torch.tensor([[1, 2, 2]] * 4)
    batch = {"input_ids": _ids(4), "pixel_values": torch.randn(16, 3), "image_grid_thw": grid,
             "pixel_values_videos": torch.randn(8, 3), "video_grid_thw": torch.tensor([[2, 2, 2]]),
             "n_videos_per_sample": torch.tensor([0, 0, 0, 1]),
             "patch_pixel_values": torch.randn(2, 3, 2, 2), "num_patches": torch.tensor([0, 0, 2, 0])}
    with HostReadCounter() as reads:
        split_media(batch, 4, images_per_sample=counts)
    assert reads.total == 1, reads.counts


def test_no_host_read_when_nothing_needs_data():
    batch = {"input_ids": _ids(4), "pixel_values": torch.randn(4, 3, 8, 8), "image_sizes": torch.ones(4, 2, dtype=torch.long)}
    with HostReadCounter() as reads:
        split_media(batch, 2)
    assert reads.total == 0


def test_text_only_batch_stages_nothing():
    batch = {"input_ids": _ids(4)}
    staged = split_media(batch, 2)
    assert staged.tensors == {} and list(staged) == [None, None]


def test_pickle_keeps_views_of_one_storage():
    pv = torch.randn(8, 3)
    staged = split_media({"input_ids": _ids(2), "pixel_values": pv, "image_grid_thw": torch.tensor([[1, 2, 2], [1, 2, 2]])}, 2)
    back = pickle.loads(pickle.dumps(staged))
    assert torch.equal(back.chunk(1).pixel_values, pv[4:])
    assert same_storage(back.chunks["pixel_values"][0], back.chunks["pixel_values"][1])


def test_to_moves_whole_tensors_and_rebuilds_views():
    staged = split_media({"input_ids": _ids(2), "pixel_values": torch.randn(8, 3), "image_grid_thw": torch.tensor([[1, 2, 2], [1, 2, 2]])}, 2)
    with HostReadCounter() as reads:
        moved = staged.to("meta")
    assert reads.total == 0
    assert moved.chunk(1).pixel_values.device.type == "meta" and moved.ranges == staged.ranges


# ---------------------------------------------------------------------------------------- errors

def _qwen_batch(B=2):
    return {"input_ids": _ids(B), "pixel_values": torch.randn(8, 3), "image_grid_thw": torch.tensor([[1, 2, 2], [1, 2, 2]])}


@pytest.mark.parametrize("n, exc, msg", [(0, ValueError, "n_microbatches: got 0"), (1.5, TypeError, "n_microbatches"), (True, TypeError, "n_microbatches")])
def test_bad_microbatch_count(n, exc, msg):
    with pytest.raises(exc, match=msg):
        split_media(_qwen_batch(), n)


def _raises(batch, match, exc=ValueError, n=2, **kw):
    before = dict(batch)
    with pytest.raises(exc, match=match):
        split_media(batch, n, **kw)
    assert batch.keys() == before.keys()  # nothing popped on error


def test_pixels_with_nothing_mapping_them_to_samples():
    _raises(_qwen_batch(B=3), r"pixel_values: 2 images for a batch of 3 samples.*n_images_per_sample \[3\]")


def test_counts_not_summing_to_images():
    _raises(_qwen_batch(B=3), r"images_per_sample: counts sum to 3; expected 2", images_per_sample=[1, 1, 1])


def test_counts_wrong_length_and_negative():
    _raises(_qwen_batch(B=3), r"images_per_sample: 2 counts; expected 3", images_per_sample=[1, 1])
    _raises(_qwen_batch(B=3), r"sample 1 \(microbatch 0\) has -1", images_per_sample=torch.tensor([2, -1, 1]))


def test_grid_products_not_matching_rows():
    batch = _qwen_batch()
    batch["pixel_values"] = torch.randn(9, 3)
    _raises(batch, r"pixel_values: dim 0 is 9; expected 8 \(the sum of the image_grid_thw products")


@pytest.mark.parametrize("grid, match", [
    (torch.tensor([[1, 2, 2, 1], [1, 2, 2, 1]]), r"image_grid_thw: shape \[2, 4\]; expected \[images, 3\]"),
    (torch.tensor([[1, 2, 2], [1, 0, 4]]), r"image_grid_thw: row 1 \(sample 1, microbatch 1\) is \[1, 0, 4\]; expected positive"),
    (torch.tensor([[1, 2, 2], [1, -2, -2]]), r"row 1 \(sample 1, microbatch 1\) is \[1, -2, -2\]"),
])
def test_bad_grids(grid, match):
    batch = _qwen_batch()
    batch["image_grid_thw"] = grid
    _raises(batch, match)


def test_float_grid_is_a_type_error():
    batch = _qwen_batch()
    batch["image_grid_thw"] = batch["image_grid_thw"].float()
    _raises(batch, "image_grid_thw: dtype torch.float32; expected an integer dtype", TypeError)


def test_num_patches_wrong_length_and_sum():
    base = {"input_ids": _ids(2), "pixel_values": torch.randn(2, 3, 4, 4), "patch_pixel_values": torch.randn(3, 3, 2, 2)}
    _raises({**base, "num_patches": torch.tensor([3])}, r"num_patches: shape \[1\]; expected \[2\]")
    _raises({**base, "num_patches": torch.tensor([1, 1])}, r"num_patches: sums to 2; expected 3, the rows of patch_pixel_values \[3, 3, 2, 2\]")
    _raises(base, r"patch_pixel_values: shape \[3, 3, 2, 2\] given without num_patches")


def test_newline_mask_wrong_length():
    batch = {"input_ids": _ids(2), "pixel_values": torch.randn(2, 3, 4, 4), "patch_pixel_values": torch.randn(3, 3, 2, 2),
             "num_patches": torch.tensor([1, 2]), "patch_newline_mask": torch.zeros(4, dtype=torch.bool)}
    _raises(batch, r"patch_newline_mask: shape \[4\]; expected \[3\]")


def test_video_pixels_without_grid():
    _raises({"input_ids": _ids(2), "pixel_values_videos": torch.randn(8, 3)}, r"pixel_values_videos: shape \[8, 3\] given without video_grid_thw")


def test_list_where_a_tensor_is_expected():
    _raises({"input_ids": _ids(2), "pixel_values": [torch.randn(4, 3)] * 2}, "pixel_values: got list; expected a torch.Tensor", TypeError)


def test_two_image_metadata_keys():
    batch = _qwen_batch()
    batch["image_sizes"] = torch.ones(2, 2, dtype=torch.long)
    _raises(batch, "image metadata: got image_grid_thw and image_sizes")


def test_counts_in_batch_and_argument():
    batch = _qwen_batch()
    batch["n_images_per_sample"] = torch.tensor([1, 1])
    _raises(batch, "n_images_per_sample: given both", images_per_sample=[1, 1])


def test_media_keys_cover_the_issue_list():
    assert set(MEDIA_KEYS) >= {"pixel_values", "image_grid_thw", "image_grid_hws", "image_sizes", "image_position_ids",
                               "pixel_values_videos", "video_grid_thw", "patch_pixel_values", "num_patches",
                               "patch_newline_mask", "n_images_per_sample", "n_videos_per_sample"}


def test_videos_with_nothing_mapping_them_to_samples():
    batch = {"input_ids": _ids(3), "pixel_values_videos": torch.randn(16, 3), "video_grid_thw": torch.tensor([[2, 2, 2], [2, 2, 2]])}
    _raises(batch, r"pixel_values_videos: 2 videos for a batch of 3 samples.*n_videos_per_sample \[3\]")
