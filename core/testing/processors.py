"""Real processors for the tiny families: the family's own processor classes around a tiny tokenizer.

:func:`build_tiny_processor` gives, for a tiny family (:mod:`ppmedia.testing.tiny_models`), the
family's own ``ProcessorMixin`` (e.g. ``Qwen2_5_VLProcessor``) holding its real image processor
(the torchvision class by default, the ``...Pil`` class with ``image_backend="pil"`` where one exists),
video processor and audio feature extractor, configured to the tiny model's patch, merge and image
sizes, a real word-level tokenizer whose special tokens carry the tiny model's ids
(:func:`ppmedia.testing.word_tokenizer.word_tokenizer`) and a chat template in the family's style.
Placeholders are expanded by the processor itself, as in training.

:func:`save_tiny_processor` writes it to a folder that ``AutoProcessor.from_pretrained`` loads back
(next to a ``save_pretrained`` tiny checkpoint, it is a complete local "hub" model folder).

:func:`chat_batch` makes a batch the way a data pipeline does: one user turn per sample, through the
chat template, then the processor on the texts and the media.

A tiny-family module provides its processor with ``build_processor(image_backend: str) ->
ProcessorMixin`` (optional in :data:`~ppmedia.testing.tiny_models.PROTOCOL`), and, when the processor's
media do not fit :func:`build_model`'s model (Gemma 4's 280 patches an image need a larger vision
position table), ``build_processor_model(seed)``: :func:`build_tiny_processor_model` gives the model
to run the processor's batches through either way. A module's ``PROCESSOR_CALL_KWARGS`` are what every
call of the processor needs once saved and loaded back (:func:`processor_call_kwargs`): the Qwen Omni
processor classes impose video sizes of their own over their video processor's, and do not save them.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any, Mapping, Sequence

import numpy as np

from . import tiny_models

__all__ = [
    "IMAGE_BACKENDS",
    "build_tiny_processor",
    "build_tiny_processor_model",
    "chat_batch",
    "has_tiny_processor",
    "processor_call_kwargs",
    "save_tiny_processor",
]

#: the image-processor backends: ``"torchvision"`` (transformers 5's default classes) and ``"pil"``
#: (the ``...Pil`` classes).
IMAGE_BACKENDS: tuple[str, ...] = ("torchvision", "pil")


def has_tiny_processor(family: str | ModuleType) -> bool:
    """Whether the tiny family's module defines ``build_processor``."""
    return callable(getattr(tiny_models.load(family), "build_processor", None))


def build_tiny_processor(family: str | ModuleType, *, image_backend: str = "torchvision") -> Any:
    """The tiny family's real processor (see the module docstring).

    Args:
        family: a built-in tiny family name, a plugin's tiny-family module or its dotted name.
        image_backend: ``"torchvision"`` or ``"pil"`` (:data:`IMAGE_BACKENDS`).

    Raises:
        ValueError: an unknown backend; a family without a tiny processor (``build_processor``);
            ``"pil"`` for a family whose image processor has no ``...Pil`` class (the family's
            ``build_processor`` says so).
    """
    if image_backend not in IMAGE_BACKENDS:
        raise ValueError(f"image_backend {image_backend!r}: expected one of {', '.join(IMAGE_BACKENDS)}")
    module = tiny_models.load(family)
    build = getattr(module, "build_processor", None)
    if not callable(build):
        raise ValueError(f"tiny family {tiny_models.family_name(module)}: no tiny processor (its module has no build_processor)")
    return build(image_backend=image_backend)


def build_tiny_processor_model(family: str | ModuleType, seed: int = 0) -> Any:
    """The tiny model that :func:`build_tiny_processor`'s batches fit: the module's
    ``build_processor_model(seed)`` where it has one, else its ``build_model(seed)``."""
    module = tiny_models.load(family)
    build = getattr(module, "build_processor_model", None)
    return build(seed) if callable(build) else module.build_model(seed)


def processor_call_kwargs(family: str | ModuleType) -> dict[str, Any]:
    """Keyword arguments every call of the family's saved-and-loaded tiny processor needs (the module's
    ``PROCESSOR_CALL_KWARGS``; ``{}`` for most families)."""
    return dict(getattr(tiny_models.load(family), "PROCESSOR_CALL_KWARGS", {}))


