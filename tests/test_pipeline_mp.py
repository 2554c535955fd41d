"""Real pipeline-parallel runs with staged media: 2 processes, gloo on 127.0.0.1, vs. the model itself.

Every family's tiny batch (8 samples, 4 microbatches, microbatch 2 text-only) runs two consecutive
training steps under GPipe, 1F1B and Interleaved1F1B (2 stages per rank), each with shapes inferred
on the first step and with static input_args/output_args. One spawned pair per family runs all its
scenarios (ppmedia.testing.parity); the tests read its report. The same spawn also runs 1F1B on stages
that each rank loads from a checkpoint of the model (``stages_from_pretrained``). A few in-process
tests check the stage split.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import ppmedia
import ppmedia.testing.tiny_models as tiny
from conftest import assert_pipeline_matches, parity_once
from ppmedia.testing.parity import ALL_SCENARIOS, ParityError, Scenario, microbatch_table, run_parity
from ppmedia.pipeline import (
    IGNORE_INDEX,
    build_stage_modules,
    count_valid_tokens,
    default_layer_split,
    make_labels,
    pipeline_loss,
)
from ppmedia.pipeline.loss import SHIFTED_MARK, shift_labels
from ppmedia.registry import get_adapter

TOL = 1e-5
N_MICROBATCHES = 4
STEPS = 2
WRONG_BATCH = Scenario("1f1b", "static", "wrong_batch")
#: every rank builds only its stages from a save_pretrained checkpoint of the model (40 KB shards)
PRETRAINED = Scenario("1f1b", "static", pretrained=True)
SCENARIO_NAMES = [s.name for s in ALL_SCENARIOS]
#: per family, scenarios run in the same spawn as its defaults. Qwen3-VL's tiny model has 2 decoder
#: layers and 2 deepstack levels: the default split (1 + 1) sends level 1 across the boundary; 2 + 0
#: keeps every deepstack layer on stage 0.
EXTRA_SCENARIOS: dict[str, tuple[Scenario, ...]] = {
    "qwen3_vl": tuple(Scenario(s, shapes, layers=(2, 0)) for s in ("gpipe", "1f1b") for shapes in ("inferred", "static"))
    + (Scenario("1f1b", "inferred", variant="text_only_first"), Scenario("gpipe", "inferred", variant="frozen_vision"))
    # the encoder spread: deepstack levels encoded on rank 1 reach layers on both ranks (ZBV: 4 stages,
    # stage 0 without layers), a text-only first microbatch, a frozen tower (no gradients travel back)
    + (Scenario("1f1b", "static", encoder="spread"),
       Scenario("ZBVZeroBubble", "inferred", variant="text_only_first", encoder="spread"),
       Scenario("gpipe", "static", variant="frozen_vision", encoder="spread")),
}

#: sequence packing (ppmedia.packing): two consecutive samples a row, the reference unpacked; and its
#: two planted bugs, which must fail: positions over the whole row, attention across one boundary
PACKED = Scenario("1f1b", "static", packed=True)
PACKED_FAULTS = (Scenario("1f1b", "static", "packed_positions", packed=True), Scenario("1f1b", "static", "packed_leak", packed=True))
PACKED_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "gemma3", "llava_next")
for _family in PACKED_FAMILIES:
    EXTRA_SCENARIOS[_family] = EXTRA_SCENARIOS.get(_family, ()) + (PACKED,) + PACKED_FAULTS * (_family == "qwen2_5_vl")

#: the families of this module's one spawn (2-layer tiny models split 1 + 1); the later families
#: (Mistral Large 4, Mistral Small 4, LLaVA, MiniMax-M3-VL, Inkling 2, Kimi-K2.5 video) run their
#: parity in one shared spawn in tests/test_state_families_mp.py.
FAMILIES = ("qwen2_5_vl", "llava_next", "step3", "kimi_vl", "qwen3_vl", "gemma3", "mistral3")
#: the audio families run their parity in one shared spawn in tests/test_audio_families_mp.py; their
#: stage split is checked here in process too
SPLIT_FAMILIES = FAMILIES + ("gemma4", "qwen2_5_omni", "qwen3_omni", "inkling")



@pytest.fixture
def one_thread():
    """In-process model runs: one intra-op thread (on 2 busy cores more threads only spin)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


#: ONE spawned pair runs every family's scenarios (starting a pair costs seconds)
_report = parity_once(FAMILIES, [*ALL_SCENARIOS, WRONG_BATCH, PRETRAINED], steps=STEPS, n_microbatches=N_MICROBATCHES,
                      tolerance=TOL, family_scenarios=EXTRA_SCENARIOS)


