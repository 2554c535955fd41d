"""Per-sample inputs (``SampleInput``): split with the samples, staged in ``chunk.extras``, reordered by a
balanced split, carried to every stage and handed to the language model; refused all or nothing."""

from __future__ import annotations

import types

import pytest
import torch

import ppmedia
from ppmedia import split_media, stage_media
from ppmedia.adapters.base import SampleInput
from ppmedia.adapters.llava_next import LlavaNextAdapter
from ppmedia.pipeline import build_stage_modules
from ppmedia.registry import AdapterRegistry, PluginError

B = 4


def _batch():
    return {"input_ids": torch.arange(B * 3).reshape(B, 3), "token_type_ids": torch.arange(B * 3).reshape(B, 3) % 2,
            "pixel_values": torch.randn(2, 3, 4, 4), "n_images_per_sample": torch.tensor([1, 0, 0, 1])}


def test_split_staged_and_popped_with_the_samples():
    batch = _batch()
    types_ = batch["token_type_ids"]
    staged = split_media(batch, 3, sample_inputs=["token_type_ids"])
    assert "token_type_ids" not in batch and staged.kinds["token_type_ids"] == "input"
    chunks = list(staged)
    assert [c.extras["token_type_ids"].shape[0] for c in chunks] == [2, 1, 1]
    assert chunks[1].has_media is False and chunks[1].pixel_values is None  # text-only, its inputs still there
    assert chunks[2].extras["token_type_ids"].data_ptr() == types_[3].data_ptr()  # a view
    given = split_media(_batch(), 2, sample_inputs={"token_type_ids": torch.ones(B, 3, dtype=torch.long)})
    assert given.chunk(1).extras["token_type_ids"].tolist() == [[1, 1, 1]] * 2


def test_stage_media_hangs_them_and_the_consumer_takes_them_once():
    staged = split_media(_batch(), 2, sample_inputs=["token_type_ids"])
    module = torch.nn.Module()
    with stage_media(module, staged):
        taken = [ppmedia.next_vlm_media_chunk(module) for _ in range(2)]
    assert [c.extras["token_type_ids"].shape for c in taken] == [torch.Size([2, 3])] * 2
    assert not hasattr(module, "_vlm_extras_chunks")


def test_a_balanced_split_reorders_them_with_their_samples():
    batch = _batch()
    batch["pixel_values"], batch["n_images_per_sample"] = torch.randn(3, 3, 4, 4), torch.tensor([2, 1, 0, 0])
    rows = batch["token_type_ids"].clone()
    staged = split_media(batch, 2, sample_inputs=["token_type_ids"], balance=True)
    order = list(staged.permutation)
    assert order != list(range(B))
    got = torch.cat([c.extras["token_type_ids"] for c in staged])
    assert torch.equal(got, rows[order]) and torch.equal(batch["input_ids"][:, 0], torch.tensor(order) * 3)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"sample_inputs": {"token_type_ids": torch.zeros(3, 3)}}, ValueError,
     r"token_type_ids: shape \[3, 3\]; expected \[4, \.\.\.\] \(a per-sample input: one row per sample\)"),
    ({"sample_inputs": ["absent"]}, ValueError, r"sample_inputs: absent is not in the batch"),
    ({"sample_inputs": ["pixel_values"]}, ValueError, r"sample_inputs: pixel_values is a media key \(media layout '\w+' reads it\); expected a key no layout reads"),
    ({"sample_inputs": {"token_type_ids": torch.tensor(1)}}, ValueError, r"token_type_ids: shape \[\]; expected \[B, \.\.\.\]"),
    ({"sample_inputs": {"token_type_ids": [1, 2, 3, 4]}}, TypeError, r"token_type_ids: got list; expected a torch.Tensor"),
    ({"sample_inputs": "token_type_ids"}, TypeError, r"sample_inputs: got str; expected batch keys"),
])
def test_bad_per_sample_inputs_are_refused_all_or_nothing(kwargs, error, match):
    batch = _batch()
    before = dict(batch)
    with pytest.raises(error, match=match):
        split_media(batch, 2, **kwargs)
    assert batch.keys() == before.keys() and all(batch[k] is before[k] for k in batch)


