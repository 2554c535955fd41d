"""Pre-split microbatches (``ppmedia.microbatch_inputs``, ``pipeline.presplit_batch``): what each
microbatch's inputs hold, the stage's ``media`` keyword, and one process's interleaved and V-shaped
pipelines (two stages on the rank, both given the keyword) against the staging path, gradient by
gradient. The multi-process runs are in ``tests/test_stack_mp.py`` (scenario token ``/presplit``)."""

from __future__ import annotations

import copy

import pytest
import torch

import ppmedia
from ppmedia import pipeline
from ppmedia.testing.tiny_models import paligemma, qwen2_5_vl

pytestmark = pytest.mark.usefixtures("one_thread")


def _split(tiny, seed=0, n=4):
    batch = tiny.build_batch(seed)
    config = tiny.build_config()
    adapter = ppmedia.get_adapter(config)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    whole = dict(batch)
    staged = ppmedia.split_media(batch, n, **adapter.media_counts(batch, config))
    return whole, ids, mask, staged, config, adapter


def test_each_microbatch_gets_its_rows_and_its_own_chunk_as_views_without_host_reads():
    whole, ids, mask, staged, config, adapter = _split(qwen2_5_vl)
    labels = pipeline.make_labels(ids, config, adapter, attention_mask=mask)
    with ppmedia.HostReadCounter() as reads:
        inputs = ppmedia.microbatch_inputs(staged, ids, mask, target=labels, loss_kwargs={"num_valid_tokens": 7})
    assert reads.total == 0
    assert len(inputs) == 4 and inputs.loss_kwargs == {"num_valid_tokens": 7}
    for k, (rows, (a, b)) in enumerate(zip(torch.tensor_split(torch.arange(ids.shape[0]), 4), staged.samples)):
        mb_ids, mb_mask = inputs.arg_mbs[k]
        assert (a, b) == (int(rows[0]), int(rows[-1]) + 1)
        assert torch.equal(mb_ids, ids[a:b]) and mb_ids.data_ptr() == ids[a:b].data_ptr()  # a view
        assert torch.equal(mb_mask, mask[a:b]) and inputs.target_mbs[k].data_ptr() == labels[a:b].data_ptr()
        media = inputs.kwarg_mbs[k][ppmedia.MEDIA_KWARG]
        assert isinstance(media, ppmedia.MicrobatchMedia) and media.index == k
        if k == 2:  # the tiny batch's text-only microbatch
            assert media.chunk is None
            continue
        assert media.chunk.pixel_values is staged.chunks["pixel_values"][k]  # the split's own view
        assert media.chunk.pixel_values.untyped_storage().data_ptr() == whole["pixel_values"].untyped_storage().data_ptr()
    assert set(inputs.step_kwargs()) == {"arg_mbs", "kwarg_mbs", "target_mbs", "loss_kwargs"}
    assert set(ppmedia.microbatch_inputs(staged, ids, mask).step_kwargs()) == {"arg_mbs", "kwarg_mbs"}


def test_per_sample_inputs_travel_with_their_microbatch():
    """PaliGemma's ``token_type_ids`` (a ``SampleInput``): microbatch k's rows, also when it has no media."""
    whole, ids, mask, staged, _, _ = _split(paligemma)
    inputs = ppmedia.microbatch_inputs(staged, ids, mask)
    for k, (a, b) in enumerate(staged.samples):
        chunk = inputs.kwarg_mbs[k]["media"].chunk
        assert torch.equal(chunk.extras["token_type_ids"], whole["token_type_ids"][a:b])
        assert (chunk.pixel_values is None) == (k == 2)


def test_a_pipeline_batch_and_bad_inputs():
    config = qwen2_5_vl.build_config()
    adapter = ppmedia.get_adapter(config)
    batch = ppmedia.collate_for_pipeline(lambda samples: samples[0], 4, adapter=adapter, config=config)([qwen2_5_vl.build_batch(0)])
    inputs = ppmedia.microbatch_inputs(batch)  # the text rows from batch.text
    assert inputs.arg_mbs[1][0].data_ptr() == batch.text["input_ids"][batch.media.samples[1][0]:].data_ptr()
    ids = batch.text["input_ids"]
    with pytest.raises(ValueError, match=r"input_ids has 4 rows on dim 0; the media were split for a batch of 8"):
        ppmedia.microbatch_inputs(batch.media, ids[:4], ids[:4])
    with pytest.raises(TypeError, match=r"media is a dict; expected ppmedia.StagedMedia"):
        ppmedia.microbatch_inputs({"input_ids": ids}, ids, ids)
    with pytest.raises(TypeError, match="attention_mask is missing"):
        ppmedia.microbatch_inputs(batch.media, ids)
    with pytest.raises(ValueError, match="split into 4 microbatches; expected n_microbatches=2"):
        pipeline.presplit_batch(batch, 2, config)


def test_presplit_batch_is_the_manual_path_in_one_call():
    config = qwen2_5_vl.build_config()
    adapter = ppmedia.get_adapter(config)
    batch = qwen2_5_vl.build_batch(0)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    labels = pipeline.make_labels(ids, config, adapter, attention_mask=mask)
    inputs = pipeline.presplit_batch(batch, 4, config)
    assert "pixel_values" not in batch  # popped, as split_media does
    assert inputs.loss_kwargs == {"num_valid_tokens": pipeline.count_valid_tokens(labels)}
    assert torch.equal(torch.cat(inputs.target_mbs), labels)
    assert pipeline.presplit_batch(qwen2_5_vl.build_batch(0), 4, config, num_valid_tokens=99).loss_kwargs == {
        "num_valid_tokens": 99}


