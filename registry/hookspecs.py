"""Hook specifications of ppmedia plugins (pluggy project name ``"ppmedia"``).

A plugin is any module or object with functions of these names decorated with
:data:`ppmedia.hookimpl`; installed packages announce one in the entry-point group
``ppmedia.adapters``. Every hook here is a docstring: the plugin writes the body.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import pluggy

PROJECT = "ppmedia"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def ppmedia_adapters() -> Sequence[Any]:
    """Return the adapters this plugin provides, imported now (see :func:`ppmedia_adapter_paths`
    for adapters imported on first use).

    Each item is a :class:`ppmedia.adapters.base.VlmAdapter` subclass or instance with ``name``,
    ``model_types`` (non-empty tuple of ``config.model_type`` strings) and ``layout`` set. A model type
    already served by another provider is an error unless the adapter sets ``override = True``.
    """


@hookspec
def ppmedia_adapter_paths() -> Mapping[str, str]:
    """Return ``{model_type: "package.module:Class"}``: adapters imported on first use.

    One row per ``config.model_type``; the class (a :class:`ppmedia.adapters.base.VlmAdapter` subclass,
    or an instance) is imported when that model type is first looked up, so a plugin with many
    families costs nothing until one is used. The class's ``model_types`` must include the row's type.
    Rows sharing a path share one adapter. A row cannot override another provider's model type
    (return the class from :func:`ppmedia_adapters` with ``override = True`` for that).
    """


@hookspec
def ppmedia_model_type_aliases() -> Mapping[str, str]:
    """Return ``{alias: model_type}``: extra ``config.model_type`` strings served like ``model_type``.

    For checkpoints that renamed their ``model_type`` but keep a known layout (a fine-tune with
    ``"my_vlm"`` that is a Qwen2.5-VL underneath: ``{"my_vlm": "qwen2_5_vl"}``).
    """
