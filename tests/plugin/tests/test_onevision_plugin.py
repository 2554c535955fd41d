"""Plugins that bring what ppmedia lacked, proven with ppmedia's own kit and nothing patched in ppmedia:

* ``ppmedia_onevision_plugin``: a new media layout (LLaVA-OneVision videos with per-frame sizes
  ``image_sizes_videos``, more specific than ppmedia's own ``onevision_videos``) and an adapter that
  takes ``llava_onevision`` over from the built-in, inheriting its per-sample input (``batch_num_images``,
  one entry per sample holding images);
* ``ppmedia_token_types_plugin``: a per-token input every stage needs (token types from the batch,
  carried with the hidden states).

Both families run their 2-process parity in ONE spawned pair.
"""

import pytest
import torch

from ppmedia.registry import default_registry

ONEVISION, TOKEN_TYPES = "ppmedia_onevision_plugin.tiny", "ppmedia_token_types_plugin.tiny"
PLUGINS = ["ppmedia_onevision_plugin", "ppmedia_token_types_plugin"]


@pytest.fixture(scope="module")
def onevision(ppmedia_kit):
    return ppmedia_kit.family(ONEVISION, plugins=["ppmedia_onevision_plugin"])


def _split(kit, batch, n):
    import ppmedia

    return ppmedia.split_media(batch, n, **kit.adapter.media_counts(batch, kit.model.config),
                               layouts=kit.registry.media_layouts())


def test_the_plugin_brings_a_layout_and_a_per_sample_input(onevision):
    layouts = dict((layout.name, provider) for layout, provider in onevision.registry.list_layouts())
    assert layouts["onevision_videos_with_sizes"] == "ppmedia_onevision_plugin (FamilyKit plugins)"
    assert layouts["onevision_videos"] == layouts["video_patch_rows"] == "ppmedia (built-in)"  # the same hook
    assert "onevision_videos_with_sizes" not in default_registry().media_layouts().names()  # only where registered
    assert [s.key for s in onevision.adapter.sample_inputs] == ["batch_num_images"]
    assert onevision.adapter.name == "llava_onevision_example"  # override: the plugin serves llava_onevision
    assert default_registry().get("llava_onevision").name == "llava_onevision"  # the built-in, elsewhere


def test_without_the_plugin_the_sizes_are_refused(onevision):
    """ppmedia's own registry does not know image_sizes_videos: a [videos, ...] tensor the schedule would
    cut along samples is refused, naming the way out (a layout); the plugin's layout is what stages it."""
    import ppmedia

    batch = dict(onevision.batch)
    adapter = default_registry().get("llava_onevision")
    with pytest.raises(ValueError, match=r"image_sizes_videos: shape \[3, 2, 2\]; expected \[8, \.\.\.\].*bring a media layout"):
        ppmedia.split_media(batch, 4, **adapter.media_counts(batch, onevision.model.config))
    assert batch.keys() == onevision.batch.keys()  # nothing popped
    del batch["image_sizes_videos"]
    staged = ppmedia.split_media(batch, 4, **adapter.media_counts(batch, onevision.model.config))
    assert staged.layouts == ("images_with_sizes", "onevision_videos")


def test_merge_matches_the_model_at_1_2_4_8_and_an_uneven_split(onevision):
    checks = onevision.check_adapter(microbatches=[1, 2, 4, 8, 3])
    assert len(checks) == 1 + 2 + 4 + 8 + 3 and max(c.max_abs_diff for c in checks) <= 1e-5
    assert [c.has_media for c in checks if c.n_microbatches == 4] == [True, True, False, True]
    assert [c.samples for c in checks if c.n_microbatches == 3] == [(0, 3), (3, 6), (6, 8)]


def test_batch_num_images_is_split_with_the_samples(onevision):
    batch = dict(onevision.batch)
    staged = _split(onevision, batch, 4)
    assert "batch_num_images" not in batch and "pixel_values_videos" not in batch  # popped with the media
    per_mb = [None if c is None else c.extras["batch_num_images"].tolist() for c in staged]
    assert per_mb == [[1, 2], [0, 1], [0, 0], [1, 0]]  # [B] from the processor's [1, 2, 1, 1] (samples 0, 1, 3, 6)
    assert staged.chunk(2).has_media is False and staged.kinds["batch_num_images"] == "input"
    assert staged.videos == (0, 1, 0, 2) and staged.layouts == ("images_with_sizes", "onevision_videos_with_sizes")
    videos, sizes = onevision.batch["pixel_values_videos"], onevision.batch["image_sizes_videos"]
    assert staged.chunk(3).pixel_values_videos.data_ptr() == videos[1].data_ptr()  # a view, no copy
    assert staged.chunk(3).extras["image_sizes_videos"].data_ptr() == sizes[1].data_ptr()


