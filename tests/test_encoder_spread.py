"""The encoder spread's pieces in one process, the step model and its timelines, ``ppmedia plan``'s
placement table, ``layers_per_stage="auto"``, and ``examples/train.py --encoder spread --trace`` under
torchrun (the multi-process parity of the spread rides in test_stack_mp.py and test_pipeline_mp.py).
"""

from __future__ import annotations

import itertools
import json
import pathlib
import xml.etree.ElementTree as ET

import pytest
import torch

import ppmedia
import ppmedia.testing.tiny_models as tiny
from ppmedia import pipeline
from ppmedia.pipeline import assign_encoders, build_stage_modules, vision_replica
from ppmedia.pipeline.encoder import AHEAD, _precomputed, encoded_ahead, interleave_encoders
from ppmedia.pipeline.stages import FEATURES_ATTRIBUTE
from ppmedia.planning.stepmodel import AutoSplit, OpCosts, best_layer_split, compare_placements, predict_step, schedule_actions
from ppmedia.planning.timeline import Bar, Timeline, render_svg
from train_helpers import model_adamw_run, train_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ----------------------------------------------------------------------------------------------
# who encodes what


def test_assign_encoders_gives_contiguous_balanced_blocks_in_rank_order():
    assert assign_encoders([1, 1, 1, 1], 2) == [0, 0, 1, 1]
    assert assign_encoders([3, 1, 1, 1], 2) == [0, 1, 1, 1]  # the heavy one alone
    assert assign_encoders([1, 0, 1, 1, 1, 0], 3) == [0, 0, 0, 1, 2, 2]  # text-only microbatches cost nothing
    assert assign_encoders([1.0] * 8, 4) == [0, 0, 1, 1, 2, 2, 3, 3]  # even: all ranks, equal shares
    assert assign_encoders([0, 0], 2) == [0, 0] and assign_encoders([5], 4) == [0]
    owners = assign_encoders([1.0] * 8, 2, weights=[1, 3])
    assert owners == [0, 0, 1, 1, 1, 1, 1, 1]
    for costs in itertools.product([0, 1, 2, 5], repeat=5):  # the largest block is the smallest possible
        owners = assign_encoders(list(costs), 2)
        assert owners == sorted(owners)
        got = max(sum(c for c, o in zip(costs, owners) if o == r) for r in (0, 1))
        best = min(max(sum(costs[:cut]), sum(costs[cut:])) for cut in range(6))
        assert got == best
    with pytest.raises(ValueError, match="expected costs >= 0"):
        assign_encoders([1, -1], 2)
    with pytest.raises(ValueError, match="expected 2 positive shares"):
        assign_encoders([1, 1], 2, weights=[1])


# ----------------------------------------------------------------------------------------------
# the first stage with precomputed outputs, every family