def test_the_stage_takes_its_media_keyword_and_later_stages_ignore_it():
    whole, ids, mask, staged, config, adapter = _split(qwen2_5_vl)
    model = qwen2_5_vl.build_model(seed=0)
    first, second = pipeline.build_stage_modules(model, 2)
    media = ppmedia.microbatch_inputs(staged, ids, mask).kwarg_mbs[0]["media"]
    a, b = staged.samples[0]
    with torch.no_grad():
        out = first(ids[a:b], mask[a:b], media=media)
        with ppmedia.stage_media(first, staged):  # the staging path: the same microbatch 0
            ref = first(ids[a:b], mask[a:b])
            with pytest.raises(ValueError, match=r"media= for microbatch 0 \(pre-split\) while media are also staged"):
                first(ids[a:b], mask[a:b], media=media)
            first.__dict__[ppmedia.CURSOR_ATTRIBUTE] = 1  # give back what the refused call did not take
            for k in range(1, 4):
                c, d = staged.samples[k]
                first(ids[c:d], mask[c:d])
        assert all(torch.equal(x, y) for x, y in zip(out, ref))
        later = second(*out, media=media)  # kwargs reach every stage of a rank: ignored here
        assert torch.equal(later, second(*out))
    with pytest.raises(TypeError, match="media is a VlmMediaChunk; expected ppmedia.MicrobatchMedia"):
        first(ids[a:b], mask[a:b], media=media.chunk)


def _run(name, base, presplit, plant=False, steps=2, n=4):
    """Losses and gradients of ``steps`` steps of a one-process pipeline (both stages on this rank)."""
    layout = pipeline.schedule_layout(name)
    stages = pipeline.make_pipeline_stages(copy.deepcopy(base), layout.n_stages(1), layout.stage_indices(0, 1), "cpu")
    schedule = pipeline.build_schedule(name, stages, n)
    first = next(s for s in stages if s.is_first)
    config, out = base.config, []
    for step in range(steps):
        batch = qwen2_5_vl.build_batch(step)
        for st in stages:
            st.submod.zero_grad(set_to_none=True)
        losses = []
        if presplit:
            inputs = pipeline.presplit_batch(batch, n, config)
            if plant:  # the planted bug: every microbatch handed microbatch 0's media
                inputs.kwarg_mbs = [inputs.kwarg_mbs[0]] * n
            schedule.step(**inputs.step_kwargs(), losses=losses)
        else:
            adapter = ppmedia.get_adapter(config)
            ids, mask = batch["input_ids"], batch["attention_mask"]
            labels = pipeline.make_labels(ids, config, adapter, attention_mask=mask)
            staged = ppmedia.split_media(batch, n, **adapter.media_counts(batch, config))
            with ppmedia.stage_media(first, staged):
                schedule.step(ids, mask, target=labels, losses=losses,
                              loss_kwargs={"num_valid_tokens": pipeline.count_valid_tokens(labels)})
        grads = {k: p.grad.clone() for st in stages for k, p in st.submod.named_parameters() if p.grad is not None}
        out.append((float(torch.stack(losses).sum().detach()), grads))
    return out


@pytest.mark.parametrize("name", ["interleaved", "ZBVZeroBubble"])
def test_one_process_two_stages_equal_the_staging_path_gradient_by_gradient(world_of_one, name):
    """Interleaved1F1B and the V-shaped ZBVZeroBubble with both stages on the one rank (stage 1 gets
    the ``media`` keyword too), shapes inferred on the first step: the same loss and the same
    gradient for every parameter as staging (measured: identical); the planted bug (every microbatch
    given microbatch 0's media) is refused by the merge's count check."""
    base = qwen2_5_vl.build_model(seed=0)
    staged, presplit = _run(name, base, False), _run(name, base, True)
    for (loss_a, grads_a), (loss_b, grads_b) in zip(staged, presplit):
        assert abs(loss_a - loss_b) <= 1e-6
        assert grads_a.keys() == grads_b.keys() and len(grads_a) > 20
        assert max(float((grads_a[k] - grads_b[k]).abs().max()) for k in grads_a) <= 1e-7
    if name == "interleaved":
        with pytest.raises(RuntimeError) as failed:
            _run(name, base, True, plant=True, steps=1)
        assert "placeholder" in repr(failed.value.__cause__ or failed.value)


def test_microbatches_of_different_shapes_are_refused(world_of_one):
    base = qwen2_5_vl.build_model(seed=0)
    stages = pipeline.make_pipeline_stages(base, 1, [0], "cpu")
    schedule = pipeline.build_schedule("gpipe", stages, 2)
    inputs = pipeline.presplit_batch(qwen2_5_vl.build_batch(0), 2, base.config)
    ids, mask = inputs.arg_mbs[1]
    inputs.arg_mbs[1] = (ids[:, :-1], mask[:, :-1])
    with pytest.raises(ValueError, match=r"pre-split microbatch 1 has tensors of shapes .*microbatch 0's are"):
        schedule.step(**inputs.step_kwargs())
