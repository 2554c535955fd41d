"""Media layouts as hooks: selection by the batch's keys, the built-ins through the same hook, a plugin's
layout split, checked, staged and refused exactly like a built-in, and bad plugins named with their data."""

from __future__ import annotations

import types

import pytest
import torch

import ppmedia
from ppmedia import HostReadCounter, split_media
from ppmedia.adapters.media_layouts import FAMILY_LAYOUTS, IDEFICS3_IMAGES, ONEVISION_VIDEOS
from ppmedia.producer.layouts import BUILTIN_LAYOUTS, GridRows, LayoutSet, MediaLayout, item_layout, sample_layout
from ppmedia.producer.planners import FieldSplit, Part
from ppmedia.registry import AdapterRegistry, PluginError

B = 4


def _ids(b: int = B) -> torch.Tensor:
    return torch.zeros(b, 3, dtype=torch.long)


# two built-in families' layouts (declared with the plugin helpers, registered by the built-in plugin) and one of
# a plugin's own; PLUGGED is what a registry holding ppmedia and that plugin selects from
ONEVISION = ONEVISION_VIDEOS
FRAMES = item_layout("frame_videos", "video", "frames", field="pixel_values_videos", rows_per_item="num_frames",
                     per_item={"num_frames": "num_frames"}, per_row={"frame_positions": "frame_positions"},
                     optional=("frame_positions",))
IDEFICS = IDEFICS3_IMAGES
PLUGGED = LayoutSet([*BUILTIN_LAYOUTS, *FAMILY_LAYOUTS, FRAMES])


def _unchanged_after(batch, error, match, **kwargs):
    before = dict(batch)
    with pytest.raises(error, match=match) as info:
        split_media(batch, kwargs.pop("n", 2), layouts=PLUGGED, **kwargs)
    assert batch.keys() == before.keys() and all(batch[k] is before[k] for k in batch)
    return str(info.value)


# ----------------------------------------------------------------------- the built-ins are hooks too


def test_the_builtin_layouts_come_through_the_hook():
    registry = AdapterRegistry(entry_point_group=None, plugins_env=None)
    assert [(layout.name, provider) for layout, provider in registry.list_layouts()] == [
        (layout.name, "ppmedia (built-in)") for layout in (*BUILTIN_LAYOUTS, *FAMILY_LAYOUTS)]
    bare = AdapterRegistry(entry_point_group=None, builtins=False, plugins_env=None)
    assert len(bare.media_layouts()) == 0  # nothing is built in beside the hook
    staged = split_media({"input_ids": _ids(2), "pixel_values": torch.randn(2, 3, 4, 4)}, 2)
    assert staged.layouts == ("images",)
    # MEDIA_KEYS: the core layouts' keys; the built-in families' layouts add theirs (declared as a plugin's are)
    assert set(ppmedia.MEDIA_KEYS) | LayoutSet(FAMILY_LAYOUTS).keys == registry.media_layouts().keys
    assert registry.media_layouts().keys - set(ppmedia.MEDIA_KEYS) == {
        "pixel_attention_mask", "image_pixel_values", "image_attention_mask", "audio_input_features", "audio_embed_sizes",
        "audio_attention_mask", "image_merge_sizes", "video_merge_sizes", "video_compression_mask",
    }  # Idefics3's, Phi-4-multimodal's, VideoLLaMA3's
    assert sample_layout("idefics3_images", "image", {"pixel_values": "pixel_values", "pixel_attention_mask":
                         "pixel_attention_mask"}).keys == IDEFICS3_IMAGES.keys  # nothing but the declaration


def test_the_most_specific_layout_wins_and_ties_are_refused():
    select = PLUGGED.select
    assert [l.name for l in select(frozenset({"pixel_values", "image_grid_thw"})).layouts] == ["image_patch_rows_thw"]
    assert [l.name for l in select(frozenset({"pixel_values_videos"})).layouts] == ["onevision_videos"]
    assert [l.name for l in select(frozenset({"pixel_values_videos", "video_grid_thw"})).layouts] == ["video_patch_rows"]
    tie = select(frozenset({"pixel_values", "image_grid_thw", "pixel_attention_mask"}))
    assert tie.error.startswith("image metadata: got image_grid_thw and pixel_attention_mask; expected at most one of them")
    assert "'image_patch_rows_thw' and 'idefics3_images'" in tie.error
    assert select(frozenset({"pixel_values"})) is select(frozenset({"pixel_values"}))  # cached per key set


