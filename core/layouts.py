"""The media-layout API for plugins and users: layouts, and the pieces a layout's own planner is built from.

One stable import path over :mod:`ppmedia.producer` (where the producer keeps them):

* layouts (:mod:`ppmedia.producer.layouts`): :class:`MediaLayout`, :class:`LayoutSet`,
  :data:`BUILTIN_LAYOUTS`, :func:`item_layout` (items on axis 0), :func:`sample_layout` (samples on axis 0),
  :class:`GridRows` (rows per item from a grid);
* a planner's pieces (:mod:`ppmedia.producer.planners`): :class:`Context`, :class:`Part`,
  :class:`FieldSplit`, :func:`check_counts`, :func:`default_counts`, :func:`offsets` and the ``require_*``
  checks. docs/plugin-hooks.md shows a planner written with them.
"""

from __future__ import annotations

from .producer.layouts import (
    BUILTIN_LAYOUTS,
    GridRows,
    LayoutSet,
    MediaLayout,
    Planner,
    Selection,
    item_layout,
    sample_layout,
)
from .producer.planners import (
    IMAGE_GRID_KEYS,
    Context,
    Counts,
    FieldSplit,
    Part,
    check_counts,
    default_counts,
    offsets,
    require_integer,
    require_readable,
    require_shape,
    require_tensor,
    shape_of,
)

__all__ = [
    "BUILTIN_LAYOUTS",
    "Context",
    "Counts",
    "FieldSplit",
    "GridRows",
    "IMAGE_GRID_KEYS",
    "LayoutSet",
    "MediaLayout",
    "Part",
    "Planner",
    "Selection",
    "check_counts",
    "default_counts",
    "item_layout",
    "offsets",
    "require_integer",
    "require_readable",
    "require_shape",
    "require_tensor",
    "sample_layout",
    "shape_of",
]
