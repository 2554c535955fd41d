"""The family x record-kind matrix (issue 34, item 6): every family with a tiny processor through
``--data`` at pp=2, its loss the model's own.

Per family: its tiny checkpoint (``save_tiny_checkpoint``: the model and its real processor), a mixed
JSON Lines file of the record kinds (:data:`~ppmedia.testing.datasets.MIXED_KINDS`: one image of odd
size, two images, text only, two exchanges, and a video where the family's processor takes videos),
ONE global batch holding every kind, ``--lr 0 --no-shuffle --steps 1 --pp 2 --microbatches 2``.
One spawned 2-process group (gloo) runs every family in turn through the training loop's own
functions (``ppmedia.train.loop.run`` on ``parse_args`` of the command line a user types), not one
``torchrun`` per cell. The reference, in this process: the model itself
(``build_tiny_processor_model``, the weights the checkpoint holds) on ONE call of the family's own
processor on the batch's records (nested per sample, as ``tests/test_data_batches.py``), with the
labels of ppmedia's template scan placed on that batch's rows; transformers' loss, within 1e-5.
GLM-4V's models refuse images and videos in one forward, so their reference is each microbatch's own
processor call, token-weighted.
"""

from __future__ import annotations

import json
import os
import socket
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from ppmedia import data
from ppmedia.pipeline.loss import IGNORE_INDEX, SHIFTED_MARK
from ppmedia.testing import tiny_models
from ppmedia.testing.datasets import save_tiny_checkpoint, write_mixed_dataset
from ppmedia.testing.processors import build_tiny_processor, build_tiny_processor_model, has_tiny_processor
from ppmedia.testing.word_tokenizer import text_words

from test_data_batches import NO_TEXT_ONLY, processor_batch, takes_video

TOL = 1e-5
#: step3 is refused by train.py before anything starts (test_a_refused_family_is_refused_by_name)
FAMILIES = [f for f in tiny_models.FAMILIES if has_tiny_processor(f) and f != "step3"]
#: families whose processor is saved without its chat template: given with --chat-template
NO_TEMPLATE = {"phi4_multimodal"}
#: GLM-4V's models refuse images and videos in one forward: the reference is per microbatch
PER_MICROBATCH = {"glm4v", "glm4v_moe", "glm46v"}
#: Kimi-VL's processor takes videos, but transformers 5.23's own Kimi video features fail for chunks of
#: more than one frame (its reference has no forward); the kimi_k25_video row runs them (its tiny model
#: has that one method fixed)
#: has that one method fixed). The tiny Qwen Omni processors need video sizes in every call
#: (``processor_call_kwargs``) that a saved processor loses, and train.py calls a processor as saved:
#: their videos come out far over --max-length (tests/test_data_video.py runs them with the sizes)
NO_VIDEO_REFERENCE = {"kimi_vl", "qwen2_5_omni", "qwen3_omni"}
#: forward arguments a family's own forward needs
FORWARD = {"qwen2_5_omni": {"use_audio_in_video": False}, "qwen3_omni": {"use_audio_in_video": False}}


def kinds_of(family: str, processor) -> list[str]:
    """The batch's record kinds in order (2 microbatches of equal size; a video in the second, with
    text-only records, so that no microbatch mixes a video with images)."""
    text = "text" if family not in NO_TEXT_ONLY else "odd"
    if takes_video(family, processor) and family not in NO_VIDEO_REFERENCE:
        return ["odd", "two", "multi", text, text, "video"]
    return ["odd", "two", text, "multi"]


