"""Sequence packing (ppmedia.packing): the row plan, the packed batch, and exactness on the stages."""

import pytest
import torch

from ppmedia.packing import enable_packing, pack_samples, packing_problem, plan_rows, sample_positions
from ppmedia.pipeline import make_labels
from ppmedia.pipeline.loss import IGNORE_INDEX, SHIFTED_MARK

pytestmark = pytest.mark.usefixtures("one_thread")


def test_plan_rows_first_fit_decreasing_every_sample_once():
    rows = plan_rows([5, 3, 7, 2, 4], 8)
    assert rows == [[2], [0, 1], [3, 4]]
    assert sorted(i for r in rows for i in r) == list(range(5))


def test_plan_rows_orders_by_cost_and_makes_a_multiple():
    # rows [2] (cost 5), [0, 1] (1), [3, 4] (2): heavy, light, middle
    assert plan_rows([5, 3, 7, 2, 4], 8, [1, 0, 5, 0, 2]) == [[2], [0, 1], [3, 4]]
    rows = plan_rows([5, 3, 7, 2, 4], 8, [1, 0, 5, 0, 2], n_microbatches=2, multiple_of=2)
    assert len(rows) == 4 and sorted(i for r in rows for i in r) == list(range(5))
    loads = [sum([1, 0, 5, 0, 2][i] for r in rows[k:k + 2] for i in r) for k in (0, 2)]
    assert sorted(loads) == [3, 5]  # {5, 0} and {1, 2}: the best split of these rows


def test_plan_rows_repacks_into_the_rows_the_multiple_adds():
    """First-fit decreasing into 128 gives 3 rows (113, 88, 51 tokens); 2 microbatches need 4: the
    samples are packed again into 4 rows of at most 71 tokens (the old split left 113: S 113 -> 71)."""
    lengths = [46, 29, 26, 25, 33, 34, 27, 32]
    rows = plan_rows(lengths, 128, multiple_of=2)
    assert len(rows) == 4 and sorted(i for r in rows for i in r) == list(range(8))
    assert max(sum(lengths[i] for i in r) for r in rows) == 71
    assert plan_rows([5, 3, 7, 2, 4], 8) == [[2], [0, 1], [3, 4]]  # no row added: first-fit decreasing as it was


def test_plan_rows_names_a_sample_too_long():
    with pytest.raises(ValueError, match=r"sample 1 has 9 tokens, over max_length=8"):
        plan_rows([3, 9], 8)


def _sample(ids, image=None):
    ids = torch.tensor([ids])
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[0, :-1] = ids[0, 1:]
    labels[0, -1] = SHIFTED_MARK
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    if image is not None:
        out["pixel_values"] = image
    return out


def test_pack_samples_rows_labels_media_positions():
    a, b, c = _sample([11, 12, 13], torch.zeros(1, 2)), _sample([21, 22]), _sample([31, 32, 33, 34], torch.ones(2, 2))
    batch = pack_samples([a, b, c], [[0, 1], [2]], pad_id=0, max_length=6)
    assert batch["input_ids"].tolist() == [[11, 12, 13, 21, 22, 0], [31, 32, 33, 34, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0]]
    # no label crosses a boundary: 13 -> 21 is not a target; the row's last column is the mark
    assert batch["labels"].tolist() == [[12, 13, -100, 22, -100, SHIFTED_MARK], [32, 33, 34, -100, -100, SHIFTED_MARK]]
    assert batch["pixel_values"].tolist() == [[0, 0], [1, 1], [1, 1]]
    assert sample_positions(batch["attention_mask"]).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]
    with pytest.raises(ValueError, match=r"sample 1 is also in row 0"):
        pack_samples([a, b, c], [[0, 1], [1, 2]], pad_id=0)
    with pytest.raises(ValueError, match=r"samples \[2\] are in no row"):
        pack_samples([a, b, c], [[0, 1]], pad_id=0)


def test_make_labels_ignores_packed_boundaries():
    ids = torch.tensor([[11, 12, 13, 21, 22, 0]])
    mask = torch.tensor([[1, 1, 1, 2, 2, 0]])
    assert make_labels(ids, None, _NoMedia(), pad_id=0, attention_mask=mask).tolist() == [[12, 13, -100, 22, -100, SHIFTED_MARK]]


class _NoMedia:
    def placeholder_masks(self, input_ids, config):
        return {}


# -- exactness in one process: the packed rows through the stages give the unpacked loss and gradients --


