"""Mistral Large 4 against transformers' own model (tiny seeded): Pixtral images with a 3 x 3 merger, and
DSA top-k indices and shared latent KV that cross stage boundaries.

The merge is checked per microbatch against the model's own merged embeddings (1, 2, 3, 4, 8
microbatches, text-only and mixed ones); stage modules of every split that cuts through a cross-layer
dependency (run in this process, forward and backward) against the model's own logits and every
gradient (``ppmedia.testing.check_stage_splits``); and an adapter that drops the state at the
boundary fails. The 2-process schedules are in test_state_families_mp.py.
"""

from __future__ import annotations

import pytest
import torch

import ppmedia
from ppmedia.adapters.mistral_large4 import MistralLarge4Adapter, crossing_state, pad_topk
from ppmedia.testing import check_adapter, check_stage_splits
from ppmedia.testing.tiny_models import capture_merged_embeds, constant_parameters
from ppmedia.testing.tiny_models import mistral_large4 as tiny
from conftest import pixtral_processor_batch

ATOL = 1e-5


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_found_by_model_type_and_every_parameter_distinct(model):
    adapter = ppmedia.get_adapter(model)
    assert isinstance(adapter, MistralLarge4Adapter) and adapter.name == "mistral_large4"
    assert model.config.spatial_merge_size == 3
    assert constant_parameters(model) == []  # transformers starts the query scaling at 0 / 1: drawn here
    scaling = model.model.language_model.layers[0].self_attn.softmax_scaling
    assert scaling.scale.abs().min() > 0 and (scaling.bias - 1).abs().max() > 1e-3


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_merge_matches_the_models_own_per_microbatch(model, batch, n):
    checks = check_adapter(tiny, microbatches=[n], model=model, batch=batch)
    assert len(checks) == n and max(c.max_abs_diff for c in checks) <= ATOL
    if n == 4:
        assert [c.has_media for c in checks] == [True, True, False, True]  # microbatch 2 is text-only


def test_what_crosses_each_boundary(model):
    config = model.config
    assert crossing_state(config, 0) == (False, ())
    assert crossing_state(config, 1) == (False, ("rope",))  # layer 2 reads layer 0's rope KV
    assert crossing_state(config, 2) == (True, ("rope", "nope"))  # layer 2 is a shared indexer layer
    assert crossing_state(config, 3) == (False, ("nope",))  # layer 3 reads layer 1's nope KV
    assert crossing_state(config, 4) == (False, ())
    names = [w.name for w in MistralLarge4Adapter().wire_tensors(config, 2)]
    assert names == ["topk_indices", "kv_rope_pass", "kv_rope_rot", "kv_nope_pass"]
    shapes = {w.name: (w.shape, w.floating) for w in MistralLarge4Adapter().wire_tensors(config, 2)}
    assert shapes["topk_indices"] == (("b", "S", 4), False)
    assert shapes["kv_rope_pass"] == (("b", 1, "S", 16), True) and shapes["kv_rope_rot"] == (("b", 1, "S", 8), True)


SPLITS = [(2, 2), (1, 3), (3, 1), (1, 1, 2), (1, 2, 1), (1, 1, 1, 1), (0, 2, 2), (4, 0)]


def test_every_split_matches_the_model(model, batch):
    """Logits and every gradient (vision tower included) within 1e-5, whatever the boundaries cut: the
    default 2 + 2 split sends the top-k indices of layer 1 and the KV of layers 0 and 1 to stage 1; 1 + 1 + 2
    sends layer 0's rope KV through the middle stage, which adds layer 1's."""
    checks = check_stage_splits(tiny, SPLITS, model=model, batch=batch)
    wire = {c.layers_per_stage: c.wire for c in checks}
    assert wire[(2, 2)] == (("topk_indices", "kv_rope_pass", "kv_rope_rot", "kv_nope_pass"),)
    assert wire[(1, 1, 2)] == (("kv_rope_pass", "kv_rope_rot"), ("topk_indices", "kv_rope_pass", "kv_rope_rot", "kv_nope_pass"))
    assert wire[(4, 0)] == ((),)
    for check in checks:
        assert check.max_logit_diff <= ATOL and check.max_grad_diff <= ATOL, check


