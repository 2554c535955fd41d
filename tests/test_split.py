"""split_media: every layout of the contract, the tensor_split rule, views, one host read, errors."""

import pickle

import numpy as np

import pytest
import torch
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

from conftest import same_storage
from ppmedia import HostReadCounter, MEDIA_KEYS, microbatch_bounds, next_vlm_media_chunk, split_media, stage_media


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
    # without a grid, LLaVA-OneVision's layout takes videos as items on axis 0: 8 of them need counts for 2 samples
    _raises({"input_ids": _ids(2), "pixel_values_videos": torch.randn(8, 3)},
            r"pixel_values_videos: 8 videos for a batch of 2 samples and nothing maps them to samples; expected n_videos_per_sample \[2\]")


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


# ------------------------------------------------------------------------- exact integer arithmetic

def _unchanged_after(batch, exc, match, n=2, **kw):
    objects = dict(batch)
    with pytest.raises(exc, match=match) as raised:
        split_media(batch, n, **kw)
    assert list(batch) == list(objects) and all(batch[k] is objects[k] for k in objects)
    return str(raised.value)


def test_grid_products_never_wrap():
    # int64 products: 2**80 + 4 rows would be accepted by a wrapping sum check only by chance; here
    # the issue's case, where the old code split rows (0, 4) without complaint.
    batch = {"input_ids": _ids(2), "pixel_values": torch.randn(4, 6), "image_grid_thw": torch.tensor([[1, 2**40, 2**40], [1, 2, 2]])}
    message = _unchanged_after(batch, ValueError, r"image_grid_thw: row 0 \(sample 0, microbatch 0\) is \[1, 1099511627776, 1099511627776\]")
    assert "exceeds the 4 rows of pixel_values" in message


def test_grid_product_that_wraps_to_the_right_total():
    # 4 * (2**64 + 1) wraps to 4 in int64: only exact arithmetic sees the row is absurd
    grid = torch.tensor([[1, 2, 2], [4, 274177, 67280421310721]])
    assert int(grid.prod(-1).sum()) == 8
    batch = {"input_ids": _ids(2), "pixel_values": torch.randn(8, 6), "image_grid_thw": grid}
    _unchanged_after(batch, ValueError, r"image_grid_thw: row 1 \(sample 1, microbatch 1\)")


def test_counts_that_wrap_are_refused():
    batch = {"input_ids": _ids(3), "pixel_values": torch.randn(8, 6), "image_grid_thw": torch.tensor([[1, 2, 2]] * 2),
             "n_images_per_sample": torch.tensor([2**63 - 1, 2**63 - 1, 4])}
    _unchanged_after(batch, ValueError, r"n_images_per_sample: sample 0 \(microbatch 0\) has 9223372036854775807 images; expected 0..2", n=1)


def test_num_patches_that_wrap_are_refused():
    batch = {"input_ids": _ids(3), "pixel_values": torch.randn(3, 3, 4, 4), "patch_pixel_values": torch.randn(2, 3, 2, 2),
             "num_patches": torch.tensor([2**63 - 1, 2**63 - 1, 4])}
    _unchanged_after(batch, ValueError, r"num_patches: sample 0 \(microbatch 0\) has 9223372036854775807 crop patches")


def test_metadata_on_meta_names_the_key():
    batch = _qwen_batch()
    batch["image_grid_thw"] = batch["image_grid_thw"].to("meta")
    _unchanged_after(batch, ValueError, r"image_grid_thw: shape \[2, 3\] on the meta device")
    # pixels on meta are fine: only their shape is used
    staged = split_media({"input_ids": _ids(2), "pixel_values": torch.randn(8, 3, device="meta"),
                          "image_grid_thw": torch.tensor([[1, 2, 2], [1, 2, 2]])}, 2)
    assert staged.chunk(1).pixel_values.device.type == "meta"


# ----------------------------------------------------------------------------- strict count arguments

