"""Sequence packing in ppmedia.data and examples/train.py --pack (issue 26, items 1 and 5).

* the loader (``ReplicaLoader(packing=data.Packing(...))``): each step holds the same samples packed as
  unpacked (names, label tokens), rows of at most ``max_length`` tokens and a multiple of the
  microbatches, fewer pad positions; the state is the unpacked one; ``across_batches`` pools the
  windows' samples (every sample once an epoch, fuller rows) and a resume inside a window continues
  with the same steps; a processor allowing longer samples than the rows is refused;
* examples/train.py in this process (one rank, pp = dp = 1, the tiny checkpoints with their real
  processors, a length-skewed dataset): with ``--lr 0 --no-shuffle``, ``--pack`` logs the losses of
  the run without it, step for step within 1e-5, and a smaller ``padding_fraction``, for every family
  of :data:`FAMILIES`; with isolation switched off (a planted bug) the losses differ, and so do
  PaliGemma's with only its masks left unisolated (its prefix block across the row's samples);
  ``--pack-across-batches 2`` trains every label token of the epoch once;
* the table is complete: every built-in family with a tiny processor is in :data:`FAMILIES`, in
  :data:`STAGES_ONLY` (train.py cannot train it at all) or in :data:`REFUSED` (``--pack`` refuses it,
  with the reason); PaliGemma's samples from ``ppmedia.data`` are prefix up to the answer only.

The 2-process broadcast of packed rows to the rank that reads no media is a scenario of
tests/test_data_mp.py's spawn.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import pathlib
import sys
from datetime import timedelta

import pytest
import torch

from ppmedia import data, pipeline

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOL = 1e-5
#: the families with tiny processors whose packed losses are checked against their unpacked ones
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "llava_next", "gemma3", "gemma4", "qwen2_5_omni", "internvl", "paligemma", "glm4v",
            "glm4v_moe", "glm46v", "llava", "llava_pixtral", "mistral3", "mistral_small4", "aya_vision", "qwen3_omni",
            "ernie4_5_vl_moe", "video_llama_3")
#: the families with tiny processors that examples/train.py cannot train even unpacked (no loss to
#: compare): their packed rows are checked on the stages in one process instead
#: (tests/test_packing.py's ``test_packed_forward_equals_the_unpacked_one``), with why
STAGES_ONLY = {
    "kimi_vl": "transformers' from_pretrained cannot load its tiny checkpoint (PermuteForRope on q_proj)",
    "kimi_k25_video": "transformers' from_pretrained cannot load its tiny checkpoint (PermuteForRope on q_proj)",
    "phi4_multimodal": "its saved tiny processor loads back without its chat template (ppmedia.data renders with it)",
}
#: the families with tiny processors that --pack refuses (ppmedia.packing.packing_problem): a piece
#: of the reason it gives
REFUSED = {
    "idefics3": "its media hold one entry per sample on axis 0",
    "smolvlm": "its media hold one entry per sample on axis 0",
    "llava_onevision": "the model tiles an image only when its sample holds exactly one image",
    "step3": "its crops are counted per sample (num_patches [samples])",
    "llama4": "chunked attention (attention_chunk_size=",
    "mistral_large4": "decoder layers of type indexed_attention are not plain attention",
    "minimax_m3_vl": "decoder layers of type minimax_m3_sparse are not plain attention",
    "inkling": "decoder layers of type hybrid, hybrid_sliding are not plain attention",
    "inkling2": "decoder layers of type hybrid, hybrid_sliding are not plain attention",
}
N_RECORDS, BATCH, MAX_LENGTH = 16, 8, 128
#: the train.py runs' rows (a LLaVA-NeXT or Gemma 4 record over it is skipped, in both runs alike)
TRAIN_MAX_LENGTH = 128
#: per family, what its records must be: PaliGemma's processor refuses a record without an image, and
#: one with two (the data pipeline hands it a sample's images as one flat list)
DATASET_KWARGS: dict[str, dict[str, float]] = {"paligemma": {"text_only": 0.0, "two_images": 0.0}}

pytestmark = pytest.mark.usefixtures("one_thread")


def _words(checkpoint: pathlib.Path) -> list[str]:
    import transformers

    from ppmedia.testing.word_tokenizer import text_words

    return text_words(transformers.AutoProcessor.from_pretrained(checkpoint).tokenizer)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    import transformers

    from ppmedia.registry import get_adapter
    from ppmedia.testing.datasets import save_tiny_checkpoint, write_length_skewed_dataset

    root = tmp_path_factory.mktemp("pack-loader")
    checkpoint = save_tiny_checkpoint("qwen2_5_vl", root / "ckpt")
    path = write_length_skewed_dataset(root / "data", 32, words=_words(checkpoint), max_words=48)
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    processor = data.SampleProcessor(transformers.AutoProcessor.from_pretrained(checkpoint), max_length=MAX_LENGTH,
                                     config=config)
    return {"ds": data.open_dataset(str(path)), "proc": processor, "config": config, "adapter": get_adapter(config)}


def _loader(world, packing=None, **kwargs):
    return data.ReplicaLoader(world["ds"], world["proc"], global_batch_size=16, dp_rank=1, dp_size=2, shuffle=False,
                              adapter=world["adapter"], packing=packing, **kwargs)


def _pads(batches) -> float:
    return sum(int((b["attention_mask"] == 0).sum()) for b in batches) / sum(b["attention_mask"].numel() for b in batches)


def test_a_packed_step_holds_the_same_samples_in_fewer_pad_positions(qwen):
    plain_loader = _loader(qwen)
    plain = list(plain_loader)
    loader = _loader(qwen, data.Packing(MAX_LENGTH, 2, config=qwen["config"]))
    packed = list(loader)
    assert len(plain) == len(packed) == 2
    for a, b in zip(plain, packed):
        assert b["sample_names"] == a["sample_names"] and b["n_samples"] == a["n_samples"] == 8
        assert b["n_label_tokens"] == a["n_label_tokens"] > 0
        rows, S = b["input_ids"].shape
        assert rows % 2 == 0 and rows < a["input_ids"].shape[0] and S <= MAX_LENGTH
        assert sorted(i for row in b["packed_rows"] for i in row) == list(range(8))  # each sample in one row
        for r, row in enumerate(b["packed_rows"]):  # the row's tokens are its samples' tokens, in order
            tokens = torch.cat([a["input_ids"][i][a["attention_mask"][i] == 1] for i in row])
            assert torch.equal(b["input_ids"][r, : tokens.numel()], tokens)
            assert b["attention_mask"][r].max() == len(row)
        images = b["media_counts"]["images_per_sample"]  # per row, the sum of its samples' images
        per_sample = a["media_counts"]["images_per_sample"]
        assert images.tolist() == [int(per_sample[row].sum()) for row in b["packed_rows"]]
        assert torch.equal(b["pixel_values"].sort(dim=0).values, a["pixel_values"].sort(dim=0).values)
    assert _pads(packed) < 0.8 * _pads(plain)
    assert loader.state_dict() == plain_loader.state_dict()  # the state means what it means unpacked


def test_across_batches_pools_a_window_and_resumes_inside_it(qwen):
    per_batch = list(_loader(qwen, data.Packing(MAX_LENGTH, 2)))
    pooled = _loader(qwen, data.Packing(MAX_LENGTH, 2, across_batches=2))
    steps = list(pooled)
    names = [n for b in steps for n in b["sample_names"]]
    assert len(steps) == 2 and sorted(names) == sorted(n for b in per_batch for n in b["sample_names"])
    assert sum(b["n_label_tokens"] for b in steps) == sum(b["n_label_tokens"] for b in per_batch)
    assert sum(b["input_ids"].shape[0] for b in steps) <= sum(b["input_ids"].shape[0] for b in per_batch)
    assert {n for b in steps[:2] for n in b["sample_names"]} == {n for b in per_batch[:2] for n in b["sample_names"]}
    assert all(b["input_ids"].shape[0] % 2 == 0 for b in steps)
    again = _loader(qwen, data.Packing(MAX_LENGTH, 2, across_batches=2))
    first = next(iter(again))
    state = again.state_dict()
    assert state["next_sample"] == 16 and first["sample_names"] == steps[0]["sample_names"]
    resumed = _loader(qwen, data.Packing(MAX_LENGTH, 2, across_batches=2))
    resumed.load_state_dict(state)  # inside the first window: it is read again, its second step comes next
    rest = list(resumed)
    assert [b["sample_names"] for b in rest] == [b["sample_names"] for b in steps[1:]]
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(rest, steps[1:]))


def test_rows_shorter_than_the_samples_allowed_are_refused(qwen):
    with pytest.raises(ValueError, match=r"packing.max_length=64, but the processor's max_length is 128"):
        _loader(qwen, data.Packing(64, 2))
    with pytest.raises(ValueError, match=r"Packing.microbatches: got 0; expected an int >= 1"):
        data.Packing(MAX_LENGTH, 0)


# -- examples/train.py --pack, one rank in this process ---------------------------------------------
def _train_script():
    spec = importlib.util.spec_from_file_location("ppmedia_train_pack", ROOT / "examples" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _one_rank():
    sys.path.insert(0, str(ROOT / "tests"))
    from test_docs import as_a_script

    with as_a_script():
        pipeline.init_distributed("gloo", timeout=timedelta(seconds=60))
        yield


def _losses(checkpoint, path, log: pathlib.Path, *extra: str) -> dict[int, dict]:
    extra = tuple(flag for flag in extra if not flag.startswith("--planted-"))
    script = _train_script()
    argv = ["--pp", "1", "--dp", "1", "--model", str(checkpoint), "--data", str(path), "--batch-size", str(BATCH),
            "--max-length", str(TRAIN_MAX_LENGTH), "--epochs", "1", "--lr", "0", "--no-shuffle", "--loss-log", str(log), *extra]
    with contextlib.redirect_stdout(io.StringIO()):
        script.run(script.parse_args(argv), {"step": None})
    rows = {row["step"]: row for row in map(json.loads, log.read_text().splitlines())}
    log.unlink()
    return rows


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(family, *flags)``: the loss log of train.py on the family's checkpoint and data, each run once."""
    from ppmedia.testing.datasets import save_tiny_checkpoint, write_length_skewed_dataset

    made: dict[str, tuple[pathlib.Path, pathlib.Path]] = {}
    done: dict[tuple[str, ...], dict[int, dict]] = {}

    def run(family: str, *flags: str) -> dict[int, dict]:
        if family not in made:
            root = tmp_path_factory.mktemp(f"pack-{family}")
            checkpoint = save_tiny_checkpoint(family, root / "ckpt")
            made[family] = (checkpoint, write_length_skewed_dataset(root / "data", N_RECORDS, words=_words(checkpoint),
                                                                    max_words=24, seed=3,
                                                                    **DATASET_KWARGS.get(family, {})))
        key = (family, *flags)
        if key not in done:
            checkpoint, path = made[family]
            with _one_rank():
                done[key] = _losses(checkpoint, path, made[family][0].parent / "loss.jsonl", *flags)
        return done[key]
    return run


