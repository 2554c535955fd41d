"""Tiny seeded GLM-4.1V (``glm4v``): Qwen-style patch rows with grids, mrope, and videos whose frames use
the IMAGE token inside ``<|begin_of_video|> ... <|end_of_video|>``.

Media as ``Glm4vImageProcessor`` gives them: ``pixel_values`` ``[patches, 384]`` (``3 * 2 * 8 * 8``: the
tiny tower's patch 8, temporal patch 2) with ``image_grid_thw`` ``[images, 3]``; videos as
``pixel_values_videos`` with ``video_grid_thw`` ``[videos, 3]``, ``t`` temporal patches each. A grid row
``(t, h, w)`` gives ``t * h * w / 4`` features. The text, as ``Glm4vProcessor`` writes it:

* an image: ``<|begin_of_image|> <|image|> * (h * w / 4) <|end_of_image|>``;
* a video: ``<|begin_of_video|>``, per temporal step ``<|begin_of_image|> <|image|> * (h * w / 4)
  <|end_of_image|>`` and a timestamp (text), then ``<|end_of_video|>``: the frames use the IMAGE token.

The processor's ``mm_token_type_ids`` (image 1, video 2: an image token inside a video block is a
video token) feed the model's mrope (``get_rope_index``); :func:`mm_token_type_ids` builds them here
the way the processor does, from the ids.

transformers' own forward cannot take images and videos in one batch (both of its placeholder masks
are ``input_ids == image_token_id``: "Image features and image tokens do not match"). So each tiny
batch holds one modality besides text; this module's batch holds images (``variant="images"``),
``variant="videos"`` the videos. :func:`build_mixed_batch` puts both in one batch, and
:func:`mixed_reference` gives its merged embeddings from the model's own forward run once per
modality (see there): the reference ppmedia's merge of a mixed batch is checked against.

Images batch (``variant="images"``):

======  ==========================================  ======
sample  media (t, h, w) -> tokens                   images
======  ==========================================  ======
0       (1, 4, 4) -> 4                              1
1       (1, 4, 6) -> 6, (1, 2, 2) -> 1              2
2       (1, 6, 4) -> 6                              1
3       (1, 2, 4) -> 2                              1
4, 5    text only                                   0
6       (1, 8, 8) -> 16                             1
7       (1, 2, 2) -> 1, (1, 4, 2) -> 2              2
======  ==========================================  ======

Videos batch: samples 0, 1, 2, 3, 6, 7 hold one video each, ``(2, 4, 4)``, ``(1, 2, 4)``, ``(3, 2, 2)``,
``(2, 2, 4)``, ``(1, 4, 4)``, ``(2, 4, 2)``; samples 4 and 5 are text only.

Text model: ``glm4v_text``, hidden 64, 2 layers, partial rotary (half the head) with ``mrope_section``
``[1, 1, 2]``; vision: depth 2, hidden 32. Constants are drawn (``seeded_distinct``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import seeded_distinct
from ._batch import right_padded
from ._configs import grid_tower_fields, text_fields

__all__ = [
    "IMAGE_END_TOKEN_ID",
    "IMAGE_START_TOKEN_ID",
    "IMAGE_TOKEN_ID",
    "MODEL_TYPE",
    "PATCH_DIM",
    "VIDEO_END_TOKEN_ID",
    "VIDEO_START_TOKEN_ID",
    "build_batch",
    "build_config",
    "build_mixed_batch",
    "build_model",
    "build_processor",
    "mixed_reference",
    "mm_token_type_ids",
    "reference_inputs",
]

MODEL_TYPE = "glm4v"

PAD_TOKEN_ID = 0
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
IMAGE_START_TOKEN_ID = 3
IMAGE_END_TOKEN_ID = 4
VIDEO_START_TOKEN_ID = 5
VIDEO_END_TOKEN_ID = 6
IMAGE_TOKEN_ID = 7
VIDEO_TOKEN_ID = 8  # <|video|>: the processor replaces it by the frames; never in a batch
_FIRST_TEXT_ID = 10
_VOCAB = 128
PATCH_SIZE = 8
TEMPORAL = 2
MERGE = 2
PATCH_DIM = 3 * TEMPORAL * PATCH_SIZE * PATCH_SIZE

IMAGE_SAMPLES: tuple[tuple[Any, ...], ...] = (
    (3, ("image", (1, 4, 4)), 4),
    (2, ("image", (1, 4, 6)), 1, ("image", (1, 2, 2)), 2),
    (4, ("image", (1, 6, 4)), 3),
    (1, ("image", (1, 2, 4)), 2),
    (9,),
    (14,),
    (2, ("image", (1, 8, 8)), 1),
    (1, ("image", (1, 2, 2)), ("image", (1, 4, 2)), 1),
)
VIDEO_SAMPLES: tuple[tuple[Any, ...], ...] = (
    (3, ("video", (2, 4, 4)), 2),
    (2, ("video", (1, 2, 4)), 3),
    (1, ("video", (3, 2, 2)), 2),
    (2, ("video", (2, 2, 4)), 1),
    (9,),
    (14,),
    (1, ("video", (1, 4, 4)), 2),
    (2, ("video", (2, 4, 2)), 1),
)
#: images and videos in one batch (samples 1 and 7 hold both): what transformers' forward cannot run
MIXED_SAMPLES: tuple[tuple[Any, ...], ...] = (
    (3, ("image", (1, 4, 4)), 4),
    (2, ("image", (1, 4, 6)), 1, ("video", (2, 2, 2)), 2),
    (1, ("video", (3, 2, 2)), 2),
    (2, ("image", (1, 2, 4)), 1),
    (9,),
    (14,),
    (1, ("video", (1, 4, 4)), 1, ("image", (1, 2, 2)), 2),
    (2, ("video", (2, 4, 2)), ("image", (1, 4, 2)), 1),
)


def text_config(**overrides: Any) -> dict[str, Any]:
    """The tiny text model's fields (``glm4v_text``), with ``overrides``."""
    text = text_fields(
        _VOCAB, PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID, head_dim=16, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 2]},
    )
    text.update(overrides)
    return text


