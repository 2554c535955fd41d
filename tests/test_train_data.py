"""examples/train.py fine-tuning a real checkpoint on real data, under torchrun (six runs in all), and
``ppmedia train recipes/demo.yaml`` with a bad record and an all-too-long run in the README run's folder (three more).

The checkpoint: the tiny Qwen2.5-VL (``save_pretrained``) with its real processor
(``ppmedia.testing.processors``); the data: generated PNG images and a LLaVA-style JSON Lines file
(one or two images, or none, per record), and the same records as a ``datasets`` ``save_to_disk``
folder in the messages style. The reference is the model itself in this process
(``AutoModelForImageTextToText`` on the same processor output, ``labels=`` in transformers' form).

1. pp=2 x dp=2, JSONL, ``--lr 0 --no-shuffle``: every step's loss is the model's own loss on that
   step's global batch within 1e-5, and so is every evaluation of ``--eval-data``; the other log fields;
   with ``--skip-bad-samples`` a record with a missing image is left out, named and counted
   (``skipped`` 1), and the batches are those of the file without it.
2. pp=1 x dp=2, the ``save_to_disk`` folder, ``--lr 0 --no-shuffle``: the same, within 1e-5.
2b. pp=2, JSONL, ``--encoder spread``, 2 steps: the same losses as the model's and run 1's within
   1e-5, microbatch 1 encoded on rank 1 from pixels sent by stage 0's rank, which alone opened media
   files (each once).
3. the README quick start's three lines as written (a user's shell, a sandbox of the repository; the
   docs test leaves them to this one): a generated checkpoint and
   16 records, pp=2 x dp=1, shuffled, 2 epochs of 4 steps, checkpoints at steps 4 and 8, the export;
   step 0 (before any update) is the model's loss on the shuffled batch 0, the loss falls.
4. the same command at pp=2 x dp=2 with FSDP2 and ``--presplit`` (pre-split microbatches; the rank
   without stage 0 reads no media), resumed from run 3's step 4 (the loader's position is in the
   checkpoint): steps 4 to 7 repeat run 3's losses within 1e-5 (the same samples, another layout,
   pre-split against staged); and at pp=1 x dp=2 (staged), steps 4 and 5 the same. Both exports reload with ``AutoProcessor`` and ``AutoModelForImageTextToText``, keep the
   checkpoint's float32 and equal their run's last DCP checkpoint tensor for tensor.

That a bfloat16 checkpoint stays bfloat16 through loading and export is checked in one process
(``test_a_bf16_checkpoint_stays_bf16``): the functions train.py calls, without a launch.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest
import torch

from ppmedia import data, pipeline
from ppmedia.pipeline.loss import SHIFTED_MARK
from ppmedia.testing.datasets import save_tiny_checkpoint, write_image_chat_dataset

ROOT = pathlib.Path(__file__).resolve().parents[1]
TORCHRUN = pathlib.Path(sys.executable).with_name("torchrun")
TOL = 1e-5
N, B, MAX_LENGTH = 12, 4, 64  # 3 global batches an epoch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(nproc: int, *args: str, cwd: pathlib.Path = ROOT) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc), "--master-port", str(_free_port()),
           "examples/train.py" if cwd != ROOT else str(ROOT / "examples" / "train.py"), *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=cwd)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout + result.stderr


def _rows(path: pathlib.Path) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, path.read_text().splitlines())}


def _words(checkpoint: pathlib.Path) -> list[str]:
    import transformers

    from ppmedia.testing.word_tokenizer import text_words

    return text_words(transformers.AutoProcessor.from_pretrained(checkpoint).tokenizer)


def _extra_records(root: pathlib.Path, words: list[str]) -> list[dict]:
    """A text-only record and one with two images (the generated ones hold one each)."""
    return [
        {"conversations": [{"from": "human", "value": f"{words[8]} {words[9]}"}, {"from": "gpt", "value": words[3]}]},
        {"images": ["img0.png", "img1.png"], "conversations": [
            {"from": "human", "value": f"<image> <image>\n{words[7]}"}, {"from": "gpt", "value": f"{words[1]} {words[2]}"}]},
    ]


def _save_to_disk(jsonl: pathlib.Path, folder: pathlib.Path) -> pathlib.Path:
    """The JSONL's records in the messages style, images as ``Image()`` features, ``save_to_disk``."""
    import datasets

    rows = []
    for line in jsonl.read_text().splitlines():
        record = json.loads(line)
        images = record.get("images") or ([record["image"]] if "image" in record else [])
        roles = {"human": "user", "gpt": "assistant"}
        rows.append({"messages": [{"role": roles[t["from"]], "content": t["value"]} for t in record["conversations"]],
                     "images": [str(jsonl.parent / p) for p in images]})
    dataset = datasets.Dataset.from_list(rows).cast_column("images", datasets.List(datasets.Image()))
    dataset.save_to_disk(str(folder))
    return folder


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("train-data")
    checkpoint = save_tiny_checkpoint("qwen2_5_vl", root / "ckpt", max_shard_size="40KB")
    words = _words(checkpoint)
    jsonl = write_image_chat_dataset(root / "data", N - 2, words=words, seed=1)
    with open(jsonl, "a") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in _extra_records(root / "data", words))
    held_out = write_image_chat_dataset(root / "data", B, words=words, seed=2, name="eval.jsonl")
    bad = root / "data" / "with_bad.jsonl"  # the same records and one whose image is missing, in the middle
    lines = jsonl.read_text().splitlines(keepends=True)
    missing = {"image": "no_such.png", "conversations": [{"from": "human", "value": f"<image>\n{words[6]}"},
                                                         {"from": "gpt", "value": words[0]}]}
    bad.write_text("".join(lines[:5]) + json.dumps(missing) + "\n" + "".join(lines[5:]))
    return {"root": root, "ckpt": checkpoint, "jsonl": jsonl, "eval": held_out, "with_bad": bad,
            "disk": _save_to_disk(jsonl, root / "disk")}