def test_back_to_back_images_need_batch_num_images(onevision):
    # sample 1's two images form one run of image tokens: without batch_num_images it counts as one
    batch = {k: v for k, v in onevision.batch.items() if k != "batch_num_images"}
    with pytest.raises(ValueError, match=r"input_ids: sample 1 has a run of 34 placeholder tokens, but images 1..2 of image_sizes \(batch order\) give \[31, 36\] tokens"):
        _split(onevision, batch, 2)


@pytest.mark.parametrize("key, value, error, match", [
    ("pixel_values_videos", torch.zeros(()), ValueError, r"pixel_values_videos: shape \[\]; expected \[videos, \.\.\.\]"),
    ("pixel_values_videos", [torch.zeros(2, 3)], TypeError, r"pixel_values_videos: got list; expected a torch.Tensor"),
    ("n_videos_per_sample", torch.tensor([0, 0, 1, 0, 0, 0, 1, 2]), ValueError,
     r"n_videos_per_sample: counts sum to 4; expected 3, the number of videos"),
    ("n_videos_per_sample", torch.tensor([0, 0, 1, 0, 0, 0, 1]), ValueError, r"n_videos_per_sample: shape \[7\]; expected \[8\]"),
    ("batch_num_images", torch.tensor([1, 2]), ValueError, r"batch_num_images: shape \[2\]; expected \[4\] \(one entry per sample holding"),
    ("batch_num_images", torch.tensor([1, 2, 0, 1]), ValueError, r"batch_num_images: sample 3 is given 0 images but holds image tokens"),
    ("image_sizes_videos", torch.ones(2, 2, 2, dtype=torch.long), ValueError,
     r"image_sizes_videos: shape \[2, 2, 2\]; expected \[3, \.\.\.\] \(one row per videos; media layout 'onevision_videos_with_sizes'\)"),
])
def test_malformed_input_through_the_plugin_layout_is_refused_all_or_nothing(onevision, key, value, error, match):
    batch = dict(onevision.batch, **{key: value})
    before = dict(batch)
    with pytest.raises(error, match=match):
        _split(onevision, batch, 4)
    assert batch.keys() == before.keys() and all(batch[k] is before[k] for k in batch)  # nothing popped


@pytest.mark.multiprocess
def test_pipeline_parity_of_both_plugins_in_one_spawn(ppmedia_kit, onevision):
    from ppmedia.testing import check_pipeline_parity

    report = check_pipeline_parity([ONEVISION, TOKEN_TYPES], ["gpipe", "1f1b/static"], plugins=PLUGINS, steps=1)
    for family in (ONEVISION, TOKEN_TYPES):
        for scenario in report.family(family).scenarios:
            assert scenario.passed(1e-5), report.format()
            # every chunk consumed once (the shape-inference forward of inferred shapes re-reads chunk 0)
            trace = [0, 1, 2, 3] if scenario.name.endswith("static") else [0, 0, 1, 2, 3]
            assert [st.chunk_trace for st in scenario.steps] == [trace]
    assert report.family(TOKEN_TYPES).model_type == "gemma3"


def test_token_types_travel_to_every_stage_and_are_needed(ppmedia_kit):
    """The token types' route in one process (two stage modules chained): the batch's types reach the
    last stage; ppmedia's own Gemma 3 adapter, which derives them from the ids, does not match."""
    import ppmedia
    from ppmedia.adapters.gemma3 import Gemma3Adapter
    from ppmedia.pipeline import build_stage_modules

    kit = ppmedia_kit.family(TOKEN_TYPES, plugins=["ppmedia_token_types_plugin"])
    assert kit.adapter.name == "gemma3_batch_token_types"
    with torch.no_grad():
        expected = kit.model(**kit.module.reference_inputs(dict(kit.batch))).logits

    def through_two_stages(adapter):
        first, last = build_stage_modules(kit.model, 2, adapter=adapter)
        batch = dict(kit.batch)
        staged = ppmedia.split_media(batch, 1, **adapter.media_counts(batch, kit.model.config))
        with torch.no_grad(), ppmedia.stage_media(first, staged):
            sent = first(batch["input_ids"], batch["attention_mask"])
            assert [w.name for w in first.wire_out] == ["token_type_ids"]
            return last(*sent)

    assert (through_two_stages(kit.adapter) - expected).abs().max() <= 1e-5
    assert (through_two_stages(Gemma3Adapter()) - expected).abs().max() > 1e-3  # the check can fail