class _Outputs:
    """What EncoderSpread hangs on the first stage for a step, without the process group: the outputs
    of every microbatch encoded beforehand on a vision replica (stand-in for the transfer only)."""

    def __init__(self, adapter, outputs, rows):
        self.adapter, self.outputs, self.rows, self.takes = adapter, outputs, rows, []

    def adapter_for(self, k, chunk):
        self.takes.append(k)
        return _precomputed(self.adapter, k, self.outputs.get(k, {}), self.rows.get(k, {}))


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_the_first_stage_with_precomputed_outputs_equals_the_stage_running_the_tower(family, one_thread):
    module = tiny.load(family)
    model = module.build_model(0)
    adapter = ppmedia.get_adapter(model)
    config = model.config
    batch = dict(module.build_batch(0))
    ids, mask = batch["input_ids"], batch["attention_mask"]
    staged = ppmedia.split_media(dict(batch), 4, **adapter.media_counts(batch, config))
    first = build_stage_modules(model, 2, stages=[0])[0]
    replica = vision_replica(model)
    vision = {n for n, _ in first.named_parameters() if not first.is_language_parameter(n)}
    assert {n for n, _ in replica.named_parameters()} == vision  # the same names, nothing of the LM
    inside = first.merge_path  # Phi-4: the encoders sit under the decoder stack, in the merge module
    assert not any(n.startswith(first.language_model_path + ".") and not (inside and n.startswith(inside + "."))
                   for n, _ in replica.named_parameters())
    outputs, rows = {}, {}
    for k, chunk in enumerate(staged):
        a, b = staged.samples[k]
        masks, host = adapter.check_counts(ids[a:b], chunk, config)
        if chunk is not None:
            outputs[k] = {n: t.detach().clone() for n, t in adapter.encoder_outputs(replica, chunk, host).items()}
            rows[k] = dict(host.totals)
    with torch.no_grad():
        with ppmedia.stage_media(first, staged):
            plain = [first(ids[a:b], mask[a:b]) for a, b in staged.samples]
        first.__dict__[FEATURES_ATTRIBUTE] = source = _Outputs(adapter, outputs, rows)
        try:
            with ppmedia.stage_media(first, staged):
                spread = [first(ids[a:b], mask[a:b]) for a, b in staged.samples]
        finally:
            del first.__dict__[FEATURES_ATTRIBUTE]
    assert source.takes == [0, 1, 2, 3]
    for k, (x, y) in enumerate(zip(plain, spread)):
        for u, v in zip(x, y):
            if family == "phi4_multimodal":  # last-bit rounding (measured 1.5e-8 on values ~1e-2; cause not pinned down)
                assert torch.allclose(u, v, rtol=0, atol=1e-6), (family, k, float((u - v).abs().max()))
            else:
                assert torch.equal(u, v), (family, k)
    # outputs that do not fit the chunk's placeholders are refused, naming the microbatch
    k = next(iter(outputs))
    wrong = {m: n + 1 for m, n in rows[k].items()}
    first.__dict__[FEATURES_ATTRIBUTE] = _Outputs(adapter, outputs, {**rows, k: wrong})
    try:
        with pytest.raises(ValueError, match=rf"encoder spread, microbatch {k}: the chunk's placeholders"):
            with ppmedia.stage_media(first, staged), torch.no_grad():
                for a, b in staged.samples:
                    first(ids[a:b], mask[a:b])
    finally:
        del first.__dict__[FEATURES_ATTRIBUTE]


def test_qwen3_deepstack_outputs_are_named_per_level(one_thread):
    module = tiny.load("qwen3_vl")
    model = module.build_model(0)
    adapter = ppmedia.get_adapter(model)
    names = adapter.encoder_output_names(model.config, "image")
    assert names == ("image", "image.deepstack_0", "image.deepstack_1")  # the tiny tower: 2 levels
    batch = dict(module.build_batch(0))
    staged = ppmedia.split_media(dict(batch), 4, **adapter.media_counts(batch, model.config))
    a, b = staged.samples[0]
    _, host = adapter.check_counts(batch["input_ids"][a:b], staged.chunk(0), model.config)
    outputs = adapter.encoder_outputs(vision_replica(model), staged.chunk(0), host)
    assert set(outputs) == set(names) and all(t.shape == (host.total("image"), 32) for t in outputs.values())


def test_make_pipeline_stages_refuses_an_unknown_encoder_mode():
    model = tiny.load("qwen2_5_vl").build_model(0)
    with pytest.raises(ValueError, match="encoder: got 'everywhere'; expected one of stage0, spread"):
        pipeline.make_pipeline_stages(model, 2, [0], encoder="everywhere")
    with pytest.raises(ValueError, match="these stages have no encoder spread"):
        pipeline.encoder_spread_of(build_stage_modules(model, 2, stages=[0]))


def test_a_rank_without_stage_0_needs_the_full_model_with_real_tensors():
    """Its copy of the vision side is cut from the model: prebuilt stage modules (stages_from_pretrained)
    and a model on the meta device are refused, before any process group is touched."""
    import types

    from ppmedia.pipeline.rank_stages import _attach_spread

    module = tiny.load("qwen2_5_vl")
    model = module.build_model(0)
    modules = build_stage_modules(model, 2, stages=[1])
    not_first = [types.SimpleNamespace(is_first=False)]
    with pytest.raises(TypeError, match=r"holds stages \[1\] as prebuilt StageModule objects.*pass the model"):
        _attach_spread(modules, modules, not_first, None, torch.device("cpu"))
    with torch.device("meta"):
        meta = module.build_model(0)
    with pytest.raises(ValueError, match="the model is on the meta device"):
        _attach_spread(meta, build_stage_modules(meta, 2, stages=[1]), not_first, None, torch.device("cpu"))