# ----------------------------------------------------------------------------------------------
# multi-process parity


@pytest.mark.multiprocess
@pytest.mark.parametrize("scenario", SCENARIO_NAMES)
@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_matches_full_batch_model(family, scenario):
    result = _report().family(family).scenario(scenario)
    schedule, shapes = scenario.split("/")
    assert result.n_stages == (4 if schedule == "interleaved" else 2)
    assert result.missing_params == [], "every parameter of the model must be on some stage"
    assert [s.step for s in result.steps] == list(range(STEPS))
    for st in result.steps:
        where = f"{family} {scenario} step {st.step}"
        assert st.loss_diff <= TOL, f"{where}: loss {st.loss_pipeline} vs {st.loss_reference}"
        assert st.grad_diff_vision <= TOL, f"{where}: vision grads differ by {st.grad_diff_vision}"
        assert st.grad_diff_lm <= TOL, f"{where}: language-model grads differ by {st.grad_diff_lm}"
        # the comparison is between real gradients, of both sides of the model
        assert st.vision_params_compared > 0
        assert st.reference_grad_max_vision > 1e-4 and st.reference_grad_max_lm > 1e-4
        # the shape-inference forward (inferred shapes, first step) runs stage 0 once more, on
        # microbatch 0's media, and costs no chunk; every call got its own microbatch's media
        inference = shapes == "inferred" and st.step == 0
        assert st.first_stage_calls == st.expected_first_stage_calls == N_MICROBATCHES + inference
        assert st.chunk_trace == [0] * inference + list(range(N_MICROBATCHES))
    # the SGD step between the steps changed the model, and the reference followed
    assert result.steps[0].loss_reference != result.steps[1].loss_reference
    assert result.passed(TOL)


@pytest.mark.multiprocess
@pytest.mark.parametrize("scenario", [s.name for s in EXTRA_SCENARIOS["qwen3_vl"]])
def test_qwen3_vl_deepstack_scenarios(scenario):
    """2 + 0: every deepstack layer on stage 0; text_only_first: the schedule infers its shapes from a
    microbatch without media (whose deepstack features carry no gradient); frozen_vision: the vision
    tower trains not at all, and nothing reaches it."""
    result = _report().family("qwen3_vl").scenario(scenario)
    assert result.layers_per_stage == ([2, 0] if "layers=" in scenario else default_layer_split(2, result.n_stages))
    assert result.missing_params == []
    for st in result.steps:
        assert st.loss_diff <= TOL and st.grad_diff_vision <= TOL and st.grad_diff_lm <= TOL, (scenario, st)
        assert st.reference_grad_max_lm > 1e-4
        frozen = "frozen_vision" in scenario
        if scenario.endswith("/spread"):  # each microbatch with media encoded once, and some on rank 1
            encoded = sorted(k for _, _, k in st.encoded)
            media = [m.index for m in microbatch_table("qwen3_vl", N_MICROBATCHES, seed=st.step) if not m.text_only]
            assert encoded == ([1, 2, 3] if "text_only_first" in scenario else media), (scenario, st.encoded)
            assert {r for _, r, _ in st.encoded} == {0, 1}
        assert (st.reference_grad_max_vision == 0.0) if frozen else (st.reference_grad_max_vision > 1e-4)
    assert result.passed(TOL)


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", FAMILIES)
def test_a_pipeline_loaded_from_a_checkpoint_matches_the_model(family):
    """Each rank reads only its stage from the checkpoint (Kimi: the q_lora_rank model transformers can
    read back, tiny_models.kimi_vl.build_checkpoint_model); the pipeline matches the model within 1e-5."""
    result = _report().family(family).scenario(PRETRAINED.name)
    assert result.name == "1f1b/static/pretrained" and result.missing_params == []
    for st in result.steps:
        assert st.loss_diff <= TOL and st.grad_diff_vision <= TOL and st.grad_diff_lm <= TOL, (family, st)
        assert st.vision_params_compared > 0 and st.reference_grad_max_vision > 1e-4
        assert st.first_stage_calls == st.expected_first_stage_calls == N_MICROBATCHES
    assert result.steps[0].loss_reference != result.steps[1].loss_reference
    assert result.passed(TOL)


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", FAMILIES)
def test_microbatch_table_has_text_only_middle_microbatch(family):
    report = _report().family(family)
    assert report.microbatches == microbatch_table(family, N_MICROBATCHES)
    assert [m.samples for m in report.microbatches] == [2, 2, 2, 2]
    assert [m.text_only for m in report.microbatches] == [False, False, True, False]
    assert report.microbatches[2].placeholder_tokens == 0
    assert all(m.placeholder_tokens > 0 and m.patch_rows > 0 for k, m in enumerate(report.microbatches) if k != 2)


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", FAMILIES)
def test_media_of_another_batch_fail_the_comparison(family):
    """Same layout, other pixels: nothing raises, but the harness sees the losses and grads differ."""
    report = _report()
    result = report.family(family).scenario(WRONG_BATCH.name)
    assert not result.passed(TOL)
    for st in result.steps:
        assert st.loss_diff > 1e-4
        assert st.grad_diff_vision > 1e-4
    assert report.ok  # a deliberate fault does not count against the run