# ---------------------------------------------------------------- every stage, and the language model's keyword


class PositionsLlavaNext(LlavaNextAdapter):
    """LLaVA-NeXT with the batch's own positions ``[B, S]`` on every stage, as the language model's keyword."""

    name = "llava_next_positions"
    sample_inputs = (SampleInput("text_positions", ("b", "S"), every_stage=True, kwarg="position_ids"),)


@pytest.fixture(scope="module")
def llava_next():
    from ppmedia.testing.tiny_models import llava_next

    torch.set_num_threads(1)
    model, batch = llava_next.build_model(0), llava_next.build_batch(0)
    S = batch["input_ids"].shape[1]
    # not the default positions, and not a shift of them either (rotary attention sees only distances)
    batch["text_positions"] = torch.arange(S)[None, :] * (1 + torch.arange(B * 2)[:, None] % 3)
    return model, batch


def _through_two_stages(model, batch, adapter, n=2):
    first, last = build_stage_modules(model, 2, adapter=adapter)
    batch = dict(batch)
    staged = split_media(batch, n, **adapter.media_counts(batch, model.config))
    logits = []
    with torch.no_grad(), stage_media(first, staged):
        for rows in torch.tensor_split(torch.arange(batch["input_ids"].shape[0]), n):
            sent = first(batch["input_ids"][rows], batch["attention_mask"][rows])
            logits.append(last(*sent))
    return first, torch.cat(logits)


def test_an_every_stage_input_reaches_the_language_model_on_every_stage(llava_next):
    model, batch = llava_next
    with torch.no_grad():
        expected = model(**{k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values", "image_sizes")},
                         position_ids=batch["text_positions"]).logits
    first, got = _through_two_stages(model, batch, PositionsLlavaNext())
    assert [w.name for w in first.wire_out] == ["text_positions"]
    assert (got - expected).abs().max() <= 1e-5
    batch_without = {k: v for k, v in batch.items() if k != "text_positions"}
    _, plain = _through_two_stages(model, batch_without, LlavaNextAdapter())
    assert (plain - expected).abs().max() > 1e-3  # the check can fail: default positions differ


def test_an_every_stage_input_that_was_not_staged_is_named(llava_next):
    model, batch = llava_next
    first, _ = build_stage_modules(model, 2, adapter=PositionsLlavaNext())
    batch = dict(batch)
    staged = split_media(batch, 2, **LlavaNextAdapter().media_counts(batch, model.config))  # without the adapter's inputs
    with pytest.raises(
        ValueError, match=r"llava_next_positions adapter: per-sample input 'text_positions' was not staged for microbatch 0; "
                          r"expected the batch's text_positions \['b', 'S'\] split with the media"):
        with torch.no_grad(), stage_media(first, staged):
            first(batch["input_ids"][:4], batch["attention_mask"][:4])


@pytest.mark.parametrize("inputs, problem", [
    ([SampleInput("x")], r"sample_inputs is \[SampleInput\(key='x'.*\]; expected a tuple of ppmedia.adapters.base.SampleInput"),
    ((SampleInput("x", ("S", "b")),), r"sample_inputs: x: shape \('S', 'b'\); expected a tuple starting with 'b'"),
    ((SampleInput("x", kwarg="x"),), r"sample_inputs: x: kwarg 'x'; expected a keyword name, with every_stage=True"),
    ((SampleInput("x"), SampleInput("x")), r"sample_inputs names a key twice: \['x', 'x'\]"),
])
def test_an_adapter_with_bad_inputs_names_its_plugin(inputs, problem):
    bad = type("BadInputs", (LlavaNextAdapter,), {"name": "bad", "model_types": ("bad",), "sample_inputs": inputs})
    plugin = types.ModuleType("bad_inputs_plugin")
    plugin.ppmedia_adapters = ppmedia.hookimpl(lambda: [bad])
    plugin.ppmedia_adapters.__name__ = "ppmedia_adapters"
    with pytest.raises(PluginError, match=r"^ppmedia plugin bad_inputs_plugin: BadInputs\." + problem):
        AdapterRegistry(entry_point_group=None, plugins_env=None).register_plugin(plugin, "bad_inputs_plugin")