def _reference(folder: Path, family: str, template: str | None) -> tuple[float, int]:
    """The model's own loss (and label tokens) on the processor's batch of the dataset's records."""
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(folder / "ckpt")
    if template is not None:
        processor.chat_template = template
    config = tiny_models.load(family).build_config()
    processor.tokenizer.padding_side = "right"  # as the loader pads: the positions of a left-padded row differ
    sp = data.SampleProcessor(processor, config=config)
    dataset = data.open_dataset(str(folder / "data" / "mixed.jsonl"))
    records = [dataset[i] for i in range(len(dataset))]
    loader = next(iter(data.ReplicaLoader(dataset, sp, global_batch_size=len(records), shuffle=False)))
    model = build_tiny_processor_model(family, 0).train()
    groups = [records[: len(records) // 2], records[len(records) // 2:]] if family in PER_MICROBATCH else [records]
    total, tokens, row = 0.0, 0, 0
    for group in groups:
        own = processor_batch(sp, group, {})
        if own.get("pixel_values") is not None and own["pixel_values"].dtype == torch.bfloat16:
            own["pixel_values"] = own["pixel_values"].float()  # Llama 4's processor (docs/processors.md)
        labels = torch.full_like(own["input_ids"], IGNORE_INDEX)
        prefix = getattr(sp, "_prefix_key", None)
        for r in range(len(group)):
            mask, theirs = loader["attention_mask"][row + r].bool(), own["attention_mask"][r].bool()
            shifted = loader["labels"][row + r][mask]
            unshifted = torch.full_like(shifted, IGNORE_INDEX)
            unshifted[1:] = shifted[:-1]
            unshifted[unshifted == SHIFTED_MARK] = IGNORE_INDEX
            labels[r, theirs] = unshifted
            for key in ("token_type_ids",) if "token_type_ids" in loader and family == "paligemma" else ():
                own[key][r, theirs] = loader[key][row + r][mask]
        row += len(group)
        n = int((labels != IGNORE_INDEX).sum())
        with torch.no_grad():
            loss = model(**own, labels=labels, use_cache=False, **FORWARD.get(family, {})).loss
        total, tokens = total + float(loss) * n, tokens + n
    return total / tokens, tokens


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, runs: list[tuple[str, list[str]]], out: str) -> None:
    """Every family's one step through the training loop, in this one process group."""
    import torch.distributed as dist

    from ppmedia.train import loop, options

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        for family, argv in runs:
            try:
                loop.run(options.parse_args(argv), {"step": None})
            except Exception as exc:  # named, then this group stops (a peer may wait on a collective)
                Path(out, f"failed-{rank}-{family}").write_text(f"{type(exc).__name__}: {exc}")
                raise
            Path(out, f"done-{rank}-{family}").touch()
    finally:
        dist.destroy_process_group()


def _spawn_all(runs: list[tuple[str, list[str]]], out: Path) -> dict[str, str]:
    """Every run in one spawned group; after a failing family (its error kept) the rest in a new group."""
    import torch.multiprocessing as mp

    failures: dict[str, str] = {}
    while runs:
        try:
            mp.spawn(_worker, args=(_free_port(), runs, str(out)), nprocs=2, join=True)
        except Exception:
            pass
        done = [f for f, _ in runs if (out / f"done-0-{f}").exists() and (out / f"done-1-{f}").exists()]
        rest = runs[len(done):]
        if rest and len(done) < len(runs):
            family = rest[0][0]
            errors = [p.read_text() for p in sorted(out.glob(f"failed-*-{family}"))]
            failures[family] = " / ".join(errors) or "the group failed"
            rest = rest[1:]
        runs = rest
    return failures


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """``{family: (train.py's loss, tokens, reference loss, reference tokens, kinds)}``."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("matrix")
    runs, expected = [], {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for family in [f for f in FAMILIES if f in os.environ.get("MATRIX_ONLY", f)]:  # MATRIX_ONLY: a subset, to debug
            folder = root / family
            ckpt = save_tiny_checkpoint(family, folder / "ckpt")
            processor = build_tiny_processor(family)
            kinds = kinds_of(family, processor)
            path = write_mixed_dataset(folder / "data", kinds, words=text_words(processor.tokenizer), seed=5)
            argv = ["--model", str(ckpt), "--data", str(path), "--pp", "2", "--microbatches", "2", "--steps", "1",
                    "--batch-size", str(len(kinds)), "--max-length", "4096", "--lr", "0", "--no-shuffle", "--loss-log", str(folder / "loss.jsonl")]
            template = processor.chat_template if family in NO_TEMPLATE else None
            if template is not None:
                (folder / "template.jinja").write_text(template)
                argv += ["--chat-template", str(folder / "template.jinja")]
            runs.append((family, argv))
            try:
                expected[family] = (*_reference(folder, family, template), kinds)
            except Exception as exc:  # named by the family's test
                expected[family] = (f"the reference fails: {type(exc).__name__}: {exc}", 0, kinds)
    failures = _spawn_all(runs, root)
    out = {}
    for family, (loss, tokens, kinds) in expected.items():
        if family in failures:
            out[family] = (f"train.py fails: {failures[family]}", 0, loss, tokens, kinds)
            continue
        (row,) = [json.loads(x) for x in (root / family / "loss.jsonl").read_text().splitlines()]
        out[family] = (row["loss"], row["tokens"], loss, tokens, kinds)
    return out


#: cells not yet at 1e-5 (kept visible, strict: a fix makes them fail until removed from here)
OPEN = {"llama4": "train.py's loss is 3.3e-5 off the model's own (4.853087 vs 4.853120; bfloat16 pixels from its "
                  "processor, cause not yet found)"}


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.xfail(reason=OPEN[f], strict=True)) if f in OPEN
                                    else f for f in FAMILIES])
def test_every_record_kind_trains_with_the_models_own_loss(matrix, family):
    if family not in matrix:
        pytest.skip("not in MATRIX_ONLY")
    loss, tokens, reference, reference_tokens, kinds = matrix[family]
    assert not isinstance(loss, str), (family, kinds, loss)
    assert not isinstance(reference, str), (family, kinds, reference)
    assert tokens == reference_tokens, (family, kinds)
    assert abs(loss - reference) <= TOL, (family, kinds, loss, reference)


def test_a_refused_family_is_refused_by_name(tmp_path, capsys):
    """Step3p7 through --data: argparse's one line (exit 2) naming the family and why, before anything."""
    from ppmedia.train import options

    ckpt = save_tiny_checkpoint("step3", tmp_path / "ckpt")
    path = write_mixed_dataset(tmp_path / "data", ["odd"], words=text_words(build_tiny_processor("step3").tokenizer))
    with pytest.raises(SystemExit) as exit_:
        options.parse_args(["--model", str(ckpt), "--data", str(path), "--steps", "1"])
    assert exit_.value.code == 2
    assert "step3p7 cannot train through --data: its processor (Step3p7Processor)" in capsys.readouterr().err