def vision_config() -> dict[str, Any]:
    """The tiny vision tower's fields (``glm4v_vision``)."""
    return grid_tower_fields(out_hidden_size=64, patch_size=PATCH_SIZE, temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE,
                             image_size=64)


def token_ids() -> dict[str, int]:
    """The special token ids of the tiny configs (``Glm4vConfig`` fields)."""
    return {
        "image_token_id": IMAGE_TOKEN_ID, "video_token_id": VIDEO_TOKEN_ID,
        "image_start_token_id": IMAGE_START_TOKEN_ID, "image_end_token_id": IMAGE_END_TOKEN_ID,
        "video_start_token_id": VIDEO_START_TOKEN_ID, "video_end_token_id": VIDEO_END_TOKEN_ID,
    }


def build_config() -> Any:
    """The tiny ``Glm4vConfig``."""
    from transformers import Glm4vConfig

    return Glm4vConfig(text_config=text_config(), vision_config=vision_config(), **token_ids())


def build_model(seed: int = 0) -> torch.nn.Module:
    """The tiny ``Glm4vForConditionalGeneration``, float32, eval mode, seeded (constants drawn)."""
    from transformers import Glm4vForConditionalGeneration

    return seeded_distinct(Glm4vForConditionalGeneration, build_config(), seed)


def _image_block(tokens: int) -> list[int]:
    return [IMAGE_START_TOKEN_ID] + [IMAGE_TOKEN_ID] * tokens + [IMAGE_END_TOKEN_ID]