# ----------------------------------------------------------------------------------------------
# the step model


MULTI = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@pytest.mark.parametrize("schedule", MULTI)
def test_schedule_actions_are_torchs_own_pipeline_order(schedule):
    import types

    from torch.distributed.pipelining import schedules

    layout = pipeline.schedule_layout(schedule)
    stage = [types.SimpleNamespace(stage_index=i, num_stages=4, group_rank=0, group_size=2, submod=None)
             for i in layout.stage_indices(0, 2)]
    order = schedules.get_schedule_class(layout.name)(stage, 4, loss_fn=None, scale_grads=False).pipeline_order
    for rank in range(2):
        expected = []
        for action in order[rank]:
            for a in (action.sub_actions or [action]) if action is not None else []:
                if a.computation_type.value in "FBIW":
                    expected.append((a.stage_index, a.computation_type.value, a.microbatch_index))
        assert schedule_actions(schedule, 2, 4)[rank] == expected
    assert {k for r in schedule_actions(schedule, 2, 4) for _, k, _ in r} <= set("FBIW")


def test_single_stage_orders_and_textbook_step():
    assert schedule_actions("1f1b", 2, 4)[0] == [(0, "F", 0), (0, "F", 1), (0, "B", 0), (0, "F", 2), (0, "B", 1),
                                                  (0, "F", 3), (0, "B", 2), (0, "B", 3)]
    costs = OpCosts(layer_forward=1.0, vision_forward=0.0)
    for schedule in ("gpipe", "1f1b"):  # equal stages: (n + P - 1)(f + b)
        p = predict_step(schedule, costs, [0] * 4, n_ranks=2, layers_per_stage=[1, 1])
        assert p.step_time == pytest.approx(5 * 3.0) and p.bubble == pytest.approx(1 / 5)


@pytest.mark.parametrize("schedule", ("gpipe", "1f1b", "ZBVZeroBubble", "DualPipeV", "Interleaved1F1B"))
def test_predicted_operations_respect_their_dependencies(schedule):
    costs = OpCosts(layer_forward=1.0, vision_forward=0.5, last_forward=0.3, latency=0.2, sync=0.4)
    loads = [2.0, 0.0, 3.0, 1.0]
    layers = [1] * pipeline.schedule_layout(schedule).n_stages(2)
    for encoder in ("stage0", "spread"):
        t = predict_step(schedule, costs, loads, n_ranks=2, layers_per_stage=layers, encoder=encoder).timeline
        end = {(b.kind, b.stage, b.microbatch): b.end for b in t.bars if b.stage >= 0}
        grad = {(b.stage, b.microbatch): b.end for b in t.bars if b.kind in "BI"}
        n_stages = len(layers)
        for rank in range(2):
            lane = t.lane(rank)
            assert all(x.end <= y.start + 1e-9 for x, y in zip(lane, lane[1:]))  # one at a time, in order
            assert [(b.stage, b.kind, b.microbatch) for b in lane if b.stage >= 0] == schedule_actions(schedule, 2, 4)[rank]
        for b in t.bars:
            if b.kind == "F" and b.stage > 0:
                assert b.start >= end[("F", b.stage - 1, b.microbatch)] - 1e-9
            if b.kind in "BI" and b.stage < n_stages - 1:
                assert b.start >= grad[(b.stage + 1, b.microbatch)] - 1e-9
            if b.kind == "V":  # after stage 0's whole backward of its microbatch
                assert b.start >= max(end.get(("B", 0, b.microbatch), 0), end.get(("W", 0, b.microbatch), 0)) - 1e-9
        if encoder == "spread":  # the background lane: later encodes (LE) and every vision backward (LV)
            encoded = sorted(b.microbatch for b in t.bars if b.kind in ("E", "LE", "EI"))  # EI: taken back by stage 0
            assert sorted(set(encoded)) == [0, 2, 3] and {b.microbatch for b in t.bars if b.kind == "LV"} == {0, 2, 3}
            assert "V" not in {b.kind for b in t.bars}
            _assert_lane_fills_idle_time(t, end)


