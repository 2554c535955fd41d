"""The built-in adapters and media layouts: a plugin like any other, registered as ``ppmedia (built-in)``.

:data:`ADAPTERS` has one row per ``config.model_type``: the adapter class as ``"module:Class"``,
imported on the first lookup of that model type (``ppmedia.get_adapter("qwen2_5_vl")`` imports
``ppmedia.adapters.qwen2_5_vl`` and no other family). To add a built-in family, add one row per model
type its adapter declares in ``model_types`` (``tests/test_registry.py`` checks the rows against them).
"""

from __future__ import annotations

from typing import Any

from ..registry.hookspecs import hookimpl

#: ``config.model_type`` -> the adapter serving it, as ``"module:Class"`` (imported on first lookup).
ADAPTERS: dict[str, str] = {
    "qwen2_5_vl": "ppmedia.adapters.qwen2_5_vl:Qwen2_5_VLAdapter",
    "qwen2_vl": "ppmedia.adapters.qwen2_5_vl:Qwen2_5_VLAdapter",
    "llava_next": "ppmedia.adapters.llava_next:LlavaNextAdapter",
    "step3_vl": "ppmedia.adapters.step3:Step3Adapter",
    "step3p7": "ppmedia.adapters.step3:Step3Adapter",
    "kimi_vl": "ppmedia.adapters.kimi_vl:KimiVLAdapter",
    "kimi_k25": "ppmedia.adapters.kimi_vl:KimiVLAdapter",
    "qwen3_vl": "ppmedia.adapters.qwen3_vl:Qwen3VLAdapter",
    "qwen3_vl_moe": "ppmedia.adapters.qwen3_vl:Qwen3VLAdapter",
    "qwen3_5": "ppmedia.adapters.qwen3_vl:Qwen3VLAdapter",
    "qwen3_5_moe": "ppmedia.adapters.qwen3_vl:Qwen3VLAdapter",
    "gemma3": "ppmedia.adapters.gemma3:Gemma3Adapter",
    "mistral3": "ppmedia.adapters.mistral3:Mistral3Adapter",
    "mistral_large4": "ppmedia.adapters.mistral_large4:MistralLarge4Adapter",
    "llava": "ppmedia.adapters.llava:LlavaAdapter",
    "minimax_m3_vl": "ppmedia.adapters.minimax_m3_vl:MiniMaxM3VLAdapter",
    "inkling2": "ppmedia.adapters.inkling2:Inkling2Adapter",
    "gemma4": "ppmedia.adapters.gemma4:Gemma4Adapter",
    "qwen2_5_omni_thinker": "ppmedia.adapters.qwen_omni:Qwen2_5OmniThinkerAdapter",
    "qwen2_5_omni": "ppmedia.adapters.qwen_omni:Qwen2_5OmniThinkerAdapter",
    "qwen3_omni_moe_thinker": "ppmedia.adapters.qwen_omni:Qwen3OmniThinkerAdapter",
    "qwen3_omni_moe": "ppmedia.adapters.qwen_omni:Qwen3OmniThinkerAdapter",
    "inkling_mm_model": "ppmedia.adapters.inkling:InklingAdapter",
    "llava_onevision": "ppmedia.adapters.llava_onevision:LlavaOnevisionAdapter",
    "idefics3": "ppmedia.adapters.idefics3:Idefics3Adapter",
    "smolvlm": "ppmedia.adapters.smolvlm:SmolVLMAdapter",
    "paligemma": "ppmedia.adapters.paligemma:PaliGemmaAdapter",
    "aya_vision": "ppmedia.adapters.aya_vision:AyaVisionAdapter",
    "llama4": "ppmedia.adapters.llama4:Llama4Adapter",
    "internvl": "ppmedia.adapters.internvl:InternVLAdapter",
    "glm4v": "ppmedia.adapters.glm4v:Glm4vAdapter",
    "glm4v_moe": "ppmedia.adapters.glm4v:Glm4vAdapter",
    "glm46v": "ppmedia.adapters.glm4v:Glm4vAdapter",
    "ernie4_5_vl_moe": "ppmedia.adapters.ernie4_5_vl:Ernie4_5_VLAdapter",
    "phi4_multimodal": "ppmedia.adapters.phi4_multimodal:Phi4MultimodalAdapter",
    "video_llama_3": "ppmedia.adapters.video_llama_3:VideoLlama3Adapter",
}

#: ``config.model_type`` strings seen on checkpoints -> the model type of a row above.
MODEL_TYPE_ALIASES: dict[str, str] = {
    "qwen2_5_vl_text": "qwen2_5_vl",
    "qwen2_vl_text": "qwen2_vl",
    "llava-next": "llava_next",
    "kimi-vl": "kimi_vl",
    "kimi_k2_5": "kimi_k25",
    "step3v": "step3_vl",
    "qwen3_omni": "qwen3_omni_moe_thinker",
    "inkling": "inkling_mm_model",
}


@hookimpl
def ppmedia_adapter_paths() -> dict[str, str]:
    """The built-in families, imported on first lookup (see :data:`ADAPTERS`)."""
    return dict(ADAPTERS)


@hookimpl
def ppmedia_model_type_aliases() -> dict[str, str]:
    """The built-ins' aliases (see :data:`MODEL_TYPE_ALIASES`)."""
    return dict(MODEL_TYPE_ALIASES)


@hookimpl
def ppmedia_media_layouts() -> list[Any]:
    """ppmedia's own media layouts (:data:`ppmedia.producer.layouts.BUILTIN_LAYOUTS`), then the built-in families'
    (:data:`ppmedia.adapters.media_layouts.FAMILY_LAYOUTS`), through the same hook as a plugin's."""
    from ..producer.layouts import BUILTIN_LAYOUTS
    from .media_layouts import FAMILY_LAYOUTS

    return [*BUILTIN_LAYOUTS, *FAMILY_LAYOUTS]