@pytest.mark.multiprocess
def test_bare_module_without_static_shapes_fails_loudly():
    """stage_media(module, ...) cannot rewind the shape-inference forward: it takes chunk 0, microbatch
    0 then gets microbatch 1's media and adapter.merge's count check stops the run."""
    with pytest.raises(ParityError, match=r"rank 0: ValueError: image: the microbatch has 8 placeholder tokens but its media give 7 feature rows; placeholders per sample: \[4, 4\]"):
        run_parity("kimi_vl", [Scenario("gpipe", "inferred", "bare_module")], steps=1)


def test_bad_arguments_fail_before_spawning():
    with pytest.raises(ValueError, match="equal microbatches"):
        run_parity("kimi_vl", ["gpipe"], n_microbatches=3)
    with pytest.raises(ValueError, match="unknown family"):
        run_parity("nope", ["gpipe"])
    with pytest.raises(ValueError, match="scenario schedule"):
        run_parity("kimi_vl", ["zero-bubble"])


# ----------------------------------------------------------------------------------------------
# in-process: the stage split


@pytest.mark.parametrize("family", SPLIT_FAMILIES)
def test_stage_modules_prune_and_keep_full_model_names(family, one_thread):
    model = tiny.load(family).build_model(0)
    full = dict(model.named_parameters(remove_duplicate=False))
    stages = build_stage_modules(model, 2)
    seen: set[str] = set()
    for module in stages:
        named = dict(module.named_parameters(remove_duplicate=False))
        for name, param in named.items():
            assert full[name] is param  # same name, same tensor
        seen |= set(named)
    assert seen == set(full)
    first, last = (dict(m.named_parameters(remove_duplicate=False)) for m in stages)
    # the vision side and the embedding only on the first stage; norm and head only on the last
    assert all(stages[1].is_language_parameter(n) for n in last)
    assert any(not stages[0].is_language_parameter(n) for n in first)
    cut = stages[0].layer_range[1]  # the first layer of the last stage (1 of 2 layers; Gemma 4: 2 of 4)
    assert f"model.language_model.layers.{cut - 1}.input_layernorm.weight" in first
    assert f"model.language_model.layers.{cut}.input_layernorm.weight" in last
    assert not any(f"language_model.layers.{i}." in n for n in first for i in range(cut, stages[1].layer_range[1]))
    assert not any(f"language_model.layers.{i}." in n for n in last for i in range(cut))
    assert "lm_head.weight" in last and "lm_head.weight" not in first
    assert "model.language_model.norm.weight" in last and "model.language_model.norm.weight" not in first


@pytest.mark.parametrize("family", SPLIT_FAMILIES)
def test_a_later_stage_keeps_nothing_else_alive(family, one_thread):
    """Pruned, not hidden: once the full model is dropped, the vision side, the embedding and the
    other stages' layers are freed; only the last stage's own modules stay."""
    model = tiny.load(family).build_model(0)
    lm = model.model.language_model
    watched = {"model": model, "inner model": model.model, "layer 0": lm.layers[0], "embedding": lm.embed_tokens}
    watched.update({name: m for name, m in model.model.named_children() if name != "language_model"})
    refs = {name: weakref.ref(m) for name, m in watched.items()}
    (stage,) = build_stage_modules(model, 2, stages=[1])
    del model, lm, watched
    gc.collect()
    assert [name for name, ref in refs.items() if ref() is not None] == []
    layers = stage.layer_range[1]
    assert stage.layer_range == (layers - default_layer_split(layers, 2)[1], layers) and stage.is_last and not stage.is_first


def test_default_layer_split():
    assert default_layer_split(2, 2) == [1, 1]
    assert default_layer_split(2, 4) == [0, 1, 1, 0]
    assert default_layer_split(5, 4) == [1, 2, 1, 1]
    assert default_layer_split(8, 4) == [2, 2, 2, 2]


