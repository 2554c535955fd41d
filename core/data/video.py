"""Videos as the model's video processor takes them: the video's metadata and only the frames it keeps.

transformers' video processors choose a video's frames from its metadata
(``transformers.video_utils.VideoMetadata``: frame count, frame rate, duration) with the family's own
settings (``fps``, ``num_frames``, ``min_frames`` / ``max_frames``, ``do_sample_frames``); several
write the kept frames' timestamps into the text (Qwen3-VL, GLM-4V, VideoLLaMA3, Gemma 4, Kimi-K2.5,
MiniMax-M3) or time the video by them (Qwen2.5-VL's ``second_per_grid_ts``). :class:`FrameSampler`
asks the processor's own ``sample_frames`` which frames it keeps; :func:`read_video` decodes only
those (PyAV: a seek by timestamp past each run of frames that holds none of them) and returns them with
the metadata, ``frames_indices`` set to the kept frames. Handed to the processor with
``do_sample_frames=False`` they give what the processor gives when it samples the whole decoded video
itself. With ``audio_rate`` it also decodes the video's audio track (the Qwen Omni processors'
``load_audio_from_video``).
"""

from __future__ import annotations

import bisect
import copy
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Iterator

import numpy as np

from .errors import DataError
from .media import _name as display_name
from .media import OPENED, open_media_file

__all__ = ["FrameSampler", "Video", "audio_slots", "read_video", "without_sampling"]

#: video-processor settings that are not ``sample_frames`` arguments (``preprocess`` takes them out)
_NOT_SAMPLING = ("input_data_format", "do_convert_rgb", "do_sample_frames", "device", "video_metadata",
                 "return_tensors", "draw_on_frames", "load_audio_from_video")


@dataclass
class Video:
    """A video read for the processor.

    Attributes:
        frames: ``[K, H, W, 3]`` uint8: the kept frames in order (every frame when the processor does
            not sample).
        metadata: the whole video's ``transformers.video_utils.VideoMetadata`` (``total_num_frames``,
            ``fps``, ``duration`` = frames / fps, ``width``, ``height``, ``video_backend="pyav"``) with
            ``frames_indices`` = the kept frames' indices as the processor's ``sample_frames`` gave them
            (``list(range(total))`` when it does not sample).
        decoded: frames the decoder produced: the kept ones and those before them back to a keyframe
            (twice the video's frames when it had to decode it all: once to count them).
        audio: the audio track, mono float32 ``[n]`` at ``audio_rate`` (``None`` unless asked for; an
            empty array when the file has no audio stream).
    """

    frames: np.ndarray
    metadata: Any
    decoded: int
    audio: np.ndarray | None = None


class FrameSampler:
    """Which frames a processor keeps of a video, asked of its own video processor.

    Args:
        processor: the model's processor; it must have a ``video_processor``.
        call_kwargs: the keyword arguments of every processor call (``SampleProcessor``'s
            ``processor_kwargs``); they override the saved settings, as in the call.

    Attributes:
        samples: whether the processor samples frames (its ``do_sample_frames`` after the call's
            arguments); when it does not, every frame is kept.
        audio_from_video: whether the processor takes each video's audio track too (the Omni
            processors' ``load_audio_from_video``, or its deprecated name ``use_audio_in_video``).

    The settings are the processor's own merge of the call's arguments over its saved ones
    (``ProcessorMixin._merge_kwargs``), completed from the video processor as its ``preprocess``
    completes them.
    """

    def __init__(self, processor: Any, call_kwargs: dict[str, Any] | None = None) -> None:
        if getattr(processor, "video_processor", None) is None:
            raise ValueError(f"{type(processor).__name__} has no video processor")
        self.video_processor: Any = processor.video_processor
        call = copy.deepcopy(dict(call_kwargs or {}))
        legacy = bool(call.pop("use_audio_in_video", False)
                      or call.get("videos_kwargs", {}).pop("use_audio_in_video", False))
        tokenizer = getattr(processor, "tokenizer", None)
        merged = processor._merge_kwargs(tokenizer_init_kwargs=getattr(tokenizer, "init_kwargs", {}), **call)
        kwargs = dict(merged["videos_kwargs"])
        for name in getattr(self.video_processor.valid_kwargs, "__annotations__", {}):
            kwargs.setdefault(name, getattr(self.video_processor, name, None))
        self.samples = bool(kwargs.get("do_sample_frames"))
        self.audio_from_video = legacy or bool(kwargs.get("load_audio_from_video")
                                               or merged.get("load_audio_from_video"))
        self._kwargs = {k: v for k, v in kwargs.items() if k not in _NOT_SAMPLING}

    def __call__(self, metadata: Any) -> Any:
        """The processor's ``sample_frames(metadata, ...)`` (indices, in the type it returns them), or
        ``None`` when it does not sample (every frame)."""
        if not self.samples:
            return None
        return self.video_processor.sample_frames(metadata=copy.deepcopy(metadata), **self._kwargs)


