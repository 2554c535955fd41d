"""Hook specifications of ppmedia plugins (pluggy project name ``"ppmedia"``).

A plugin is any module or object with functions of these names decorated with
:data:`ppmedia.hookimpl`; installed packages announce one in the entry-point group
``ppmedia.adapters``. Every hook here is a docstring: the plugin writes the body.

What a family brings, and where it goes:

* its adapter (:func:`ppmedia_adapters`, :func:`ppmedia_adapter_paths`), which also declares the
  family's per-sample inputs (``VlmAdapter.sample_inputs``: ``[B, ...]`` tensors split with the samples
  and handed to the first stage, or carried to every stage) and where its language model sits
  (``VlmAdapter.language_model_path``, e.g. ``"language_model.model"``);
* the media layouts its processor writes, when ppmedia's own do not cover them
  (:func:`ppmedia_media_layouts`): keyed by batch keys, so every split sees them, whichever family;
* extra ``model_type`` names (:func:`ppmedia_model_type_aliases`).

ppmedia's own adapters and layouts come through these same hooks (``ppmedia.adapters.builtin``).
docs/plugin-hooks.md is the author's guide.
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


@hookspec
def ppmedia_media_layouts() -> Sequence[Any]:
    """Return the media layouts this plugin brings: :class:`ppmedia.producer.layouts.MediaLayout` objects.

    A layout names the batch keys it reads (``requires``: all present selects it; ``optional``), what
    axis 0 of each holds, the chunk fields it stages (a :class:`ppmedia.VlmMediaChunk` field or a new
    name, carried in ``chunk.extras``) and a planner that maps its items to samples and rows. Build
    one with :func:`ppmedia.producer.layouts.item_layout` (items on axis 0, optionally several rows each) or
    :func:`ppmedia.producer.layouts.sample_layout` (samples on axis 0), or write the planner (see
    :mod:`ppmedia.producer.planners`). Every split then checks, stages as views and refuses malformed input
    all or nothing for it exactly as for ppmedia's own. A name, or the exact ``requires`` of another
    layout sharing a key, already registered by another provider is an error.
    """
