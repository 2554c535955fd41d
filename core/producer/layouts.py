"""Media layouts: how a family's media sit in a processor batch, as :func:`ppmedia.split_media` reads them.

A :class:`MediaLayout` names the batch keys it reads, what axis 0 of each holds, and a planner (see
:mod:`ppmedia.producer.planners`) that maps the items to samples and rows. Plugins bring layouts through the hook
``ppmedia_media_layouts`` (:mod:`ppmedia.registry.hookspecs`); ppmedia's own layouts
(:data:`BUILTIN_LAYOUTS`) come through the same hook, from the built-in plugin, and every split, plain
or balanced, goes through :meth:`LayoutSet.select` and the planners it selects.

Selection, per batch, from the keys present (values that are not ``None``):

1. a layout applies when every key of its ``requires`` is present (a layout requiring nothing applies
   when any of its keys is present);
2. of two applying layouts that read a common present key, the one whose ``requires`` is a strict
   superset of the other's wins (``pixel_values`` + ``image_grid_thw`` beats ``pixel_values`` alone);
   neither: the batch is ambiguous, a ``ValueError`` naming both layouts and their keys;
3. a present key that no selected layout reads is an error ("given without ..."), except an empty
   value of a layout's optional key, which is dropped (an empty ``second_per_grid_ts`` in a batch
   without videos); a mask (``..._mask``) describes its features and is refused without them, empty
   or not;
4. per-sample counts (the batch's ``n_<modality>s_per_sample``, the ``<modality>s_per_sample=``
   argument) go to the selected layout of their modality; counts for a modality without media must
   all be zero.

The selection depends only on which keys are present, so it is computed once per key set and cached.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

from .declared import GridRows, item_planner, sample_planner
from .planners_audio import AUDIO_FEATURE_KEYS, AUDIO_MASKS, audio_planner
from .planners_frames import frames_planner
from .planners import (
    IMAGE_GRID_KEYS,
    Context,
    Counts,
    Part,
    image_major_planner,
    patch_rows_planner,
    plan_pan_and_scan,
    plan_step3,
    plan_videos,
)

__all__ = [
    "BUILTIN_LAYOUTS",
    "GridRows",
    "LayoutSet",
    "MediaLayout",
    "Planner",
    "Selection",
    "item_layout",
    "sample_layout",
]

#: ``plan(ctx, media, counts) -> finish``; ``finish() -> Part`` after the host read (see :mod:`ppmedia.producer.planners`).
Planner = Callable[[Context, Mapping[str, Any], "Counts | None"], Callable[[], Part]]


@dataclass(frozen=True)
class MediaLayout:
    """One way a family's media sit in a batch: what ``split_media`` needs to split, check and stage them.

    Attributes:
        name: unique among all registered layouts (``"qwen_videos"``, ``"onevision_videos"``).
        modality: what the items are (``"image"``, ``"video"``, ``"audio"``, ``"crop"``, any word).
            With ``counted``, its per-sample counts are the batch key ``n_<modality>s_per_sample`` and
            the argument ``<modality>s_per_sample=`` (``images_per_sample``); the split's per-modality
            tallies (``StagedMedia.items``/``rows``) are keyed by it.
        requires: the batch keys that select it (all present); see the module docstring.
        plan: the planner (:data:`Planner`); it is handed the batch's values of ``requires`` and of
            the present ``optional`` keys (plus the counts key), never any other key.
        fields: the chunk fields it stages: :class:`~ppmedia.VlmMediaChunk` fields (``pixel_values``,
            ``video_grid``) or any other name, which the chunk carries in ``chunk.extras[name]``.
        optional: further keys it reads when present (``second_per_grid_ts``).
        counted: whether per-sample counts map its items to samples (``False``: the planner maps them
            itself, e.g. Step3's ``num_patches`` or a layout with samples on axis 0).
        sequences: keys whose value may be a Python sequence instead of a tensor (the planner checks
            them); every other value must be a dense tensor.
        axis0: in words, what axis 0 of each key holds (``{"pixel_values_videos": "videos"}``), for
            messages, ``ppmedia adapters`` and authors.
    """

    name: str
    modality: str
    requires: tuple[str, ...]
    plan: Planner
    fields: tuple[str, ...]
    optional: tuple[str, ...] = ()
    counted: bool = True
    sequences: tuple[str, ...] = ()
    axis0: Mapping[str, str] | None = None

    @property
    def keys(self) -> tuple[str, ...]:
        """Every batch key it reads, ``requires`` first (its counts key not included)."""
        return (*self.requires, *(k for k in self.optional if k not in self.requires))

    @property
    def counts_key(self) -> str | None:
        """The batch key of its per-sample counts (``n_images_per_sample``), or ``None`` when not counted."""
        return f"n_{self.modality}s_per_sample" if self.counted else None

    @property
    def counts_argument(self) -> str | None:
        """The ``split_media`` argument of its per-sample counts (``images_per_sample``), or ``None``."""
        return f"{self.modality}s_per_sample" if self.counted else None

    def describe(self) -> str:
        """``name (modality): key [axis 0], ...``: one line for listings."""
        axis0 = dict(self.axis0 or {})
        keys = ", ".join(f"{k} [{axis0[k]}]" if k in axis0 else k for k in self.keys)
        return f"{self.name} ({self.modality}): {keys}"


class Orphan(NamedTuple):
    """A present key that no selected layout reads: the layout that would, and what it lacks."""

    key: str
    owner: MediaLayout
    missing: tuple[str, ...]
    optional: bool  # an optional key of ``owner`` but no mask: an empty value is dropped, not an error


class Selection(NamedTuple):
    """What :meth:`LayoutSet.select` chose for one set of present keys."""

    layouts: tuple[MediaLayout, ...]  # registration order
    orphans: tuple[Orphan, ...]
    error: str | None  # ambiguity: the message of the ValueError every split of such a batch raises
    #: per selected layout: (layout, its counts batch key, its counts argument), keys ``None`` when not counted
    plans: tuple[tuple[MediaLayout, str | None, str | None], ...] = ()
    #: the counted modalities no selected layout serves: (modality, counts key, argument); their counts must be 0
    unplanned: tuple[tuple[str, str, str], ...] = ()


def check_layout(layout: Any) -> MediaLayout:
    """``layout`` if it is a well-formed :class:`MediaLayout`, else ``TypeError``/``ValueError`` saying what is wrong."""
    if not isinstance(layout, MediaLayout):
        raise TypeError(f"got {type(layout).__name__} {layout!r}; expected a ppmedia.producer.layouts.MediaLayout")
    name = layout.name
    if not isinstance(name, str) or not name:
        raise ValueError(f"MediaLayout.name is {name!r}; expected a non-empty str")
    if not isinstance(layout.modality, str) or not layout.modality.isidentifier():
        raise ValueError(f"media layout {name!r}: modality {layout.modality!r}; expected a word such as 'image'")
    for attribute in ("requires", "optional", "fields", "sequences"):
        value = getattr(layout, attribute)
        if not isinstance(value, tuple) or not all(isinstance(k, str) and k for k in value):
            raise ValueError(f"media layout {name!r}: {attribute} is {value!r}; expected a tuple of non-empty str")
    if not layout.fields:
        raise ValueError(f"media layout {name!r}: fields is (); expected the chunk fields it stages")
    if not layout.keys:
        raise ValueError(f"media layout {name!r}: requires and optional are both empty; expected the batch keys it reads")
    if not callable(layout.plan):
        raise ValueError(f"media layout {name!r}: plan is {layout.plan!r}; expected a planner plan(ctx, media, counts) -> finish")
    if layout.counts_key is not None and layout.counts_key in layout.keys:
        raise ValueError(f"media layout {name!r}: reads its own counts key {layout.counts_key}; the split passes those counts")
    return layout


class LayoutSet:
    """The registered layouts, and the per-batch selection (:meth:`select`, cached per key set).

    Args:
        layouts: in registration order (the order ties are reported and keys listed in).

    Raises:
        ValueError: a malformed layout, two layouts of one name, or two that require the same keys and
            read a common key (no batch could tell them apart).
    """

    def __init__(self, layouts: Iterable[MediaLayout]) -> None:
        self.layouts: tuple[MediaLayout, ...] = tuple(check_layout(layout) for layout in layouts)
        names: dict[str, MediaLayout] = {}
        for layout in self.layouts:
            if layout.name in names:
                raise ValueError(f"two media layouts are named {layout.name!r}")
            for other in names.values():
                if set(other.requires) == set(layout.requires) and set(other.keys) & set(layout.keys):
                    raise ValueError(
                        f"media layouts {other.name!r} and {layout.name!r} both require {list(layout.requires)}: no batch "
                        f"can tell them apart; expected one of them to require a key the other does not"
                    )
            names[layout.name] = layout
        ordered: dict[str, None] = {}
        counts: dict[str, tuple[str, str]] = {}
        for layout in self.layouts:
            ordered.update(dict.fromkeys(layout.keys))
            if layout.counts_key is not None and layout.counts_argument is not None:
                counts.setdefault(layout.modality, (layout.counts_key, layout.counts_argument))
        for key, _ in counts.values():
            ordered.setdefault(key)
        #: every key a split pops, in registration order.
        self.ordered_keys: tuple[str, ...] = tuple(ordered)
        self.keys: frozenset[str] = frozenset(ordered)
        #: counted modality -> (its counts batch key, its split_media argument).
        self.counted: dict[str, tuple[str, str]] = counts
        count_keys = {key for key, _ in counts.values()}
        self._count_keys = frozenset(count_keys)
        #: keys whose values may be sequences (counts included).
        self.sequences: frozenset[str] = frozenset(count_keys.union(*(layout.sequences for layout in self.layouts)))
        self._cache: dict[frozenset[str], Selection] = {}
        self._lock = threading.Lock()

    def __iter__(self) -> Any:
        return iter(self.layouts)

    def __len__(self) -> int:
        return len(self.layouts)

    def __repr__(self) -> str:
        return f"LayoutSet({[layout.name for layout in self.layouts]})"

    def names(self) -> list[str]:
        return [layout.name for layout in self.layouts]

    def select(self, present: frozenset[str]) -> Selection:
        """The layouts for a batch whose present (non-``None``) media keys are ``present``."""
        found = self._cache.get(present)
        if found is None:
            found = self._select(present)
            with self._lock:
                if len(self._cache) > 1024:  # keep it bounded whatever batches come
                    self._cache.clear()
                self._cache[present] = found
        return found

    def _select(self, present: frozenset[str]) -> Selection:
        candidates = [
            layout for layout in self.layouts
            if set(layout.requires) <= present and (layout.requires or present.intersection(layout.keys))
        ]
        chosen = [c for c in candidates if not any(_dominates(d, c, present) for d in candidates if d is not c)]
        error = _ambiguity(chosen, present)
        if error is None:
            error = _same_modality(chosen)
        read = set().union(*(layout.keys for layout in chosen))
        orphans = []
        for key in self.ordered_keys:
            if key in present and key not in read and key not in self._count_keys:
                owner = next(layout for layout in self.layouts if key in layout.keys)
                missing = tuple(k for k in owner.requires if k not in present)
                orphans.append(Orphan(key, owner, missing, key in owner.optional and not key.endswith("_mask")))
        plans = tuple((layout, layout.counts_key, layout.counts_argument) for layout in chosen)
        planned = {layout.modality for layout in chosen if layout.counted}
        unplanned = tuple((m, key, arg) for m, (key, arg) in self.counted.items() if m not in planned)
        return Selection(tuple(chosen), tuple(orphans), error, plans, unplanned)


def _dominates(winner: MediaLayout, loser: MediaLayout, present: frozenset[str]) -> bool:
    """``winner`` requires strictly more than ``loser`` and both read a present key."""
    shared = present.intersection(winner.keys).intersection(loser.keys)
    return bool(shared) and set(loser.requires) < set(winner.requires)


def _ambiguity(chosen: Sequence[MediaLayout], present: frozenset[str]) -> str | None:
    """The message for selected layouts that read one present key, or ``None``."""
    for key in sorted(present):
        readers = [layout for layout in chosen if key in layout.keys]
        if len(readers) < 2:
            continue
        distinct: dict[str, None] = {}
        for layout in readers:
            distinct.update(dict.fromkeys(k for k in layout.requires if k != key and k in present))
        what = readers[0].modality
        names = " and ".join(repr(layout.name) for layout in readers)
        got = " and ".join(distinct) or " and ".join(layout.name for layout in readers)
        return (
            f"{what} metadata: got {got}; expected at most one of them (media layouts {names} all read {key}, "
            f"and the batch's keys do not tell which one it is)"
        )
    return None


def _same_modality(chosen: Sequence[MediaLayout]) -> str | None:
    seen: dict[str, MediaLayout] = {}
    for layout in chosen:
        if not layout.counted:
            continue
        other = seen.get(layout.modality)
        if other is not None:
            return (
                f"{layout.modality} media: the batch holds the keys of two {layout.modality} layouts, {other.name!r} "
                f"({', '.join(other.requires)}) and {layout.name!r} ({', '.join(layout.requires)}); expected one: "
                f"the per-sample {layout.modality} counts could not say which items are whose"
            )
        seen[layout.modality] = layout
    return None


# --------------------------------------------------------------------------------------------------
# layouts from a declaration (for plugins: the planner is ppmedia's)


def item_layout(
    name: str,
    modality: str,
    pixels: str,
    *,
    field: str | None = None,
    per_item: Mapping[str, str] | None = None,
    per_row: Mapping[str, str] | None = None,
    rows_per_item: str | GridRows | None = None,
    optional: Sequence[str] = (),
) -> MediaLayout:
    """A layout whose ``pixels`` hold items on axis 0 (one row per item), or, with ``rows_per_item``,
    several rows per item; items map to samples by the per-sample counts of ``modality``
    (``n_<modality>s_per_sample``, ``<modality>s_per_sample=``, else one per sample when there are
    exactly ``B``).

    Args:
        name: the layout's name; modality: what the items are (``"video"``).
        pixels: the batch key of the pixels (``"pixel_values_videos"``).
        field: the chunk field it is staged as (default: ``pixels``; a name that is not a
            :class:`~ppmedia.VlmMediaChunk` field is carried in ``chunk.extras``).
        per_item: ``{batch key: chunk field}`` of per-item metadata (axis 0: items), e.g.
            ``{"num_frames_per_video": "num_frames_per_video"}``.
        per_row: ``{batch key: chunk field}`` of per-row metadata (axis 0: the rows of ``pixels``).
        rows_per_item: the rows of each item: the batch key of an ``[items]`` integer tensor, or a
            :class:`GridRows`, the product of a grid key's columns ``[items, columns]`` (optionally
            over a merge size squared), e.g. ``GridRows("video_grid_thw")``: ``t * h * w`` rows per
            video. The keys it names are required; give one in ``per_item`` too to stage it.
        optional: keys of ``per_item``/``per_row`` that may be absent (the others are required).

    Example: LLaVA-OneVision videos ``[videos, frames, C, H, W]`` with nothing else::

        item_layout("onevision_videos", "video", "pixel_values_videos")

    Example: patch rows ``[sum of t*h*w, D]`` per ``video_grid_thw`` ``[videos, 3]``, with per-video
    merge sizes staged beside them::

        item_layout("merged_videos", "video", "pixel_values_videos", rows_per_item=GridRows("video_grid_thw"),
                    per_item={"video_grid_thw": "video_grid", "video_merge_sizes": "video_merge_sizes"})
    """
    per_item, per_row = dict(per_item or {}), dict(per_row or {})
    meta = [*per_item, *per_row]
    if rows_per_item is not None and not isinstance(rows_per_item, (str, GridRows)) or rows_per_item == "":
        raise ValueError(f"media layout {name!r}: rows_per_item is {rows_per_item!r}; expected a batch key or a GridRows")
    sources = (rows_per_item.keys if isinstance(rows_per_item, GridRows) else (rows_per_item,)) if rows_per_item else ()
    requires = (pixels, *(k for k in sources if k not in meta), *(k for k in meta if k not in optional))
    axis0 = {pixels: "rows" if rows_per_item else f"{modality}s", **{k: f"{modality}s" for k in per_item},
             **{k: f"rows of {pixels}" for k in per_row}}
    for key in sources:
        if key in optional:
            raise ValueError(f"media layout {name!r}: {key} gives the rows per item and is in optional; expected it required")
        axis0[key] = f"{modality}s"
    return MediaLayout(
        name, modality, tuple(dict.fromkeys(requires)),
        item_planner(name, modality, pixels, field or pixels, per_item, per_row, rows_per_item),
        tuple(dict.fromkeys((field or pixels, *per_item.values(), *per_row.values()))),
        optional=tuple(k for k in optional if k in meta), axis0=axis0,
    )


def sample_layout(name: str, modality: str, keys: Mapping[str, str], *, optional: Sequence[str] = ()) -> MediaLayout:
    """A layout whose every key holds the samples on axis 0 (``[B, ...]``): microbatch ``k`` gets its
    samples' rows. For processors that pad media per sample (Idefics3 / SmolVLM ``pixel_values``
    ``[B, max_crops, 3, H, W]`` with ``pixel_attention_mask`` ``[B, max_crops, H, W]``).

    Args:
        keys: ``{batch key: chunk field}``; the first is the pixels.
        optional: keys that may be absent.
    """
    requires = tuple(k for k in keys if k not in optional)
    return MediaLayout(
        name, modality, requires, sample_planner(name, dict(keys)), tuple(dict.fromkeys(keys.values())),
        optional=tuple(k for k in optional if k in keys), counted=False, axis0={k: "samples" for k in keys},
    )


# --------------------------------------------------------------------------------------------------
# the built-in layouts (registered by ppmedia.adapters.builtin, the built-in plugin)

_IMAGE_AXIS0 = {"pixel_values": "patch rows, each image's grid product", "n_images_per_sample": "samples"}


def _image_layouts() -> list[MediaLayout]:
    layouts = []
    for grid_key in ("image_grid_thw", "image_grid_hws"):
        layouts.append(MediaLayout(
            f"image_patch_rows_{grid_key.rsplit('_', 1)[-1]}", "image", ("pixel_values", grid_key), patch_rows_planner(grid_key),
            ("pixel_values", "image_grid"), axis0={**_IMAGE_AXIS0, grid_key: "images"},
        ))
    for grid_key in ("image_sizes", "image_position_ids"):
        layouts.append(MediaLayout(
            f"images_with_{grid_key.removeprefix('image_')}", "image", ("pixel_values", grid_key), image_major_planner(grid_key),
            ("pixel_values", "image_grid"), axis0={"pixel_values": "images", grid_key: "images"},
        ))
    layouts.append(MediaLayout(
        "image_pan_and_scan", "image", ("pixel_values", "num_crops"), plan_pan_and_scan, ("pixel_values", "image_grid"),
        axis0={"pixel_values": "images and their crops (1 + num_crops rows each)", "num_crops": "images"},
    ))
    layouts.append(MediaLayout(
        "images", "image", ("pixel_values",), image_major_planner(None), ("pixel_values",),
        axis0={"pixel_values": "images"},
    ))
    return layouts


def _frames_layout() -> MediaLayout:
    """Gemma 4's padded video frames (:mod:`ppmedia.producer.planners_frames`): ``num_frames_per_video`` rows each."""
    declared = item_layout(
        "video_frames", "video", "pixel_values_videos", per_item={"num_frames_per_video": "num_frames_per_video"},
        per_row={"video_position_ids": "video_position_ids"}, rows_per_item="num_frames_per_video",
        optional=("video_position_ids",),
    )
    axis0 = {"pixel_values_videos": "frames (num_frames_per_video rows each video)", "video_position_ids": "frames",
             "num_frames_per_video": "videos"}
    return replace(declared, plan=frames_planner(declared.plan), axis0=axis0)