class _OffGrid(Exception):
    """The stream's frames are not on a constant-rate grid of ``total`` frames (or one is missing)."""


def _metadata(total: int, rate: Fraction, stream: Any) -> Any:
    from transformers.video_utils import VideoMetadata

    return VideoMetadata(total_num_frames=total, fps=float(rate), width=stream.width, height=stream.height,
                         duration=total / float(rate), video_backend="pyav")


class _Frames:
    """Frame ``k`` of a constant-rate stream is the one shown at ``start + k / rate``. One demux pass
    (no decoding) checks that the packets are exactly frames ``0 .. total-1`` on that grid (``total``:
    the container's frame count, else the packets') and finds the keyframes; :meth:`get` then seeks
    (to the keyframe at or before ``k``) only when a keyframe lies after the last decoded frame, and
    else decodes on."""

    def __init__(self, container: Any, stream: Any, rate: Fraction) -> None:
        self.container, self.stream, self.rate = container, stream, rate
        self.start = stream.start_time or 0
        scale = Fraction(stream.time_base) * rate  # frames per pts unit, as integers for speed
        self._num, self._den = scale.numerator, scale.denominator
        packets = [(self._index(p.pts), bool(p.is_keyframe)) for p in container.demux(stream) if p.pts is not None]
        self.total = int(stream.frames) or len(packets)  # Matroska / WebM headers hold no frame count
        if sorted(k for k, _ in packets) != list(range(self.total)):
            raise _OffGrid
        self.keyframes = sorted(k for k, key in packets if key)
        if not self.keyframes or self.keyframes[0] != 0:
            raise _OffGrid
        self.decoded, self.position = 0, -1
        self._decoding: Iterator[Any] | None = None

    def _index(self, pts: int) -> int:
        """The frame shown at ``pts``; :class:`_OffGrid` unless within 1% of a frame's time."""
        num, den = (pts - self.start) * self._num, self._den
        k = (2 * num + den) // (2 * den)
        if 100 * abs(num - k * den) > den:
            raise _OffGrid
        return k

    def get(self, k: int) -> np.ndarray:
        """Frame ``k`` as ``[H, W, 3]`` uint8 (``k`` increasing from call to call)."""
        key = self.keyframes[bisect.bisect_right(self.keyframes, k) - 1]
        if self._decoding is None or key > self.position:
            target = self.start + int(Fraction(k) / self.rate / self.stream.time_base)
            self.container.seek(target, stream=self.stream, backward=True, any_frame=False)
            self._decoding = self.container.decode(self.stream)
        for frame in self._decoding:
            self.decoded += 1
            self.position = self._index(frame.pts)
            if self.position == k:
                return frame.to_ndarray(format="rgb24")
            if self.position > k:
                break
        raise _OffGrid


def _kept(indices: Any, total: int, where: str, name: str) -> list[int]:
    kept = list(range(total)) if indices is None else [int(i) for i in indices]
    if not kept or kept != sorted(kept) or kept[0] < 0 or kept[-1] >= total:
        raise DataError(where, f"video {name!r}: the processor's sample_frames chose frames {kept[:4]}..., "
                               f"expected increasing indices in [0, {total})")
    return kept


def _sampled(sampler: Callable[[Any], Any] | None, metadata: Any, where: str, name: str) -> tuple[Any, list[int]]:
    total = metadata.total_num_frames
    try:
        indices = None if sampler is None else sampler(metadata)
    except Exception as e:  # the processor's own complaint about this video
        raise DataError(where, f"video {name!r} ({total} frames at {metadata.fps:g} fps): the processor cannot "
                               f"sample its frames ({type(e).__name__}: {e})") from None
    kept = _kept(indices, total, where, name)
    metadata.frames_indices = list(range(total)) if indices is None else indices
    return metadata, kept


def _read_kept(container: Any, stream: Any, sampler: Callable[[Any], Any] | None, where: str, name: str) -> Video:
    rate = Fraction(stream.average_rate or stream.guessed_rate or 0)
    if not rate:
        raise _OffGrid
    frames = _Frames(container, stream, rate)
    metadata, kept = _sampled(sampler, _metadata(frames.total, rate, stream), where, name)
    pictures = [frames.get(k) for k in kept]
    return Video(np.stack(pictures), metadata, frames.decoded)