@pytest.mark.parametrize("family", FAMILIES)
def test_pack_logs_the_unpacked_losses_step_for_step(family, runs):
    plain, packed = runs(family), runs(family, "--pack")
    assert sorted(plain) == sorted(packed) == [0, 1]
    for step in plain:
        a, b = plain[step], packed[step]
        assert abs(a["loss"] - b["loss"]) <= TOL, (step, a["loss"], b["loss"])
        assert (a["tokens"], a["samples"], a["skipped"]) == (b["tokens"], b["samples"], b["skipped"])
        assert a["samples"] + a["skipped"] >= BATCH - 1 and a["tokens"] > 0
        assert b["padding_fraction"] < a["padding_fraction"], (step, b["padding_fraction"], a["padding_fraction"])


def test_paligemma_samples_are_prefix_up_to_the_answer(tmp_path):
    """PaliGemma's processor, called without a suffix, marks the whole sample prefix (token type 0:
    bidirectional, the answer would see itself); with the config the answer and what follows are 1."""
    from ppmedia.testing.datasets import write_length_skewed_dataset
    from ppmedia.testing.processors import build_tiny_processor
    from ppmedia.testing.tiny_models import paligemma
    from ppmedia.testing.word_tokenizer import text_words

    processor = build_tiny_processor("paligemma")
    path = write_length_skewed_dataset(tmp_path, 1, words=text_words(processor.tokenizer), text_only=0.0, two_images=0.0)
    record = data.open_dataset(str(path))[0]
    alone = data.SampleProcessor(processor)(record)
    sample = data.SampleProcessor(processor, config=paligemma.build_config())(record)
    assert alone["token_type_ids"].eq(0).all()
    answer = int((sample["labels"][0] >= 0).nonzero()[0, 0]) + 1  # labels are shifted by one
    types = sample["token_type_ids"][0].tolist()
    assert 0 < answer < len(types) and types == [0] * answer + [1] * (len(types) - answer)
    assert torch.equal(sample["input_ids"], alone["input_ids"]) and torch.equal(sample["labels"], alone["labels"])


