"""The loader's batch is the processor's own batch (issue 34, item 2).

For every family with a tiny processor, a mixed batch (one image of odd size, two images, text only,
two exchanges, and a video where the processor has a video processor) goes through
``ppmedia.data`` (``SampleProcessor`` per record, ``ReplicaLoader``'s collate) and, separately,
through ONE call of the family's own processor on the batch's rendered texts and media, nested one
list per sample, as a family's own collate calls it. Token rows are equal row by row (the loader
pads on the right; some processors on the left) and every media key is equal, shape and values:
per-call counts (LLaVA-OneVision's ``batch_num_images``), samples on axis 0 (Idefics3 / SmolVLM
``[B, max_crops, ...]``, a text-only sample's all-zero entry included), padding across samples
(Pixtral, LLaVA-NeXT crops, Phi-4-multimodal).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from ppmedia import data
from ppmedia.data.labels import render
from ppmedia.registry import get_adapter
from ppmedia.testing import tiny_models
from ppmedia.testing.datasets import write_mixed_dataset
from ppmedia.testing.processors import build_tiny_processor, has_tiny_processor, processor_call_kwargs
from ppmedia.testing.word_tokenizer import text_words

FAMILIES = [f for f in tiny_models.FAMILIES if has_tiny_processor(f)]
KINDS = ["odd", "two", "text", "multi"]
#: families whose processor has a video processor but whose batch takes no video next to images here:
#: GLM-4V's model refuses both in one batch (its own batch is compared without images below)
NO_VIDEO = {"idefics3", "smolvlm", "paligemma", "aya_vision", "llama4", "phi4_multimodal", "inkling", "inkling2"}


#: PaliGemma's processor refuses a sample without an image when called on it alone (``images`` are
#: expected): such a record is one DataError naming it (test below), documented in docs/data.md
NO_TEXT_ONLY = {"paligemma"}


def takes_video(family: str, processor) -> bool:
    return getattr(processor, "video_processor", None) is not None and family not in NO_VIDEO


def rows(tensor: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [r[m.bool()].tolist() for r, m in zip(tensor, mask)]


def processor_batch(sp: data.SampleProcessor, records: list[data.Record], kwargs: dict) -> dict[str, torch.Tensor]:
    """The family's own processor, called once on the whole batch (media nested per sample)."""
    from ppmedia.data.media import load_image

    texts = [render(sp.processor, r.messages, r.where)[0] for r in records]
    images = [[load_image(i, r.where) for i in r.media.get("image", [])] for r in records]
    videos = [v for r in records for v in sp._videos(r)]
    media: dict = {}
    if any(images):
        media["images"] = images
    if videos:
        media["videos"] = [v.frames for v in videos]
        media["video_metadata"] = [v.metadata for v in videos]
        kwargs = data.video.without_sampling(kwargs)
    out = sp.processor(text=texts, return_tensors="pt", padding=True, add_special_tokens=False, **media, **kwargs)
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor) and k != "labels"}


def compare(loader: dict, own: dict, skip: tuple[str, ...] = ()) -> list[str]:
    problems = []
    for key in data.processor.TOKEN_KEYS:
        if key in own and key not in skip and key != "attention_mask" and rows(loader[key], loader["attention_mask"]) != rows(
                own[key], own["attention_mask"]):
            problems.append(f"{key}: rows differ")
    media = [k for k in set(own) | set(loader) if k not in data.processor.TOKEN_KEYS and isinstance(
        loader.get(k, own.get(k)), torch.Tensor)]
    for key in sorted(media):
        if key not in own or key not in loader:
            problems.append(f"{key}: only in {'the loader' if key in loader else 'the processor'}'s batch")
        elif own[key].shape != loader[key].shape:
            problems.append(f"{key}: loader {list(loader[key].shape)}, processor {list(own[key].shape)}")
        elif not torch.equal(own[key], loader[key]):
            problems.append(f"{key}: values differ")
    return problems


def loader_and_own(family: str, folder, kinds: list[str]) -> tuple[dict, dict]:
    torch.set_num_threads(1)
    processor = build_tiny_processor(family)
    kinds = kinds + (["video"] if takes_video(family, processor) else [])
    path = write_mixed_dataset(folder, kinds, words=text_words(processor.tokenizer), seed=3)
    kwargs = processor_call_kwargs(family)
    sp = data.SampleProcessor(processor, config=tiny_models.load(family).build_config(), processor_kwargs=kwargs)
    dataset = data.open_dataset(str(path))
    loader = data.ReplicaLoader(dataset, sp, global_batch_size=len(kinds), shuffle=False)
    batch = next(iter(loader))
    return batch, processor_batch(sp, [dataset[i] for i in range(len(kinds))], kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_loaders_batch_is_the_processors_own(family, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batch, own = loader_and_own(family, tmp_path, [k for k in KINDS if k != "text" or family not in NO_TEXT_ONLY])
    # a prefix-LM family's token types: SampleProcessor sets them from the labels (the processor
    # without a suffix marks every token prefix); tested in tests/test_data_labels.py
    prefix = getattr(get_adapter(tiny_models.load(family).build_config()), "prefix_lm_key", None)
    assert compare(batch, own, skip=(prefix,) if prefix else ()) == [], family


def test_a_paligemma_text_only_record_is_refused_by_name(tmp_path):
    torch.set_num_threads(1)
    processor = build_tiny_processor("paligemma")
    path = write_mixed_dataset(tmp_path, ["odd", "text"], words=text_words(processor.tokenizer))
    sp = data.SampleProcessor(processor, config=tiny_models.load("paligemma").build_config())
    with pytest.raises(data.DataError, match=r"mixed.jsonl:2: the processor refuses this record .*images"):
        sp(data.open_dataset(str(path))[1])


def test_media_that_cannot_be_batched_name_both_records():
    one = {"input_ids": torch.ones(1, 3, dtype=torch.int64), "attention_mask": torch.ones(1, 3, dtype=torch.int64),
           "labels": torch.full((1, 3), -100), "pixel_values": torch.zeros(2, 4)}
    other = {**one, "pixel_values": torch.zeros(1, 3, 4)}
    with pytest.raises(data.DataError, match=r"b.jsonl:7: the processor gives pixel_values \[1, 3, 4\] .* for a.jsonl:2"):
        data.collate_samples([one, other], 0, names=["a.jsonl:2", "b.jsonl:7"])


def test_samples_on_axis_0_get_a_zero_entry_per_sample_without_media():
    """Idefics3's layout: a text-only sample and a filler row (a skipped sample) get all-zero crops."""
    row = {"input_ids": torch.ones(1, 3, dtype=torch.int64), "attention_mask": torch.ones(1, 3, dtype=torch.int64),
           "labels": torch.full((1, 3), -100)}
    crops = {**row, "pixel_values": torch.ones(1, 2, 3, 4, 4)}
    batch = data.collate_samples([row, crops, None], 0, sample_axis_keys=("pixel_values",))
    assert batch["pixel_values"].shape == (3, 2, 3, 4, 4)
    assert batch["pixel_values"][1].eq(1).all() and not batch["pixel_values"][[0, 2]].any()