def _read_all(container: Any, stream: Any, sampler: Callable[[Any], Any] | None, where: str, name: str) -> Video:
    """Off the grid: one pass decodes (without converting) to count the frames, a second converts the
    kept ones; memory holds only those."""
    rate = Fraction(stream.average_rate or stream.guessed_rate or 0)
    if not rate:
        raise DataError(where, f"video {name!r} has no frame rate: its frames cannot be timed")
    container.seek(0)
    total = sum(1 for _ in container.decode(stream))
    if not total:
        raise DataError(where, f"video {name!r} has no frames")
    metadata, kept = _sampled(sampler, _metadata(total, rate, stream), where, name)
    container.seek(0)
    wanted, pictures = set(kept), {}
    for k, frame in enumerate(container.decode(stream)):
        if k in wanted:
            pictures[k] = frame.to_ndarray(format="rgb24")
    if len(pictures) != len(wanted):
        raise DataError(where, f"video {name!r} decoded {total} frames once and fewer the second time")
    return Video(np.stack([pictures[k] for k in kept]), metadata, 2 * total)


def _audio_track(container: Any, rate: int) -> np.ndarray:
    import av

    if not container.streams.audio:
        return np.zeros(0, dtype=np.float32)
    stream = container.streams.audio[0]
    container.seek(0)
    resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
    chunks = [out.to_ndarray().reshape(-1) for frame in container.decode(stream) for out in resampler.resample(frame)]
    chunks += [out.to_ndarray().reshape(-1) for out in resampler.resample(None)]
    return np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, dtype=np.float32)


def _opened(item: Any) -> Any:
    """``av.open`` on ``item``: a path directly (PyAV reading through a Python file object decoded the
    benchmark's clip 1.6x slower), else its bytes; counted in :data:`~ppmedia.data.media.OPENED`."""
    import av

    path = item.get("path") if isinstance(item, dict) and not item.get("bytes") else item
    if isinstance(path, str):
        OPENED.append(path)
        return av.open(path)
    return av.open(open_media_file(item))  # in-memory bytes


def read_video(item: Any, where: str, sampler: Callable[[Any], Any] | None = None,
               audio_rate: int | None = None) -> Video:
    """The frames of ``item``'s first video stream that ``sampler`` keeps, and its metadata.

    Args:
        item: a path or a ``datasets`` ``{"bytes", "path"}`` dict (:func:`~ppmedia.data.media.open_media_file`).
        where: the record, for errors.
        sampler: metadata -> the kept frames' indices or ``None`` (all), e.g. a :class:`FrameSampler`;
            ``None``: every frame.
        audio_rate: also decode the first audio stream, mono, resampled to this rate (``Video.audio``).

    Frame ``k`` is the ``k``-th frame the decoder shows, as when every frame is decoded. Where every
    packet lies on the frame rate's grid (frames ``0 .. total-1``, ``total`` from the container's
    header or its packets), only the kept frames are decoded, each from the keyframe before it (a seek
    by timestamp, skipped when no keyframe lies between two kept frames). Otherwise (a variable frame
    rate) the video is decoded twice: once to count its frames, once to convert the kept ones.

    Raises:
        DataError: naming ``where`` and the file: unreadable, no video stream, no frames, no frame rate,
            or a processor that cannot sample it.
    """
    import av

    name = display_name(item)
    try:
        with _opened(item) as container:
            if not container.streams.video:
                raise DataError(where, f"video {name!r} has no video stream")
            stream = container.streams.video[0]
            try:
                video = _read_kept(container, stream, sampler, where, name)
            except _OffGrid:
                video = _read_all(container, stream, sampler, where, name)
            if audio_rate is not None:
                video.audio = _audio_track(container, audio_rate)
            return video
    except DataError:
        raise
    except (OSError, av.error.FFmpegError) as e:
        raise DataError(where, f"video {name!r} cannot be read: {e}") from None


def without_sampling(call_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``call_kwargs`` (a processor call's keyword arguments) with ``do_sample_frames=False``, where the
    call takes it (inside ``videos_kwargs`` when the call has one): the frames are already the kept ones."""
    call = copy.deepcopy(dict(call_kwargs))
    if isinstance(call.get("videos_kwargs"), dict):
        call.pop("do_sample_frames", None)
        call["videos_kwargs"]["do_sample_frames"] = False
    else:
        call["do_sample_frames"] = False
    return call


def audio_slots(messages: list[dict[str, Any]], clips: list[np.ndarray],
                tracks: list[np.ndarray | None]) -> tuple[list[np.ndarray], list[int | None]]:
    """The audio of a record whose videos bring their tracks: standalone ``clips`` and the videos'
    ``tracks`` in prompt order, and per slot ``None`` (a clip) or the index of the video it is the
    track of: the Omni processors' ``audio`` and ``audio_from_video_indices``."""
    audio: list[np.ndarray] = []
    sources: list[int | None] = []
    clip_iter, video = iter(clips), 0
    for message in messages:
        for part in message["content"]:
            if part["type"] == "audio":
                audio.append(next(clip_iter))
                sources.append(None)
            elif part["type"] == "video":
                track = tracks[video]
                if track is not None:
                    audio.append(track)
                    sources.append(video)
                video += 1
    return audio, sources
