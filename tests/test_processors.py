"""Every family on its own real processor (``ppmedia.testing.processors``): batches made by the
family's processor classes from the tiny tokenizer (placeholders expanded by the processor, no
hand-written ids), on media of varied sizes, aspect ratios, frame counts and durations, plus
text-only samples. The adapter's merged embeddings (and positions, where the family has its own)
equal the model's own forward on the same batch for 1, 2, 3, 4 and 8 microbatches.

Every batch has 8 samples; samples 4 and 5 are text-only, so 4 microbatches give a text-only
microbatch 2 and 8 microbatches two text-only ones. docs/processors.md is the table of what is
tested; ``test_the_docs_table_names_these_tests`` keeps it honest.
"""

from __future__ import annotations

import pathlib
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pytest
import torch
from PIL import Image

from ppmedia.testing import AdapterMismatch, check_adapter
from ppmedia.testing.processors import (
    build_tiny_processor,
    build_tiny_processor_model,
    chat_batch,
    processor_call_kwargs,
    save_tiny_processor,
)
from ppmedia.testing.tiny_models import capture_reference, load

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = pathlib.Path(__file__).resolve().parents[1]
MICROBATCHES = (1, 2, 3, 4, 8)
ATOL = 1e-5  # float32 rounding of one encoder call per microbatch against one for the batch


def image(rng, h, w):
    return ("image", Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))


def video(rng, t, h, w, track_seconds=None):
    frames = rng.integers(0, 256, (t, h, w, 3), dtype=np.uint8)
    return ("video", frames) if track_seconds is None else ("video", frames, wave(rng, track_seconds))


def wave(rng, seconds, rate=16000):
    return (rng.standard_normal(int(rate * seconds)) * 0.1).astype(np.float32)


def audio(rng, seconds):
    return ("audio", wave(rng, seconds))


@dataclass(frozen=True)
class Case:
    """One family's processor test: its 8 samples (``samples(rng)``), the processor call's extra
    arguments, the model forward's, and what the processor's classes are."""

    samples: Callable[[np.random.Generator], list[list[Any]]]
    classes: tuple[str, ...]  # processor, then image processor (torchvision class), video, audio classes
    pil: str | None = None  # the image processor's Pil class, where there is one
    call: dict[str, Any] = field(default_factory=dict)
    forward: dict[str, Any] = field(default_factory=dict)
    text_only_empty: bool = True  # a text-only microbatch has no media (False: padding crops on axis 0)
    family: str | None = None  # the tiny family, when the case's name is not it (a second batch of one)
    float_reference: tuple[str, ...] = ()  # keys cast to float32 for the model's own forward (not for ppmedia)


def qwen_samples(scale):
    """Images from 8x16 to 40x40 pixels (times ``scale``; resized by the processor to multiples of
    patch x merge), videos of 2, 3 and 4 frames (3 padded to 4 by the processor: 2 temporal steps),
    text-only samples 4 and 5."""

    def samples(rng):
        s = lambda n: n * scale  # noqa: E731
        return [
            [3, image(rng, s(16), s(16)), 2],
            [image(rng, s(24), s(40)), 1, image(rng, s(9), s(30))],
            [video(rng, 4, s(16), s(16)), 3],
            [image(rng, s(32), s(20)), video(rng, 3, s(16), s(24)), 1],
            [5],
            [7],
            [image(rng, s(40), s(40)), 2],
            [image(rng, s(8), s(16)), video(rng, 2, s(24), s(8)), image(rng, s(16), s(8))],
        ]

    return samples


def image_samples(rng):
    """Images of 5x7 to 33x17 pixels, wide, tall and square, one or two a sample."""
    return [
        [3, image(rng, 10, 30), 2],
        [image(rng, 30, 12), 1, image(rng, 24, 24)],
        [image(rng, 7, 5), 3],
        [image(rng, 33, 17), 1],
        [5],
        [7],
        [image(rng, 16, 16), 2, image(rng, 9, 21)],
        [image(rng, 20, 20), 4],
    ]