def test_layouts_that_no_batch_could_tell_apart_are_refused():
    twin = item_layout("twin", "video", "pixel_values_videos")
    with pytest.raises(ValueError, match="media layouts 'onevision_videos' and 'twin' both require"):
        LayoutSet([ONEVISION, twin])
    with pytest.raises(ValueError, match="two media layouts are named 'images'"):
        LayoutSet([*BUILTIN_LAYOUTS, item_layout("images", "image", "other_pixels")])


# ----------------------------------------------------------------------- a plugin's layouts split


def test_items_with_rows_per_item_and_per_row_metadata():
    frames = torch.randn(7, 5)
    batch = {"input_ids": _ids(), "frames": frames, "num_frames": torch.tensor([3, 4]),
             "frame_positions": torch.arange(14).reshape(7, 2), "n_videos_per_sample": torch.tensor([1, 0, 0, 1])}
    with HostReadCounter() as reads:
        staged = split_media(batch, 2, layouts=PLUGGED)
    assert reads.total == 1 and set(batch) == {"input_ids"}
    assert staged.videos == (1, 1) and staged.video_rows == (3, 4)
    first, second = staged
    assert first.pixel_values_videos.data_ptr() == frames.data_ptr()  # views
    assert second.extras["frame_positions"].tolist() == [[6, 7], [8, 9], [10, 11], [12, 13]]
    assert second.extras["num_frames"].tolist() == [4]


# rows per clip = the product of its clip_grid row over its clip_merge size squared (no precomputed key)
GRID = item_layout("grid_clips", "video", "clip_patches", rows_per_item=GridRows("clip_grid", merge="clip_merge"),
                   per_item={"clip_grid": "clip_grid"})
GRID_SET = LayoutSet([*BUILTIN_LAYOUTS, GRID])


def _grid_batch(**changes):
    batch = {"input_ids": _ids(), "clip_patches": torch.arange(20.0)[:, None], "clip_grid": torch.tensor([[1, 4, 4], [2, 2, 2], [1, 2, 4]]),
             "clip_merge": torch.tensor([2, 1, 1]), "n_videos_per_sample": torch.tensor([1, 0, 1, 1])}
    return {**batch, **changes}


def test_rows_per_item_as_a_grid_product():
    assert GRID.requires == ("clip_patches", "clip_merge", "clip_grid") and GRID.axis0["clip_merge"] == "videos"
    batch = _grid_batch()
    with HostReadCounter() as reads:
        staged = split_media(batch, 2, layouts=GRID_SET)
    assert reads.total == 1 and set(batch) == {"input_ids"}
    assert staged.videos == (1, 2) and staged.video_rows == (4, 16)  # 16 / 2**2, then 8 + 8
    assert staged.chunk(1).extras["clip_patches"][:, 0].tolist() == list(range(4, 20))
    assert staged.chunk(1).extras["clip_grid"].tolist() == [[2, 2, 2], [1, 2, 4]]
    plain = item_layout("plain", "video", "clip_patches", rows_per_item=GridRows("clip_grid"))  # t * h * w rows
    both = split_media({"input_ids": _ids(2), "clip_patches": torch.zeros(24, 3), "clip_grid": torch.tensor([[1, 4, 4], [2, 2, 2]])},
                       2, layouts=LayoutSet([*BUILTIN_LAYOUTS, plain]))
    assert both.video_rows == (16, 8)