def _sequential(stages, batch, adapter, config, n):
    """Run the stage modules one after the other, microbatch by microbatch, with staged media."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    images, videos = adapter.media_per_sample(ids, config)
    staged = ppmedia.split_media(dict(batch), n, images_per_sample=images, videos_per_sample=videos)
    logits = []
    with ppmedia.stage_media(stages[0], staged):
        for a, b in staged.samples:
            x = (ids[a:b], mask[a:b])
            for module in stages:
                x = module(*x)
                x = x if isinstance(x, tuple) else (x,)
            logits.append(x[0])
    return torch.cat(logits)


def test_layer_types_follow_their_layers_on_every_stage(one_thread):
    """Step3 text model with a sliding-window layer 0 and a full-attention layer 1 (each its own rope):
    the stage holding only layer 1 must still treat it as full attention."""
    from transformers import Step3p7ForConditionalGeneration

    module = tiny.load("step3")
    config = module.build_config()
    text = config.text_config
    text.layer_types = ["sliding_attention", "full_attention"]
    text.sliding_window = 4
    full_rope = dict(text.rope_parameters["full_attention"])
    text.rope_parameters = {"full_attention": full_rope, "sliding_attention": {**full_rope, "rope_theta": 500.0}}
    torch.manual_seed(0)
    model = Step3p7ForConditionalGeneration(config).eval()
    batch = module.build_batch(0)
    with torch.no_grad():
        expected = model(**module.reference_inputs(batch)).logits
        plain = module.build_model(0)
        plain.load_state_dict(model.state_dict())
        assert (plain(**module.reference_inputs(batch)).logits - expected).abs().max() > 1e-2  # the window matters
        adapter = get_adapter(model)
        # 2 stages: layer 1 (full attention) alone on the last stage, where it is the first layer
        got = _sequential(build_stage_modules(model, 2), batch, adapter, model.config, 4)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_labels_and_loss_normalisation(one_thread):
    module = tiny.load("llava_next")
    config = module.build_config()
    adapter = get_adapter(config)
    batch = module.build_batch(0)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    labels = make_labels(ids, config, adapter, attention_mask=mask)
    targets = make_labels(ids, config, adapter, attention_mask=mask, shift=False)
    assert (labels[:, -1] == SHIFTED_MARK).all()  # the mark pipeline_loss checks
    assert torch.equal(labels[:, :-1], targets[:, 1:])
    ignored = (ids == module.IMAGE_TOKEN_ID) | (ids == module.PAD_TOKEN_ID)
    assert torch.equal(targets == IGNORE_INDEX, ignored)
    # per-microbatch losses normalised by the whole batch's tokens add up to the batch mean
    logits = torch.randn(*ids.shape, config.text_config.vocab_size)
    n = count_valid_tokens(labels)
    parts = sum(pipeline_loss(logits[a : a + 2], labels[a : a + 2], n) for a in range(0, 8, 2))
    plain = labels.masked_fill(labels == SHIFTED_MARK, IGNORE_INDEX)
    mean = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), plain.reshape(-1))
    torch.testing.assert_close(parts, mean)
    # transformers' unshifted labels are refused, never a different objective in silence
    with pytest.raises(ValueError, match="not marked"):
        pipeline_loss(logits, targets, n)
    torch.testing.assert_close(pipeline_loss(logits, shift_labels(targets), n), mean)


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", PACKED_FAMILIES)
def test_packed_rows_match_the_unpacked_model(family):
    """Two samples a row under 1F1B: loss and every gradient within 1e-5 of the model's own run on the
    unpacked batch, positions restarting at every sample on every stage."""
    result = _report().family(family).scenario(PACKED.name)
    assert result.packed and result.name == "1f1b/static/packed"
    assert_pipeline_matches(result, family, result.name, TOL, [1, 1])
    assert all(st.position_problems == [] for st in result.steps)


@pytest.mark.multiprocess
def test_planted_packing_bugs_fail():
    """Positions over the whole row (the loss cannot show it under rotary positions: the check of the
    stages' positions does) and one boundary crossed by attention (loss and gradients off)."""
    report = _report().family("qwen2_5_vl")
    positions, leak = (report.scenario(sc.name) for sc in PACKED_FAULTS)
    assert not positions.passed(TOL) and not leak.passed(TOL)
    assert all("sample starting at token" in st.position_problems[0] for st in positions.steps)
    assert all(st.loss_diff > 1e-3 and st.grad_diff > 1e-3 and st.position_problems == [] for st in leak.steps)
