"""Pieces the tiny families' ``build_processor`` share: image-processor classes by backend, the
Qwen-style processors (chatml turns, ``<|vision_start|>`` blocks)."""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["QWEN_MEDIA", "image_processor_class", "qwen_processor", "qwen_tokenizer"]

#: Qwen's chat-template markup per media kind.
QWEN_MEDIA: dict[str, str] = {
    "image": "<|vision_start|><|image_pad|><|vision_end|>",
    "video": "<|vision_start|><|video_pad|><|vision_end|>",
}


def image_processor_class(name: str, image_backend: str) -> Any:
    """``transformers.<name>`` (the torchvision class) or ``transformers.<name>Pil``.

    Raises:
        ValueError: ``"pil"`` and transformers has no ``<name>Pil`` class.
    """
    import transformers

    if image_backend == "pil":
        if not hasattr(transformers, name + "Pil"):
            raise ValueError(f"{name}: transformers has no {name}Pil class; expected image_backend='torchvision'")
        return getattr(transformers, name + "Pil")
    return getattr(transformers, name)


def qwen_tokenizer(vocab_size: int, ids: Mapping[str, int], image: str = "<|image_pad|>", video: str = "<|video_pad|>",
                   **attributes: str) -> Any:
    """A word-level tokenizer with Qwen's special token names at the given ids (``"<|im_start|>"`` and
    ``"<|im_end|>"`` the chat turns, ``"<|endoftext|>"`` pad, ``"<|im_end|>"`` eos)."""
    from ..word_tokenizer import TokenizerSpec, word_tokenizer

    spec = TokenizerSpec(vocab_size, dict(ids), pad="<|endoftext|>", eos="<|im_end|>",
                         attributes={"image_token": image, "video_token": video, **attributes})
    return word_tokenizer(spec)


def qwen_processor(processor: str, *, tokenizer: Any, images: Any, videos: Any = None, media: Mapping[str, str] = QWEN_MEDIA,
                   **more: Any) -> Any:
    """``transformers.<processor>(image_processor=images, video_processor=videos, tokenizer=...,
    chat_template=<chatml with media>, **more)``."""
    import transformers

    from ..word_tokenizer import chat_template

    parts: dict[str, Any] = {"image_processor": images, "tokenizer": tokenizer}
    if videos is not None:
        parts["video_processor"] = videos
    return getattr(transformers, processor)(**parts, chat_template=chat_template("chatml", media), **more)