@pytest.mark.parametrize("changes, match", [
    ({"clip_merge": torch.tensor([3, 1, 1])}, r"clip_grid: video 0 \(sample 0, microbatch 0\) is \[1, 4, 4\], product 16; expected a "
     r"multiple of 3\*\*2 = 9 \(merge size 3 from clip_merge\), whole rows of clip_patches \[20, 1\]"),
    ({"clip_grid": torch.tensor([[1, 4, 4], [2, 0, 2], [1, 2, 4]])}, r"clip_grid: row 1 \(video 1 \(sample 2, microbatch 1\)\) is "
     r"\[2, 0, 2\]; expected positive entries"),
    ({"clip_grid": torch.tensor([[1, 4, 4], [2, 2, 2], [1, 2, 5]])}, r"the clip_grid products / clip_merge\*\*2: sum to 22; expected 20, "
     r"the rows of clip_patches \[20, 1\] \(whole batch\)"),
    ({"clip_grid": torch.tensor([[1, 4, 4], [2, 2, 2], [1, 2, 2**40]])}, r"clip_grid: video 2 \(sample 3, microbatch 1\) is "
     r"\[1, 2, 1099511627776\], 2199023255552 rows .*; expected at most 20, the rows of clip_patches"),
    ({"clip_merge": torch.tensor([0, 1, 1])}, r"clip_merge: video 0 \(sample 0, microbatch 0\) has merge size 0; expected 1\.\."),
    ({"clip_grid": torch.tensor([[1, 4, 4], [2, 2, 2]])}, r"clip_merge: shape \[3\]; expected \[2\] \(one merge size per row of clip_grid \[2, 3\]\)"),
    ({"clip_grid": torch.tensor([16, 8, 8])}, r"clip_grid: shape \[3\]; expected \[videos, columns\]"),
    ({"clip_grid": torch.tensor([[1.0, 4, 4], [2, 2, 2], [1, 2, 4]])}, r"clip_grid: dtype torch.float32; expected an integer dtype"),
])
def test_a_bad_grid_is_refused_naming_the_key_and_the_item(changes, match):
    batch = _grid_batch(**changes)
    before = dict(batch)
    with pytest.raises((ValueError, TypeError), match=match):
        split_media(batch, 2, layouts=GRID_SET)
    assert batch.keys() == before.keys()  # nothing popped
    with pytest.raises(ValueError, match=r"GridRows\('g'\)\.merge is 0; expected an int >= 1 or a per-item batch key"):
        GridRows("g", merge=0)


def test_samples_on_axis_0():
    pixels = torch.randn(B, 2, 3, 4, 4)
    staged = split_media({"input_ids": _ids(), "pixel_values": pixels, "pixel_attention_mask": torch.ones(B, 2, 4, 4)},
                         3, layouts=PLUGGED)
    assert [c.pixel_values.shape[0] for c in staged] == [2, 1, 1] and staged.images == (2, 1, 1)
    assert staged.chunk(1).pixel_values.data_ptr() == pixels[2].data_ptr()


@pytest.mark.parametrize("batch, error, match", [
    ({"frames": torch.randn(7, 5), "num_frames": torch.tensor([3, 3]), "n_videos_per_sample": torch.tensor([1, 0, 0, 1])},
     ValueError, r"num_frames: sums to 6; expected 7, the rows of frames \[7, 5\]"),
    ({"frames": torch.randn(7, 5), "num_frames": torch.tensor([3.0, 4.0])}, TypeError, r"num_frames: dtype torch.float32"),
    ({"frames": torch.randn(7, 5), "num_frames": torch.tensor([3, 4]), "frame_positions": torch.zeros(6, 2),
      "n_videos_per_sample": torch.tensor([1, 0, 0, 1])}, ValueError, r"frame_positions: shape \[6, 2\]; expected \[7, \.\.\.\]"),
    ({"frames": torch.randn(7, 5), "num_frames": torch.tensor([2**62, 2**62 + 7]), "n_videos_per_sample": torch.tensor([1, 0, 0, 1])},
     ValueError, r"num_frames: video 0 \(sample 0, microbatch 0\) has 4611686018427387904 rows of frames; expected 0..7"),
    ({"num_frames": torch.tensor([3, 4])}, ValueError, r"num_frames: shape \[2\] given without frames"),
    ({"pixel_values_videos": torch.randn(3, 2, 3, 4, 4)}, ValueError,
     r"pixel_values_videos: 3 videos for a batch of 4 samples and nothing maps them to samples; expected n_videos_per_sample \[4\]"),
    ({"pixel_values": torch.randn(3, 2, 3, 4, 4), "pixel_attention_mask": torch.ones(3, 2, 4, 4)}, ValueError,
     r"pixel_values: shape \[3, 2, 3, 4, 4\]; expected \[4, \.\.\.\] \(samples on axis 0; media layout 'idefics3_images'\)"),
    ({"pixel_values": torch.randn(4, 2, 3, 4, 4), "pixel_attention_mask": torch.ones(4, 2, 4, 4), "image_grid_thw": torch.ones(1, 3)},
     ValueError, r"image metadata: got image_grid_thw and pixel_attention_mask"),
])
def test_malformed_plugin_media_are_refused_all_or_nothing(batch, error, match):
    _unchanged_after({"input_ids": _ids(), **batch}, error, match)