@pytest.mark.parametrize("counts, exc, match", [
    ([1.9, 1.2], TypeError, r"images_per_sample: sample 0 \(microbatch 0\) is 1.9 \(float\); expected an int"),
    ([None, 2], TypeError, r"images_per_sample: sample 0 \(microbatch 0\) is None"),
    ([True, 1], TypeError, r"images_per_sample: sample 0 \(microbatch 0\) is True \(bool\)"),
    ([2, "1"], TypeError, r"images_per_sample: sample 1 \(microbatch 1\) is '1'"),
    ([2**64, 2], ValueError, r"images_per_sample: sample 0 \(microbatch 0\) has 18446744073709551616"),
    ([-1, 3], ValueError, r"images_per_sample: sample 0 \(microbatch 0\) has -1"),
    (torch.tensor([1.0, 1.0]), TypeError, r"images_per_sample: dtype torch.float32"),
    (torch.tensor([True, True]), TypeError, r"images_per_sample: dtype torch.bool"),
    (torch.tensor([[1, 1]]), ValueError, r"images_per_sample: shape \[1, 2\]; expected \[2\]"),
    ("11", TypeError, r"images_per_sample: got str"),
])
def test_counts_are_ints_only(counts, exc, match):
    _unchanged_after(_qwen_batch(), exc, match, images_per_sample=counts)


def test_numpy_integers_are_ints():
    staged = split_media(_qwen_batch(), 2, images_per_sample=[np.int64(1), np.int32(1)])
    assert staged.images == (1, 1)


def test_back_to_back_images_hint():
    # 3 images; counts from placeholder runs see 2 (two images written back to back are one run)
    batch = {"input_ids": _ids(2), "pixel_values": torch.randn(3, 3, 4, 4), "image_sizes": torch.ones(3, 2, dtype=torch.long)}
    message = _unchanged_after(batch, ValueError, "images_per_sample: counts sum to 2; expected 3", images_per_sample=torch.tensor([1, 1]))
    assert "back to back" in message and "n_images_per_sample" in message


def test_video_counts_from_tokens_hint():
    # one 3-step video written as three timestamped blocks (Qwen3-VL): tokens count 3 videos
    batch = {"input_ids": _ids(2), "pixel_values_videos": torch.randn(12, 6), "video_grid_thw": torch.tensor([[3, 2, 2]])}
    message = _unchanged_after(batch, ValueError, r"videos_per_sample: sample 0 \(microbatch 0\) has 3 videos; expected 0..1", videos_per_sample=torch.tensor([3, 0]))
    assert "one block per temporal step" in message and "n_videos_per_sample" in message


def test_microbatches_beyond_samples_are_refused():
    _unchanged_after(_qwen_batch(), ValueError, r"n_microbatches: got 3 for a batch of 2 samples; expected 1..2", n=3)


# --------------------------------------------------------------------------------- video timing

def _video_batch(timing):
    return {"input_ids": _ids(3), "pixel_values_videos": torch.randn(16, 6),
            "video_grid_thw": torch.tensor([[2, 2, 2], [1, 2, 2], [2, 2, 1]]), "second_per_grid_ts": timing}


def test_second_per_grid_ts_tensor_is_split_with_its_videos():
    timing = torch.tensor([0.5, 1.0, 2.0])
    batch = _video_batch(timing)
    staged = split_media(batch, 2, videos_per_sample=[2, 0, 1])
    assert "second_per_grid_ts" not in batch and set(batch) == {"input_ids"}
    assert staged.videos == (2, 1) and staged.sources["second_per_grid_ts"] == "second_per_grid_ts"
    c0, c1 = staged.chunk(0), staged.chunk(1)
    assert c0.second_per_grid_ts.tolist() == [0.5, 1.0] and c1.second_per_grid_ts.tolist() == [2.0]
    assert same_storage(c0.second_per_grid_ts, timing)
    module = torch.nn.Linear(1, 1)
    with stage_media(module, staged):
        assert next_vlm_media_chunk(module).second_per_grid_ts is staged.chunks["second_per_grid_ts"][0]
        next_vlm_media_chunk(module)


def test_second_per_grid_ts_list_becomes_one_host_tensor():
    staged = split_media(_video_batch([0.5, 1, 2.0]), 3)
    whole = staged.tensors["second_per_grid_ts"]
    assert whole.device.type == "cpu" and whole.shape == (3,) and whole.dtype == torch.float32
    assert [staged.chunk(k).second_per_grid_ts.tolist() for k in range(3)] == [[0.5], [1.0], [2.0]]
    assert staged.chunk(1).video_grid.tolist() == [[1, 2, 2]]


@pytest.mark.parametrize("timing, exc, match", [
    ([0.5, 1.0], ValueError, r"second_per_grid_ts: 2 entries; expected 3"),
    (torch.tensor([0.5, 1.0]), ValueError, r"second_per_grid_ts: shape \[2\]; expected \[3\]"),
    ([0.5, float("nan"), 1.0], ValueError, r"second_per_grid_ts: video 1 is nan"),
    ([0.5, True, 1.0], TypeError, r"second_per_grid_ts: video 1 is True"),
    (torch.tensor([True, False, True]), TypeError, r"second_per_grid_ts: dtype torch.bool"),
])
def test_bad_second_per_grid_ts(timing, exc, match):
    _unchanged_after(_video_batch(timing), exc, match, n=3)


