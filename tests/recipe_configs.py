"""Config-only checkpoint folders shaped like the real checkpoints the recipes in recipes/ name (their
published config.json sizes: hidden sizes, layers, heads, experts, vocabularies, vision towers), for
``ppmedia train RECIPE --dry-run``: built on meta, nothing allocated, no weights."""

from __future__ import annotations

import pathlib
from typing import Any

import transformers

#: recipe file stem -> (model_type, the config's keyword arguments)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2_5_vl_7b": ("qwen2_5_vl", dict(
        text_config=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064, max_position_embeddings=128000,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31]),
        tie_word_embeddings=False)),
    "qwen3_vl_8b": ("qwen3_vl", dict(
        text_config=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                         rope_scaling={"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True}),
        vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                           deepstack_visual_indexes=[8, 16, 24], num_position_embeddings=2304),
        tie_word_embeddings=False)),
    "qwen3_vl_30b_a3b": ("qwen3_vl_moe", dict(
        text_config=dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                         num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                         num_experts_per_tok=8, decoder_sparse_step=1, vocab_size=151936, tie_word_embeddings=False,
                         rope_scaling={"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True}),
        vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=2048,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                           deepstack_visual_indexes=[8, 16, 24], num_position_embeddings=2304),
        tie_word_embeddings=False)),
    "gemma3_27b": ("gemma3", dict(
        text_config=dict(hidden_size=5376, intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32,
                         num_key_value_heads=16, head_dim=128, vocab_size=262208, sliding_window=1024,
                         query_pre_attn_scalar=168),
        vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                           image_size=896, patch_size=14),
        mm_tokens_per_image=256)),
    "llava_onevision_7b": ("llava_onevision", dict(
        text_config=dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4, vocab_size=152128, tie_word_embeddings=False),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304,
                           num_hidden_layers=26, num_attention_heads=16, image_size=384, patch_size=14),
        tie_word_embeddings=False)),
    "internvl3_8b": ("internvl", dict(
        text_config=dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4, vocab_size=151674, tie_word_embeddings=False),
        vision_config=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                           image_size=[448, 448], patch_size=[14, 14]),
        tie_word_embeddings=False)),
    "glm4_5v": ("glm4v_moe", dict(
        text_config=dict(hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=46,
                         num_attention_heads=96, num_key_value_heads=8, head_dim=128, n_routed_experts=128,
                         n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=1, vocab_size=151552,
                         partial_rotary_factor=0.5),
        vision_config=dict(depth=24, hidden_size=1536, intermediate_size=10944, num_heads=12, out_hidden_size=4096,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, image_size=336))),
    "llama4_scout": ("llama4", dict(
        text_config=dict(hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384, num_hidden_layers=48,
                         num_attention_heads=40, num_key_value_heads=8, head_dim=128, num_local_experts=16,
                         num_experts_per_tok=1, interleave_moe_layer_step=1, vocab_size=202048),
        vision_config=dict(hidden_size=1408, intermediate_size=5632, num_hidden_layers=34, num_attention_heads=16,
                           image_size=336, patch_size=14, vision_output_dim=4096, pixel_shuffle_ratio=0.5,
                           projector_input_dim=4096, projector_output_dim=4096))),
}

#: each recipe's published architecture class (recorded in config.json, as save_pretrained writes it)
ARCHITECTURES = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration",
                 "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration", "gemma3": "Gemma3ForConditionalGeneration",
                 "llava_onevision": "LlavaOnevisionForConditionalGeneration", "internvl": "InternVLForConditionalGeneration",
                 "glm4v_moe": "Glm4vMoeForConditionalGeneration", "llama4": "Llama4ForConditionalGeneration"}


def write_config(name: str, folder: pathlib.Path) -> pathlib.Path:
    """``folder/name/config.json`` for the recipe ``name`` (bfloat16, as the checkpoints are published)."""
    model_type, kwargs = CONFIGS[name]
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    config.architectures = [ARCHITECTURES[model_type]]
    config.dtype = "bfloat16"
    out = folder / name
    config.save_pretrained(out)
    return out