def gemma4_samples(rng):
    """Images, videos of 1 to 3 frames, audio clips of 0.05 to 0.3 s at 16 kHz."""
    return [
        [2, image(rng, 16, 16), 1, audio(rng, 0.16), 2],
        [audio(rng, 0.12), 2, image(rng, 8, 16), 1],
        [3, video(rng, 2, 8, 16), 2],
        [1, image(rng, 8, 8), 1, video(rng, 1, 16, 8), audio(rng, 0.08)],
        [9],
        [12],
        [2, audio(rng, 0.05), image(rng, 16, 16), audio(rng, 0.3)],
        [video(rng, 3, 8, 8), 1, image(rng, 8, 16)],
    ]


def omni_samples(rng):
    """Images, audio clips of 0.09 to 0.48 s, and videos of 3 and 4 frames with their audio tracks
    (0.17 s and 2.5 s: a track longer than the video's 2-second chunk)."""
    return [
        [2, image(rng, 16, 16), 1, audio(rng, 0.3), 2],
        [audio(rng, 0.48), 2, image(rng, 16, 24), 1],
        [3, video(rng, 4, 16, 16, track_seconds=0.17), 2],
        [1, image(rng, 8, 8), 1, audio(rng, 0.09), 1],
        [9],
        [12],
        [2, audio(rng, 0.3), 1, audio(rng, 0.09)],
        [video(rng, 3, 8, 16, track_seconds=2.5), 1, image(rng, 16, 16)],
    ]


def internvl_samples(rng):
    """Images of 1 to 5 tiles, videos of 3 frames (InternVL's video processor stacks the videos of a
    call: they must share a frame count)."""
    return [
        [3, image(rng, 32, 32), 2],
        [image(rng, 60, 130), 1, video(rng, 3, 20, 36)],
        [video(rng, 3, 32, 32), 3],
        [image(rng, 90, 90), image(rng, 16, 40), 1],
        [5],
        [7],
        [image(rng, 200, 50), 2],
        [video(rng, 3, 8, 16), 1, image(rng, 40, 40)],
    ]


def onevision_samples(rng):
    """Images (one a sample: tiled; two: base crops only) and videos of 3 frames (the video processor
    stacks the videos of a call: one frame count)."""
    return [
        [3, image(rng, 10, 30), 2],
        [image(rng, 30, 12), 1, image(rng, 16, 16)],
        [video(rng, 3, 16, 16), 3],
        [image(rng, 30, 12), 1],
        [5],
        [7],
        [image(rng, 24, 24), 2, video(rng, 3, 20, 20)],
        [video(rng, 3, 8, 16), 4],
    ]


def tile_samples(rng):
    """Images of 1 to 5 tiles: wide, tall, square, small."""
    return [
        [3, image(rng, 40, 20), 2],
        [image(rng, 16, 16), 1, image(rng, 20, 70)],
        [image(rng, 64, 64), 3],
        [image(rng, 16, 30), 1],
        [5],
        [7],
        [image(rng, 8, 32), image(rng, 16, 8)],
        [image(rng, 50, 50), 4],
    ]


#: PaliGemma's answers (the processor's ``suffix``: token type 1)
SUFFIXES = ["w1 w2", "w3", "w4 w5 w6", "w7", "w8 w9", "w1", "w2 w3", "w4"]

def glm_image_samples(rng):
    """Images of 16x16 to 33x90 pixels (GLM's models take images and videos in separate batches)."""
    return [
        [3, image(rng, 16, 24), 2],
        [image(rng, 40, 70), 1, image(rng, 20, 20)],
        [image(rng, 64, 30), 3],
        [image(rng, 33, 90), 1],
        [5],
        [7],
        [image(rng, 16, 16), 2, image(rng, 50, 40)],
        [image(rng, 24, 48), 4],
    ]


def glm_video_samples(rng):
    """Videos of 2 to 6 frames, one a sample."""
    return [
        [3, video(rng, 4, 32, 32), 2],
        [video(rng, 2, 16, 32), 1],
        [video(rng, 6, 16, 16), 3],
        [video(rng, 4, 32, 16), 1],
        [5],
        [7],
        [video(rng, 2, 32, 32), 2],
        [video(rng, 3, 16, 32), 4],
    ]