def _assert_lane_fills_idle_time(t, end):
    """A lane's pieces never overlap its rank's own work, its jobs run in order, a backward starts after
    stage 0's backward of its microbatch, and stage 0's forward of a lane-encoded microbatch after it."""
    for rank in range(t.ranks):
        work = [b for b in t.lane(rank)]
        pieces = sorted((b for b in t.bars if b.rank == rank and b.kind in ("LE", "LV")), key=lambda b: b.start)
        for p in pieces:
            assert all(p.end <= w.start + 1e-9 or p.start >= w.end - 1e-9 for w in work), (p, rank)
        assert all(x.end <= y.start + 1e-9 for x, y in zip(pieces, pieces[1:]))
        kinds = [p.kind for p in pieces]
        assert kinds == sorted(kinds)  # every LE before every LV
    for p in t.bars:
        if p.kind == "LV":
            assert p.start >= max(end.get(("B", 0, p.microbatch), 0), end.get(("W", 0, p.microbatch), 0)) - 1e-9
        if p.kind == "LE":
            assert end[("F", 0, p.microbatch)] - 1e-9 >= p.end


def test_without_the_lane_every_encode_comes_first_and_every_backward_after_the_schedule():
    costs = OpCosts(layer_forward=1.0, vision_forward=0.5, last_forward=0.3, latency=0.2, sync=0.4)
    loads = [2.0, 0.0, 3.0, 1.0]
    t = predict_step("1f1b", costs, loads, n_ranks=2, layers_per_stage=[1, 1], encoder="spread", background=False).timeline
    end = {(b.kind, b.stage, b.microbatch): b.end for b in t.bars if b.stage >= 0}
    assert sorted(b.microbatch for b in t.bars if b.kind == "E") == [0, 2, 3]
    assert sorted(b.microbatch for b in t.bars if b.kind == "V") == [0, 2, 3]
    assert not {b.kind for b in t.bars} & {"LE", "LV"}
    for b in t.bars:
        if b.kind == "V":
            assert b.start >= end[("B", 0, b.microbatch)] - 1e-9
    lane = predict_step("1f1b", costs, loads, n_ranks=2, layers_per_stage=[1, 1], encoder="spread").step_time
    assert lane < t.step_time  # the lane fills the schedule's idle time


def test_the_replay_runs_a_lane_only_while_its_rank_idles():
    from ppmedia.planning.replay import Op, lane_done, replay

    # rank 0: A (0-2), then B once rank 1's C (0-5) is done, then the join; its lane's job (cost 4)
    # is ready when A ends
    ranks = [[Op(0, "F", 0, 0, 2.0, [], [(("a",), 0.0)]), Op(0, "F", 0, 1, 2.0, [(("c",), 0.0)]),
              Op(0, "J", -1, -1, 0.0, [(lane_done(0), 0.0)])],
             [Op(1, "F", 1, 0, 5.0, [], [(("c",), 0.0)])]]
    lanes = [[Op(0, "LV", -1, 7, 4.0, [(("a",), 0.0)])], []]
    t = replay(ranks, "t", "s", lanes)
    pieces = [(b.start, b.end) for b in t.bars if b.kind == "LV"]
    assert pieces == [(2.0, 5.0), (7.0, 8.0)]  # in the gap 2-5 (preempted by B 5-7), then the rest
    assert t.step_time == pytest.approx(8.0)
    with pytest.raises(RuntimeError, match="deadlocked"):
        replay([[Op(0, "F", 0, 0, 1.0, [(("never",), 0.0)])]], "stuck", "s")


def test_the_spread_beats_stage_0_when_vision_is_heavy_and_not_when_it_is_small():
    loads = [1.0] * 4
    heavy = OpCosts(layer_forward=1.0, vision_forward=2.0, latency=0.05, sync=0.3)
    small = OpCosts(layer_forward=1.0, vision_forward=0.05, latency=0.05, sync=0.3)
    ratio = {}
    for name, costs in (("heavy", heavy), ("small", small)):
        options, best = compare_placements("1f1b", costs, loads, n_ranks=2, num_layers=4)
        ratio[name] = options[2].step_time / options[0].step_time
        assert options[1].step_time <= options[0].step_time + 1e-9  # the best split is never worse
    assert ratio["heavy"] < 0.85 and ratio["small"] > 0.97  # a small tower: nothing to gain


