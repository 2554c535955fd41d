"""The built-in adapters, registered with the registry as the plugin ``ppmedia (built-in)``."""

from __future__ import annotations

from typing import Any

from ..registry.hookspecs import hookimpl


@hookimpl
def ppmedia_adapters() -> list[Any]:
    """ppmedia's built-in families (imported here, on first registry use, not at ``import ppmedia``)."""
    from .gemma3 import Gemma3Adapter
    from .kimi_vl import KimiVLAdapter
    from .llava_next import LlavaNextAdapter
    from .mistral3 import Mistral3Adapter
    from .qwen2_5_vl import Qwen2_5_VLAdapter
    from .step3 import Step3Adapter

    return [Qwen2_5_VLAdapter, LlavaNextAdapter, Step3Adapter, KimiVLAdapter, Gemma3Adapter, Mistral3Adapter]
