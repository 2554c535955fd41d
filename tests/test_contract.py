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
        ("extras", None),  # always last: a layout's or a per-sample input's other names (a dict per chunk)
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


# ------------------------------------------------------------------------------------------------
# Partially staged modules (NeMo Automodel sets only some lists; ppmedia resolves the missing ones
# without Module.__getattr__). Every combination must read exactly as getattr(module, name, None).

_NAMES = list(STAGED_ATTRIBUTES.values())
_ABSENT, _NONE, _LIST = "absent", "None", "list"


def _reference_take(module):
    """The contract written naively with getattr: what next_vlm_media_chunk must do, step by step."""
    k = getattr(module, CURSOR_ATTRIBUTE, None)
    lists = [getattr(module, name, None) for name in _NAMES]
    if k is None or all(staged is None for staged in lists):
        return None
    values = []
    for name, staged in zip(_NAMES, lists):
        if staged is None:
            values.append(None)
            continue
        if not 0 <= k < len(staged):
            raise ValueError(f"{name} has {len(staged)} entries but microbatch {k} was requested")
        entry = staged[k]
        if entry is not None and not isinstance(entry, torch.Tensor):
            raise TypeError(f"{name}[{k}] is a {type(entry).__name__}")
        values.append(entry if entry is not None and entry.numel() else None)
    setattr(module, CURSOR_ATTRIBUTE, k + 1)
    return VlmMediaChunk(*values) if any(v is not None for v in values) else None


def _outcome(take, module):
    try:
        chunk = take(module)
    except (ValueError, TypeError) as error:
        return type(error), str(error).split(" was requested")[0].split(" is a ")[0], module.__dict__.get(CURSOR_ATTRIBUTE)
    # a view (data, shape, strides): indexing a staged tensor (not a list) makes a new view object per call
    views = None if chunk is None else tuple(
        None if v is None else (v.data_ptr(), v.shape, v.stride()) for v in (getattr(chunk, f) for f in STAGED_ATTRIBUTES)
    )
    return views, getattr(module, CURSOR_ATTRIBUTE, None)


def test_every_partial_combination_of_absent_none_and_set_lists():
    """3**8 layouts: each list absent from the module, set to None, or staged; 4 calls each."""
    import itertools

    combos = 0
    for states in itertools.product((_ABSENT, _NONE, _LIST), repeat=len(_NAMES)):
        module = torch.nn.Module()
        staged = {}
        for name, state in zip(_NAMES, states):
            if state == _NONE:
                setattr(module, name, None)
            elif state == _LIST:
                staged[name] = [torch.ones(1, 2), torch.empty(0, 2), None]
                setattr(module, name, staged[name])
        module._vlm_chunk_idx = 0
        first = next_vlm_media_chunk(module)
        if not staged:
            assert first is None and module._vlm_chunk_idx == 0, states
            assert next_vlm_media_chunk(module) is None and module._vlm_chunk_idx == 0
            continue
        combos += 1
        for field, name in STAGED_ATTRIBUTES.items():
            expected = staged[name][0] if name in staged else None
            assert getattr(first, field) is expected, (states, field)
        assert module._vlm_chunk_idx == 1
        assert next_vlm_media_chunk(module) is None and module._vlm_chunk_idx == 2  # empty entries
        assert next_vlm_media_chunk(module) is None and module._vlm_chunk_idx == 3  # None entries
        exhausted = next(name for name in _NAMES if name in staged)
        with pytest.raises(ValueError, match=rf"^{exhausted} has 3 entries but microbatch 3 was requested"):
            next_vlm_media_chunk(module)
        assert module._vlm_chunk_idx == 3, states
        for name in _NAMES:  # nothing was added to or removed from the module
            assert (name in module.__dict__) == (states[_NAMES.index(name)] != _ABSENT)
    assert combos == 3**8 - 2**8


def test_cursor_absent_with_lists_staged_returns_none_and_adds_no_cursor():
    module = torch.nn.Module()
    module._vlm_pixel_values_chunks = [torch.ones(1, 2)]
    assert next_vlm_media_chunk(module) is None
    assert CURSOR_ATTRIBUTE not in module.__dict__


