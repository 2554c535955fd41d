"""SmolVLM (``smolvlm``): Idefics3's media layout and architecture (:mod:`ppmedia.adapters.idefics3`).

What differs for ppmedia: SmolVLM's own ``get_image_features`` invents one all-zero crop when a call
holds no real crop (its ``real_images_inds[0] |= ~any(...)``) and returns its features, which no
placeholder token takes. A text-only microbatch (its rows all padding crops) therefore never reaches
the encoder here: :meth:`~ppmedia.adapters.idefics3.Idefics3Adapter.encode` skips a microbatch whose
placeholders are 0, after merge's count check found no real crop in it.

SmolVLM2's videos reach the model as image crops (its processor samples frames and writes them as
images); ``SmolVLMVideoProcessor`` needs torchvision. ``SmolVLMImageProcessorPil`` runs without it.
"""

from __future__ import annotations

from typing import ClassVar

from .idefics3 import Idefics3Adapter

__all__ = ["SmolVLMAdapter"]


class SmolVLMAdapter(Idefics3Adapter):
    """SmolVLM adapter (``SmolVLMForConditionalGeneration``): :class:`~ppmedia.adapters.idefics3.Idefics3Adapter`
    for the model type ``smolvlm`` (module paths ``model.model.get_image_features``, ``model.model.text_model``)."""

    name: ClassVar[str] = "smolvlm"
    model_types: ClassVar[tuple[str, ...]] = ("smolvlm",)
    family: ClassVar[str] = "SmolVLM"
