"""Video reading benchmark (``python tests/bench/run.py --video``): reading a clip for a processor that
samples its frames, against decoding only the frames it keeps.

The clip: 60 s at 30 fps (1,800 frames, 160 x 96), written here with PyAV (libx264, its default
settings: keyframes at scene cuts and at most every 250 frames, B-frames). The processor: the tiny
Qwen3-VL one (``ppmedia.testing.processors``) sampling as its family does (``do_sample_frames``, 2 frames
a second: 120 of the 1,800). Per repetition, interleaved:

* **ppmedia**: ``ppmedia.data.video.read_video(path, where, FrameSampler(processor))``: probe, the
  processor's own frame choice, decode the kept frames (seeking by timestamp), their metadata;
* **kept only** (the floor): a bare PyAV loop given the kept indices and the keyframes (found before the
  clock starts) that seeks to the keyframe before a kept frame whenever one lies past the last decoded
  frame and decodes forward to it, converting only the kept frames to RGB: the least decoding the kept
  frames need;
* **decode everything** (ppmedia's reader before issue 34): every frame decoded and converted, the
  processor then samples.

``R`` = ppmedia / kept only (goal ``<= 1.2``); beside it decode everything / kept only. Medians of the
per-repetition ratios.
"""

from __future__ import annotations

import bisect
import os
import statistics
import tempfile
import time
from fractions import Fraction
from typing import Any

import numpy as np

SECONDS, FPS, WIDTH, HEIGHT = 60, 30, 160, 96
GOAL_R = 1.2


def write_clip(path: str) -> str:
    """The benchmark's clip: a moving pattern with a scene cut every 10 s."""
    import av

    rng = np.random.default_rng(0)
    scenes = [rng.integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8) for _ in range(SECONDS // 10)]
    with av.open(path, "w") as container:
        stream = container.add_stream("libx264", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        for i in range(SECONDS * FPS):
            picture = np.roll(scenes[i // (10 * FPS)], i, axis=1)
            for packet in stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def _keyframes(path: str) -> list[int]:
    import av

    with av.open(path) as container:
        stream = container.streams.video[0]
        scale = stream.time_base * stream.average_rate
        return sorted(round((p.pts - (stream.start_time or 0)) * scale) for p in container.demux(stream)
                      if p.pts is not None and p.is_keyframe)


def kept_only(path: str, kept: list[int], keyframes: list[int]) -> np.ndarray:
    """The floor: decode only what the kept frames need (see the module docstring)."""
    import av

    with av.open(path) as container:
        stream = container.streams.video[0]
        rate, base, start = Fraction(stream.average_rate), stream.time_base, stream.start_time or 0
        frames, position, decoding = [], -1, None
        for k in kept:
            if decoding is None or keyframes[bisect.bisect_right(keyframes, k) - 1] > position:
                container.seek(start + int(Fraction(k) / rate / base), stream=stream, backward=True)
                decoding = container.decode(stream)
            for frame in decoding:
                position = round((frame.pts - start) * base * rate)
                if position == k:
                    frames.append(frame.to_ndarray(format="rgb24"))
                    break
        return np.stack(frames)


def decode_everything(path: str, sampler: Any) -> np.ndarray:
    """ppmedia's reader before issue 34 (``ppmedia.data.media.load_video``): every frame decoded and
    converted; then the processor's choice."""
    import av
    from transformers.video_utils import VideoMetadata

    with open(path, "rb") as f, av.open(f) as container:  # it read through a Python file object
        stream = container.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
        fps = float(stream.average_rate)
    indices = sampler(VideoMetadata(total_num_frames=len(frames), fps=fps, width=WIDTH, height=HEIGHT,
                                    duration=len(frames) / fps))
    return frames[np.asarray([int(i) for i in indices])]


def run(repeats: int = 5) -> dict[str, Any]:
    from ppmedia.data.video import FrameSampler, read_video
    from ppmedia.testing.processors import build_tiny_processor

    processor = build_tiny_processor("qwen3_vl")
    sampler = FrameSampler(processor, {"do_sample_frames": True, "fps": 2})
    with tempfile.TemporaryDirectory() as folder:
        path = write_clip(os.path.join(folder, "clip.mp4"))
        keyframes = _keyframes(path)
        video = read_video(path, "clip.mp4", sampler)
        kept = [int(i) for i in video.metadata.frames_indices]
        same = np.array_equal(video.frames, kept_only(path, kept, keyframes)) and np.array_equal(
            video.frames, decode_everything(path, sampler))
        times: dict[str, list[float]] = {"ppmedia": [], "kept": [], "everything": []}
        for _ in range(repeats):
            for arm, call in (("ppmedia", lambda: read_video(path, "clip.mp4", sampler)),
                              ("kept", lambda: kept_only(path, kept, keyframes)),
                              ("everything", lambda: decode_everything(path, sampler))):
                started = time.perf_counter()
                call()
                times[arm].append(time.perf_counter() - started)
    ratio = [a / b for a, b in zip(times["ppmedia"], times["kept"])]
    before = [a / b for a, b in zip(times["everything"], times["kept"])]
    return {
        "clip": {"seconds": SECONDS, "fps": FPS, "frames": SECONDS * FPS, "size": [WIDTH, HEIGHT], "codec": "libx264",
                 "keyframes": len(keyframes)},
        "kept_frames": len(kept), "decoded_frames": video.decoded, "same_frames": bool(same),
        "median_s": {arm: statistics.median(t) for arm, t in times.items()},
        "R": statistics.median(ratio), "decode_everything_over_kept": statistics.median(before), "goal": GOAL_R,
        "repeats": repeats,
    }


def report(result: dict[str, Any]) -> str:
    t, clip = result["median_s"], result["clip"]
    return "\n".join([
        f"13. video reading: a {clip['seconds']} s {clip['fps']} fps clip ({clip['frames']} frames, "
        f"{clip['size'][0]}x{clip['size'][1]}, {clip['codec']}, {clip['keyframes']} keyframes); the processor keeps "
        f"{result['kept_frames']} frames, ppmedia decoded {result['decoded_frames']} (same frames in every arm: "
        f"{'yes' if result['same_frames'] else 'NO'})",
        f"   ppmedia {t['ppmedia']:.3f} s, kept frames only {t['kept']:.3f} s, decode everything {t['everything']:.3f} s",
        f"video-read: seconds to read a {clip['seconds']} s {clip['fps']} fps clip / seconds to decode only its kept "
        f"frames = {result['R']:.2f} (goal <= {result['goal']}; decode everything: {result['decode_everything_over_kept']:.2f})",
    ])