_MODEL_LOSSES: dict[tuple[str, str, bool, int], list[tuple[float, int]]] = {}


def _model_losses(world, path, *, shuffle: bool, steps: int) -> list[tuple[float, int]]:
    """(the model's own loss, label tokens) of each global batch, in one process (once per arguments)."""
    key = (str(world["ckpt"]), str(path), shuffle, steps)
    if key not in _MODEL_LOSSES:
        _MODEL_LOSSES[key] = _compute_model_losses(world, path, shuffle=shuffle, steps=steps)
    return _MODEL_LOSSES[key]


def _compute_model_losses(world, path, *, shuffle: bool, steps: int) -> list[tuple[float, int]]:
    """Shuffled: train.py's default order, grouped by length (``--group-by-length``'s default)."""
    import transformers

    from ppmedia.train.options import DEFAULT_GROUP

    torch.set_num_threads(1)
    model = transformers.AutoModelForImageTextToText.from_pretrained(world["ckpt"]).train()
    processor = data.SampleProcessor(transformers.AutoProcessor.from_pretrained(world["ckpt"]),
                                     max_length=MAX_LENGTH, config=model.config)
    loader = data.ReplicaLoader(data.open_dataset(str(path)), processor, global_batch_size=B, dp_rank=0, dp_size=1,
                                seed=0, shuffle=shuffle, group_by_length=DEFAULT_GROUP if shuffle else 1)
    out = []
    while len(out) < steps:
        for batch in loader:
            labels = batch["labels"]
            unshifted = torch.full_like(labels, pipeline.IGNORE_INDEX)
            unshifted[:, 1:] = labels[:, :-1]
            unshifted[unshifted == SHIFTED_MARK] = pipeline.IGNORE_INDEX
            inputs = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and k != "labels"}
            with torch.no_grad():
                loss = model(**inputs, labels=unshifted, use_cache=False).loss
            out.append((float(loss), int((unshifted != pipeline.IGNORE_INDEX).sum())))
    return out[:steps]


def _common(world, log: pathlib.Path) -> list[str]:
    return ["--model", str(world["ckpt"]), "--batch-size", str(B), "--max-length", str(MAX_LENGTH),
            "--loss-log", str(log)]


@pytest.fixture(scope="module")
def lr0_run(world, tmp_path_factory):
    """``--lr 0 --no-shuffle`` runs by name, each launched once per module: ``(rows, printed)``."""
    done: dict[str, tuple[dict[int, dict], str]] = {}

    def run(name: str, nproc: int, *args: str) -> tuple[dict[int, dict], str]:
        if name not in done:
            log = tmp_path_factory.mktemp(name) / "loss.jsonl"
            printed = _torchrun(nproc, *_common(world, log), "--lr", "0", "--no-shuffle", *args)
            done[name] = (_rows(log), printed)
        return done[name]

    return run


