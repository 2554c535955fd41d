"""The consumer side: one microbatch's staged media, taken in schedule order.

The contract is the one NeMo Automodel's pipeline staging uses, so media staged by either library can
be consumed by the other. A producer hangs one list per media tensor on the first stage module (see
:data:`STAGED_ATTRIBUTES`) plus a cursor ``_vlm_chunk_idx``; every forward call of that stage calls
:func:`next_vlm_media_chunk` once and gets the entries at the cursor.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "CURSOR_ATTRIBUTE",
    "EXTRAS_ATTRIBUTE",
    "STAGED_ATTRIBUTES",
    "VlmMediaChunk",
    "next_vlm_media_chunk",
]


@dataclass(slots=True)
class VlmMediaChunk:
    """One microbatch's media, each field the staged tensor itself (a view of the batch, never a copy).

    A field is ``None`` when nothing was staged for it or its staged tensor is empty.

    Attributes:
        pixel_values: image pixels in the processor's layout, images or patches on axis 0: complete
            images ``[images, C, H, W]``, padded patches ``[images, max_patches, D]``, LLaVA-NeXT crops
            ``[images, max_crops, C, H, W]``, flat patch rows ``[patches, D]`` or patch-major patches
            ``[patches, C, ph, pw]``.
        image_grid: per-image metadata, images on axis 0: patch grid ``[images, 2]`` (h, w) or
            ``[images, 3]`` (t, h, w), original sizes ``[images, 2]``, or per-patch positions
            ``[images, max_patches, 2]``.
        pixel_values_videos: video pixels with patches on axis 0, e.g. flat patch rows ``[patches, D]``,
            in video order.
        video_grid: ``[videos, 3]``, the (t, h, w) patch grid of each video.
        patch_pixel_values: Step3 crop patches ``[patches, C, h, w]``, concatenated in image order.
        num_patches: Step3 ``[batch]``, each sample's crop-patch count; indexes ``patch_pixel_values``
            and ``patch_newline_mask``.
        patch_newline_mask: Step3 ``[patches]``, marks the crop patches that end a row.
        second_per_grid_ts: ``[videos]``, seconds between two temporal patches of each video of the
            chunk (Qwen2.5-VL / Qwen3-VL video timing for mrope positions), in video order. An
            addition after the seven contract fields: optional, so the seven-argument constructor and
            media staged by other libraries (which never set it) keep working.
        input_features: ``[audios, ...]``, the microbatch's audio clips, one clip per row of axis 0, in
            the family's layout: log-mel frames ``[audios, T, mel]`` (Gemma 4), Whisper features
            ``[audios, mel, T]`` (Qwen2.5-Omni, Qwen3-Omni) or discrete mel codes ``[audios, frames,
            bins]`` (Inkling's ``audio_input_ids``). Optional trailing field (like
            ``second_per_grid_ts``): staged from the batch key ``input_features`` or ``audio_input_ids``.
        input_features_mask: ``[audios, T]``, the valid (non-padding) frames of each clip of
            ``input_features``, bool or integer; staged from ``input_features_mask`` (Gemma 4, Inkling's
            feature extractor), ``feature_attention_mask`` (Whisper, the Qwen Omni processors) or
            ``audio_input_ids_mask`` (Inkling's processor).
        video_position_ids: ``[frames, max_patches, 2]``, Gemma 4's per-frame patch positions (``-1``
            marks padding) for ``pixel_values_videos`` ``[frames, max_patches, D]``, frames in video order.
        num_frames_per_video: ``[videos]``, Gemma 4's frames of each video of the chunk (its rows of
            ``pixel_values_videos`` / ``video_position_ids``).
        extras: ``{name: tensor}``, the microbatch's views of everything else a media layout or a
            per-sample input staged (a plugin's layout fields, an adapter's ``sample_inputs`` such as
            ``token_type_ids`` ``[b, S]``), each the staged tensor itself and non-empty; ``None`` when
            there is none. Always the last field, keyword only in practice: ``VlmMediaChunk(*tensors,
            extras=...)``. Staged as :data:`EXTRAS_ATTRIBUTE` (one dict per microbatch).
    """

    pixel_values: Tensor | None
    image_grid: Tensor | None
    pixel_values_videos: Tensor | None
    video_grid: Tensor | None
    patch_pixel_values: Tensor | None = None
    num_patches: Tensor | None = None
    patch_newline_mask: Tensor | None = None
    second_per_grid_ts: Tensor | None = None
    input_features: Tensor | None = None
    input_features_mask: Tensor | None = None
    video_position_ids: Tensor | None = None
    num_frames_per_video: Tensor | None = None
    extras: dict[str, Tensor] | None = None

    @property
    def has_media(self) -> bool:
        """Whether any media field is set (``extras`` alone, e.g. per-sample inputs of a text-only
        microbatch, is not media: such a chunk merges nothing)."""
        return not (
            self.pixel_values is None and self.image_grid is None and self.pixel_values_videos is None
            and self.video_grid is None and self.patch_pixel_values is None and self.num_patches is None
            and self.patch_newline_mask is None and self.second_per_grid_ts is None and self.input_features is None
            and self.input_features_mask is None and self.video_position_ids is None and self.num_frames_per_video is None
        )


#: chunk field -> the list attribute on the first stage module that stages it, in field order.
STAGED_ATTRIBUTES: dict[str, str] = {
    "pixel_values": "_vlm_pixel_values_chunks",
    "image_grid": "_vlm_image_grid_hws_chunks",
    "pixel_values_videos": "_vlm_pixel_values_videos_chunks",
    "video_grid": "_vlm_video_grid_thw_chunks",
    "patch_pixel_values": "_vlm_patch_pixel_values_chunks",
    "num_patches": "_vlm_num_patches_chunks",
    "patch_newline_mask": "_vlm_patch_newline_mask_chunks",
    "second_per_grid_ts": "_vlm_second_per_grid_ts_chunks",
    "input_features": "_vlm_input_features_chunks",
    "input_features_mask": "_vlm_input_features_mask_chunks",
    "video_position_ids": "_vlm_video_position_ids_chunks",
    "num_frames_per_video": "_vlm_num_frames_per_video_chunks",
}
#: the attribute holding the index of the next microbatch to consume.
CURSOR_ATTRIBUTE = "_vlm_chunk_idx"
#: the list attribute staging ``VlmMediaChunk.extras``: per microbatch a dict of non-empty tensors, or ``None``.
EXTRAS_ATTRIBUTE = "_vlm_extras_chunks"

assert (*STAGED_ATTRIBUTES, "extras") == tuple(f.name for f in fields(VlmMediaChunk))
_ATTRS = tuple(STAGED_ATTRIBUTES.values())
_NAMES = frozenset((*_ATTRS, CURSOR_ATTRIBUTE, EXTRAS_ATTRIBUTE))
_NAMES_SET = set(_NAMES)  # a plain set: dict_keys & set looks up the set's few names in the dict
#: ppmedia's optional trailing lists (video timing, audio, Gemma 4 video frames), after the seven
_TRAILING = _ATTRS[7:]
assert _TRAILING[0] == STAGED_ATTRIBUTES["second_per_grid_ts"]
_read_contract = operator.itemgetter(*_ATTRS[:7])  # a tuple of the seven contract lists
_read_all = operator.itemgetter(*_ATTRS)  # every list: ppmedia's own staging sets them all
_MISSING = object()
_Tensor = torch.Tensor
_MODULE_GETATTR: Any = torch.nn.Module.__getattr__
_OBJECT_GETATTRIBUTE: Any = object.__getattribute__
_REGISTRIES = ("_parameters", "_buffers", "_modules")

# Reading a name that is not in an ``nn.Module``'s ``__dict__`` with ``getattr(module, name, None)``
# goes through ``Module.__getattr__``, which builds and raises an AttributeError: microseconds per
# name. NeMo Automodel stages only some of the lists, so ppmedia resolves a missing name itself
# where it can prove the answer is the same: the class neither defines the name (no class attribute,
# property or slot) nor answers attributes in its own way (``__getattr__``, ``__getattribute__``),
# and no parameter, buffer or submodule carries the name. Then the answer is ``None``, exactly what
# ``getattr`` would return. type -> whether that holds for its instances, decided on a type's first
# use (a staged name added to a class after that is not seen: staging sets instance attributes).
_PLAIN_TYPES: dict[type, bool] = {}


def _names_live_in_instance(cls: type) -> bool:
    plain = (
        getattr(cls, "__getattr__", None) is _MODULE_GETATTR
        and cls.__getattribute__ is _OBJECT_GETATTRIBUTE
        and not any(hasattr(cls, name) for name in _NAMES)
    )
    if len(_PLAIN_TYPES) > 4096:  # dynamically made classes: keep the cache bounded
        _PLAIN_TYPES.clear()
    _PLAIN_TYPES[cls] = plain
    return plain


def _missing_is_none(module: torch.nn.Module, state: dict[str, Any]) -> bool:
    """Whether every staged name absent from ``state`` (the module's ``__dict__``) reads as ``None``."""
    plain = _PLAIN_TYPES.get(type(module))
    if plain is None:
        plain = _names_live_in_instance(type(module))
    if not plain:
        return False
    for registry in _REGISTRIES:
        entries = state.get(registry)
        if not entries:
            continue
        if len(entries) <= 16:
            shared = not _NAMES.isdisjoint(entries)  # walks the registry
        else:  # a long registry (a flat stage of many layers): look the few names up in it instead
            shared = bool(entries.keys() & _NAMES_SET)
        if shared:
            return False
    return True


def _read_missing(module: torch.nn.Module, state: dict[str, Any], name: str) -> Any:
    """``getattr(module, name, None)`` for one ``name`` that is not in ``state`` (the module's ``__dict__``)."""
    plain = _PLAIN_TYPES.get(type(module))
    if plain is None:
        plain = _names_live_in_instance(type(module))
    if plain:
        for registry in _REGISTRIES:
            entries = state.get(registry)
            if entries and name in entries:
                break
        else:
            return None
    return getattr(module, name, None)


def _read_partial(module: torch.nn.Module, state: dict[str, Any]) -> tuple[Any, ...]:
    """The staged lists when some are not in ``state``: what ``getattr(module, name, None)`` gives."""
    if _missing_is_none(module, state):
        return tuple(map(state.get, _ATTRS))
    return tuple(getattr(module, name, None) for name in _ATTRS)


def _read_some(module: torch.nn.Module, state: dict[str, Any]) -> tuple[Any, ...]:
    """The staged lists when not all are in ``state``: another producer's staging (NeMo Automodel)."""
    try:  # the seven contract lists, one C call: NeMo Automodel's staging after its first step
        lists: tuple[Any, ...] = _read_contract(state)
    except KeyError:  # NeMo Automodel's first step sets only the lists of the batch's modalities
        return _read_partial(module, state)
    get = state.get  # ppmedia's additions, which no other producer sets
    return lists + tuple(
        _read_missing(module, state, name) if (value := get(name, _MISSING)) is _MISSING else value
        for name in _TRAILING
    )


def next_vlm_media_chunk(module: torch.nn.Module) -> VlmMediaChunk | None:
    """Take the next microbatch's staged media from ``module`` and advance its cursor once.

    Call it exactly once per forward of the first pipeline stage. The cursor advances also for a
    text-only microbatch, so later microbatches always get their own media. Only tensor metadata
    (``numel()``) is read: no tensor data reaches the host, so no device sync happens here.

    Every list is read as ``getattr(module, name, None)`` would read it, but without paying for
    ``nn.Module.__getattr__``'s miss path on lists a producer did not set (NeMo Automodel sets only
    some; none sets the trailing ones, ``second_per_grid_ts`` and the audio lists, but ppmedia), so a partially staged module costs about as
    much per call as a fully staged one.

    Args:
        module: the first stage's module, carrying the lists named in :data:`STAGED_ATTRIBUTES` and
            the cursor :data:`CURSOR_ATTRIBUTE`.

    Returns:
        ``None`` when nothing is staged (every list absent or ``None``, or the cursor ``None``; nothing
        changes then) or when the microbatch is text-only (every entry absent or empty); otherwise a
        :class:`VlmMediaChunk` whose non-``None`` fields are the staged tensor objects themselves.

    Raises:
        ValueError: a staged list has no entry at the cursor (the schedule ran more microbatches than
            were staged).
        TypeError: a staged entry is neither a tensor nor ``None``.
    """
    state = module.__dict__
    k = state.get(CURSOR_ATTRIBUTE, _MISSING)
    if k is _MISSING:
        k = _read_missing(module, state, CURSOR_ATTRIBUTE)
    if k is None:
        return None
    try:  # every list, one C call: ppmedia's own staging sets them all
        lists: tuple[Any, ...] = _read_all(state)
    except KeyError:
        lists = _read_some(module, state)
    # values[i] is field i of the chunk; its length is also the index of the list being read.
    values: list[Any] = []
    append = values.append
    staged_any = present = False
    for staged in lists:
        if staged is None:
            append(None)
            continue
        staged_any = True
        if not 0 <= k < len(staged):
            raise ValueError(
                f"{_ATTRS[len(values)]} has {len(staged)} entries but microbatch {k} was requested: the "
                f"schedule ran more microbatches than were staged (a schedule's first step also runs a "
                f"shape-inference forward: stage with ppmedia.stage_media(first_pipeline_stage, ...))"
            )
        entry = staged[k]
        if entry is None:
            append(None)
            continue
        if not isinstance(entry, _Tensor):
            raise TypeError(
                f"{_ATTRS[len(values)]}[{k}] is a {type(entry).__name__}; expected a torch.Tensor or None "
                f"(microbatch {k})"
            )
        if entry.numel():
            append(entry)
            present = True
        else:
            append(None)
    extras = state.get(EXTRAS_ATTRIBUTE, _MISSING)
    if extras is _MISSING:
        extras = _read_missing(module, state, EXTRAS_ATTRIBUTE)
    if extras is not None:  # layouts' or per-sample inputs' names beyond the chunk fields
        staged_any = True
        extras = _extras_entry(extras, k)
    if not staged_any:
        return None
    if CURSOR_ATTRIBUTE in state:
        state[CURSOR_ATTRIBUTE] = k + 1
    else:
        setattr(module, CURSOR_ATTRIBUTE, k + 1)
    if extras is not None:
        chunk = VlmMediaChunk(*values)
        chunk.extras = extras
        return chunk
    return VlmMediaChunk(*values) if present else None


def _extras_entry(staged: Any, k: int) -> dict[str, Tensor] | None:
    """Entry ``k`` of the staged extras list: a dict of non-empty tensors, or ``None``."""
    if not 0 <= k < len(staged):
        raise ValueError(
            f"{EXTRAS_ATTRIBUTE} has {len(staged)} entries but microbatch {k} was requested: the schedule ran "
            f"more microbatches than were staged"
        )
    entry = staged[k]
    if entry is not None and not isinstance(entry, dict):
        raise TypeError(f"{EXTRAS_ATTRIBUTE}[{k}] is a {type(entry).__name__}; expected a dict of tensors or None (microbatch {k})")
    return entry or None