def test_best_layer_split_is_the_brute_force_optimum_and_the_local_search_gets_close():
    costs = OpCosts(layer_forward=1.0, vision_forward=1.0, first_forward=0.2, last_forward=1.5, latency=0.1)
    loads = [3.0, 1.0, 0.0, 2.0]
    best = best_layer_split("1f1b", costs, loads, n_ranks=3, num_layers=7)
    every = [predict_step("1f1b", costs, loads, n_ranks=3, layers_per_stage=list(c)).step_time
             for c in itertools.product(range(8), repeat=3) if sum(c) == 7]
    assert best.step_time == pytest.approx(min(every))
    searched = best_layer_split("1f1b", costs, loads, n_ranks=3, num_layers=7, limit=1)
    assert searched.step_time <= 1.05 * min(every)


def test_op_costs_refuse_bad_values_and_round_trip():
    with pytest.raises(ValueError, match=r"OpCosts.latency: got -1"):
        OpCosts(layer_forward=1.0, vision_forward=1.0, latency=-1)
    costs = OpCosts(layer_forward=1.0, vision_forward=2.0, sync=0.5, unit="s")
    assert OpCosts.from_dict(json.loads(json.dumps(costs.to_dict()))) == costs
    with pytest.raises(ValueError, match=r"unknown fields \['layers'\]"):
        OpCosts.from_dict({"layer_forward": 1.0, "vision_forward": 1.0, "layers": 3})
    config = tiny.load("qwen2_5_vl").build_config()
    flops = OpCosts.from_config(config, 2, 28)
    assert flops.layer_forward > 0 and flops.last_forward > 0 and flops.unit == "GFLOP"


def test_layers_per_stage_auto_takes_the_step_models_best_split(one_thread):
    module = tiny.load("qwen2_5_vl")
    model = module.build_model(0)
    batch = module.build_batch(0)
    costs = OpCosts(layer_forward=1.0, vision_forward=1.0, unit="s")  # vision heavy: fewer layers on stage 0
    request = AutoSplit(batch, 4, "1f1b", costs)
    stages = build_stage_modules(model, 2, layers_per_stage="auto", auto_split=request)
    from ppmedia.cli.plan import plan_batch

    loads = plan_batch(dict(batch), 4, ppmedia.get_adapter(model), model.config)["loads"]
    best = best_layer_split("1f1b", costs, loads, n_ranks=2, num_layers=2)
    assert [s.num_layers for s in stages] == best.layers_per_stage == [0, 2]
    assert "input_ids" in batch and "pixel_values" in batch  # the request's batch is not modified
    with pytest.raises(TypeError, match="needs auto_split=ppmedia.planning.stepmodel.AutoSplit"):
        build_stage_modules(model, 2, layers_per_stage="auto")
    with pytest.raises(ValueError, match="expected a list of counts or 'auto'"):
        build_stage_modules(model, 2, layers_per_stage="best", auto_split=request)

    class FixedSplit:  # any LayerSplitRequest: the cutter asks it, it never imports the step model
        def split_layers(self, config, n_stages, adapter=None, num_layers=None):
            assert (n_stages, num_layers) == (2, 2) and adapter is not None
            return [2, 0]

    assert [s.num_layers for s in build_stage_modules(model, 2, layers_per_stage="auto", auto_split=FixedSplit())] == [2, 0]


# ----------------------------------------------------------------------------------------------
# timelines


def _lanes(svg: str) -> dict[int, list[tuple[int, str, int]]]:
    """Per rank of the first panel, its bars' (stage, kind, microbatch) in data-seq order."""
    root = ET.fromstring(svg)  # well-formed XML, or this raises
    panel = next(root.iter(f"{SVG}g"))
    lanes: dict[int, list[tuple[int, tuple[int, str, int]]]] = {}
    for rect in panel.iter(f"{SVG}rect"):
        if rect.get("class") == "bar":
            lanes.setdefault(int(rect.get("data-rank")), []).append(
                (int(rect.get("data-seq")), (int(rect.get("data-stage")), rect.get("data-kind"), int(rect.get("data-mb")))))
    return {r: [bar for _, bar in sorted(items)] for r, items in lanes.items()}


