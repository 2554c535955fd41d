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
    """Return the adapters this plugin provides.

    Each item is a :class:`ppmedia.adapters.base.VlmAdapter` subclass or instance with ``name``,
    ``model_types`` (non-empty tuple of ``config.model_type`` strings) and ``layout`` set. A model type
    already served by another provider is an error unless the adapter sets ``override = True``.
    """


@hookspec
def ppmedia_model_type_aliases() -> Mapping[str, str]:
    """Return ``{alias: model_type}``: extra ``config.model_type`` strings served like ``model_type``.

    For checkpoints that renamed their ``model_type`` but keep a known layout (a fine-tune with
    ``"my_vlm"`` that is a Qwen2.5-VL underneath: ``{"my_vlm": "qwen2_5_vl"}``).
    """
