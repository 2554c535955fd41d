"""next_vlm_media_chunk against ../shared/CONTRACT.md, field by field."""

import dataclasses

import pytest
import torch

import ppmedia
from ppmedia import CURSOR_ATTRIBUTE, STAGED_ATTRIBUTES, HostReadCounter, VlmMediaChunk, next_vlm_media_chunk


def test_dataclass_fields_in_contract_order():
    names = [(f.name, f.default) for f in dataclasses.fields(VlmMediaChunk)]
    assert names == [
        ("pixel_values", dataclasses.MISSING),
        ("image_grid", dataclasses.MISSING),
        ("pixel_values_videos", dataclasses.MISSING),
        ("video_grid", dataclasses.MISSING),
        ("patch_pixel_values", None),
        ("num_patches", None),
        ("patch_newline_mask", None),
        ("second_per_grid_ts", None),  # ppmedia's addition after the seven contract fields
    ]


def test_seven_argument_constructor_still_works():
    t = torch.zeros(1)
    chunk = VlmMediaChunk(t, t, None, None, t, t, t)
    assert chunk.patch_newline_mask is t and chunk.second_per_grid_ts is None


def test_attribute_names_match_nemo_automodel_staging():
    assert STAGED_ATTRIBUTES == {
        "pixel_values": "_vlm_pixel_values_chunks",
        "image_grid": "_vlm_image_grid_hws_chunks",
        "pixel_values_videos": "_vlm_pixel_values_videos_chunks",
        "video_grid": "_vlm_video_grid_thw_chunks",
        "patch_pixel_values": "_vlm_patch_pixel_values_chunks",
        "num_patches": "_vlm_num_patches_chunks",
        "patch_newline_mask": "_vlm_patch_newline_mask_chunks",
        "second_per_grid_ts": "_vlm_second_per_grid_ts_chunks",  # ppmedia only; NeMo never sets it
    }
    assert CURSOR_ATTRIBUTE == "_vlm_chunk_idx"


def _stage_by_hand(module, **lists):
    # The way NeMo Automodel's staging does it: setattr of plain lists and the cursor.
    for field, value in lists.items():
        setattr(module, STAGED_ATTRIBUTES[field], value)
    module._vlm_chunk_idx = 0


def test_nothing_staged_returns_none_and_changes_nothing(first_stage):
    assert next_vlm_media_chunk(first_stage) is None
    assert not hasattr(first_stage, CURSOR_ATTRIBUTE)
    first_stage._vlm_pixel_values_chunks = [torch.ones(2, 3)]
    first_stage._vlm_chunk_idx = None
    assert next_vlm_media_chunk(first_stage) is None
    assert first_stage._vlm_chunk_idx is None
    del first_stage._vlm_pixel_values_chunks
    first_stage._vlm_chunk_idx = 0
    assert next_vlm_media_chunk(first_stage) is None
    assert first_stage._vlm_chunk_idx == 0


def test_cursor_advances_once_per_call_including_text_only(first_stage):
    pv = torch.randn(10, 4)
    grid = torch.tensor([[1, 2, 2], [1, 2, 1], [1, 2, 2]])
    _stage_by_hand(
        first_stage,
        pixel_values=[pv[0:4], pv[4:4], pv[4:6], pv[6:10]],
        image_grid=[grid[0:1], grid[1:1], grid[1:2], grid[2:3]],
    )
    got = [next_vlm_media_chunk(first_stage) for _ in range(4)]
    assert first_stage._vlm_chunk_idx == 4
    assert got[1] is None
    assert [c.pixel_values.shape[0] for c in (got[0], got[2], got[3])] == [4, 2, 4]
    # every later microbatch got its own images, not its predecessor's
    assert torch.equal(got[2].pixel_values, pv[4:6]) and torch.equal(got[3].image_grid, grid[2:3])


def test_fields_are_the_staged_objects(first_stage):
    pv, grid, vid, vgrid = torch.randn(4, 3), torch.tensor([[1, 2, 2]]), torch.randn(8, 3), torch.tensor([[2, 2, 2]])
    crops, num, nl = torch.randn(3, 3, 2, 2), torch.tensor([3]), torch.tensor([False, False, True])
    _stage_by_hand(
        first_stage, pixel_values=[pv], image_grid=[grid], pixel_values_videos=[vid], video_grid=[vgrid],
        patch_pixel_values=[crops], num_patches=[num], patch_newline_mask=[nl],
    )
    chunk = next_vlm_media_chunk(first_stage)
    for name, obj in zip(STAGED_ATTRIBUTES, (pv, grid, vid, vgrid, crops, num, nl)):
        assert getattr(chunk, name) is obj


def test_empty_and_none_entries_become_none(first_stage):
    pv = torch.randn(4, 3)
    _stage_by_hand(first_stage, pixel_values=[pv[0:0], None, pv], image_grid=None, pixel_values_videos=[torch.empty(0, 3)] * 3)
    assert next_vlm_media_chunk(first_stage) is None
    assert next_vlm_media_chunk(first_stage) is None
    chunk = next_vlm_media_chunk(first_stage)
    assert chunk.pixel_values is pv and chunk.pixel_values_videos is None and chunk.image_grid is None


@pytest.mark.parametrize("short", list(STAGED_ATTRIBUTES))
def test_exhausted_list_raises_naming_list_length_and_index(first_stage, short):
    lists = {name: [torch.ones(1, 1)] * 3 for name in STAGED_ATTRIBUTES}
    lists[short] = [torch.ones(1, 1)] * 2
    _stage_by_hand(first_stage, **lists)
    next_vlm_media_chunk(first_stage)
    next_vlm_media_chunk(first_stage)
    with pytest.raises(ValueError, match=rf"{STAGED_ATTRIBUTES[short]} has 2 entries but microbatch 2"):
        next_vlm_media_chunk(first_stage)
    assert first_stage._vlm_chunk_idx == 2  # not advanced by the failed call


def test_grid_list_exhausted_even_when_pixels_are_not(first_stage):
    _stage_by_hand(first_stage, pixel_values=[torch.ones(2, 2)] * 2, image_grid=[torch.ones(1, 3, dtype=torch.long)])
    next_vlm_media_chunk(first_stage)
    with pytest.raises(ValueError, match="_vlm_image_grid_hws_chunks has 1 entries but microbatch 1"):
        next_vlm_media_chunk(first_stage)


def test_non_tensor_entry_is_a_type_error(first_stage):
    _stage_by_hand(first_stage, pixel_values=[[1, 2, 3]])
    with pytest.raises(TypeError, match=r"_vlm_pixel_values_chunks\[0\] is a list"):
        next_vlm_media_chunk(first_stage)


def test_no_host_reads(first_stage):
    pv = torch.randn(6, 3)
    _stage_by_hand(first_stage, pixel_values=[pv[:2], pv[2:2], pv[2:]], image_grid=[torch.ones(1, 3, dtype=torch.long)] * 3)
    with HostReadCounter() as reads:
        for _ in range(3):
            next_vlm_media_chunk(first_stage)
    assert reads.total == 0, reads.counts


def test_meta_tensors_work_because_no_data_is_read(first_stage):
    pv = torch.empty(6, 3, device="meta")
    _stage_by_hand(first_stage, pixel_values=[pv[:2], pv[2:]])
    assert next_vlm_media_chunk(first_stage).pixel_values.shape == (2, 3)


def test_public_api_exported():
    for name in ppmedia.__all__:
        assert hasattr(ppmedia, name), name
    assert {"VlmMediaChunk", "next_vlm_media_chunk", "split_media", "stage_media", "StagedMedia"} <= set(ppmedia.__all__)
