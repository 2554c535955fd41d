"""Pieces the tiny families' ``build_processor`` share: image-processor classes by backend, the
Qwen-style processors (chatml turns, ``<|vision_start|>`` blocks), Qwen's image and video processors at
a tiny model's sizes."""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["QWEN_MEDIA", "QWEN_TOKENS", "image_processor_class", "qwen_media_processors", "qwen_processor", "qwen_tokenizer",
           "qwen_vl_processor"]

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


#: Qwen-VL's special tokens, in the order of :func:`qwen_vl_processor`'s ``token_ids``: pad, the chat
#: turns' start and end (end = eos), vision start and end, the image and video placeholders.
QWEN_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                                "<|image_pad|>", "<|video_pad|>")


def qwen_tokenizer(vocab_size: int, ids: Mapping[str, int], image: str = "<|image_pad|>", video: str | None = "<|video_pad|>",
                   **attributes: str) -> Any:
    """A word-level tokenizer with Qwen's special token names at the given ids (``"<|im_start|>"`` and
    ``"<|im_end|>"`` the chat turns, ``"<|endoftext|>"`` pad, ``"<|im_end|>"`` eos); ``video=None`` for
    a family without videos (no ``video_token`` attribute: it would add a token past the vocabulary)."""
    from ..word_tokenizer import TokenizerSpec, word_tokenizer

    media = {"image_token": image} if video is None else {"image_token": image, "video_token": video}
    spec = TokenizerSpec(vocab_size, dict(ids), pad="<|endoftext|>", eos="<|im_end|>", attributes={**media, **attributes})
    return word_tokenizer(spec)


def qwen_media_processors(video_processor: str, image_backend: str, *, patch_size: int, temporal_patch_size: int,
                          merge_size: int, pixels: tuple[int, int]) -> tuple[Any, Any]:
    """``Qwen2VLImageProcessor`` (``...Pil`` with ``image_backend="pil"``) and ``transformers.<video_processor>``
    at the tiny model's patch, temporal patch and merge, ``pixels`` = (fewest, most) pixels an image or
    frame, frames as given (no sampling, no per-frame cap)."""
    import transformers

    sizes = {"patch_size": patch_size, "temporal_patch_size": temporal_patch_size, "merge_size": merge_size,
             "size": {"shortest_edge": pixels[0], "longest_edge": pixels[1]}}
    images = image_processor_class("Qwen2VLImageProcessor", image_backend)(**sizes)
    videos = getattr(transformers, video_processor)(**sizes, do_sample_frames=False, cap_pixels_per_frame=False)
    return images, videos


def qwen_vl_processor(processor: str, video_processor: str, image_backend: str, *, vocab_size: int,
                      token_ids: tuple[int, ...], sizes: tuple[int, int, int], pixels: tuple[int, int],
                      media: Mapping[str, str] = QWEN_MEDIA, **attributes: str) -> Any:
    """A Qwen-VL-style ``transformers.<processor>``: :func:`qwen_media_processors` (``sizes`` = patch,
    temporal patch, merge), a :func:`qwen_tokenizer` with :data:`QWEN_TOKENS` at ``token_ids`` (and the
    extra token ``attributes``), a chatml chat template writing ``media``."""
    patch, temporal, merge = sizes
    images, videos = qwen_media_processors(video_processor, image_backend, patch_size=patch, temporal_patch_size=temporal,
                                           merge_size=merge, pixels=pixels)
    tokenizer = qwen_tokenizer(vocab_size, dict(zip(QWEN_TOKENS, token_ids, strict=True)), **attributes)
    return qwen_processor(processor, tokenizer=tokenizer, images=images, videos=videos, media=media)


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