def test_nemo_automodel_image_staging_layout(first_stage):
    # What Automodel 0.7.0's stage_vlm_media_for_pp sets for an image batch: five lists and the cursor;
    # the two video lists and second_per_grid_ts are never set.
    pv, grid = torch.randn(6, 4), torch.tensor([[1, 2, 2], [1, 2, 1]])
    first_stage._vlm_pixel_values_chunks = [pv[:4], pv[4:]]
    first_stage._vlm_image_grid_hws_chunks = [grid[:1], grid[1:]]
    first_stage._vlm_num_patches_chunks = None
    first_stage._vlm_patch_pixel_values_chunks = None
    first_stage._vlm_patch_newline_mask_chunks = None
    first_stage._vlm_chunk_idx = 0
    a, b = next_vlm_media_chunk(first_stage), next_vlm_media_chunk(first_stage)
    assert a.pixel_values is first_stage._vlm_pixel_values_chunks[0] and b.image_grid is first_stage._vlm_image_grid_hws_chunks[1]
    assert a.pixel_values_videos is None and a.second_per_grid_ts is None
    assert first_stage._vlm_chunk_idx == 2


def test_partial_staging_never_reaches_module_getattr(first_stage):
    """The fast path resolves missing names itself: Module.__getattr__ (its slow miss path) never runs."""
    import sys

    first_stage._vlm_pixel_values_chunks = [torch.ones(2, 2)] * 2
    first_stage._vlm_image_grid_hws_chunks = [torch.ones(1, 3)] * 2
    first_stage._vlm_chunk_idx = 0
    calls = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is torch.nn.Module.__getattr__.__code__:
            calls.append(frame.f_locals.get("name"))

    unstaged = torch.nn.Linear(2, 2)
    later = torch.nn.Linear(2, 2)  # NeMo's later steps: the seven contract lists set (None or lists), no timing
    for name in _NAMES[:-1]:
        setattr(later, name, None)
    later._vlm_pixel_values_chunks = [torch.ones(2, 2)]
    later._vlm_chunk_idx = 0
    sys.setprofile(profile)
    try:
        next_vlm_media_chunk(first_stage)
        next_vlm_media_chunk(first_stage)
        next_vlm_media_chunk(unstaged)  # nothing staged, not even the cursor
        next_vlm_media_chunk(later)
    finally:
        sys.setprofile(None)
    assert calls == []
    assert first_stage._vlm_chunk_idx == 2 and later._vlm_chunk_idx == 1


class _ClassDefaults(torch.nn.Module):
    # A class attribute answers getattr when the instance has no value of its own.
    _vlm_chunk_idx = None
    _vlm_video_grid_thw_chunks = None


class _ClassStaged(torch.nn.Module):
    _vlm_image_grid_hws_chunks = [torch.tensor([[1, 2, 2]])]


class _Forwarding(torch.nn.Module):
    """A wrapper that answers unknown attributes from the module it wraps (as some wrappers do)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)


class _PropertyCursor(torch.nn.Module):
    @property
    def _vlm_chunk_idx(self):
        return self.__dict__.get("_cursor_store")

    @_vlm_chunk_idx.setter
    def _vlm_chunk_idx(self, value):
        self.__dict__["_cursor_store"] = value


def _twins(kind):
    """Two identically staged modules of one kind (the same tensors): one for ppmedia, one for the reference."""
    pv = [torch.ones(2, 2), torch.empty(0, 2), torch.ones(1, 2)]
    grids = torch.tensor([[[2, 2, 2]], [[2, 2, 2]], [[1, 2, 2]]])
    made = []
    for _ in range(2):
        if kind == "forwarding":
            inner = torch.nn.Linear(2, 2)
            inner._vlm_pixel_values_chunks = pv
            inner._vlm_chunk_idx = 0
            made.append(_Forwarding(inner))
            continue
        m = {
            "class_defaults": _ClassDefaults, "class_staged_list": _ClassStaged, "class_cursor_none": _ClassDefaults,
            "property_cursor": _PropertyCursor, "buffer_named_like_a_list": torch.nn.Module,
            "long_registry": lambda: torch.nn.Sequential(*[torch.nn.Identity() for _ in range(20)]),
        }[kind]()
        m._vlm_pixel_values_chunks = pv
        if kind != "class_cursor_none":
            m._vlm_chunk_idx = 0
        if kind == "buffer_named_like_a_list":
            m.register_buffer("_vlm_video_grid_thw_chunks", grids)
        if kind == "long_registry":  # 20 submodules: the registry check looks names up instead of walking
            m.add_module("_vlm_image_grid_hws_chunks", torch.nn.Identity())
        made.append(m)
    return made


@pytest.mark.parametrize(
    "kind",
    ["class_defaults", "class_staged_list", "class_cursor_none", "forwarding", "property_cursor", "buffer_named_like_a_list",
     "long_registry"],
)
def test_unusual_modules_read_exactly_as_getattr(kind):
    ours, theirs = _twins(kind)
    for _ in range(4):
        assert _outcome(next_vlm_media_chunk, ours) == _outcome(_reference_take, theirs)