def ernie_samples(rng):
    """Images of 28x28 to 84x40 pixels and videos of 2, 4 and 6 frames."""
    return [
        [3, image(rng, 28, 28), 2],
        [image(rng, 40, 70), 1, video(rng, 4, 28, 56)],
        [video(rng, 2, 56, 28), 3],
        [image(rng, 28, 84), image(rng, 60, 60), 1],
        [5],
        [7],
        [video(rng, 6, 28, 28), 2, image(rng, 50, 40)],
        [image(rng, 84, 40), 4],
    ]


def omni3_samples(rng):
    """As :func:`omni_samples` with every clip and track over one second: Qwen3-Omni's audio tower pads
    a call's windows to its longest, so clips shorter than one window differ per microbatch (a known
    limit of the model, docs/audio-families.md)."""
    return [
        [2, image(rng, 16, 16), 1, audio(rng, 1.3), 2],
        [audio(rng, 1.48), 2, image(rng, 16, 24), 1],
        [3, video(rng, 4, 16, 16, track_seconds=1.17), 2],
        [1, image(rng, 8, 8), 1, audio(rng, 1.09), 1],
        [9],
        [12],
        [2, audio(rng, 2.3), 1, audio(rng, 1.09)],
        [video(rng, 3, 8, 16, track_seconds=2.5), 1, image(rng, 16, 16)],
    ]


def minimax_samples(rng):
    """Images, and videos of 2 to 8 frames (1 to 4 temporal steps: the processor cuts them in chunks of
    at most 2 steps, one grid row each)."""
    return [
        [3, image(rng, 16, 24), 2],
        [image(rng, 40, 70), image(rng, 20, 20), 1],
        [video(rng, 6, 32, 32), 3],
        [image(rng, 33, 90), 1, video(rng, 2, 16, 32)],
        [5],
        [7],
        [image(rng, 16, 16), 2, video(rng, 8, 16, 16)],
        [image(rng, 24, 48), video(rng, 4, 32, 16), image(rng, 16, 32)],
    ]


def kimi_image_samples(rng):
    """Images of 16x16 to 33x90 pixels (at most 32 x 32 after resizing)."""
    return [
        [3, image(rng, 16, 24), 2],
        [image(rng, 40, 70), image(rng, 20, 20), 1],
        [image(rng, 32, 32), 3],
        [image(rng, 33, 90), 1],
        [5],
        [7],
        [image(rng, 16, 16), 2, image(rng, 8, 24)],
        [image(rng, 24, 48), 4],
    ]


def kimi_video_samples(rng):
    """Images and videos of 2 to 8 frames (chunks of 2 frames: 1 to 4 grid rows a video)."""
    return [
        [3, image(rng, 16, 24), video(rng, 2, 32, 32)],
        [video(rng, 4, 16, 32), 1],
        [image(rng, 32, 32), 3],
        [video(rng, 6, 32, 16), image(rng, 16, 32)],
        [5],
        [7],
        [image(rng, 16, 16), 2, video(rng, 2, 16, 16)],
        [video(rng, 8, 32, 32), 4],
    ]


def inkling2_samples(rng):
    """Images of 8x8 to 30x30 pixels: padded to whole 8 x 8 tiles, one token a tile (two images back to
    back in sample 1)."""
    return [
        [3, image(rng, 16, 16), 2],
        [image(rng, 16, 24), image(rng, 8, 8), 1],
        [image(rng, 24, 32), 3],
        [image(rng, 9, 15), 1],
        [5],
        [7],
        [image(rng, 8, 32), 2, image(rng, 16, 8)],
        [image(rng, 30, 30), 4],
    ]


def inkling_samples(rng):
    """Images of 4x4 to 12x10 pixels (4 x 4 tiles, one token each) and audio clips of 0.1 to 0.3 s (one
    token per 50 ms), an image and a clip back to back in sample 3."""
    return [
        [3, image(rng, 8, 8), 2, audio(rng, 0.2)],
        [audio(rng, 0.3), 2, image(rng, 4, 12), 1],
        [image(rng, 12, 6), 3],
        [audio(rng, 0.1), 1, image(rng, 5, 5), audio(rng, 0.25)],
        [5],
        [7],
        [audio(rng, 0.15), image(rng, 8, 3), 2],
        [image(rng, 4, 4), image(rng, 10, 7), 4],
    ]