def batch_of(samples: tuple[tuple[Any, ...], ...], seed: int = 0) -> dict[str, Tensor]:
    """The processor-style batch of ``samples`` (text runs, ``("image", (t, h, w))``, ``("video", (t, h,
    w))``): ``input_ids`` / ``attention_mask`` ``[B, S]`` (right-padded), ``mm_token_type_ids`` ``[B, S]``,
    and ``pixel_values`` / ``image_grid_thw``, ``pixel_values_videos`` / ``video_grid_thw`` for the
    modalities present."""
    gen = torch.Generator().manual_seed(seed)

    def text(n: int) -> list[int]:
        return torch.randint(_FIRST_TEXT_ID, _VOCAB, (n,), generator=gen).tolist()

    rows: list[list[int]] = []
    grids: dict[str, list[tuple[int, int, int]]] = {"image": [], "video": []}
    for sample in samples:
        ids = [BOS_TOKEN_ID]
        for part in sample:
            if isinstance(part, int):
                ids += text(part)
                continue
            kind, (t, h, w) = part
            grids[kind].append((t, h, w))
            if kind == "image":
                ids += _image_block(t * h * w // MERGE**2)
            else:  # one image block per temporal step, each followed by its timestamp
                ids.append(VIDEO_START_TOKEN_ID)
                for _ in range(t):
                    ids += _image_block(h * w // MERGE**2) + text(1)
                ids.append(VIDEO_END_TOKEN_ID)
        rows.append(ids + [EOS_TOKEN_ID])
    input_ids, attention_mask = right_padded(rows, PAD_TOKEN_ID)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "mm_token_type_ids": mm_token_type_ids(input_ids)}
    for kind, pixels, grid in (("image", "pixel_values", "image_grid_thw"), ("video", "pixel_values_videos", "video_grid_thw")):
        if grids[kind]:
            n = sum(t * h * w for t, h, w in grids[kind])
            batch[pixels] = torch.randn((n, PATCH_DIM), generator=gen)
            batch[grid] = torch.tensor(grids[kind], dtype=torch.int64)
    return batch


def mm_token_type_ids(input_ids: Tensor) -> Tensor:
    """``[B, S]`` int64 as ``Glm4vProcessor.create_mm_token_type_ids`` makes them: 2 at image tokens inside
    a video block (``<|begin_of_video|>`` ... ``<|end_of_video|>``), 1 at the other image tokens."""
    inside = torch.cumsum(input_ids == VIDEO_START_TOKEN_ID, dim=1) > torch.cumsum(input_ids == VIDEO_END_TOKEN_ID, dim=1)
    image = input_ids == IMAGE_TOKEN_ID
    return (image & ~inside).to(torch.int64) + 2 * (image & inside).to(torch.int64)


def build_batch(seed: int = 0, *, variant: str = "images") -> dict[str, Tensor]:
    """The tiny batch of ``variant`` ``"images"`` (the module docstring's table) or ``"videos"``."""
    if variant not in ("images", "videos"):
        raise ValueError(f"variant {variant!r}; expected 'images' or 'videos' (build_mixed_batch for both)")
    return batch_of(IMAGE_SAMPLES if variant == "images" else VIDEO_SAMPLES, seed)


def build_mixed_batch(seed: int = 0) -> dict[str, Tensor]:
    """Images and videos in one batch (:data:`MIXED_SAMPLES`; samples 1 and 7 hold both)."""
    return batch_of(MIXED_SAMPLES, seed)


_MEDIA_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def reference_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of the model's own full-batch forward (``mm_token_type_ids`` included: its mrope
    needs them whenever a grid is passed)."""
    keys = ("input_ids", "attention_mask", "mm_token_type_ids", *_MEDIA_KEYS)
    return {k: batch[k] for k in keys if batch.get(k) is not None}


def mixed_reference(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[Tensor, Tensor]:
    """The merged embeddings ``[B, S, H]`` and mrope positions ``[3, B, S]`` of a batch with images AND
    videos, from the model's own code, which cannot run such a batch in one forward.

    Per modality, the model's own forward on the whole batch with only that modality's media and the
    OTHER modality's placeholder tokens replaced by a text token (so its mask counts only its own
    features): images-only run -> the merged embeddings at image tokens; videos-only run -> at video
    tokens. Every other position is a text token's embedding, the same in both runs (the replaced
    placeholders are taken from the run that keeps them). Merged embeddings are per position (an
    embedding lookup, then features scattered at placeholders), so the two runs together give exactly
    what one forward would. Positions: the model's own ``get_rope_index`` on the whole batch with the
    processor's ``mm_token_type_ids`` (it handles both modalities).
    """
    from . import capture_merged_embeds

    ids, types = batch["input_ids"], batch["mm_token_type_ids"]
    filler = _FIRST_TEXT_ID
    runs = {}
    for keep, drop, keys in ((1, 2, ("pixel_values", "image_grid_thw")), (2, 1, ("pixel_values_videos", "video_grid_thw"))):
        inputs = {"input_ids": ids.masked_fill(types == drop, filler), "attention_mask": batch["attention_mask"]}
        inputs["mm_token_type_ids"] = types.masked_fill(types == drop, 0)
        inputs.update({k: batch[k] for k in keys})
        runs[keep] = capture_merged_embeds(model, **inputs)
    mask = (types == 2).unsqueeze(-1)
    embeds = torch.where(mask, runs[2], runs[1])
    inner: Any = getattr(model, "model")
    with torch.no_grad():
        positions = inner.get_rope_index(
            ids, mm_token_type_ids=types, image_grid_thw=batch["image_grid_thw"],
            video_grid_thw=batch["video_grid_thw"], attention_mask=batch["attention_mask"],
        )[0]
    return embeds, positions


#: the tiny processors' image and frame sizes: 16 to 64 pixels a side (multiples of patch x merge = 16).
MIN_PIXELS = 16 * 16
MAX_PIXELS = 64 * 48


def glm_processor(processor: str, image_class: str, video_class: str, image_backend: str) -> Any:
    """A real GLM processor (``Glm4vProcessor``, ``Glm46VProcessor``) with ``<image_class>`` (``...Pil``
    with ``image_backend="pil"``) and ``<video_class>`` at patch 8, temporal patch 2, merge 2, 256..3072
    pixels a frame (frames as given); a word-level tokenizer with the tiny ids (``<|im_start|>`` /
    ``<|im_end|>`` the turns at ``BOS_TOKEN_ID`` / ``EOS_TOKEN_ID``), a chatml chat template: an image
    ``<|begin_of_image|><|image|><|end_of_image|>``, a video ``<|begin_of_video|><|video|><|end_of_video|>``
    (the processor writes each frame as an image block and its timestamp)."""
    import transformers

    from ._processors import image_processor_class, qwen_processor, qwen_tokenizer

    sizes = {"patch_size": PATCH_SIZE, "temporal_patch_size": TEMPORAL, "merge_size": MERGE,
             "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}}
    images = image_processor_class(image_class, image_backend)(**sizes)
    videos = getattr(transformers, video_class)(**sizes, do_sample_frames=False)
    ids = {"<|endoftext|>": PAD_TOKEN_ID, "<|im_start|>": BOS_TOKEN_ID, "<|im_end|>": EOS_TOKEN_ID,
           "<|begin_of_image|>": IMAGE_START_TOKEN_ID, "<|end_of_image|>": IMAGE_END_TOKEN_ID,
           "<|begin_of_video|>": VIDEO_START_TOKEN_ID, "<|end_of_video|>": VIDEO_END_TOKEN_ID,
           "<|image|>": IMAGE_TOKEN_ID, "<|video|>": VIDEO_TOKEN_ID}
    media = {"image": "<|begin_of_image|><|image|><|end_of_image|>", "video": "<|begin_of_video|><|video|><|end_of_video|>"}
    return qwen_processor(processor, tokenizer=qwen_tokenizer(_VOCAB, ids, image="<|image|>", video="<|video|>"),
                          images=images, videos=videos, media=media)


def build_processor(image_backend: str = "torchvision") -> Any:
    """A real ``Glm4vProcessor`` (``Glm4vImageProcessor``, ``Glm4vVideoProcessor``): :func:`glm_processor`.
    Its model takes images and videos in separate batches (see the module docstring)."""
    return glm_processor("Glm4vProcessor", "Glm4vImageProcessor", "Glm4vVideoProcessor", image_backend)
