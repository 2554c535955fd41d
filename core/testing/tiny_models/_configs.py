"""The tiny text model and vision towers the built-in tiny families share, as config fields (private to
``ppmedia.testing.tiny_models``).

Most families build the same tiny text model (64 wide, MLP 128, 2 layers, 4 attention heads over 2 KV
heads; some 32 wide) and the same tiny vision tower (32 wide, MLP 64, 2 layers, 2 heads); a family
module states only what differs (its vocabulary and special ids, head sizes, window, rope, experts) as
keyword arguments, which add to or replace the shared fields. The dicts go to the family's config
classes as they are (``Gemma3TextConfig(**text_fields(...))``) or as sub-config dicts.
"""

from __future__ import annotations

from typing import Any

__all__ = ["grid_tower_fields", "pixtral_tower_fields", "text_fields", "tower_fields"]


def text_fields(vocab_size: int, pad: int, bos: int | None = 1, eos: int | None = 2, *, width: int = 64,
                **fields: Any) -> dict[str, Any]:
    """The shared tiny text model: ``width`` wide (64; MLP ``2 * width``), 2 layers, 4 attention heads
    over 2 KV heads, vocabulary ``vocab_size``, then ``fields`` (added, or replacing those), then the
    special ids (``bos`` / ``eos`` ``None``: not set)."""
    text: dict[str, Any] = {
        "vocab_size": vocab_size, "hidden_size": width, "intermediate_size": 2 * width, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, **fields, "pad_token_id": pad,
    }
    text.update({k: v for k, v in (("bos_token_id", bos), ("eos_token_id", eos)) if v is not None})
    return text


def tower_fields(**fields: Any) -> dict[str, Any]:
    """The shared tiny vision tower (32 wide, MLP 64, 2 layers, 2 heads; transformers' usual field names:
    CLIP, SigLIP, Pixtral, InternViT, ...), then ``fields`` (added, or replacing those)."""
    return {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, **fields}


def grid_tower_fields(**fields: Any) -> dict[str, Any]:
    """:func:`tower_fields` under the field names of the flat-patch towers (Qwen2.5-VL's and its
    descendants': ``depth``, ``num_heads``), then ``fields``."""
    return {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, **fields}


def pixtral_tower_fields(image_size: int, patch_size: int) -> dict[str, Any]:
    """The tiny Pixtral tower of the Mistral families and Pixtral-backbone LLaVA: :func:`tower_fields`
    with 4 heads of 8, images of at most ``image_size`` pixels a side in ``patch_size`` patches."""
    return tower_fields(num_attention_heads=4, head_dim=8, image_size=image_size, patch_size=patch_size)