def phi4_samples(rng):
    """Images of 16x16 to 70x30 pixels (1 or 2 sub-crops of 32 pixels, padded at the bottom or right) and
    audio clips of 0.05 to 0.3 s at 16 kHz; samples with audio alone in a batch with images (the model
    projects their audio as the batch's: "vision")."""
    return [
        [2, image(rng, 32, 32), 1, audio(rng, 0.16), 2],
        [audio(rng, 0.12), 2, image(rng, 20, 50), 1],
        [3, audio(rng, 0.3), 2],
        [1, image(rng, 70, 30), 1],
        [9],
        [12],
        [2, audio(rng, 0.05), image(rng, 16, 16), audio(rng, 0.2)],
        [image(rng, 40, 64), 1],
    ]


def static_video(rng, t, h, w):
    """A video whose frames after the first redraw only their bottom half: VideoLLaMA3's compression
    drops the tokens of the unchanged top half."""
    frames = np.stack([rng.integers(0, 256, (h, w, 3), dtype=np.uint8)] * t)
    for k in range(1, t):
        frames[k, h // 2 :] = rng.integers(0, 256, (h - h // 2, w, 3), dtype=np.uint8)
    return ("video", frames)


def video_llama_3_samples(rng):
    """Images of 9x9 to 33x17 pixels (merge size 1), two back to back in sample 2; videos of 2 to 4
    frames (merge size 2), two of them half static (the compression mask drops tokens), two videos
    back to back in sample 6; images and videos in one sample."""
    return [
        [2, image(rng, 10, 30), 1, video(rng, 2, 16, 24), 1],
        [static_video(rng, 3, 16, 16), 2, image(rng, 20, 12)],
        [image(rng, 9, 9), image(rng, 24, 16), 2],
        [3, video(rng, 4, 8, 16)],
        [5],
        [7],
        [video(rng, 2, 24, 24), static_video(rng, 3, 16, 32), 1],
        [image(rng, 33, 17), 2],
    ]


PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 8, "pan_and_scan_max_num_crops": 3,
                "pan_and_scan_min_ratio_to_activate": 1.2}