@pytest.mark.parametrize("schedule", ("1f1b", "ZBVZeroBubble", "DualPipeV"))
def test_predicted_svg_is_well_formed_and_its_bars_follow_the_schedules_order(schedule):
    costs = OpCosts(layer_forward=1.0, vision_forward=1.0, latency=0.1, sync=0.2)
    layers = [1] * pipeline.schedule_layout(schedule).n_stages(2)
    for encoder in ("stage0", "spread"):
        t = predict_step(schedule, costs, [1, 0, 2, 1], n_ranks=2, layers_per_stage=layers, encoder=encoder).timeline
        svg = render_svg([[t, t]], title="a <title> & more")
        lanes = _lanes(svg)
        for rank in range(2):
            compute = [bar for bar in lanes[rank] if bar[0] >= 0]
            assert compute == schedule_actions(schedule, 2, 4)[rank]
        if encoder == "spread":  # the first encodes before the schedule; the lane's work is drawn as overlays
            mine = [m for m, o in enumerate(interleave_encoders([1, 0, 2, 1], 2)) if o == 0 and m != 1]
            kinds = [k for _, k, _ in lanes[0]]
            assert kinds[: kinds.index("F")] == ["E"] * encoded_ahead(len(mine), AHEAD) and "V" not in kinds
            others = [k for _, k, _ in lanes[1]]  # the copy waits for the weights first, reduces last
            assert others[0] == "S" and others[-1] == "R"
            root = ET.fromstring(svg)
            overlays = {r.get("data-kind") for r in root.iter(f"{SVG}rect") if r.get("class") == "overlay"}
            assert "LV" in overlays


def test_timeline_bubbles_and_units():
    t = Timeline("x", 2, [Bar(0, "F", 0.0, 1.0, 0, 0), Bar(1, "F", 1.0, 2.0, 1, 0), Bar(0, "wait", 0.2, 0.4, 0, 0)])
    assert t.step_time == 2.0 and t.bubbles(0) == [(1.0, 2.0)] and t.bubbles(1) == [(0.0, 1.0)]
    assert t.bubble == pytest.approx(0.5)
    with pytest.raises(ValueError, match="different units"):
        render_svg([[t, Timeline("y", 1, [], unit="GFLOP")]])


# ----------------------------------------------------------------------------------------------
# ppmedia plan


def test_plan_prints_the_placements_recommends_one_and_draws_them(capsys, tmp_path):
    from ppmedia.cli import main

    fixture = ROOT / "fixtures/qwen2_5_vl/inputs.safetensors"
    svg = tmp_path / "plan.svg"
    assert main(["plan", str(fixture), "--microbatches", "4", "--stages", "2", "--timeline", str(svg)]) == 0
    out = capsys.readouterr().out
    for label in ("(a) vision on stage 0, uniform split", "(b) vision on stage 0, best static split",
                  "(c) encoder spread, uniform split", "(d) encoder spread, best split"):
        assert label in out
    assert "recommended for 1f1b: (" in out
    lanes = _lanes(svg.read_text())
    assert [b for b in lanes[0] if b[0] >= 0] == schedule_actions("1f1b", 2, 4)[0]
    costs = tmp_path / "costs.json"  # calibrated per-operation costs, in seconds
    costs.write_text(json.dumps(OpCosts(layer_forward=0.004, vision_forward=0.00003, latency=0.0005, sync=0.002,
                                        unit="s").to_dict()))
    assert main(["plan", str(fixture), "--microbatches", "4", "--stages", "2", "--schedule", "zbvzerobubble",
                 "--calibration", str(costs)]) == 0
    out = capsys.readouterr().out
    assert "vision placement, ZBVZeroBubble on 2 ranks (2 decoder layers; calibrated)" in out and "step (ms)" in out
    assert main(["plan", str(fixture), "--microbatches", "4", "--stages", "2", "--schedule", "zigzag"]) == 2
    assert "argument --schedule: got 'zigzag'" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# examples/train.py --encoder spread --trace, under torchrun


def documented_spread_lines() -> list[str]:
    """docs/encoder-spread.md's "Use it" command (tests/test_docs.py leaves it to the test below)."""
    from test_docs import command_lines, read_blocks, section

    text = DOC.read_text()
    (block,) = [b for b in read_blocks(DOC, section(text, "Use it")) if b.lang == "bash"]
    return command_lines(block)