def _audio_layouts() -> list[MediaLayout]:
    """Audio clips, one row each (:mod:`ppmedia.producer.planners_audio`): one layout per features key."""
    names = {"input_features": "audio_features", "audio_input_ids": "audio_codes"}
    return [
        MediaLayout(
            names[key], "audio", (key,), audio_planner(key), ("input_features", "input_features_mask"),
            optional=AUDIO_MASKS[key], axis0={key: "audio clips", **{m: "audio clips" for m in AUDIO_MASKS[key]}},
        )
        for key in AUDIO_FEATURE_KEYS
    ]


#: ppmedia's own layouts, in the order ties and keys are reported (``IMAGE_GRID_KEYS`` order first).
BUILTIN_LAYOUTS: tuple[MediaLayout, ...] = (
    *_image_layouts(),
    MediaLayout(
        "video_patch_rows", "video", ("pixel_values_videos", "video_grid_thw"), plan_videos,
        ("pixel_values_videos", "video_grid", "second_per_grid_ts"),
        optional=("second_per_grid_ts", "video_second_per_grid", "num_chunks_per_video"),
        sequences=("second_per_grid_ts", "video_second_per_grid", "num_chunks_per_video"),
        axis0={"pixel_values_videos": "patch rows, each video's grid product", "video_grid_thw": "videos",
               "second_per_grid_ts": "videos", "video_second_per_grid": "videos (the Qwen Omnis' second_per_grid_ts)",
               "num_chunks_per_video": "videos (grid rows each spans)"},
    ),
    _frames_layout(),
    MediaLayout(
        "step3_crops", "crop", (), plan_step3, ("patch_pixel_values", "num_patches", "patch_newline_mask"),
        optional=("patch_pixel_values", "num_patches", "patch_newline_mask"), counted=False,
        axis0={"patch_pixel_values": "crop patches", "num_patches": "samples", "patch_newline_mask": "crop patches"},
    ),
    *_audio_layouts(),
)

assert [k for k in dict.fromkeys(k for layout in BUILTIN_LAYOUTS for k in layout.requires) if k in IMAGE_GRID_KEYS] == [
    k for k in IMAGE_GRID_KEYS
], "the image layouts follow IMAGE_GRID_KEYS"