CASES: dict[str, Case] = {
    "qwen2_5_vl": Case(qwen_samples(1), ("Qwen2_5_VLProcessor", "Qwen2VLImageProcessor", "Qwen2VLVideoProcessor"),
                       pil="Qwen2VLImageProcessorPil", forward={"use_cache": False}),
    "qwen3_vl": Case(qwen_samples(3), ("Qwen3VLProcessor", "Qwen2VLImageProcessor", "Qwen3VLVideoProcessor"),
                     pil="Qwen2VLImageProcessorPil", forward={"use_cache": False}),
    "llava_next": Case(image_samples, ("LlavaNextProcessor", "LlavaNextImageProcessor"), pil="LlavaNextImageProcessorPil"),
    "gemma3": Case(image_samples, ("Gemma3Processor", "Gemma3ImageProcessor"), pil="Gemma3ImageProcessorPil",
                   call={"nested": True, **PAN_AND_SCAN}),
    "gemma4": Case(gemma4_samples, ("Gemma4Processor", "Gemma4ImageProcessor", "Gemma4VideoProcessor",
                                    "Gemma4AudioFeatureExtractor"), pil="Gemma4ImageProcessorPil",
                   call={"nested": True, "sampling_rate": 16000}, forward={"use_cache": False}),
    "qwen2_5_omni": Case(omni_samples, ("Qwen2_5OmniProcessor", "Qwen2VLImageProcessor", "Qwen2VLVideoProcessor",
                                        "WhisperFeatureExtractor"), pil="Qwen2VLImageProcessorPil",
                         call={"sampling_rate": 16000}, forward={"use_cache": False, "use_audio_in_video": True}),
    "idefics3": Case(image_samples, ("Idefics3Processor", "Idefics3ImageProcessor"), pil="Idefics3ImageProcessorPil",
                     call={"nested": True}, text_only_empty=False),
    "smolvlm": Case(image_samples, ("SmolVLMProcessor", "SmolVLMImageProcessor", "SmolVLMVideoProcessor"), pil="SmolVLMImageProcessorPil",
                    call={"nested": True}, text_only_empty=False),
    "internvl": Case(internvl_samples, ("InternVLProcessor", "GotOcr2ImageProcessor", "InternVLVideoProcessor"),
                     pil="GotOcr2ImageProcessorPil"),
    "llava_onevision": Case(onevision_samples, ("LlavaOnevisionProcessor", "LlavaOnevisionImageProcessor",
                                                "LlavaOnevisionVideoProcessor"), pil="LlavaOnevisionImageProcessorPil",
                            call={"nested": True}),
    "llava": Case(image_samples, ("LlavaProcessor", "LlavaImageProcessor"), pil="LlavaImageProcessorPil"),
    "llava_pixtral": Case(image_samples, ("PixtralProcessor", "PixtralImageProcessor"), pil="PixtralImageProcessorPil"),
    "mistral3": Case(image_samples, ("PixtralProcessor", "PixtralImageProcessor"), pil="PixtralImageProcessorPil"),
    "mistral_small4": Case(image_samples, ("PixtralProcessor", "PixtralImageProcessor"), pil="PixtralImageProcessorPil"),
    "mistral_large4": Case(image_samples, ("PixtralProcessor", "PixtralImageProcessor"), pil="PixtralImageProcessorPil"),
    "paligemma": Case(image_samples, ("PaliGemmaProcessor", "SiglipImageProcessor"), pil="SiglipImageProcessorPil",
                      call={"nested": True, "suffix": SUFFIXES}),
    "aya_vision": Case(tile_samples, ("AyaVisionProcessor", "GotOcr2ImageProcessor"), pil="GotOcr2ImageProcessorPil"),
    "glm4v": Case(glm_image_samples, ("Glm4vProcessor", "Glm4vImageProcessor", "Glm4vVideoProcessor"),
                  pil="Glm4vImageProcessorPil", forward={"use_cache": False}),
    "glm4v_moe": Case(glm_video_samples, ("Glm4vProcessor", "Glm4vImageProcessor", "Glm4vVideoProcessor"),
                      pil="Glm4vImageProcessorPil", forward={"use_cache": False}),
    "glm46v": Case(glm_image_samples, ("Glm46VProcessor", "Glm46VImageProcessor", "Glm46VVideoProcessor"),
                   pil="Glm46VImageProcessorPil", forward={"use_cache": False}),
    "glm46v_videos": Case(glm_video_samples, ("Glm46VProcessor", "Glm46VImageProcessor", "Glm46VVideoProcessor"),
                          forward={"use_cache": False}, family="glm46v"),
    "ernie4_5_vl_moe": Case(ernie_samples, ("Ernie4_5_VLMoeProcessor", "Ernie4_5_VLMoeImageProcessor",
                                            "Ernie4_5_VLMoeVideoProcessor"), pil="Ernie4_5_VLMoeImageProcessorPil",
                            forward={"use_cache": False}),
    "llama4": Case(tile_samples, ("Llama4Processor", "Llama4ImageProcessor"), forward={"use_cache": False},
                   float_reference=("pixel_values",)),
    "qwen3_omni": Case(omni3_samples, ("Qwen3OmniMoeProcessor", "Qwen2VLImageProcessor", "Qwen2VLVideoProcessor",
                                       "WhisperFeatureExtractor"), pil="Qwen2VLImageProcessorPil",
                       call={"sampling_rate": 16000}, forward={"use_cache": False, "use_audio_in_video": True}),
    "minimax_m3_vl": Case(minimax_samples, ("MiniMaxM3VLProcessor", "MiniMaxM3VLImageProcessor", "MiniMaxM3VLVideoProcessor"),
                          forward={"use_cache": False}),
    "kimi_vl": Case(kimi_image_samples, ("Kimi_K25Processor", "Kimi_K25ImageProcessor", "Kimi_K25VideoProcessor"),
                    forward={"use_cache": False}),
    "kimi_k25_video": Case(kimi_video_samples, ("Kimi_K25Processor", "Kimi_K25ImageProcessor", "Kimi_K25VideoProcessor"),
                           forward={"use_cache": False}),
    "inkling": Case(inkling_samples, ("InklingProcessor", "InklingImageProcessor", "InklingFeatureExtractor"),
                    call={"sampling_rate": 16000}, forward={"use_cache": False}),
    "inkling2": Case(inkling2_samples, ("Inkling2Processor", "Inkling2ImageProcessor"), forward={"use_cache": False}),
    "phi4_multimodal": Case(phi4_samples, ("Phi4MultimodalProcessor", "Phi4MultimodalImageProcessor",
                                           "Phi4MultimodalFeatureExtractor"), call={"sampling_rate": 16000}),
    "video_llama_3": Case(video_llama_3_samples, ("VideoLlama3Processor", "VideoLlama3ImageProcessor",
                                                  "VideoLlama3VideoProcessor"), pil="VideoLlama3ImageProcessorPil"),
}