def test_kv_gradient_reaches_the_source_layer_on_an_earlier_stage(model, batch):
    """Layer 3 (stage 1) attends to layer 1's latent KV (stage 0): the only way layer 1's
    kv_a_proj_with_mqa gets that part of its gradient is back across the boundary."""
    from ppmedia.testing.stages import reference_run, stage_run

    _, ref = reference_run(model, tiny, batch)
    _, got, _ = stage_run(model, batch, (2, 2))
    name = "model.language_model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    assert (got[name] - ref[name]).abs().max() <= ATOL and ref[name].abs().max() > 1e-4


class _Dropping(MistralLarge4Adapter):
    """Carries nothing across a boundary: the Mistral 3 pipeline."""

    def wire_tensors(self, config, first_layer):
        return ()

    def stage_hooks(self, stage, layers, state):
        return ()


class _DroppingTopk(MistralLarge4Adapter):
    """Carries the shared KV but not the top-k indices."""

    def wire_tensors(self, config, first_layer):
        return tuple(w for w in super().wire_tensors(config, first_layer) if w.name != "topk_indices")


def test_an_adapter_that_drops_the_state_fails(model, batch):
    # a stage starting on a shared indexer layer: the model's own code refuses
    with pytest.raises(ValueError, match="Shared DSA layers require top-k indices from a previous full indexer layer"):
        check_stage_splits(tiny, [(2, 2)], adapter=_DroppingTopk(), model=model, batch=batch)
    # a stage whose layers read KV sources on an earlier stage
    with pytest.raises(KeyError, match="rope"):
        check_stage_splits(tiny, [(2, 2)], adapter=_Dropping(), model=model, batch=batch)
    with pytest.raises(KeyError, match="nope"):
        check_stage_splits(tiny, [(3, 1)], adapter=_Dropping(), model=model, batch=batch)
    # the dropping adapter is fine where nothing crosses
    assert check_stage_splits(tiny, [(4, 0)], adapter=_Dropping(), model=model, batch=batch)


def test_fewer_tokens_than_index_topk_pad_the_indices():
    """index_topk 64 > S: the model keeps all S indices; the wire carries 64, the rest repeating the
    first (the sparse mask is the same), and every split still matches."""
    model = tiny.build_model(0, index_topk=64)
    batch = tiny.build_batch(0)
    assert batch["input_ids"].shape[1] < 64
    checks = check_stage_splits(tiny, [(2, 2), (1, 2, 1)], model=model, batch=batch)
    assert all(c.max_grad_diff <= ATOL for c in checks)
    indices = torch.tensor([[[3, 1, 2]]])
    padded = pad_topk(indices, 6)
    assert padded.tolist() == [[[3, 1, 2, 3, 3, 3]]] and padded.dtype == torch.int64
    scatter = lambda i: torch.ones(1, 1, 8, dtype=torch.bool).scatter(-1, i, False)  # noqa: E731 (the model's mask)
    assert torch.equal(scatter(indices), scatter(padded))
    with pytest.raises(ValueError, match=r"topk_indices: shape \[1, 1, 3\]; expected at most 2"):
        pad_topk(indices, 2)


def test_last_stage_soft_caps_the_logits(model):
    """As the model's forward does after lm_head: tanh(logits / 30) * 30."""
    from ppmedia.pipeline import build_stage_modules

    last = build_stage_modules(model, 2, stages=[1])[0]
    cap = model.config.text_config.final_logit_softcapping
    hidden = torch.randn(2, 3, 64) * 200
    with torch.no_grad():
        raw = last.lm_head(hidden)
        capped = MistralLarge4Adapter().logits(last, hidden)
    assert raw.abs().max() > cap > capped.abs().max()
    torch.testing.assert_close(capped, torch.tanh(raw / cap) * cap)