def test_second_per_grid_ts_without_videos():
    _unchanged_after({"input_ids": _ids(2), "second_per_grid_ts": [1.0]}, ValueError, "second_per_grid_ts: a list given without")
    _unchanged_after({"input_ids": _ids(2), "second_per_grid_ts": 1.0}, ValueError, "second_per_grid_ts: a float given without")
    for empty in ([], torch.zeros(0)):  # nothing to split: popped
        batch = {"input_ids": _ids(2), "second_per_grid_ts": empty}
        assert split_media(batch, 2).tensors == {} and set(batch) == {"input_ids"}


def test_zero_images_need_no_counts():
    batch = {"input_ids": _ids(3), "pixel_values": torch.zeros(0, 6), "image_grid_thw": torch.zeros(0, 3, dtype=torch.long)}
    staged = split_media(batch, 3)
    assert staged.images == (0, 0, 0) and list(staged) == [None, None, None]


def test_counts_in_the_batch_as_lists():
    batch = _qwen_batch(B=3)
    batch["n_images_per_sample"] = [1, 0, 1]
    assert split_media(batch, 3).images == (1, 0, 1) and "n_images_per_sample" not in batch
    batch = _qwen_batch(B=3)
    batch["n_images_per_sample"] = [1, 0.5, 1]
    _unchanged_after(batch, TypeError, r"n_images_per_sample: sample 1 \(microbatch 1\) is 0.5", n=3)


def test_numpy_count_arrays():
    assert split_media(_qwen_batch(), 2, images_per_sample=np.array([2, 0])).images == (2, 0)
    _unchanged_after(_qwen_batch(), TypeError, r"images_per_sample: sample 0 \(microbatch 0\) is 1.0 \(float\)",
                     images_per_sample=np.array([1.0, 1.0]))


# --------------------------------------------------------------------- Gemma 3 and Mistral 3 layouts

def _pan_and_scan_batch():
    # 3 samples: sample 0 one image with 2 crops, sample 1 text only, sample 2 two images (0 and 1 crops)
    return {"input_ids": _ids(3), "pixel_values": torch.randn(6, 3, 4, 4), "num_crops": torch.tensor([2, 0, 1])}


@pytest.mark.parametrize("counts", [[1, 0, 2], [3, 0, 3]], ids=["images", "rows"])
def test_pan_and_scan_rows_follow_num_crops(counts):
    batch = _pan_and_scan_batch()
    pv, crops = batch["pixel_values"], batch["num_crops"]
    staged = split_media(batch, 3, images_per_sample=counts)
    assert set(batch) == {"input_ids"}
    assert staged.images == (1, 0, 2) and staged.image_rows == (3, 0, 3)
    assert staged.sources["image_grid"] == "num_crops"
    assert staged.chunk(1) is None
    assert staged.chunk(2).pixel_values.data_ptr() == pv[3].data_ptr()
    assert staged.chunk(2).image_grid.tolist() == [0, 1] and same_storage(staged.chunk(2).image_grid, crops)


def test_pan_and_scan_counts_that_cut_an_image():
    message = _unchanged_after(_pan_and_scan_batch(), ValueError, r"images_per_sample: sample 1 \(microbatch 1\) starts at row 2",
                               n=3, images_per_sample=[2, 1, 3])
    assert "num_crops" in message


def test_pan_and_scan_rows_that_do_not_add_up():
    batch = _pan_and_scan_batch()
    batch["num_crops"] = torch.tensor([2, 0, 2])
    _unchanged_after(batch, ValueError, r"num_crops: 3 images \+ 4 crops = 7 rows; expected 6", n=3, images_per_sample=[1, 0, 2])


def test_mistral_padded_images_with_sizes():
    pv = torch.randn(3, 3, 32, 48)
    sizes = torch.tensor([[32, 48], [16, 16], [32, 16]])
    staged = split_media({"input_ids": _ids(2), "pixel_values": pv, "image_sizes": sizes}, 2, images_per_sample=[2, 1])
    assert staged.image_rows == (2, 1) and torch.equal(staged.chunk(1).image_grid, sizes[2:])
    batch = {"input_ids": _ids(2), "pixel_values": pv, "image_sizes": sizes[:2]}
    _unchanged_after(batch, ValueError, r"image_sizes: shape \[2, 2\]; expected \[3, 2\]", images_per_sample=[2, 1])