def test_every_family_with_a_tiny_processor_is_checked_or_refused():
    """The table is complete: each built-in family with a tiny processor is in exactly one of FAMILIES
    (train.py's losses), STAGES_ONLY (train.py cannot run it; the stages' check) and REFUSED; a refused
    family's config is refused with its reason, the others' are not."""
    from ppmedia.packing import packing_problem
    from ppmedia.registry import get_adapter
    from ppmedia.testing import tiny_models
    from ppmedia.testing.processors import has_tiny_processor

    groups = [set(FAMILIES), set(STAGES_ONLY), set(REFUSED)]
    assert sum(map(len, groups)) == len(set.union(*groups)), "a family in two groups"
    assert set.union(*groups) == {f for f in tiny_models.FAMILIES if has_tiny_processor(f)}
    for family in tiny_models.FAMILIES:
        config = tiny_models.load(family).build_config()
        problem = packing_problem(config, get_adapter(config))
        if family in REFUSED:
            assert problem is not None and REFUSED[family] in problem, (family, problem)
        elif family in FAMILIES or family in STAGES_ONLY:
            assert problem is None, (family, problem)


def test_pack_refuses_a_family_before_training(runs):
    """train.py --pack on Idefics3: one ValueError naming the family and why, before any step."""
    with pytest.raises(ValueError, match=r"sequence packing refused for idefics3: its media hold one entry per sample "
                                         r"on axis 0 \(pixel_values \[samples, max_crops, C, H, W\]"):
        runs("idefics3", "--pack")