def _stage0_pp2xdp2(world, lr0_run) -> tuple[dict[int, dict], str]:
    extra = ["--eval-data", str(world["eval"]), "--eval-every", "2", "--skip-bad-samples"]
    return lr0_run("pp2xdp2-jsonl", 4, "--data", str(world["with_bad"]), "--pp", "2", "--dp", "2", "--epochs", "1",
                   *extra)


def _media_reads(printed: str) -> dict[int, tuple[int, int]]:
    """train.py's ``media files opened per rank: R: N (D distinct), ...`` line, as ``{rank: (N, D)}``."""
    import re

    (line,) = [x for x in printed.splitlines() if x.startswith("media files opened per rank: ")]
    return {int(r): (int(n), int(d)) for r, n, d in re.findall(r"(\d+): (\d+) \((\d+) distinct\)", line)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, source", [(("2", "2"), "with_bad"), (("1", "2"), "disk")],
                         ids=["pp2xdp2-jsonl", "pp1xdp2-disk"])
def test_lr0_losses_are_the_models_own(world, lr0_run, layout, source):
    pp, dp = layout
    jsonl = source == "with_bad"  # its missing image is skipped (and counted) when the file is opened
    if jsonl:
        rows, printed = _stage0_pp2xdp2(world, lr0_run)
        reads = _media_reads(printed)  # world rank = dp_rank * pp + pp_rank: stage 0 on ranks 0 and 2
        assert reads[1] == reads[3] == (0, 0) and reads[0][0] > 0 and reads[2][0] > 0, reads
    else:
        rows, printed = lr0_run("pp1xdp2-disk", 2, "--data", str(world[source]), "--pp", pp, "--dp", dp, "--epochs", "1")
    reference = _model_losses(world, world["jsonl"], shuffle=False, steps=N // B)
    assert sorted(rows) == list(range(N // B))
    for step, (loss, tokens) in enumerate(reference):
        row = rows[step]
        assert abs(row["loss"] - loss) <= TOL, (step, row["loss"], loss)
        assert (row["tokens"], row["samples"], row["skipped"], row["lr"]) == (tokens, B, int(jsonl), 0.0)
        assert 0 < row["padding_fraction"] < 1 and row["grad_norm"] > 0
        assert row["step_time_s"] > 0 and row["tokens_per_s"] == pytest.approx(tokens / row["step_time_s"])
    if jsonl:
        assert "no_such.png" in printed  # named in the log (each rank's stderr)
        (held_out, _), = _model_losses(world, world["eval"], shuffle=False, steps=1)
        assert sorted(s for s, r in rows.items() if "eval_loss" in r) == [0, 2]
        assert all(abs(rows[s]["eval_loss"] - held_out) <= TOL for s in (0, 2))  # lr 0: the same weights


@pytest.mark.multiprocess
def test_the_spread_on_a_checkpoint_and_data_file_matches_and_reads_each_file_once(world, lr0_run):
    """``--encoder spread`` with ``--model --data`` at pp=2: rank 1 loads the checkpoint's vision side
    (``vision_from_pretrained``) and encodes its share of the microbatches from the pixels stage 0's
    rank sends it; the losses are the model's own and the stage-0 run's within 1e-5, and only stage
    0's rank opened media files, each once."""
    rows, printed = lr0_run("pp2-spread", 2, "--data", str(world["jsonl"]), "--pp", "2", "--steps", "2",
                            "--encoder", "spread")
    stage0, _ = _stage0_pp2xdp2(world, lr0_run)
    reference = _model_losses(world, world["jsonl"], shuffle=False, steps=N // B)[:2]  # run 1's, computed once
    assert sorted(rows) == [0, 1]
    for step, (loss, tokens) in enumerate(reference):
        assert abs(rows[step]["loss"] - loss) <= TOL, (step, rows[step]["loss"], loss)
        assert abs(rows[step]["loss"] - stage0[step]["loss"]) <= TOL, (step, rows[step], stage0[step])
        assert rows[step]["tokens"] == tokens == stage0[step]["tokens"]
    assert "encoder spread, last step: microbatches encoded per rank: 0: [0], 1: [1]" in printed
    records = [json.loads(x) for x in world["jsonl"].read_text().splitlines()[: 2 * B]]
    images = {p for r in records for p in (r.get("images") or ([r["image"]] if "image" in r else []))}
    assert _media_reads(printed) == {0: (len(images), len(images)), 1: (0, 0)}


def _readme_lines() -> list[str]:
    """The README quick start's three lines from a data file to an exported model."""
    import shlex

    sys.path.insert(0, str(ROOT / "tests"))
    from test_docs import README, command_lines, read_blocks, section

    blocks = [b for b in read_blocks(README, section(README.read_text(), "Quick start")) if b.lang == "sh"]
    lines = command_lines(blocks[1])
    assert [shlex.split(line)[0] for line in lines] == ["python", "torchrun", "python"], lines
    return lines


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Run 3: the README's three lines as written, in a scratch folder (pp=2 x dp=1, shuffled, 2 epochs
    of 4 steps, checkpoints at steps 4 and 8, the export); run 4: the same command at pp=2 x dp=2 with
    FSDP2 and --presplit, resumed from run 3's step 4 (into another save folder), exported too; run 5: pp=1 x
    dp=2 resumed from it for 2 steps."""
    import shlex

    from test_docs import run_documented

    work = tmp_path_factory.mktemp("readme")
    make, train, check = _readme_lines()
    # as a user types them, in a clean environment (tests/test_docs.py leaves them to this fixture)
    *_, printed_check = run_documented("README.md: Quick start", [make, train, check], work)
    argv = shlex.split(train)[4:]  # after torchrun --standalone --nproc-per-node 2
    assert argv[0] == "examples/train.py"
    printed = _torchrun(4, *argv[1:], "--pp", "2", "--dp", "2", "--fsdp", "--presplit", "--resume", "runs/step4",
                        "--save-dir", "runs4", "--loss-log", "resumed.jsonl", "--export", "trained4", cwd=work)
    short = [a for a in argv[1:] if a not in ("--epochs", "2")] + ["--steps", "6"]  # steps 4 and 5
    _torchrun(2, *short, "--pp", "1", "--dp", "2", "--resume", "runs/step4", "--save-dir", "runs5",
              "--loss-log", "resumed5.jsonl", "--export", "trained5", cwd=work)
    return {"work": work, "printed": printed, "dtype_line": printed_check.stdout, "straight": _rows(work / "loss.jsonl"),
            "resumed": _rows(work / "resumed.jsonl"), "resumed5": _rows(work / "resumed5.jsonl")}


@pytest.mark.multiprocess
def test_shuffled_run_resumed_at_another_layout_continues_identically(trained):
    straight, resumed = trained["straight"], trained["resumed"]
    assert sorted(straight) == list(range(8)) and sorted(resumed) == list(range(4, 8))  # 2 epochs of 16 / 4
    work = {"ckpt": trained["work"] / "demo-ckpt"}
    (first, _), = _model_losses(work, trained["work"] / "demo-data" / "train.jsonl", shuffle=True, steps=1)
    assert abs(straight[0]["loss"] - first) <= TOL, (straight[0]["loss"], first)  # shuffled: not the file's order
    assert straight[7]["loss"] < straight[0]["loss"]  # it learns
    assert sorted(trained["resumed5"]) == [4, 5]
    for step in range(4, 8):  # the loader's position came back with the weights: the same samples
        assert abs(resumed[step]["loss"] - straight[step]["loss"]) <= TOL, (step, resumed[step], straight[step])
        assert resumed[step]["tokens"] == straight[step]["tokens"]
        other = trained["resumed5"].get(step)  # pp=1 x dp=2, staged (run 4: pp=2 x dp=2, pre-split)
        if other is not None:
            assert abs(other["loss"] - straight[step]["loss"]) <= TOL, (step, other, straight[step])
            assert other["tokens"] == straight[step]["tokens"] and other["lr"] == straight[step]["lr"] > 0
    assert "resumed from runs/step4" in trained["printed"] and "continuing at step 4" in trained["printed"]
    assert trained["dtype_line"] == "torch.float32\n"  # the README's last line


@pytest.mark.multiprocess
@pytest.mark.parametrize("export, saved", [("trained", "runs"), ("trained4", "runs4")], ids=["pp2xdp1", "pp2xdp2-fsdp"])
def test_the_export_reloads_with_the_processor_and_the_dtype(trained, export, saved):
    import transformers

    work = trained["work"]
    processor = transformers.AutoProcessor.from_pretrained(work / export)
    assert type(processor).__name__ == "Qwen2_5_VLProcessor" and processor.chat_template
    model, info = transformers.AutoModelForImageTextToText.from_pretrained(work / export, output_loading_info=True)
    assert not any(info.values()), info
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the checkpoint's
    (stage,) = pipeline.build_stage_modules(model, 1)
    last = pipeline.build_stage_modules(transformers.AutoModelForImageTextToText.from_pretrained(work / "demo-ckpt"), 1)
    pipeline.load_checkpoint(str(work / saved / "step8"), last, None)
    exported, expected = stage.state_dict(), last[0].state_dict()
    assert exported.keys() == expected.keys() and all(torch.equal(exported[k], expected[k]) for k in expected)
    initial = transformers.AutoModelForImageTextToText.from_pretrained(work / "demo-ckpt").state_dict()
    assert sum(not torch.equal(initial[k], exported[k]) for k in exported) > len(exported) // 2  # it trained


def test_a_bf16_checkpoint_stays_bf16(tmp_path):
    """What train.py does with a bfloat16 checkpoint and no --dtype: the stages load in the
    checkpoint's dtype (``checkpoint_dtype``), the export writes it so, with the processor files."""
    import transformers

    torch.set_num_threads(1)
    source = save_tiny_checkpoint("qwen2_5_vl", tmp_path / "bf16", dtype=torch.bfloat16)
    dtype = pipeline.checkpoint_dtype(source)
    assert dtype == torch.bfloat16
    stages = pipeline.stages_from_pretrained(source, 2, dtype=dtype)
    assert {p.dtype for s in stages for p in s.parameters()} == {torch.bfloat16}
    pipeline.save_pretrained_stages(stages, tmp_path / "export")
    pipeline.copy_processor_files(source, tmp_path / "export")
    model = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "export", dtype="auto")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert pipeline.checkpoint_dtype(tmp_path / "export") == torch.bfloat16
    assert transformers.AutoProcessor.from_pretrained(tmp_path / "export").chat_template


def test_a_saved_gemma4_checkpoint_takes_its_processors_batches(tmp_path):
    """``save_tiny_checkpoint`` saves the model its processor's output fits: Gemma 4's processor puts
    up to 280 patches an image, whose coordinates (a 16 x 24 image: 19) passed the plain tiny model's
    position table of 16 (``IndexError`` in the model's own forward before the fix)."""
    import transformers

    torch.set_num_threads(1)
    checkpoint = save_tiny_checkpoint("gemma4", tmp_path / "ckpt")
    path = write_image_chat_dataset(tmp_path / "data", 3, words=_words(checkpoint))  # 16x16, 16x24, 24x16
    model = transformers.AutoModelForImageTextToText.from_pretrained(checkpoint)
    processor = data.SampleProcessor(transformers.AutoProcessor.from_pretrained(checkpoint), max_length=512,
                                     config=model.config)
    batch = next(iter(data.ReplicaLoader(data.open_dataset(str(path)), processor, global_batch_size=3, shuffle=False)))
    assert int(batch["image_position_ids"].max()) >= 16  # past the plain tiny table
    inputs = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and k != "labels"}
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits
    assert logits.shape[:2] == batch["input_ids"].shape and torch.isfinite(logits).all()


# ------------------------------------------------------------------ ppmedia train (docs/train-command.md)
def documented_train_command_lines() -> list[str]:
    """docs/train-command.md's first block: the dataset line (the README's, run by ``trained`` already),
    ``ppmedia train recipes/demo.yaml --steps 5`` and ``ppmedia plot``."""
    from test_docs import DOCS, command_lines, read_blocks

    block = [b for b in read_blocks(DOCS / "train-command.md") if b.lang == "sh"][0]
    return command_lines(block)


def _cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **extra)
    env.pop("PYTHONPATH", None)
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.mark.multiprocess
def test_ppmedia_train_from_the_demo_recipe_repeats_the_readme_run(trained):
    """The page's lines as written, in the README run's folder (its demo-ckpt and demo-data; the dataset
    line is the README's, run already): ``ppmedia train recipes/demo.yaml --steps 5`` (2 processes, pp 2,
    the README's options) gives the README's ``torchrun examples/train.py`` losses; TensorBoard's
    ``train/loss`` equals the JSON log; the last step is checkpointed, the final model evaluated; the plot."""
    from test_docs import run_lines

    make, train, plot = documented_train_command_lines()
    assert make == _readme_lines()[0] and train.split("#")[0].split() == ["ppmedia", "train", "recipes/demo.yaml",
                                                                         "--steps", "5"]
    work = trained["work"]  # a sandbox of the repository: recipes/ is there
    _, plotted = run_lines("docs/train-command.md", [train, plot], work)
    rows = _rows(work / "demo-loss.jsonl")
    assert sorted(rows) == list(range(5))
    for step, row in rows.items():  # the README's run, same options: the same losses
        assert row["loss"] == trained["straight"][step]["loss"], (step, row, trained["straight"][step])
        assert len(row["peak_memory_gb"]) == 2 and min(row["peak_memory_gb"]) > 0.05 and "mfu" not in row  # CPU
    assert [step for step, row in rows.items() if "eval_loss" in row] == [0, 2, 4]
    assert rows[4]["final_eval_loss"] < rows[4]["eval_loss"]  # the final weights, after the last step
    assert sorted(p.name for p in (work / "demo-runs").glob("step*")) == ["step2", "step4", "step5"]
    assert plotted.stdout.startswith("wrote loss.png: 5 steps, 4 eval points")
    assert (work / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(work / "demo-tb"))
    events.Reload()
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/padding_fraction",
            "eval/loss"} <= set(events.Tags()["scalars"])
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (step, pytest.approx(row["loss"], rel=1e-6)) for step, row in rows.items()]
    assert [e.step for e in events.Scalars("eval/loss")] == [0, 2, 4, 5]