# ------------------------------------------------------------------- nothing mis-split left behind

def test_batch_first_keys_stay():
    B = 4
    batch = {"input_ids": _ids(B), "attention_mask": _ids(B), "labels": _ids(B), "token_type_ids": _ids(B),
             "mm_token_type_ids": _ids(B), "position_ids": torch.zeros(B, 3, 5, dtype=torch.long),
             "pixel_values": torch.randn(B, 3, 8, 8), "texts": ["a"] * B}
    split_media(batch, 2)
    assert set(batch) == {"input_ids", "attention_mask", "labels", "token_type_ids", "mm_token_type_ids", "position_ids", "texts"}


def test_mrope_positions_need_samples_first():
    batch = _qwen_batch()
    batch["position_ids"] = torch.zeros(3, 2, 5, dtype=torch.long)
    message = _unchanged_after(batch, ValueError, r"position_ids: shape \[3, 2, 5\]; expected \[2, \.\.\.\]")
    assert "transpose(0, 1)" in message and "adapter.position_ids" in message


@pytest.mark.parametrize("key, value", [
    ("image_embeds", torch.randn(5, 16)),
    ("num_items_in_batch", torch.tensor(12)),
])
def test_unknown_per_media_keys_are_refused(key, value):
    batch = _qwen_batch()
    batch[key] = value
    message = _unchanged_after(batch, ValueError, rf"{key}: shape {list(value.shape)}; expected \[2, \.\.\.\]".replace("[", r"\[").replace(r"\\[", r"\["))
    assert "take it out of the batch" in message


def test_a_pixel_attention_mask_beside_a_qwen_grid_is_refused():
    # pixel_attention_mask is Idefics3 / SmolVLM's (layout idefics3_images, samples on axis 0); beside
    # Qwen's image_grid_thw the batch matches two image layouts that both read pixel_values: refused
    batch = _qwen_batch()
    batch["pixel_attention_mask"] = torch.ones(5, 8, 8, dtype=torch.bool)
    _unchanged_after(batch, ValueError, r"image metadata: got image_grid_thw and pixel_attention_mask; expected at most one of "
                     r"them \(media layouts 'image_patch_rows_thw' and 'idefics3_images' all read pixel_values")


# -------------------------------------------------------------------- real image processors' output

def _images(sizes):
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def test_real_processor_outputs_split_per_image():
    from transformers import Gemma3ImageProcessorPil, PixtralImageProcessorPil, Qwen2VLImageProcessorPil

    images = _images([(40, 120), (64, 64), (30, 90), (50, 20)])
    per_sample = [2, 0, 1, 1]
    gemma = Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, do_pan_and_scan=True, pan_and_scan_min_crop_size=8,
                                    pan_and_scan_max_num_crops=4, pan_and_scan_min_ratio_to_activate=1.2)
    pixtral = PixtralImageProcessorPil(patch_size={"height": 16, "width": 16}, size={"longest_edge": 64})
    qwen = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)
    qwen3 = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 16)  # Qwen3-VL's
    for processor in (gemma, pixtral, qwen, qwen3):
        whole = dict(processor(images, return_tensors="pt"))
        assert "num_crops" not in whole or int(whole["num_crops"].sum()) > 0  # pan-and-scan rows present
        staged = split_media({"input_ids": _ids(4), **whole}, 4, images_per_sample=per_sample)
        # each image's own processor output equals its rows of the batch's split
        starts = [0, 2, 2, 3]
        for k in range(4):
            chunk = staged.chunk(k)
            own = [dict(processor(images[i:i + 1], return_tensors="pt")) for i in range(starts[k], starts[k] + per_sample[k])]
            if not own:
                assert chunk is None
                continue
            offset = 0
            for o in own:
                want = o["pixel_values"]
                got = chunk.pixel_values[offset : offset + want.shape[0]]
                if want.shape[1:] != got.shape[1:]:  # Pixtral pads to the batch's largest image
                    got = got[..., : want.shape[-2], : want.shape[-1]]
                assert torch.equal(got, want), type(processor).__name__
                offset += want.shape[0]
            assert offset == chunk.pixel_values.shape[0]
            meta = [k for k in whole if k != "pixel_values"][0]
            assert torch.equal(chunk.image_grid, torch.cat([o[meta] for o in own])), meta