def save_tiny_processor(family: str | ModuleType, directory: str | Path, *, image_backend: str = "torchvision") -> Path:
    """Write :func:`build_tiny_processor`'s processor to ``directory`` (created if needed) with
    ``save_pretrained``; ``AutoProcessor.from_pretrained(directory)`` loads it back. Returns the folder."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    build_tiny_processor(family, image_backend=image_backend).save_pretrained(str(path))
    return path


#: a sample's parts for :func:`chat_batch`: ``int`` n (n text words), ``str`` (that text), or a media
#: item ``("image", PIL image)``, ``("video", uint8 frames [T, H, W, 3])``, ``("audio", float [n])``,
#: ``("video", frames, float [n])`` (a video with its audio track, for the Omni processors).
Part = Any


def _content(parts: Sequence[Part], words: Sequence[str], rng: np.random.Generator) -> tuple[list[dict[str, Any]], dict[str, list[Any]]]:
    """One sample's chat content and media per kind; ``media["audio_from_video"]`` holds, per audio
    clip, ``None`` or the index of the sample's video it is the track of, in prompt order."""
    content: list[dict[str, Any]] = []
    media: dict[str, list[Any]] = {}
    for part in parts:
        if isinstance(part, (int, np.integer)):
            content.append({"type": "text", "text": " ".join(rng.choice(list(words), int(part)).tolist())})
        elif isinstance(part, str):
            content.append({"type": "text", "text": part})
        else:
            kind, item, *track = part
            content.append({"type": kind})
            media.setdefault(kind, []).append(item)
            if kind == "audio" or track:
                media.setdefault("audio_from_video", []).append(len(media["video"]) - 1 if track else None)
            if track:
                media.setdefault("audio", []).append(track[0])
    return content, media


def _media_arguments(per_sample: list[dict[str, list[Any]]], nested: bool, names: Mapping[str, str]) -> dict[str, Any]:
    arguments: dict[str, Any] = {}
    for kind in sorted({k for media in per_sample for k in media} - {"audio_from_video"}):
        lists = [media.get(kind, []) for media in per_sample]
        arguments[names[kind]] = lists if nested else [item for items in lists for item in items]
    slots: list[int | None] = []
    first_video = 0
    for media in per_sample:
        slots += [None if slot is None else first_video + slot for slot in media.get("audio_from_video", [])]
        first_video += len(media.get("video", []))
    if any(slot is not None for slot in slots):  # audio tracks of videos: the Omni processors' slots
        arguments["audio_from_video_indices"] = slots
        arguments["load_audio_from_video"] = True
    return arguments


def chat_batch(
    processor: Any,
    samples: Sequence[Sequence[Part]],
    *,
    seed: int = 0,
    nested: bool = False,
    media_keys: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """``processor(text=..., images=..., videos=..., audio=..., return_tensors="pt", padding=True,
    **kwargs)`` on one user turn per sample, rendered by ``processor.apply_chat_template``.

    Args:
        processor: a tiny processor (:func:`build_tiny_processor`).
        samples: per sample its parts (:data:`Part`): text word counts (words drawn from ``seed``),
            text, and media items in prompt order. A video with its audio track adds the track to the
            audio clips at the video's place and calls the processor with ``audio_from_video_indices``
            and ``load_audio_from_video=True``.
        nested: pass media as one list per sample (processors that want them so, e.g. Idefics3)
            instead of one flat list in prompt order.
        media_keys: the processor's argument per media kind (default ``images``, ``videos``, ``audio``).

    Returns:
        The processor's output as a plain dict (``input_ids`` ``[B, S]``, the media keys).
    """
    from .word_tokenizer import text_words

    rng = np.random.default_rng(seed)
    words = text_words(processor.tokenizer)
    names = {"image": "images", "video": "videos", "audio": "audio", **dict(media_keys or {})}
    texts: list[str] = []
    per_sample: list[dict[str, list[Any]]] = []
    for parts in samples:
        content, media = _content(parts, words, rng)
        texts.append(processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False))
        per_sample.append(media)
    arguments = _media_arguments(per_sample, nested, names)
    out = processor(text=texts, return_tensors="pt", padding=True, **arguments, **kwargs)
    return dict(out)