def test_a_balanced_split_of_a_plugin_layout_is_the_plain_split_of_the_reordered_batch():
    frames = torch.arange(9, dtype=torch.float32)[:, None].repeat(1, 2)
    counts = torch.tensor([1, 1, 0, 1])  # plain: 4 + 3 frames in microbatch 0, 2 in microbatch 1
    batch = {"input_ids": torch.arange(B)[:, None].repeat(1, 3), "frames": frames, "num_frames": torch.tensor([4, 3, 2]),
             "n_videos_per_sample": counts}
    staged = split_media(dict(batch), 2, balance=True, layouts=PLUGGED)
    order = list(staged.permutation)
    assert order != [0, 1, 2, 3]
    # the same batch, reordered by hand, split plainly
    rows = [frames[0:4], frames[4:7], frames[7:7], frames[7:9]]  # per sample
    num_frames = [[4], [3], [], [2]]
    reordered = {"input_ids": batch["input_ids"][order], "frames": torch.cat([rows[s] for s in order]),
                 "num_frames": torch.tensor([n for s in order for n in num_frames[s]]), "n_videos_per_sample": counts[order]}
    plain = split_media(reordered, 2, layouts=PLUGGED)
    for got, want in zip(staged, plain):
        assert torch.equal(got.pixel_values_videos, want.pixel_values_videos)
        assert torch.equal(got.extras["num_frames"], want.extras["num_frames"])


# ----------------------------------------------------------------------- a broken plugin is named


def _plugin(name, **hooks):
    module = types.ModuleType(name)
    for hook, result in hooks.items():
        module.__dict__[hook] = ppmedia.hookimpl(lambda result=result: result)
        module.__dict__[hook].__name__ = hook
    return module


@pytest.mark.parametrize("given, problem", [
    ("not a list", r"ppmedia_media_layouts returned str 'not a list'; expected a list"),
    ([object()], r"ppmedia_media_layouts: got object <object object at .*>; expected a ppmedia.producer.layouts.MediaLayout"),
    ([MediaLayout("bad", "video", ("k",), lambda *a: None, ())], r"ppmedia_media_layouts: media layout 'bad': fields is \(\); expected"),
    ([MediaLayout("bad", "video", ["k"], lambda *a: None, ("f",))], r"ppmedia_media_layouts: media layout 'bad': requires is \['k'\]; expected a tuple"),
    ([item_layout("images", "image", "x")], r"ppmedia_media_layouts: media layout 'images' has the name of media layout 'images' from ppmedia \(built-in\)"),
    ([item_layout("mine", "video", "pixel_values")], r"ppmedia_media_layouts: media layout 'mine' requires exactly the keys \(pixel_values\) of media "
     r"layout 'images' from ppmedia \(built-in\)"),
])
def test_bad_layouts_name_the_plugin_and_carry_the_data(given, problem):
    registry = AdapterRegistry(entry_point_group=None, plugins_env=None)
    with pytest.raises(PluginError, match=r"^ppmedia plugin my_plugin: " + problem) as info:
        registry.register_plugin(_plugin("my_plugin", ppmedia_media_layouts=given), "my_plugin")
    assert info.value.hook == "ppmedia_media_layouts" and info.value.provider == "my_plugin"
    assert "my_plugin" not in [p for _, p in registry.list_layouts()]  # nothing of it stays
    registry.register_plugin(_plugin("fine", ppmedia_media_layouts=[FRAMES]), "fine")
    assert registry.media_layouts().names()[-1] == "frame_videos"


def test_a_planner_that_stages_what_its_layout_does_not_declare_is_named():
    def plan(ctx, media, counts):
        t = media["weird"]

        def finish():
            ranges = ((0, 1), (1, 2))
            return Part([FieldSplit("pixel_values", "weird", t, ranges, (1, 1))], (1, 1), (1, 1))

        return finish

    layout = MediaLayout("weird_layout", "thing", ("weird",), plan, ("weird",), counted=False)
    with pytest.raises(TypeError, match=r"media layout 'weird_layout': its planner staged 'pixel_values' .*expected one of its fields \['weird'\]"):
        split_media({"input_ids": _ids(2), "weird": torch.zeros(2)}, 2, layouts=LayoutSet([*BUILTIN_LAYOUTS, layout]))