@pytest.mark.multiprocess
def test_train_script_with_the_spread_matches_the_model_and_traces_the_schedules_order(tmp_path):
    """docs/encoder-spread.md's command as written (a user's shell, from a sandbox of the repository):
    2 steps of ZBVZeroBubble with the spread, its loss log and its trace."""
    from test_docs import command_key, run_documented

    (line,) = documented_spread_lines()
    assert "--schedule ZBVZeroBubble --microbatches 4 --steps 2 --encoder spread" in command_key(line), line
    run_documented(f"{DOC.name}: Use it", [line], tmp_path)
    log, svg = tmp_path / "loss.jsonl", tmp_path / "step.svg"
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    # the model itself, one process, the same two batches, AdamW after clipping to norm 1
    own = model_adamw_run("qwen2_5_vl", [step % 2 for step in range(len(losses))], clip=1.0).losses
    assert len(losses) == 2 and max(abs(a - b) for a, b in zip(losses, own)) <= 1e-5, (losses, own)
    lanes = _lanes(svg.read_text())  # the measured bars: each rank's actions in torch's own order
    for rank in range(2):
        assert [b for b in lanes[rank] if b[0] >= 0] == schedule_actions("ZBVZeroBubble", 2, 4)[rank]
        assert any(kind == "E" for _, kind, _ in lanes[rank])  # its first encode before the schedule
    overlays = [(int(r.get("data-rank")), r.get("data-kind")) for r in ET.fromstring(svg.read_text()).iter(f"{SVG}rect")
                if r.get("class") == "overlay"]
    assert {(0, "LV"), (1, "LV")} <= set(overlays)  # each rank's vision backwards ran on its background lane


# ----------------------------------------------------------------------------------------------
# docs/encoder-spread.md


DOC = ROOT / "docs" / "encoder-spread.md"


def _blocks(kind: str) -> list[str]:
    import re

    return re.findall(rf"```{kind}\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_docs_python_blocks_run_and_print_the_quoted_table(capsys):
    blocks = _blocks("python")
    assert blocks, "docs/encoder-spread.md has python blocks"
    for code in blocks:
        exec(compile(code, str(DOC), "exec"), {"__name__": "docs"})  # self-contained, each on its own
    printed = capsys.readouterr().out.strip()
    assert printed and printed in DOC.read_text(), "the table in the page is the one its block prints"


def test_the_docs_commands_work(capsys, monkeypatch, tmp_path):
    import re
    import shlex

    from ppmedia.cli import main
    from ppmedia.testing.parity import parse_scenarios

    train = train_script()
    lines = [line for block in _blocks("bash") for line in block.replace("\\\n", " ").strip().splitlines()]
    assert any(line.startswith("torchrun ") for line in lines) and any(line.startswith("ppmedia plan ") for line in lines)
    monkeypatch.chdir(ROOT)
    for line in lines:
        words = shlex.split(line)
        if words[0] == "torchrun":
            args = train.parse_args(words[words.index("examples/train.py") + 1:])
            assert args.encoder == "spread" and args.trace
        elif words[:2] == ["ppmedia", "plan"]:
            words[words.index("--timeline") + 1] = str(tmp_path / "plan.svg")
            assert main(words[1:]) == 0
            out = capsys.readouterr().out
            ET.parse(tmp_path / "plan.svg")
            quoted = re.search(r"it\s+predicts(.*?)`layers_per_stage", DOC.read_text(), flags=re.S).group(1)
            for figure in re.findall(r"\d\.\d{3}", quoted):  # every figure quoted for the fixture is printed
                assert figure in out, figure
    run = re.search(r"`python -m ppmedia.testing.parity ([^`]+)`", DOC.read_text()).group(1).split()
    assert run[0] in tiny.FAMILIES
    assert [s.encoder for s in parse_scenarios(run[2::2])] == ["spread", "spread"]


# ----------------------------------------------------------------------------------------------
# the background lane


def test_interleave_encoders_goes_round_robin_and_balances_costs():
    assert interleave_encoders([1, 1, 1, 1], 2) == [0, 1, 0, 1]
    assert interleave_encoders([1.0] * 8, 4) == [0, 1, 2, 3, 0, 1, 2, 3]
    assert interleave_encoders([3, 1, 1, 1], 2) == [0, 1, 1, 1]  # the heavy one's rank waits its turn
    assert interleave_encoders([1, 0, 1, 1], 2) == [0, 0, 1, 0]  # text-only microbatches cost nothing
    assert interleave_encoders([0, 0], 2) == [0, 0] and interleave_encoders([5], 4) == [0]
    assert interleave_encoders([1.0] * 8, 2, weights=[1, 3]) == [0, 1, 1, 1, 0, 1, 1, 1]
    for costs in itertools.product([0, 1, 2, 5], repeat=5):  # greedy: no rank more than one job over the rest
        owners = interleave_encoders(list(costs), 2)
        loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in (0, 1)]
        assert abs(loads[0] - loads[1]) <= max(costs)
    with pytest.raises(ValueError, match="expected costs >= 0"):
        interleave_encoders([1, -1], 2)
    with pytest.raises(ValueError, match="expected 2 positive shares"):
        interleave_encoders([1, 1], 2, weights=[1, 0])
    assert [encoded_ahead(n, 0.5) for n in range(5)] == [0, 1, 1, 2, 2]
    assert encoded_ahead(4, 0.0) == 1 and encoded_ahead(4, 1.0) == 4
    with pytest.raises(ValueError, match="ahead: got 1.5; expected a share 0..1"):
        encoded_ahead(4, 1.5)