def test_static_stage_args_follow_the_wire(model):
    from ppmedia.pipeline import build_stage_modules, static_stage_args

    first, last = build_stage_modules(model, 2)
    _, outs = static_stage_args(first, 2, 28)
    ins, logits = static_stage_args(last, 2, 28)
    shapes = [(list(t.shape), t.dtype, t.requires_grad) for t in outs]
    assert shapes[2:] == [([2, 28, 4], torch.int64, False), ([2, 1, 28, 16], torch.float32, True),
                          ([2, 1, 28, 8], torch.float32, True), ([2, 1, 28, 16], torch.float32, True)]
    assert [list(t.shape) for t in ins] == [s for s, _, _ in shapes] and list(logits[0].shape) == [2, 28, 128]


def test_real_pixtral_processor_output(model):
    """PixtralImageProcessorPil (no torchvision) with the patch size PixtralProcessor gives it (vision patch
    x merge = 12): images of different sizes padded to the largest; split, staged, merged per microbatch,
    equal to the model's own merge."""
    batch = pixtral_processor_batch(tiny.LAYOUT, [[(20, 50)], [(32, 32), (60, 15)], [], [(9, 12)], [(15, 22), (100, 45)]])
    sizes = batch["image_sizes"].tolist()
    assert len({tuple(s) for s in sizes}) > 3 and all(h % 12 == 0 and w % 12 == 0 for h, w in sizes)
    reference = capture_merged_embeds(model, **tiny.reference_inputs(batch))
    checks = check_adapter(tiny, microbatches=[1, 2, 5], model=model, batch=batch, reference=reference)
    assert max(c.max_abs_diff for c in checks) <= ATOL


def test_bad_image_sizes_name_this_family(model, batch, adapter):
    chunk = ppmedia.VlmMediaChunk(batch["pixel_values"][:1], torch.tensor([[60, 12]]), None, None)
    ids = batch["input_ids"][:1]
    with pytest.raises(ValueError, match=r"mistral_large4 image_sizes: row 0 of the microbatch is \[60, 12\]"):
        adapter.merge(model, ids, model.get_input_embeddings()(ids), chunk)


class _Forgetful(MistralLarge4Adapter):
    """Declares the state but stores none of it (its hooks only read)."""

    def stage_hooks(self, stage, layers, state):
        return super().stage_hooks(stage, layers, state)[:1]


def test_state_declared_but_not_made_is_an_error_naming_it(model, batch):
    with pytest.raises(TypeError, match=r"stage 0: _Forgetful.wire_tensors declares 'topk_indices' for stage 1, but "
                                        r"this stage does not hold it \(it has \[\]\)"):
        check_stage_splits(tiny, [(2, 2)], adapter=_Forgetful(), model=model, batch=batch)


def test_the_hooks_are_gone_after_each_forward(model, batch):
    """The stages share their layers with the model: no hook of a stage stays on them."""
    from ppmedia.testing.stages import stage_run

    def hooks():
        return {name: (len(m._forward_pre_hooks), len(m._forward_hooks)) for name, m in model.named_modules()}

    before = hooks()  # transformers' own output-capturing hooks
    stage_run(model, batch, (1, 1, 2))
    assert hooks() == before


def test_with_the_models_own_activation_checkpointing():
    """transformers checkpoints a layer's forward, not its __call__: a recomputed layer sees the
    arguments the stage's hooks gave it, and the gradients still match."""
    model = tiny.build_model(0)
    model.activation_checkpointing_enable()
    model.train()
    (check,) = check_stage_splits(tiny, [(1, 2, 1)], model=model)
    assert check.max_logit_diff <= ATOL and check.max_grad_diff <= ATOL
