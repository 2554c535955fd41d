"""ppmedia.data labels: assistant turns only, token by token against the template's rendering, with
generation markers and without; lengths; the model's own loss equals pipeline_loss on them."""

from __future__ import annotations

import json

import pytest
import torch

import data_fixtures as fx
from ppmedia import data
from ppmedia.pipeline import pipeline_loss
from ppmedia.pipeline.loss import IGNORE_INDEX, SHIFTED_MARK
from ppmedia.testing.processors import save_tiny_processor
from ppmedia.testing.tiny_models import qwen2_5_vl as tiny

pytestmark = pytest.mark.usefixtures("one_thread")

#: the same layout with transformers' generation markers around each reply and its <|im_end|>
MARKED = fx.TEMPLATE.replace(
    "{% if message['content'] is string %}{{ message['content'] }}",
    "{% if message['role'] == 'assistant' %}{% generation %}{% for part in message['content'] %}{{ part['text'] }}"
    "{% endfor %}<|im_end|>{% endgeneration %}\n{% elif message['content'] is string %}{{ message['content'] }}",
).replace("{% endfor %}{% endif %}<|im_end|>\n{% endfor %}", "{% endfor %}{% endif %}{% if message['role'] != 'assistant' %}<|im_end|>\n{% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("labels")
    records = fx.llava_records(str(root), 6)
    records.append({"conversations": [{"from": "system", "value": "w9 w8"}, {"from": "human", "value": "w1"},
                                      {"from": "gpt", "value": ""}]})  # an empty reply
    return {"root": root, "ds": data.open_dataset(fx.write_jsonl(str(root / "train.jsonl"), records)),
            "plain": fx.save_qwen_processor(str(root / "plain")), "marked": fx.save_qwen_processor(str(root / "marked"), MARKED),
            # the testing kit's tiny Qwen2.5-VL processor (its own chatml template, no default system turn)
            "kit": fx.AutoProcessor_from(str(save_tiny_processor("qwen2_5_vl", root / "kit")))}


def expected_targets(tokens):
    """From the rendered tokens alone: after each `<|im_start|> assistant` header, every token up to
    and including the next `<|im_end|>` (the reply and its end of turn)."""
    targets, inside = [False] * len(tokens), False
    for i, t in enumerate(tokens):
        if inside:
            targets[i] = True
            inside = t != "<|im_end|>"
        elif t == "assistant" and i and tokens[i - 1] == "<|im_start|>":
            inside = True
    return targets


@pytest.mark.parametrize("template", ["plain", "marked", "kit"])
def test_labels_are_the_assistant_tokens_token_by_token(world, template):
    processor = world[template]
    assert data.labels.has_generation_markers(processor.chat_template) == (template == "marked")
    proc = data.SampleProcessor(processor, config=tiny.build_config())
    for i in range(len(world["ds"])):
        sample = proc(world["ds"][i])
        ids, labels = sample["input_ids"][0], sample["labels"][0]
        tokens = processor.tokenizer.convert_ids_to_tokens(ids.tolist())
        want = torch.tensor(expected_targets(tokens))
        assert labels[-1] == SHIFTED_MARK
        # shifted: position t holds token t + 1 where t + 1 is an assistant token, else ignored
        assert torch.equal(labels[:-1] != IGNORE_INDEX, want[1:]), (i, tokens)
        assert torch.equal(labels[:-1][want[1:]], ids[1:][want[1:]])
        assert not want[ids == tiny.IMAGE_TOKEN_ID].any()
    empty = proc(world["ds"][6])
    assert empty["labels"][0][empty["labels"][0] >= 0].tolist() == [2]  # only the <|im_end|> of the empty reply


def test_a_planted_off_by_one_is_caught(world):
    # the comparison above fails on labels one token late (the golden test is shown to fail)
    proc = data.SampleProcessor(world["plain"])
    sample = proc(world["ds"][1])
    tokens = world["plain"].tokenizer.convert_ids_to_tokens(sample["input_ids"][0].tolist())
    want = torch.tensor(expected_targets(tokens))
    late = torch.roll(sample["labels"][0][:-1] != IGNORE_INDEX, 1)
    assert not torch.equal(late, want[1:])


@pytest.mark.parametrize("template", ["plain", "kit"])
def test_model_loss_equals_pipeline_loss_on_the_labels(world, template):
    model = tiny.build_model(0)
    proc = data.SampleProcessor(world[template])
    batch = data.collate_samples([proc(world["ds"][i]) for i in range(len(world["ds"]))], proc.pad_id)
    labels = batch["labels"]
    unshifted = torch.full_like(labels, IGNORE_INDEX)
    unshifted[:, 1:] = labels[:, :-1]
    unshifted[unshifted == SHIFTED_MARK] = IGNORE_INDEX
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        out = model(**inputs, labels=unshifted, use_cache=False)
        ours = pipeline_loss(out.logits, labels, data.global_label_tokens({"n_label_tokens": int((labels >= 0).sum())}))
    torch.testing.assert_close(ours, out.loss, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="not marked"):  # transformers' form is refused
        pipeline_loss(out.logits, unshifted)


def test_no_label_tokens_gives_zero_not_nan():
    logits = torch.randn(2, 5, 128)
    labels = torch.full((2, 5), IGNORE_INDEX)
    labels[:, -1] = SHIFTED_MARK
    assert float(pipeline_loss(logits, labels, 0)) == 0.0 and float(pipeline_loss(logits, labels)) == 0.0


def test_lengths_never_cut_through_media(world, tmp_path):
    config = tiny.build_config()
    record = world["ds"][2]  # two images, then text
    full = data.SampleProcessor(world["plain"], config=config)(record)
    n = full["input_ids"].shape[1]
    last_media = int((full["mm_token_type_ids"][0] > 0).nonzero().max())
    # too long, skipped by default
    with pytest.raises(data.TooLong, match=f"{n} tokens, over max_length={n - 1}"):
        data.SampleProcessor(world["plain"], max_length=n - 1, config=config)(record)
    # truncated where no media token is lost: the labels stay aligned and marked
    cut = data.SampleProcessor(world["plain"], max_length=last_media + 3, config=config, truncate=True)(record)
    assert cut["input_ids"].shape == (1, last_media + 3) and cut["labels"][0, -1] == SHIFTED_MARK
    assert torch.equal(cut["input_ids"], full["input_ids"][:, : last_media + 3])
    assert torch.equal(cut["labels"][0, :-1], full["labels"][0, : last_media + 2])
    # a cut through the media run is refused even with truncate
    with pytest.raises(data.TooLong, match="media tokens up to position"):
        data.SampleProcessor(world["plain"], max_length=last_media, config=config, truncate=True)(record)


def test_too_long_samples_are_skipped_and_counted(world):
    lengths = [data.SampleProcessor(world["plain"])(world["ds"][i])["input_ids"].shape[1] for i in range(6)]
    limit = sorted(lengths)[3]
    proc = data.SampleProcessor(world["plain"], max_length=limit)
    loader = data.ReplicaLoader(world["ds"], proc, global_batch_size=3, shuffle=False)
    batches = list(loader)
    too_long = sum(n > limit for n in lengths)
    assert sum(b["n_samples"] for b in batches) == 6 - too_long and batches[-1]["skipped"] == too_long
    assert all(b["input_ids"].shape[1] <= limit for b in batches)


@pytest.mark.parametrize("family", ["gemma3", "idefics3", "internvl", "llava_next"])
def test_labels_with_other_families_templates(world, family, tmp_path):
    # each family's tiny processor and chat template (ppmedia.testing.processors): the labels are
    # exactly the replies' words in order, each reply followed by one end-of-turn token, the same one
    from ppmedia.testing.processors import processor_call_kwargs

    processor = fx.AutoProcessor_from(str(save_tiny_processor(family, tmp_path / family)))
    proc = data.SampleProcessor(processor, processor_kwargs=processor_call_kwargs(family))
    for i in range(6):
        record = world["ds"][i]
        labels = proc(record)["labels"][0]
        targets = processor.tokenizer.convert_ids_to_tokens(labels[labels >= 0].tolist())
        replies = [p["text"].split() for m in record.messages if m["role"] == "assistant" for p in m["content"]]
        ends = [sum(len(w) + 1 for w in replies[: k + 1]) - 1 for k in range(len(replies))]  # after each reply
        assert len(targets) == ends[-1] + 1, (family, i, targets)
        assert [t for k, t in enumerate(targets) if k not in ends] == sum(replies, []), (family, i, targets)
        eot = {targets[k] for k in ends}
        assert len(eot) == 1 and not eot & set(sum(replies, [])), (family, i, targets)