def test_a_lane_runs_its_jobs_in_order_at_the_lowest_priority_and_hands_back_errors():
    import threading

    from ppmedia.pipeline.lane import Lane

    ran, gate = [], threading.Event()
    lane = Lane([(gate.wait, lambda: ran.append(("a", threading.current_thread().name))),
                 (lambda: None, lambda: ran.append(("b", torch.get_num_threads())))], name="t-lane")
    assert ran == []  # the first job waits for its input
    gate.set()
    lane.join()
    assert ran == [("a", "t-lane"), ("b", torch.get_num_threads())]  # the caller's thread count, not every core
    assert lane.priority in ("idle", "nice", "none")
    seen = []
    failing = Lane([(lambda: None, lambda: 1 / 0), (lambda: None, lambda: seen.append("never"))],
                   on_error=lambda e: seen.append(type(e).__name__))
    with pytest.raises(ZeroDivisionError):
        failing.join()
    assert seen == ["ZeroDivisionError"]  # on_error ran; the later job did not
    here = []
    Lane([(lambda: None, lambda: here.append(threading.current_thread().name))], background=False).join()
    assert here == [threading.current_thread().name]  # background=False: the caller runs the jobs
    gate2 = threading.Event()
    cancelled = Lane([(gate2.wait, lambda: here.append("late"))])
    cancelled.cancel()
    gate2.set()
    cancelled._thread.join(5)
    assert "late" not in here


def _policy() -> tuple[int, int]:
    import os
    import threading

    tid = threading.get_native_id()
    return os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)


def test_a_boosted_lane_runs_its_current_job_at_the_normal_priority_and_drops_back_after_it():
    import os
    import threading

    from ppmedia.pipeline.lane import Lane

    started, release, seen = threading.Event(), threading.Event(), []

    def job() -> None:
        seen.append(("before", _policy()))
        started.set()
        release.wait(5)
        seen.append(("during", _policy()))

    lane = Lane([(lambda: None, job), (lambda: None, lambda: seen.append(("next", _policy())))])
    assert started.wait(5)
    done = threading.Event()
    done.set()
    assert not lane.boost(unless=done)  # the awaited job has ended: the one running now keeps its priority
    boosted = lane.boost(unless=threading.Event())
    assert not lane.boost()  # once per job
    release.set()
    lane.join()
    low = {"idle": (os.SCHED_IDLE, 0), "nice": (os.SCHED_OTHER, 19)}.get(lane.priority)
    if low is None or not boosted:  # neither low priority granted, or raising it back refused: nothing to see
        pytest.skip(f"this machine granted the lane priority {lane.priority!r} and boost() {boosted}")
    assert seen == [("before", low), ("during", (os.SCHED_OTHER, 0)), ("next", low)], seen
    assert lane.boosts == 1
    assert not Lane([(lambda: None, lambda: None)], background=False).boost()  # no thread: nothing to raise


def test_the_spread_refuses_a_bad_ahead_share():
    with pytest.raises(ValueError, match="ahead: got -0.1"):
        pipeline.encoder.EncoderSpread.__init__(object.__new__(pipeline.encoder.EncoderSpread), torch.nn.Linear(1, 1),
                                               None, ahead=-0.1)