BACKEND_CASES = [(family, "torchvision") for family in CASES] + [(f, "pil") for f, case in CASES.items() if case.pil]


def family_of(name):
    return CASES[name].family or name


def processor_batch(name, backend="torchvision", seed=0, processor=None):
    case = CASES[name]
    processor = build_tiny_processor(family_of(name), image_backend=backend) if processor is None else processor
    batch = chat_batch(processor, case.samples(np.random.default_rng(seed)), seed=seed, **case.call)
    return processor, batch


def assert_matches_model(name, batch, model):
    """The model's own forward on ``batch`` is the reference; the adapter's split -> stage -> merge
    (and positions) must equal it for every microbatch count; returns the reference."""
    case = CASES[name]
    as_float = {key: batch[key].float() for key in case.float_reference}
    reference, positions = capture_reference(model, **{**batch, **as_float}, **case.forward)
    checks = check_adapter(family_of(name), model=model, batch=batch, reference=reference, positions=positions,
                           microbatches=MICROBATCHES, atol=ATOL)
    assert len(checks) == sum(MICROBATCHES)
    assert max(c.max_abs_diff for c in checks) <= ATOL
    four = [c.has_media for c in checks if c.n_microbatches == 4]
    eight = [c.has_media for c in checks if c.n_microbatches == 8]
    if case.text_only_empty:
        assert four == [True, True, False, True], four
        assert eight[4:6] == [False, False] and sum(eight) == 6, eight
    return reference, positions


@pytest.mark.parametrize("family, backend", BACKEND_CASES, ids=[f"{f}-{b}" for f, b in BACKEND_CASES])
def test_family_on_its_processor(family, backend):
    case = CASES[family]  # family: the case's name (a tiny family, or a second batch of one)
    processor, batch = processor_batch(family, backend)
    names = [type(processor).__name__, type(processor.image_processor).__name__]
    names += [type(part).__name__ for part in (getattr(processor, "video_processor", None),
                                                getattr(processor, "feature_extractor", None) or getattr(processor, "audio_processor", None))
              if part is not None]  # Phi-4's processor names its feature extractor audio_processor
    expected = list(case.classes)
    if backend == "pil":
        expected[1] = case.pil
    assert names == expected
    if family == "minimax_m3_vl":  # 4 videos in 6 chunks, one grid row a chunk (the processor drops the count)
        assert batch["video_grid_thw"][:, 0].tolist() == [2, 1, 1, 2, 2, 2] and "num_chunks_per_video" not in batch
    if family == "inkling":  # 30 tiles a token each; 5 clips of 2 to 6 frames (the processor drops the tile counts)
        assert batch["pixel_values"].shape == (30, 2, 4, 4, 3) and "num_patches" not in batch
        assert batch["audio_input_ids_mask"].sum(-1).tolist() == [4, 6, 2, 5, 3]
    if family == "video_llama_3":  # merge sizes 1 (images) and 2 (videos); the static halves compressed away
        assert batch["image_merge_sizes"].tolist() == [1] * 5 and batch["video_merge_sizes"].tolist() == [2] * 5
        assert batch["video_compression_mask"].shape == (74,) and int(batch["video_compression_mask"].sum()) == 62
    if family == "kimi_k25_video":  # 5 videos in 11 chunks of 2 frames
        assert batch["video_grid_thw"][:, 0].tolist() == [2] * 11
    assert_matches_model(family, batch, build_tiny_processor_model(family_of(family)))


