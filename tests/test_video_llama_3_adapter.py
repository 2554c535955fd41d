"""VideoLLaMA3 (built in): merge sizes per image and per video, the compression mask split by video
features, items mapped to samples by their token counts. Merges against the model's own forward for
1, 2 and 4 microbatches are in tests/test_goldens.py, the real processor in tests/test_processors.py."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch

import ppmedia
from ppmedia.adapters.media_layouts import _VIDEO_ROWS, VIDEOLLAMA3_VIDEOS, _with_compression_mask
from ppmedia.adapters.video_llama_3 import VideoLlama3Adapter
from ppmedia.producer.layouts import GridRows, LayoutSet, item_layout
from ppmedia.testing import AdapterMismatch, check_adapter
from ppmedia.testing.goldens import check_goldens
from ppmedia.testing.tiny_models import video_llama_3 as tiny

pytestmark = pytest.mark.usefixtures("one_thread")
GOLDENS = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "video_llama_3"


def _merge_two(chunk):
    """The planted bug: every video's merge size taken as 2 (the video processor's default)."""
    extras = chunk.extras or {}
    if "video_merge_sizes" not in extras:
        return chunk
    return dataclasses.replace(chunk, extras={**extras, "video_merge_sizes": torch.full_like(extras["video_merge_sizes"], 2)})


class VideoMergeTwo(VideoLlama3Adapter):
    def host_inputs(self, chunk, config):
        return super().host_inputs(_merge_two(chunk), config)

    def feature_counts(self, chunk, config, host):
        return super().feature_counts(_merge_two(chunk), config, host)

    def encode(self, model, chunk, host):
        return super().encode(model, _merge_two(chunk), host)


def test_the_golden_check_catches_a_video_merge_size_hard_coded_to_2():
    """The goldens pass at 8 microbatches (one sample each; 1, 2, 4 in test_goldens.py). With every video
    taken as merge size 2, the batch of one structure (the processor's merge sizes) still passes; the
    golden batch, with videos of merge size 1 too, fails."""
    check_goldens("video_llama_3", GOLDENS, microbatches=(8,))
    model = tiny.build_model()
    uniform = tiny.build_batches()[0]
    assert set(uniform["video_merge_sizes"].tolist()) == {2}
    assert check_adapter("video_llama_3", adapter=VideoMergeTwo(), model=model, batch=uniform, microbatches=(1, 4))
    with pytest.raises(AssertionError, match=r"1 microbatches, microbatch 0 .*video_compression_mask: 40 entries; expected 25"):
        check_goldens("video_llama_3", GOLDENS, adapter=VideoMergeTwo, microbatches=(1,))


def test_the_compression_mask_is_split_by_video_features():
    """Microbatch k gets prod(grid) / merge**2 mask entries per video (not prod(grid): the patch rows),
    its pieces tile the batch's mask; a mask cut by patch rows, or of the wrong length, is refused."""
    batch = tiny.build_batch()
    counts = VideoLlama3Adapter().media_counts(batch, tiny.build_config())
    assert counts["images_per_sample"].tolist() == [1, 1, 2, 0, 0, 0, 0, 1]  # sample 2: two images back to back
    assert counts["videos_per_sample"].tolist() == [1, 1, 0, 1, 0, 0, 2, 0]
    staged = ppmedia.split_media(dict(batch), 8, **counts)
    assert staged.layouts == ("videollama3_images", "videollama3_videos")
    pieces, first = [], torch.nn.Module()
    with ppmedia.stage_media(first, staged):
        for _ in range(8):
            chunk = ppmedia.next_vlm_media_chunk(first)
            if chunk is None or chunk.video_grid is None:
                continue
            merges = chunk.extras["video_merge_sizes"]
            mask = chunk.extras["video_compression_mask"]
            assert mask.shape[0] == int((chunk.video_grid.prod(dim=1) // merges**2).sum())
            assert chunk.pixel_values_videos.shape[0] == int(chunk.video_grid.prod(dim=1).sum())
            pieces.append(mask)
    assert torch.equal(torch.cat(pieces), batch["video_compression_mask"])

    rows = item_layout("rows", "video", "video_compression_mask", rows_per_item=GridRows("video_grid_thw"))
    by_rows = dataclasses.replace(VIDEOLLAMA3_VIDEOS, plan=_with_compression_mask(  # the planted bug: mask cut like the rows
        _VIDEO_ROWS.plan, rows.plan))
    layouts = LayoutSet([layout for layout in ppmedia.registry.media_layouts() if layout.name != "videollama3_videos"]
                        + [by_rows])
    with pytest.raises(ValueError, match=r"products: sum to 100; expected 40, the rows of video_compression_mask"):
        ppmedia.split_media(dict(batch), 4, layouts=layouts, **counts)
    short = dict(batch, video_compression_mask=batch["video_compression_mask"][:-1])
    with pytest.raises(ValueError, match=r"sum to 40; expected 39, the rows of video_compression_mask"):
        ppmedia.split_media(short, 4, **counts)


def test_items_are_mapped_to_samples_by_their_tokens():
    config = tiny.build_config()
    batch = tiny.build_batch()
    adapter = VideoLlama3Adapter()
    with pytest.raises(ValueError, match="video placeholder tokens but media holds no video_grid_thw"):
        adapter.media_per_sample(batch["input_ids"], config)
    shifted = dict(batch, video_merge_sizes=torch.tensor([2, 1, 2, 2, 2]))  # video 3 (sample 6) would give 2 tokens, not 8
    with pytest.raises(ValueError, match=r"sample 6 has 15 video placeholder tokens, which the videos' token counts "
                                         r"\[7, 10, 4, 2, 8\]"):
        adapter.media_per_sample(batch["input_ids"], config, media=shifted)
    odd = dict(batch, image_merge_sizes=torch.tensor([2, 1, 1, 2, 4]))  # image 4: h = 4, w = 6
    with pytest.raises(ValueError, match=r"image 4: grid \(t, h, w\) = \(1, 4, 6\) with merge size 4"):
        adapter.media_per_sample(batch["input_ids"], config, media=odd)
    empty = batch["video_compression_mask"].clone()
    empty[8:20] = False  # video 1 (sample 1) keeps nothing
    with pytest.raises(ValueError, match=r"video 1 gives no placeholder tokens"):
        adapter.media_per_sample(batch["input_ids"], config, media=dict(batch, video_compression_mask=empty))
    counts = adapter.media_counts(batch, config)
    as_int = dict(batch, video_compression_mask=batch["video_compression_mask"].to(torch.int64))
    with pytest.raises(AdapterMismatch, match=r"dtype torch.int64; expected \[video features\] bool"):
        check_adapter("video_llama_3", batch=as_int, reference=torch.zeros(8, 25, 64), microbatches=(1,))
    with pytest.raises(ValueError, match=r"image_grid_thw products: sum to 60; expected 59, the rows of pixel_values"):
        ppmedia.split_media(dict(batch, pixel_values=batch["pixel_values"][:-1]), 2, **counts)
