"""Reading media for the processor: images with PIL, audio with soundfile (videos: :mod:`.video`).

Every file is opened through :func:`open_media_file`, and ``OPENED`` counts the files this process
opened, so a test (or you) can check that a rank which does not encode media reads none.
"""

from __future__ import annotations

import io
from typing import IO, Any

import numpy as np

from .errors import DataError

__all__ = ["OPENED", "load_audio", "load_image", "media_reads", "open_media_file"]

#: media files opened by this process (one entry per open: the path)
OPENED: list[str] = []


def open_media_file(item: Any) -> IO[bytes]:
    """A binary file object of ``item``: a path, or a ``datasets`` ``{"bytes", "path"}`` dict (its
    bytes when present); paths are appended to :data:`OPENED`."""
    if isinstance(item, dict):
        if item.get("bytes"):
            OPENED.append(str(item.get("path") or "<bytes>"))
            return io.BytesIO(item["bytes"])
        item = item.get("path")
    if not isinstance(item, str):
        raise TypeError(f"a media item is {type(item).__name__}, expected a path or a datasets bytes dict")
    OPENED.append(item)
    return open(item, "rb")


def media_reads(group: Any = None) -> list[tuple[int, int]]:
    """``(opens, distinct files)`` of :data:`OPENED` on every rank of ``group`` (default: the world),
    in group rank order; collective over ``group`` (one ``all_gather_object``). Opens in
    ``DataLoader`` worker processes are counted there, not here: use it with ``workers=0``."""
    import torch.distributed as dist

    mine = (len(OPENED), len(set(OPENED)))
    if not dist.is_initialized():
        return [mine]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    return [(int(a), int(b)) for a, b in gathered]


def _name(item: Any) -> str:
    return str(item.get("path") or "<bytes>") if isinstance(item, dict) else str(item)


def load_image(item: Any, where: str) -> Any:
    """``item`` as an RGB ``PIL.Image`` (an image object passes through); :class:`DataError` naming
    ``where`` and the file if it is missing or cannot be decoded."""
    from PIL import Image

    if isinstance(item, Image.Image):
        return item.convert("RGB")
    try:
        with open_media_file(item) as f:
            image = Image.open(f)
            image.load()
            return image.convert("RGB")
    except (OSError, SyntaxError, ValueError) as e:
        raise DataError(where, f"image {_name(item)!r} cannot be read: {e}") from None


def load_audio(item: Any, where: str, sampling_rate: int) -> np.ndarray:
    """``item`` as mono float32 samples ``[n]`` at ``sampling_rate`` (read with soundfile; another
    rate is resampled by linear interpolation)."""
    import soundfile

    try:
        with open_media_file(item) as f:
            samples, rate = soundfile.read(f, dtype="float32", always_2d=True)
    except (OSError, RuntimeError, soundfile.LibsndfileError) as e:
        raise DataError(where, f"audio {_name(item)!r} cannot be read: {e}") from None
    mono = samples.mean(axis=1)
    if rate != sampling_rate and len(mono) > 1:
        n = max(1, round(len(mono) * sampling_rate / rate))
        mono = np.interp(np.linspace(0, len(mono) - 1, n), np.arange(len(mono)), mono).astype(np.float32)
    return mono
