"""The built-in PaliGemma adapter against transformers' own PaliGemma 2 (tiny, seeded): merges per
microbatch, the prefix-LM token types carried to every stage (the merged embeddings do not depend on
them, so planted wrong token types on a later stage are caught by the stage checks, not by the
embeddings), the model's 1-indexed positions, its final logit soft-capping, the real
``SiglipImageProcessorPil``, and a batch without token types refused before anything is popped."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import ppmedia
from ppmedia.adapters.paligemma import PaliGemmaAdapter, tokens_per_image
from ppmedia.pipeline import build_stage_modules
from ppmedia.testing import AdapterMismatch, check_adapter, check_stage_splits
from ppmedia.testing.tiny_models import capture_merged_embeds, capture_reference
from ppmedia.testing.tiny_models import paligemma as tiny

ATOL = 1e-5


def test_registered_with_token_types_on_every_stage(adapter, model):
    assert isinstance(adapter, PaliGemmaAdapter)
    (spec,) = adapter.sample_inputs
    assert (spec.key, spec.shape, spec.every_stage) == ("token_type_ids", ("b", "S"), True)
    assert [w.name for w in adapter.stage_wire_tensors(model.config, 1)] == ["token_type_ids"]
    assert tokens_per_image(model.config) == tiny.TOKENS_PER_IMAGE == 16


def test_merge_matches_the_model_at_1_2_4_8_and_an_uneven_split(model):
    checks = check_adapter(tiny, microbatches=[1, 2, 4, 8, 3], model=model)
    assert len(checks) == 18 and max(c.max_abs_diff for c in checks) <= ATOL
    assert [c.has_media for c in checks if c.n_microbatches == 4] == [True, True, False, True]


def test_the_merged_embeddings_do_not_depend_on_the_token_types(model, batch):
    """Why a golden of embeddings cannot check the token types: the model's own merge ignores them."""
    wrong = dict(batch, token_type_ids=torch.ones_like(batch["token_type_ids"]))
    assert torch.equal(capture_merged_embeds(model, **tiny.reference_inputs(batch)),
                       capture_merged_embeds(model, **tiny.reference_inputs(wrong)))


def test_stage_splits_match_the_model_and_carry_the_token_types(model):
    checks = check_stage_splits(tiny, [(1, 1), (2, 0), (0, 2)], model=model)
    assert all(c.max_grad_diff <= ATOL and c.max_logit_diff <= ATOL for c in checks)
    assert all(c.wire == (("token_type_ids",),) for c in checks)


class _WrongTypesLater(PaliGemmaAdapter):
    """Planted bug: a later stage builds its mask from token types derived from the ids (1 = image)."""

    def decoder_kwargs(self, stage: Any, layers: range, hidden: Any, attention_mask: Any, wire: Any) -> dict[str, Any]:
        if layers.start > 0:
            wire = {**wire, "token_type_ids": torch.ones_like(wire["token_type_ids"])}  # causal everywhere
        return super().decoder_kwargs(stage, layers, hidden, attention_mask, wire)


class _NoSoftCap(PaliGemmaAdapter):
    """Planted bug: the last stage's logits without the model's final soft-capping."""

    def logits(self, stage: Any, hidden: Any) -> Any:
        return stage.output_head(hidden)


@pytest.mark.parametrize("bad", [_WrongTypesLater, _NoSoftCap])
def test_a_stage_given_wrong_token_types_or_logits_fails(model, bad):
    with pytest.raises(AdapterMismatch, match=r"paligemma, layers per stage \[1, 1\].*differ"):
        check_stage_splits(tiny, [(1, 1)], model=model, adapter=bad())


def test_the_language_model_gets_the_models_positions(model, batch):
    """1-indexed positions, exactly the model's own (RoPE is relative, so 0-indexed ones would give
    nearly the same logits: this compares the positions themselves)."""
    _, expected = capture_reference(model, **tiny.reference_inputs(batch))
    assert expected.tolist() == [list(range(1, batch["input_ids"].shape[1] + 1))]
    first, last = build_stage_modules(model, 2)
    seen = []
    handle = last.stage_language_model.register_forward_pre_hook(lambda m, a, k: seen.append(k["position_ids"]), with_kwargs=True)
    local = dict(batch)
    staged = ppmedia.split_media(local, 1, **first.adapter.media_counts(local, model.config))
    try:
        with torch.no_grad(), ppmedia.stage_media(first, staged):
            last(*first(local["input_ids"], local["attention_mask"]))
    finally:
        handle.remove()
    assert torch.equal(seen[0], expected)


def test_a_batch_without_token_types_is_refused_before_anything_is_popped(model, batch, adapter):
    bad = {k: v for k, v in batch.items() if k != "token_type_ids"}
    before = dict(bad)
    with pytest.raises(ValueError, match=r"paligemma: token_type_ids is missing; expected \[8, 41\] like input_ids"):
        ppmedia.split_media(bad, 4, **adapter.media_counts(bad, model.config))
    assert bad.keys() == before.keys()
    short = dict(batch, token_type_ids=batch["token_type_ids"][:, :5])
    with pytest.raises(ValueError, match=r"token_type_ids is \[8, 5\]; expected \[8, 41\]"):
        adapter.media_counts(short, model.config)


def test_images_of_another_size_are_refused(model, batch, adapter):
    ids = batch["input_ids"][:1]
    with pytest.raises(ValueError, match=r"paligemma pixel_values: shape \[1, 3, 32, 32\]; expected \[images, 3, 16, 16\]"):
        adapter.merge(model, ids, model.get_input_embeddings()(ids), ppmedia.VlmMediaChunk(torch.zeros(1, 3, 32, 32), None, None, None))


def test_real_siglip_image_processor(model):
    """SiglipImageProcessorPil (resize to the tower's 16 x 16) on images of any size; the prompt as
    PaliGemmaProcessor writes it (images first, <bos>, prompt, newline, then the suffix: type 1)."""
    from PIL import Image
    from transformers import SiglipImageProcessorPil

    rng = np.random.default_rng(4)
    processor = SiglipImageProcessorPil(size={"height": 16, "width": 16})
    counts, prompts, suffixes = [1, 0, 2, 1], [3, 6, 2, 4], [4, 2, 5, 3]
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in [(40, 30), (9, 64), (23, 23), (90, 50)]]
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    assert pixels.shape == (4, 3, 16, 16)
    rows, types = [], []
    for n, p, s in zip(counts, prompts, suffixes):
        prefix = [tiny.IMAGE_TOKEN_ID] * (16 * n) + [tiny.BOS_TOKEN_ID] + rng.integers(3, 100, p).tolist() + [tiny.NEWLINE_TOKEN_ID]
        suffix = rng.integers(3, 100, s).tolist() + [tiny.EOS_TOKEN_ID]
        rows.append(prefix + suffix)
        types.append([0] * len(prefix) + [1] * len(suffix))
    seq = max(map(len, rows))
    ids = torch.tensor([r + [0] * (seq - len(r)) for r in rows])
    batch = {"input_ids": ids, "attention_mask": (ids != 0).long(), "pixel_values": pixels,
             "token_type_ids": torch.tensor([t + [1] * (seq - len(t)) for t in types])}
    reference = capture_merged_embeds(model, **tiny.reference_inputs(batch))
    checks = check_adapter(tiny, microbatches=[1, 2, 4], model=model, batch=batch, reference=reference)
    assert max(c.max_abs_diff for c in checks) <= ATOL
    assert check_stage_splits(tiny, [(1, 1)], model=model, batch=batch)[0].max_grad_diff <= ATOL