@pytest.mark.parametrize("family", ["qwen2_5_vl", "paligemma"])
def test_without_isolation_the_packed_losses_differ(family, runs, monkeypatch):
    """The planted bug: stages that take packed rows as plain ones (no per-sample positions or masks).
    PaliGemma: its prefix-LM block (every prefix token of the row, type 0) then spans the samples."""
    from ppmedia import packing

    plain = runs(family)
    monkeypatch.setattr(packing, "enable_packing", lambda modules, enabled=True: None)
    packed = runs(family, "--pack", "--planted-bug")  # the key of this run only; train.py never sees it
    assert max(abs(plain[s]["loss"] - packed[s]["loss"]) for s in plain) > 1e-3


def test_paligemma_prefix_leaking_across_a_boundary_changes_the_losses(runs, monkeypatch):
    """The planted bug: positions restart per sample, but the masks are the family's own over the whole
    row (``isolate`` a no-op): the row's prefix-LM block and the causal mask reach into other samples."""
    from ppmedia.packing import isolation

    plain = runs("paligemma")
    monkeypatch.setattr(isolation, "isolate", lambda config, hidden, mask, segments: mask)
    packed = runs("paligemma", "--pack", "--planted-leak")
    assert max(abs(plain[s]["loss"] - packed[s]["loss"]) for s in plain) > 1e-3


def test_pack_across_batches_trains_every_label_token_once(runs):
    plain, pooled = runs("qwen2_5_vl"), runs("qwen2_5_vl", "--pack", "--pack-across-batches", "2")
    assert sorted(pooled) == [0, 1]
    assert sum(r["tokens"] for r in pooled.values()) == sum(r["tokens"] for r in plain.values())
    assert sum(r["samples"] for r in pooled.values()) == N_RECORDS
    # the mean token loss over the epoch is the same (lr 0: the same weights at every step)
    mean = lambda rows: sum(r["loss"] * r["tokens"] for r in rows.values()) / sum(r["tokens"] for r in rows.values())  # noqa: E731
    assert abs(mean(pooled) - mean(plain)) <= TOL


@pytest.mark.parametrize("argv, says", [
    (["--pack"], "--pack packs the samples of --data: give --model and --data"),
    (["--pack-across-batches", "2"], "--pack-across-batches N pools batches for --pack: give --pack too"),
])
def test_pack_flags_are_refused_without_what_they_need(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        _train_script().parse_args(argv)
    assert exit_.value.code == 2 and says in capsys.readouterr().err