@pytest.mark.multiprocess
def test_a_failure_is_one_line_and_a_run_with_no_label_stops_before_step_0(trained, tmp_path):
    """A bad record at pp 2: one line naming FILE:LINE and the traceback file, from one rank. Every sample
    over --max-length (one process): stopped before step 0, naming why."""
    work = trained["work"]
    lines = (work / "demo-data" / "train.jsonl").read_text().splitlines()
    lines[2] = lines[2].replace("img2.png", "missing.png")
    (work / "demo-data" / "bad.jsonl").write_text("\n".join(lines) + "\n")
    logs = tmp_path / "logs"
    failed = subprocess.run([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(ROOT / "examples" / "train.py"),
                             "--model", "demo-ckpt", "--data", "demo-data/bad.jsonl", "--batch-size", "4",
                             "--max-length", "64", "--steps", "2", "--no-shuffle"],
                            cwd=work, capture_output=True, text=True, env=_cli_env(PPMEDIA_LOG_DIR=str(logs)), timeout=600)
    assert failed.returncode == 1
    ours = [line for line in (failed.stdout + failed.stderr).splitlines() if line.startswith("train.py")]
    assert len(ours) == 1, failed.stderr
    found = re.fullmatch(r"train\.py: demo-data/bad\.jsonl:3: image file '.*missing\.png' does not exist "
                         r"\(rank \d; traceback: (\S+)\)", ours[0])  # the rank that reported first
    assert found and "DataError" in pathlib.Path(found[1]).read_text(), ours
    assert "step None" not in failed.stderr and failed.stderr.count("Traceback") == 1  # torchrun's own report

    nothing = subprocess.run([sys.executable, "-m", "ppmedia.train", "--model", "demo-ckpt", "--data",
                              "demo-data/train.jsonl", "--pp", "1", "--batch-size", "4", "--max-length", "8",
                              "--steps", "2"], cwd=work, capture_output=True, text=True,
                             env=_cli_env(PPMEDIA_LOG_DIR=str(logs)), timeout=600)
    assert nothing.returncode == 1 and "step 0: loss" not in nothing.stdout
    (line,) = [line for line in nothing.stderr.splitlines() if line.startswith("train.py")]
    assert line.startswith("train.py: step 0: the global batch of 4 samples holds no label token: all were skipped "
                           "(4 samples skipped so far: longer than --max-length 8"), line