def test_glm_models_refuse_images_and_videos_in_one_batch():
    """transformers' GLM-4V forward matches both placeholder kinds with the image token, so the
    processor's batch of images AND videos is refused by the model itself (ppmedia's merge of such a
    batch is checked against a per-modality reference in tests/test_glm4v_adapter.py)."""
    rng = np.random.default_rng(0)
    samples = [[2, image(rng, 16, 24)], [video(rng, 2, 16, 32), 1]]
    batch = chat_batch(build_tiny_processor("glm4v"), samples)
    assert batch["mm_token_type_ids"].tolist()[1].count(2) > 0  # the processor marks the video's frames
    with pytest.raises(ValueError, match="Image features and image tokens do not match"):
        capture_reference(build_tiny_processor_model("glm4v"), **batch, use_cache=False)


def test_llama4_processor_gives_bfloat16_pixels_its_float32_model_refuses():
    """Llama4ImageProcessor returns bfloat16 pixels (as the original implementation); transformers' own
    float32 forward refuses them (a dtype error), while ppmedia's merge casts them to the tower's dtype:
    the family test compares it with the model's forward on the same pixels in float32."""
    _, batch = processor_batch("llama4")
    assert batch["pixel_values"].dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="same dtype"):
        capture_reference(build_tiny_processor_model("llama4"), **batch, use_cache=False)
    with pytest.raises(ValueError, match="Llama4ImageProcessorPil"):
        build_tiny_processor("llama4", image_backend="pil")


def test_step3p7_processor_keys_are_refused_then_renamed_they_match_the_model():
    """transformers' Step3p7Processor writes the crops as ``pixel_values_local`` with
    ``num_local_patches`` PER IMAGE; ppmedia's step3 layout reads the Step3-VL names
    (``patch_pixel_values``, ``num_patches`` per SAMPLE) and refuses the others with one clear error.
    Renamed (counts summed per sample), the merges equal the model's own forward on the native batch."""
    import ppmedia
    from ppmedia.testing.tiny_models import step3 as tiny

    processor = build_tiny_processor("step3")
    assert [type(processor).__name__, type(processor.image_processor).__name__] == ["Step3p7Processor", "Step3p7ImageProcessor"]
    rng = np.random.default_rng(0)  # one image a sample (ppmedia's step3 adapter: one global view a sample)
    sizes = [(40, 20), (16, 16), (96, 64), (16, 30), None, None, (80, 32), (50, 50)]
    batch = chat_batch(processor, [[3, image(rng, *hw), 2] if hw else [5] for hw in sizes])
    model = build_tiny_processor_model("step3")
    reference, positions = capture_reference(model, **batch, use_cache=False)
    with pytest.raises(ValueError, match="ppmedia does not know (pixel_values_local|num_local_patches) as a media key"):
        ppmedia.split_media(dict(batch), 2)
    images = (batch["input_ids"] == tiny.IM_START_ID).sum(-1)  # one global view an image
    owner = torch.repeat_interleave(torch.arange(images.shape[0]), images)
    per_sample = torch.zeros_like(images).index_add_(0, owner, batch["num_local_patches"])
    renamed = {k: v for k, v in batch.items() if k not in ("pixel_values_local", "num_local_patches")}
    renamed.update(patch_pixel_values=batch["pixel_values_local"], num_patches=per_sample)
    assert int(per_sample.sum()) == renamed["patch_pixel_values"].shape[0] > 0
    checks = check_adapter("step3", model=model, batch=renamed, reference=reference, positions=positions,
                           microbatches=MICROBATCHES, atol=ATOL)
    assert max(c.max_abs_diff for c in checks) <= ATOL
    assert [c.has_media for c in checks if c.n_microbatches == 4] == [True, True, False, True]


