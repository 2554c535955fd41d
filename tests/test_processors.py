"""Every family on its own real processor (``ppmedia.testing.processors``): batches made by the
family's processor classes from the tiny tokenizer (placeholders expanded by the processor, no
hand-written ids), on media of varied sizes, aspect ratios, frame counts and durations, plus
text-only samples. The adapter's merged embeddings (and positions, where the family has its own)
equal the model's own forward on the same batch for 1, 2, 3, 4 and 8 microbatches.

Every batch has 8 samples; samples 4 and 5 are text-only, so 4 microbatches give a text-only
microbatch 2 and 8 microbatches two text-only ones. docs/processors.md is the table of what is tested.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from ppmedia.testing import AdapterMismatch, check_adapter
from ppmedia.testing.processors import build_tiny_processor, chat_batch, save_tiny_processor
from ppmedia.testing.tiny_models import capture_reference, load

pytestmark = pytest.mark.usefixtures("one_thread")

MICROBATCHES = (1, 2, 3, 4, 8)


def image(rng, h, w):
    return ("image", Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))


def video(rng, t, h, w):
    return ("video", rng.integers(0, 256, (t, h, w, 3), dtype=np.uint8))


def assert_matches_model(family, batch, model=None, **model_kwargs):
    """The model's own forward on ``batch`` (plus ``model_kwargs``) is the reference; the adapter's
    split -> stage -> merge (and positions) must equal it for every microbatch count."""
    tiny = load(family)
    model = tiny.build_model() if model is None else model
    reference, positions = capture_reference(model, **batch, **model_kwargs)
    checks = check_adapter(family, model=model, batch=batch, reference=reference, positions=positions, microbatches=MICROBATCHES)
    assert len(checks) == sum(MICROBATCHES)
    assert max(c.max_abs_diff for c in checks) <= 1e-5
    four = [c.has_media for c in checks if c.n_microbatches == 4]
    assert four == [True, True, False, True], four
    eight = [c.has_media for c in checks if c.n_microbatches == 8]
    assert eight[4:6] == [False, False] and sum(eight) == 6, eight
    return model, reference, positions


# -- Qwen2.5-VL -------------------------------------------------------------------------------------


def qwen_samples(seed=0):
    """Images from 8x16 to 40x40 (resized by the processor to multiples of 8), videos of 2, 3 and 4
    frames (3 is padded to 4 by the processor: 2 temporal steps), text-only samples 4 and 5."""
    rng = np.random.default_rng(seed)
    return [
        [3, image(rng, 16, 16), 2],
        [image(rng, 24, 40), 1, image(rng, 9, 30)],
        [video(rng, 4, 16, 16), 3],
        [image(rng, 32, 20), video(rng, 3, 16, 24), 1],
        [5],
        [7],
        [image(rng, 40, 40), 2],
        [image(rng, 8, 16), video(rng, 2, 24, 8), image(rng, 16, 8)],
    ]


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
def test_qwen2_5_vl_processor(backend):
    processor = build_tiny_processor("qwen2_5_vl", image_backend=backend)
    names = {"torchvision": "Qwen2VLImageProcessor", "pil": "Qwen2VLImageProcessorPil"}
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"
    assert type(processor.image_processor).__name__ == names[backend]
    assert type(processor.video_processor).__name__ == "Qwen2VLVideoProcessor"
    batch = chat_batch(processor, qwen_samples())
    assert batch["image_grid_thw"].shape == (7, 3) and batch["video_grid_thw"][:, 0].tolist() == [2, 2, 1]
    model, _, _ = assert_matches_model("qwen2_5_vl", batch, use_cache=False)
    # the video timing matters: staged without second_per_grid_ts, a video's positions differ
    timeless = {k: v for k, v in batch.items() if k != "second_per_grid_ts"}
    reference, positions = capture_reference(model, **batch, use_cache=False)
    with pytest.raises(AdapterMismatch, match="position_ids"):
        check_adapter("qwen2_5_vl", model=model, batch=timeless, reference=reference, positions=positions, microbatches=[1])


def test_saved_qwen2_5_vl_processor_round_trips_and_feeds_the_model(tmp_path):
    from transformers import AutoProcessor

    folder = save_tiny_processor("qwen2_5_vl", tmp_path / "tiny")
    loaded = AutoProcessor.from_pretrained(folder)
    assert type(loaded).__name__ == "Qwen2_5_VLProcessor"
    assert type(loaded.image_processor).__name__ == "Qwen2VLImageProcessor"
    fresh = chat_batch(build_tiny_processor("qwen2_5_vl"), qwen_samples(1))
    again = chat_batch(loaded, qwen_samples(1))
    assert fresh.keys() == again.keys()
    for key in fresh:
        assert torch.equal(fresh[key], again[key]), key
    tiny = load("qwen2_5_vl")
    assert loaded.tokenizer.pad_token_id == tiny.PAD_TOKEN_ID and loaded.tokenizer.eos_token_id == tiny.EOS_TOKEN_ID
    assert loaded.image_token_id == tiny.IMAGE_TOKEN_ID and loaded.video_token_id == tiny.VIDEO_TOKEN_ID
    model = tiny.build_model()
    with torch.no_grad():
        logits = model(**again, use_cache=False).logits
    assert logits.shape == (*again["input_ids"].shape, model.config.text_config.vocab_size)
    assert torch.isfinite(logits).all()