def _step(stages, batch, config):
    from ppmedia.pipeline import pipeline_loss, presplit_batch

    inputs = presplit_batch(dict(batch), 1, config)
    for stage in stages:
        stage.zero_grad(set_to_none=True)
    out = stages[0](*inputs.arg_mbs[0], **inputs.kwarg_mbs[0])
    for stage in stages[1:]:
        out = stage(*out)
    loss = pipeline_loss(out, inputs.target_mbs[0], **inputs.loss_kwargs)
    loss.backward()
    grads = {n: p.grad.clone() for s in stages for n, p in s.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads, inputs.loss_kwargs["num_valid_tokens"]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3", "kimi_vl", "kimi_k25_video", "phi4_multimodal"])
def test_packed_forward_equals_the_unpacked_one(family):
    """Two samples a row (Qwen2.5-VL: mrope per sample; Gemma 3: image blocks and sliding windows;
    Kimi-VL, Kimi-K2.5 and Phi-4-multimodal: the families examples/train.py cannot train, see
    tests/test_pack_data.py's STAGES_ONLY): loss and every gradient within 1e-5 of the unpacked batch
    through the same two stages; with the stages not told (no isolation, positions over the row) the
    loss is off by over 50 times that (Kimi-VL's by 7.6e-4, the least)."""
    from ppmedia.pipeline import build_stage_modules
    from ppmedia.testing import tiny_models
    from ppmedia.testing.packed import in_order_rows, pack_batch

    tiny = tiny_models.load(family)
    model = tiny.build_model(seed=0)
    batch = tiny.build_batch(seed=0)
    stages = build_stage_modules(model, 2)
    loss, grads, valid = _step(stages, batch, model.config)
    packed = pack_batch(batch, in_order_rows(8, 2), model.config.get_text_config().pad_token_id or 0)
    assert packed["input_ids"].shape[0] == 4
    wrong, _, _ = _step(stages, packed, model.config)
    enable_packing(stages)
    loss_p, grads_p, valid_p = _step(stages, packed, model.config)
    assert valid_p == valid and abs(loss_p - loss) <= 1e-5 and abs(wrong - loss) > 5e-4
    assert grads_p.keys() == grads.keys()
    assert max(float((grads[n] - grads_p[n]).abs().max()) for n in grads) <= 1e-5


def test_families_that_cannot_isolate_are_refused():
    """Qwen3.5's linear-attention layers carry state along the row: refused, naming family and reason."""
    from ppmedia.pipeline import build_stage_modules
    from ppmedia.testing.tiny_models import qwen3_vl

    model = qwen3_vl.build_variant("qwen3_5", seed=0)
    assert "linear_attention" in packing_problem(model.config)
    with pytest.raises(ValueError, match=r"sequence packing refused for qwen3_5 \(qwen3_vl adapter\): decoder layers of type linear_attention"):
        enable_packing(build_stage_modules(model, 2))


def test_sample_costs_and_a_packed_processor_batch():
    """Real Qwen2.5-VL processor outputs, one per sample: costs from the encoder model (a larger image
    costs more, text-only nothing), then FFD rows ordered by them and the packed batch's media in row order."""
    import numpy as np
    from PIL import Image

    import ppmedia
    from ppmedia.packing import sample_costs
    from ppmedia.pipeline import count_valid_tokens
    from ppmedia.testing.processors import build_tiny_processor, chat_batch
    from ppmedia.testing.tiny_models import qwen2_5_vl

    rng = np.random.default_rng(0)
    picture = lambda h, w: ("image", Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))  # noqa: E731
    processor = build_tiny_processor("qwen2_5_vl")
    config = qwen2_5_vl.build_config()
    samples = [dict(chat_batch(processor, [parts], seed=i)) for i, parts in enumerate([[2, picture(16, 16)], [4], [1, picture(32, 32)]])]
    for s in samples:
        s["labels"] = make_labels(s["input_ids"], config, attention_mask=s["attention_mask"])
    costs = sample_costs(samples, config)
    assert costs[1] == 0 and 0 < costs[0] < costs[2]
    lengths = [s["input_ids"].shape[1] for s in samples]
    rows = plan_rows(lengths, max(lengths) + min(lengths), costs)
    batch = pack_samples(samples, rows, pad_id=0, max_length=max(lengths) + min(lengths))
    order = [i for row in rows for i in row]
    with_image = [i for i in order if "pixel_values" in samples[i]]
    assert torch.equal(batch["image_grid_thw"], torch.cat([samples[i]["image_grid_thw"] for i in with_image]))
    assert torch.equal(batch["pixel_values"], torch.cat([samples[i]["pixel_values"] for i in with_image]))
    adapter = ppmedia.get_adapter(config)
    assert adapter.media_per_sample(batch["input_ids"], config)[0].sum() == 2
    assert count_valid_tokens(batch["labels"]) == sum(count_valid_tokens(s["labels"]) for s in samples)