def test_qwen2_5_vl_video_timing_reaches_the_positions():
    """Staged without the processor's ``second_per_grid_ts``, a video's mrope positions differ from
    the model's own: the positions check sees the video timing."""
    _, batch = processor_batch("qwen2_5_vl")
    assert batch["image_grid_thw"].shape == (7, 3) and batch["video_grid_thw"][:, 0].tolist() == [2, 2, 1]
    model = build_tiny_processor_model("qwen2_5_vl")
    reference, positions = capture_reference(model, **batch, use_cache=False)
    timeless = {k: v for k, v in batch.items() if k != "second_per_grid_ts"}
    with pytest.raises(AdapterMismatch, match="position_ids"):
        check_adapter("qwen2_5_vl", model=model, batch=timeless, reference=reference, positions=positions, microbatches=[1])


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_5_omni"])
def test_saved_processor_round_trips_and_feeds_the_model(family, tmp_path):
    """``save_tiny_processor`` -> ``AutoProcessor.from_pretrained`` gives the same classes and the same
    batch (with :func:`processor_call_kwargs`), and the tiny model runs on it."""
    from transformers import AutoProcessor

    loaded = AutoProcessor.from_pretrained(save_tiny_processor(family, tmp_path / "tiny"))
    assert [type(loaded).__name__, type(loaded.image_processor).__name__] == list(CASES[family].classes[:2])
    _, fresh = processor_batch(family, seed=1)
    case = CASES[family]
    again = chat_batch(loaded, case.samples(np.random.default_rng(1)), seed=1, **case.call, **processor_call_kwargs(family))
    assert fresh.keys() == again.keys()
    for key in fresh:
        assert torch.equal(fresh[key], again[key]), key
    tiny = load(family)
    assert loaded.tokenizer.pad_token_id == tiny.PAD_TOKEN_ID and loaded.tokenizer.eos_token_id == tiny.EOS_TOKEN_ID
    assert loaded.image_token_id == tiny.IMAGE_TOKEN_ID and loaded.video_token_id == tiny.VIDEO_TOKEN_ID
    model = build_tiny_processor_model(family)
    with torch.no_grad():
        logits = model(**again, **case.forward).logits
    assert logits.shape == (*again["input_ids"].shape, model.config.text_config.vocab_size)
    assert torch.isfinite(logits).all()


def test_the_docs_table_names_these_tests():
    """docs/processors.md: a row per family of the README's Families table (and per tiny family);
    every ``tested (...)`` cell names a test of this module that exists; every image, video and audio
    cell is tested, refused or none (nothing "not yet tested")."""
    from ppmedia.testing.tiny_models import FAMILIES

    text = (ROOT / "docs" / "processors.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([a-z0-9_]+)` \|.*$", text, flags=re.M)}
    readme = (ROOT / "README.md").read_text()
    families = re.findall(r"^\| `([a-z0-9_]+)` \| `", readme[readme.index("## Families"):], flags=re.M)
    assert families and set(families) <= set(rows), set(families) - set(rows)
    assert set(FAMILIES) <= set(rows), set(FAMILIES) - set(rows)
    ids = {f"test_family_on_its_processor[{f}-{b}]" for f, b in BACKEND_CASES}
    ids |= {"test_qwen2_5_vl_video_timing_reaches_the_positions", "test_glm_models_refuse_images_and_videos_in_one_batch",
            "test_llama4_processor_gives_bfloat16_pixels_its_float32_model_refuses",
            "test_step3p7_processor_keys_are_refused_then_renamed_they_match_the_model"}
    ids |= {f"test_saved_processor_round_trips_and_feeds_the_model[{f}]" for f in ("qwen2_5_vl", "qwen2_5_omni")}
    named = re.findall(r"`(test_[a-z0-9_]+(?:\[[^\]]+\])?)`", text)
    assert named and set(named) <= ids, set(named) - ids
    for name in CASES:  # every family tested here says so in its row
        assert "tested (" in rows[family_of(name)], name
    for family, row in rows.items():  # every modality cell: tested, refused (with the reason) or none
        cells = [cell.strip() for cell in row.strip("|").split(" | ")[2:]]
        assert len(cells) == 3 and all(c == "none" or c.startswith(("tested", "refused")) for c in cells), (family, cells)
