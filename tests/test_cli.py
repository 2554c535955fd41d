"""The ppmedia command line: adapters, inspect, and exactly one error line for every bad input.

Every failure case asserts the whole stderr (one ``ppmedia: error: ...`` line, nothing before it),
an empty stdout and the exit status: 2 for a wrong command line, 1 for a file that cannot be used.
"""

import fractions
import json
import pathlib
import pickle
import re
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors.torch import load_file, save_file

from ppmedia import cli
import ppmedia.cli.commands  # noqa: F401  (cli.commands: the module holding COMMANDS)
from ppmedia.cli import COMMANDS, main

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures"
QWEN = FIXTURES / "qwen2_5_vl"
EXE = pathlib.Path(sys.executable).with_name("ppmedia")
EXPECTED = "expected a dict of tensors saved with torch.save or as a .safetensors file"
#: Python names a command-line user never set; no error line may contain them.
PYTHON_TERMS = re.compile(
    r"(?<!n_)\b(images|videos)_per_sample|n_microbatches|batch_size=|split_media|weights_only|media_per_sample|Traceback|\x1b"
)

from ppmedia.adapters.builtin import ADAPTERS

#: the built-in model types, as the errors list them (sorted)
KNOWN = ", ".join(sorted(ADAPTERS))


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def fails(capsys, *argv):
    """(exit status, the one error line); asserts nothing else was printed."""
    code, out, err = run(capsys, *argv)
    assert out == "", out
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), err
    assert lines[0].startswith("ppmedia: error: ")
    assert not PYTHON_TERMS.search(lines[0]), lines[0]
    return code, lines[0]


@pytest.fixture
def qwen_dir(tmp_path):
    """A directory with the Qwen2.5-VL fixture's config.json (batches saved next to it are counted with it)."""
    shutil.copy(QWEN / "config.json", tmp_path / "config.json")
    return tmp_path


# ------------------------------------------------------------------------------------- success
def test_adapters_lists_builtins_with_layouts_and_providers(capsys):
    code, out, err = run(capsys, "adapters")
    assert code == 0 and err == ""
    for name, types in [("qwen2_5_vl", "qwen2_5_vl, qwen2_vl"), ("llava_next", "llava_next"),
                        ("step3", "step3_vl, step3p7"), ("kimi_vl", "kimi_vl, kimi_k25"),
                        ("qwen3_vl", "qwen3_vl, qwen3_vl_moe, qwen3_5, qwen3_5_moe")]:
        line = next(l for l in out.splitlines() if l.startswith(name + " "))
        assert types in line and "ppmedia (built-in)" in line
    assert "flat patch rows" in out and "qwen2_5_vl_text -> qwen2_5_vl" in out
    layouts = out[out.index("media layouts"):].splitlines()
    from ppmedia.registry import default_registry

    for layout, _ in default_registry().list_layouts():  # every registered one, with its keys
        line = next(l for l in layouts if l.startswith(layout.name + " "))
        assert layout.modality in line and all(key in line for key in layout.requires)


def test_inspect_fixture_prints_per_microbatch_table(capsys):
    code, out, err = run(capsys, "inspect", QWEN / "inputs.safetensors", "--microbatches", "4")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert "images [1, 2, 0, 1, 0, 0, 1, 2], videos [0, 0, 1, 1, 0, 0, 0, 1]" in out
    table = lines[lines.index(next(l for l in lines if l.startswith("mb "))) + 2:][:4]
    assert [l.split() for l in table] == [
        ["0", "0..1", "3", "0", "44", "0", "0", "11", "0"],
        ["1", "2..3", "1", "2", "24", "48", "0", "6", "12"],
        ["2", "4..5", "0", "0", "0", "0", "0", "0", "0"],
        ["3", "6..7", "3", "1", "80", "16", "0", "20", "4"],
    ]
    assert lines[-1] == "4 microbatches of 8 samples; text-only: [2]"


def test_inspect_one_microbatch_per_sample_is_accepted(capsys):
    code, out, _ = run(capsys, "inspect", QWEN / "inputs.safetensors", "--microbatches", "8")
    assert code == 0 and out.splitlines()[-1] == "8 microbatches of 8 samples; text-only: [4, 5]"


def test_inspect_torch_save_batch_with_model_type(capsys, tmp_path):
    # --model-type alone: placeholders counted with transformers' default step3p7 config, whose ids it names
    path = tmp_path / "batch.pt"
    ids = torch.zeros(3, 4, dtype=torch.long)
    ids[0, 1:3] = ids[2, 2] = 151679  # the default config's image token: sample 0 and 2 hold images
    torch.save({"input_ids": ids, "pixel_values": torch.randn(2, 3, 8, 8), "num_patches": torch.zeros(3, dtype=torch.long)}, path)
    code, out, _ = run(capsys, "inspect", path, "--microbatches", "2", "--model-type", "step3p7")
    assert code == 0
    assert ("adapter step3 (step3p7) (no config.json: transformers' default step3p7 config, assuming its ids "
            "image_token_id 151679; pass --config if the checkpoint's differ); per-sample counts from placeholder "
            "tokens: images [1, 0, 1]") in out
    assert out.splitlines()[-1] == "2 microbatches of 3 samples; text-only: none"


def test_inspect_model_type_without_a_default_config_points_at_the_config_only(capsys, tmp_path):
    # kimi_vl is remote code: no default config to count with; the error names --config, not --model-type again
    path = tmp_path / "batch.pt"
    torch.save({"input_ids": torch.zeros(3, 4, dtype=torch.long), "pixel_values": torch.randn(5, 6),
                "image_grid_thw": torch.tensor([[1, 1, 5]])}, path)
    code, out, _ = run(capsys, "inspect", path, "--microbatches", "1", "--model-type", "kimi_vl", "--config", QWEN / "config.json")
    assert code == 2  # a config.json that contradicts --model-type: refused as before
    code, line = fails(capsys, "inspect", path, "--microbatches", "2", "--model-type", "kimi_vl")
    assert code == 1 and "--model-type" not in line, line
    assert line == (f"ppmedia: error: {path}: pixel_values: 1 images for a batch of 3 samples and nothing maps them to "
                    f"samples; expected n_images_per_sample [3] in the batch, or the model's config.json (--config, or "
                    f"beside the file: there is no default kimi_vl config) to count the image placeholder tokens in input_ids")


def test_inspect_default_config_whose_ids_miss_the_tokens_says_so(capsys, tmp_path):
    path = tmp_path / "batch.pt"
    torch.save({"input_ids": torch.zeros(3, 4, dtype=torch.long), "pixel_values": torch.randn(3, 3, 8, 8)}, path)
    code, line = fails(capsys, "inspect", path, "--microbatches", "2", "--model-type", "step3p7")
    assert code == 1 and line.endswith("(counted with transformers' default config: pass --config if the checkpoint's ids differ)"), line


def test_counting_errors_name_their_key_once(capsys, tmp_path):
    # LLaVA-NeXT counts back-to-back images by their sizes; a run that fits no sizes is an input_ids error,
    # reported as "input_ids: ..." once (it used to read "input_ids: input_ids: ...")
    (tmp_path / "config.json").write_text((FIXTURES / "llava_next" / "config.json").read_text())
    batch = load_file(str(FIXTURES / "llava_next" / "inputs.safetensors"))
    batch["image_sizes"] = batch["image_sizes"].flip(0)  # the sizes no longer fit the runs
    path = tmp_path / "batch.pt"
    torch.save(batch, path)
    code, line = fails(capsys, "inspect", path, "--microbatches", "2")
    assert code == 1 and line.startswith(f"ppmedia: error: {path}: input_ids: sample ") and "input_ids: input_ids" not in line, line


def test_format_is_told_from_the_bytes_not_the_name(capsys, tmp_path):
    # a safetensors file named .pt and a torch.save file named .safetensors both load
    batch = load_file(str(QWEN / "inputs.safetensors"))
    save_file(batch, str(tmp_path / "a.pt"))
    torch.save(batch, tmp_path / "b.safetensors")
    for name in ("a.pt", "b.safetensors"):
        shutil.copy(QWEN / "config.json", tmp_path / "config.json")
        code, out, _ = run(capsys, "inspect", tmp_path / name, "--microbatches", "4")
        assert code == 0 and out.splitlines()[-1] == "4 microbatches of 8 samples; text-only: [2]"


def test_legacy_torch_save_format_loads(capsys, tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save({"input_ids": torch.zeros(2, 3, dtype=torch.long)}, path, _use_new_zipfile_serialization=False)
    code, out, _ = run(capsys, "inspect", path, "--microbatches", "2")
    assert code == 0 and out.splitlines()[-1] == "2 microbatches of 2 samples; text-only: [0, 1]"


def test_empty_batch_shows_its_microbatch_as_empty_not_text_only(capsys, tmp_path):
    path = tmp_path / "zero.pt"
    torch.save({"input_ids": torch.zeros(0, 3, dtype=torch.long)}, path)
    code, out, _ = run(capsys, "inspect", path, "--microbatches", "1")
    assert code == 0
    assert out.splitlines()[-1] == "1 microbatch of 0 samples; text-only: none; empty (no samples): [0]"
    assert out.splitlines()[-2].split()[:2] == ["0", "-"]


# ------------------------------------------------------------------------------------- arguments (exit 2)
def test_microbatches_zero_is_an_argparse_error_before_the_file_is_read(capsys, tmp_path):
    missing = tmp_path / "missing.pt"
    assert fails(capsys, "inspect", missing, "--microbatches", "0") == (
        2, "ppmedia: error: argument --microbatches: got 0; expected an integer >= 1 (see 'ppmedia inspect --help')")
    assert fails(capsys, "inspect", missing, "--microbatches", "two") == (
        2, "ppmedia: error: argument --microbatches: got 'two'; expected an integer >= 1 (see 'ppmedia inspect --help')")


def test_more_microbatches_than_samples_is_refused(capsys):
    path = QWEN / "inputs.safetensors"
    assert fails(capsys, "inspect", path, "--microbatches", "9") == (
        2, f"ppmedia: error: argument --microbatches: got 9 for a batch of 8 samples in {path}; expected 1..8 "
           f"(the schedule's split gives at most one microbatch per sample) (see 'ppmedia inspect --help')")


def test_unknown_model_type_is_refused_before_the_file_is_read(capsys, tmp_path):
    code, line = fails(capsys, "inspect", tmp_path / "missing.pt", "--microbatches", "2", "--model-type", "gpt2")
    assert code == 2
    assert line == (
        f"ppmedia: error: argument --model-type: no ppmedia adapter for 'gpt2'; known model types: {KNOWN} "
        "('ppmedia adapters' lists them, plugins included) (see 'ppmedia inspect --help')"
    )


def test_missing_or_directory_config_argument_before_the_file_is_read(capsys, tmp_path):
    missing = tmp_path / "missing.pt"
    assert fails(capsys, "inspect", missing, "--microbatches", "2", "--config", tmp_path / "nope.json") == (
        2, f"ppmedia: error: argument --config: {tmp_path / 'nope.json'}: no such file (see 'ppmedia inspect --help')")
    assert fails(capsys, "inspect", missing, "--microbatches", "2", "--config", tmp_path) == (
        2, f"ppmedia: error: argument --config: {tmp_path}: is a directory; expected a config.json file "
           f"(see 'ppmedia inspect --help')")


def test_model_type_contradicting_config_json(capsys):
    code, line = fails(capsys, "inspect", QWEN / "inputs.safetensors", "--microbatches", "2", "--model-type", "llava_next")
    assert code == 2
    assert line == (
        f"ppmedia: error: argument --model-type: 'llava_next' contradicts model_type 'qwen2_5_vl' in "
        f"{QWEN / 'config.json'} (found beside the batch); drop --model-type, or pass --config with a llava_next "
        f"config.json (see 'ppmedia inspect --help')"
    )


def test_model_type_served_by_the_same_adapter_is_no_contradiction(capsys):
    code, out, _ = run(capsys, "inspect", QWEN / "inputs.safetensors", "--microbatches", "4", "--model-type", "qwen2_vl")
    assert code == 0 and "adapter qwen2_5_vl (qwen2_5_vl)" in out


def test_demo_arguments_are_checked_before_anything_runs(capsys):
    assert fails(capsys, "demo", "--microbatches", "0") == (
        2, "ppmedia: error: argument --microbatches: got 0; expected an integer >= 1 (see 'ppmedia demo --help')")
    assert fails(capsys, "demo", "--family", "kimi_vl", "--microbatches", "3") == (
        2, "ppmedia: error: argument --microbatches: got 3; the demo's tiny batches have 8 samples and the "
           "schedules need equal microbatches: use 1, 2, 4 or 8 (see 'ppmedia demo --help')")
    assert fails(capsys, "demo", "--steps", "0") == (
        2, "ppmedia: error: argument --steps: got 0; expected an integer >= 1 (see 'ppmedia demo --help')")


def test_console_script_bad_arguments_no_traceback():
    result = subprocess.run([str(EXE), "demo", "--schedule", "zigzag"], capture_output=True, text=True)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (
        "ppmedia: error: argument --schedule: invalid choice: 'zigzag' (choose from 'gpipe', '1f1b', 'interleaved', "
        "'DualPipeV', 'Interleaved1F1B', 'InterleavedZeroBubble', 'LoopedBFS', 'ZBVZeroBubble') "
        "(see 'ppmedia demo --help')\n"
    )


# ------------------------------------------------------------------------------------- files (exit 1)
def test_missing_file(capsys, tmp_path):
    path = tmp_path / "missing.pt"
    assert fails(capsys, "inspect", path, "--microbatches", "2") == (1, f"ppmedia: error: {path}: no such file")


def test_directory(capsys, tmp_path):
    path = tmp_path / "batch.pt"
    path.mkdir()
    assert fails(capsys, "inspect", path, "--microbatches", "2") == (1, f"ppmedia: error: {path}: is a directory; {EXPECTED}")


@pytest.mark.parametrize("name, content, reason", [
    ("empty.pt", b"", "an empty file (0 bytes); " + EXPECTED),
    ("notes.pt", b"hello world\nthis is text\n", f'a text file (it starts with "hello world"), not a batch; {EXPECTED}'),
    ("config.pt", json.dumps({"model_type": "qwen2_5_vl"}).encode(),
     f"a JSON file, not a batch; {EXPECTED} (a model's config.json goes to --config)"),
    ("noise.pt", bytes(range(256)), f"not a torch.save or safetensors file (it starts with bytes 00 01 02 03 04 05 06 07); {EXPECTED}"),
    ("broken.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all", None),
])
def test_files_that_are_not_batches(capsys, tmp_path, name, content, reason):
    path = tmp_path / name
    path.write_bytes(content)
    code, line = fails(capsys, "inspect", path, "--microbatches", "2")
    assert code == 1
    if reason is None:  # safetensors' own parse error, relayed on the line
        assert line.startswith(f"ppmedia: error: {path}: a damaged safetensors file (")
    else:
        assert line == f"ppmedia: error: {path}: {reason}"


def test_numpy_npy_file(capsys, tmp_path):
    np.save(tmp_path / "a.npy", np.zeros(3))
    path = tmp_path / "a.npy"
    assert fails(capsys, "inspect", path, "--microbatches", "2") == (
        1, f"ppmedia: error: {path}: a numpy .npy file, not a batch; {EXPECTED}")


def test_unsafe_pickle_names_the_blocked_class_without_ansi_codes(capsys, tmp_path):
    path = tmp_path / "batch.pt"
    torch.save({"input_ids": torch.zeros(2, 3, dtype=torch.long), "meta": fractions.Fraction(1, 3)}, path)
    assert fails(capsys, "inspect", path, "--microbatches", "2") == (
        1, f"ppmedia: error: {path}: the pickle in it needs fractions.Fraction, which ppmedia does not unpickle "
           f"(unpickling it could run code from the file); expected a dict of tensors: re-save the batch with "
           f"tensors only (torch.save), or as a .safetensors file")


def test_numpy_arrays_in_a_batch_get_numpy_advice(capsys, tmp_path):
    path = tmp_path / "batch.pt"
    torch.save({"input_ids": torch.zeros(2, 3, dtype=torch.long), "pixels": np.zeros(3)}, path)
    code, line = fails(capsys, "inspect", path, "--microbatches", "2")
    assert code == 1
    assert line.startswith(f"ppmedia: error: {path}: the pickle in it needs numpy.")
    assert line.endswith("expected a dict of tensors: convert numpy arrays with torch.from_numpy before saving, "
                         "or save as a .safetensors file")


def test_plain_pickles(capsys, tmp_path):
    old = tmp_path / "old.pt"
    old.write_bytes(pickle.dumps({"input_ids": [1, 2]}, protocol=2))
    assert fails(capsys, "inspect", old, "--microbatches", "2") == (
        1, f"ppmedia: error: {old}: a plain pickle, not written by torch.save; {EXPECTED}")
    new = tmp_path / "new.pt"
    new.write_bytes(pickle.dumps({"input_ids": [1, 2]}, protocol=4))
    assert fails(capsys, "inspect", new, "--microbatches", "2") == (
        1, f"ppmedia: error: {new}: a plain pickle, not written by torch.save (torch's safe loader stops at pickle "
           f"opcode 149); {EXPECTED}")


def test_plain_pickle_in_a_fresh_process_prints_no_warning_before_the_line(tmp_path):
    # torch warns about the pickle protocol before failing; the warning must not reach the terminal.
    path = tmp_path / "batch.pt"
    path.write_bytes(pickle.dumps({"input_ids": [1, 2]}, protocol=4))
    result = subprocess.run([str(EXE), "inspect", str(path), "--microbatches", "2"], capture_output=True, text=True)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == (
        f"ppmedia: error: {path}: a plain pickle, not written by torch.save (torch's safe loader stops at pickle "
        f"opcode 149); {EXPECTED}\n"
    )


def test_zip_archives_that_are_not_torch_files(capsys, tmp_path):
    path = tmp_path / "batch.pt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("notes.txt", "hi")
    assert fails(capsys, "inspect", path, "--microbatches", "2") == (
        1, f"ppmedia: error: {path}: a zip archive, but not one written by torch.save; {EXPECTED}")
    good = tmp_path / "good.pt"
    torch.save({"input_ids": torch.zeros(2, 3, dtype=torch.long)}, good)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    assert fails(capsys, "inspect", cut, "--microbatches", "2") == (
        1, f"ppmedia: error: {cut}: damaged or not a torch.save file (RuntimeError: PytorchStreamReader failed "
           f"reading zip archive: failed finding central directory. This can happen if the checkpoint was not saved "
           f"properly, was transferred incorrectly, or the file was modified after saving); {EXPECTED}")


def test_saved_objects_that_are_not_a_batch_dict(capsys, tmp_path):
    tensor, int_keys = tmp_path / "tensor.pt", tmp_path / "keys.pt"
    torch.save(torch.zeros(3), tensor)
    torch.save({1: torch.zeros(3)}, int_keys)
    assert fails(capsys, "inspect", tensor, "--microbatches", "2") == (
        1, f"ppmedia: error: {tensor}: holds a Tensor; expected a dict of str to tensors (the batch)")
    assert fails(capsys, "inspect", int_keys, "--microbatches", "2") == (
        1, f"ppmedia: error: {int_keys}: holds a dict with the key 1 (int); expected str keys such as input_ids")


def test_batch_without_input_ids_next_to_a_config(capsys, qwen_dir):
    path = qwen_dir / "batch.pt"
    torch.save({"pixel_values": torch.randn(4, 96), "image_grid_thw": torch.tensor([[1, 2, 2]])}, path)
    assert fails(capsys, "inspect", path, "--microbatches", "1") == (
        1, f"ppmedia: error: {path}: no input_ids in the batch; the qwen2_5_vl adapter (qwen2_5_vl, from "
           f"{qwen_dir / 'config.json'}) counts each sample's images and videos from the placeholder tokens in "
           f"input_ids (batch keys: pixel_values, image_grid_thw)")


def test_batch_without_any_sample_tensor(capsys, tmp_path):
    path = tmp_path / "batch.pt"
    torch.save({"pixel_values": torch.randn(4, 96), "image_grid_thw": torch.tensor([[1, 2, 2]])}, path)
    assert fails(capsys, "inspect", path, "--microbatches", "1") == (
        1, f"ppmedia: error: {path}: no input_ids (or other [samples, ...] tensor besides the media) to take the "
           f"number of samples from (batch keys: pixel_values, image_grid_thw)")


@pytest.mark.parametrize("text, reason", [
    ("{not json", "not valid JSON (line 1, column 2: Expecting property name enclosed in double quotes)"),
    ("[1, 2]", "holds a JSON list; expected a model config (a JSON object)"),
    ("{}", "no model_type in it; pass --model-type"),
    ('{"model_type": "gpt2"}', f"model_type 'gpt2' has no ppmedia adapter; known model types: {KNOWN}"),
])
def test_bad_config_json_beside_the_batch(capsys, tmp_path, text, reason):
    (tmp_path / "config.json").write_text(text)
    path = tmp_path / "batch.pt"
    torch.save({"input_ids": torch.zeros(2, 3, dtype=torch.long)}, path)
    assert fails(capsys, "inspect", path, "--microbatches", "2") == (
        1, f"ppmedia: error: {tmp_path / 'config.json'} (found beside the batch): {reason}")


def _qwen_batch():
    return load_file(str(QWEN / "inputs.safetensors"))


def test_placeholder_counts_that_disagree_with_the_media_in_cli_terms(capsys, qwen_dir):
    batch = _qwen_batch()
    grid = batch["image_grid_thw"]
    batch["image_grid_thw"], batch["pixel_values"] = grid[:-1], batch["pixel_values"][: -int(grid[-1].prod())]
    path = qwen_dir / "batch.pt"
    torch.save(batch, path)
    assert fails(capsys, "inspect", path, "--microbatches", "2") == (
        1, f"ppmedia: error: {path}: the image counts taken from the placeholder tokens in input_ids: counts sum "
           f"to 7; expected 6, the number of images (whole batch)")


def test_images_without_counts_name_the_batch_key_and_the_flags(capsys, tmp_path):
    path = tmp_path / "batch.pt"
    torch.save({"input_ids": torch.zeros(3, 4, dtype=torch.long), "pixel_values": torch.randn(5, 6),
                "image_grid_thw": torch.tensor([[1, 1, 5]])}, path)
    assert fails(capsys, "inspect", path, "--microbatches", "2") == (
        1, f"ppmedia: error: {path}: pixel_values: 1 images for a batch of 3 samples and nothing maps them to "
           f"samples; expected n_images_per_sample [3] in the batch, or a model type (--model-type, --config or a "
           f"config.json beside the file) to count the image placeholder tokens in input_ids")


@pytest.mark.parametrize("message, translated", [
    ("n_microbatches: got 3; use 1, 2, 4 or 8", "--microbatches: got 3; use 1, 2, 4 or 8"),
    ("batch: no input_ids (or other [B, ...] tensor) to take the batch size from; pass batch_size=",
     "batch: no input_ids (or other [B, ...] tensor) to take the batch size from"),
    ("images_per_sample: counts sum to 2; expected 3, the number of images (whole batch). If these counts come "
     "from placeholder runs (an adapter's media_per_sample), images written back to back form one run",
     "the image counts taken from the placeholder tokens in input_ids: counts sum to 2; expected 3, the number of "
     "images (whole batch). If these counts come from placeholder runs, images written back to back form one run"),
    ("videos_per_sample: sample 1 (microbatch 0) has -1; expected a count >= 0",
     "the video counts taken from the placeholder tokens in input_ids: sample 1 (microbatch 0) has -1; expected a count >= 0"),
    ("x: take it out of the batch before split_media and carry it yourself",
     "x: take it out of the batch before saving it and carry it yourself"),
])
def test_library_messages_in_command_line_terms(message, translated):
    assert cli.cli_terms(message) == translated


def test_one_line_strips_ansi_and_escapes_control_characters():
    assert cli.one_line("a \x1b[1mbold\x1b[0m\n\tb\x07c") == "a bold b\\x07c"


def test_unexpected_errors_are_one_line_too(capsys, tmp_path, monkeypatch):
    def boom(args):
        raise AssertionError("a bug\nover two lines")

    monkeypatch.setattr(cli.commands, "COMMANDS", [cli.Command("boom", "raises", lambda p: None, boom)])
    assert fails(capsys, "boom") == (
        1, "ppmedia: error: unexpected AssertionError: a bug over two lines (a bug in ppmedia or a plugin; "
           "PPMEDIA_DEBUG=1 shows the traceback)")


def test_warnings_during_a_failure_are_dropped_and_after_a_success_shown(capsys, monkeypatch):
    import warnings

    def ok(args):
        warnings.warn("careful\nnow", UserWarning)
        print("done")
        return 0

    def bad(args):
        warnings.warn("ignored", UserWarning)
        raise cli.CliError("it broke")

    monkeypatch.setattr(cli.commands, "COMMANDS", [cli.Command("ok", "", lambda p: None, ok), cli.Command("bad", "", lambda p: None, bad)])
    assert run(capsys, "ok") == (0, "done\n", "ppmedia: warning: UserWarning: careful now\n")
    assert fails(capsys, "bad") == (1, "ppmedia: error: it broke")


def test_commands_are_registered_as_entries():
    assert [c.name for c in COMMANDS] == ["demo", "adapters", "inspect", "plan", "train", "plot"]
    parser = cli.build_parser()
    args = parser.parse_args(["inspect", "x.pt", "--microbatches", "3"])
    assert args.run is COMMANDS[2].run and args.microbatches == 3


# ------------------------------------------------------------------------------------- generated bad batches
_KEYS = ("input_ids", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
         "n_images_per_sample", "image_sizes", "num_patches", "patch_pixel_values", "attention_mask")


@st.composite
def _batches(draw):
    batch = {}
    for key in draw(st.lists(st.sampled_from(_KEYS), unique=True, max_size=5)):
        shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=3))
        dtype = draw(st.sampled_from([torch.int64, torch.float32, torch.bool]))
        batch[key] = torch.zeros(shape, dtype=dtype) if dtype is not torch.int64 else torch.randint(-1, 5, shape)
    return batch, draw(st.integers(1, 6)), draw(st.booleans())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_batches())
def test_generated_batches_succeed_or_fail_with_one_line(capsys, tmp_path_factory, case):
    batch, n, with_config = case
    folder = tmp_path_factory.mktemp("gen")
    if with_config:
        shutil.copy(QWEN / "config.json", folder / "config.json")
    path = folder / "batch.pt"
    torch.save(batch, path)
    code, out, err = run(capsys, "inspect", path, "--microbatches", n)
    if code == 0:
        assert err == "" and out
        return
    assert code in (1, 2) and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ppmedia: error: "), err
    assert "unexpected" not in lines[0] and not PYTHON_TERMS.search(lines[0]), lines[0]


# ------------------------------------------------------------------------------------- demo
def documented_demo_lines() -> list[str]:
    """docs/cli.md's one-family demo line (tests/test_docs.py leaves it to the test below)."""
    from test_docs import DOCS, command_lines, read_blocks

    blocks = [b for b in read_blocks(DOCS / "cli.md") if b.lang == "sh"]
    return [line for b in blocks for line in command_lines(b) if line.startswith("ppmedia demo --family")]


@pytest.mark.multiprocess
def test_demo_runs_a_real_pipeline_and_prints_parity(tmp_path):
    """docs/cli.md's ``ppmedia demo --family llava_next --schedule DualPipeV --steps 1`` as written (a
    user's shell, from a sandbox of the repository): a real 2-process pipeline, its parity printed."""
    from test_docs import run_documented

    (line,) = documented_demo_lines()
    (result,) = run_documented("docs/cli.md", [line], tmp_path)
    out = result.stdout
    assert re.search(r"^llava_next \(llava_next\): 8 samples x \d+ tokens, 4 microbatches", out, flags=re.M), out
    assert "text-only" in out and "DualPipeV/inferred" in out and "DualPipeV/static" in out
    assert "5/5" in out  # the shape-inference forward ran and did not cost a chunk
    assert "all 1 families match the single-process run within 1e-5" in out


def test_torch_advice_never_reaches_the_line():
    # torch's safe-loader errors end with Python advice (weights_only=False, add_safe_globals): dropped
    from ppmedia.cli.inspect_batch import _unpickling_reason

    message = (
        "Weights only load failed. In PyTorch 2.6, we changed the default value of the `weights_only` argument in "
        "`torch.load` from `False` to `True`. Re-running `torch.load` with `weights_only` set to `False` will likely "
        "succeed, but it can result in arbitrary code execution. Do it only if you got the file from a trusted "
        "source.\nPlease file an issue with the following so that we can make `weights_only=True` compatible with "
        "your use case: WeightsUnpickler error: \n\nString is too long\n\nCheck the documentation of torch.load to "
        "learn more about types accepted by default with weights_only https://pytorch.org/docs/stable/generated/torch.load.html."
    )
    assert _unpickling_reason(message) == f"torch's safe loader refused it (String is too long); {EXPECTED}"
    assert _unpickling_reason("Weights only load failed. Re-running with weights_only=False works.") == (
        f"torch's safe loader refused it (Weights only load failed); {EXPECTED}")


def test_model_type_contradicting_a_config_ppmedia_does_not_know(capsys, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    path = tmp_path / "batch.pt"
    torch.save({"input_ids": torch.zeros(2, 3, dtype=torch.long)}, path)
    assert fails(capsys, "inspect", path, "--microbatches", "2", "--model-type", "qwen2_5_vl") == (
        2, f"ppmedia: error: argument --model-type: 'qwen2_5_vl' contradicts model_type 'gpt2' in "
           f"{tmp_path / 'config.json'} (found beside the batch); drop --model-type, or pass --config with a "
           f"qwen2_5_vl config.json (see 'ppmedia inspect --help')")


def test_explicit_config_for_a_batch_elsewhere(capsys, tmp_path):
    path = tmp_path / "batch.safetensors"
    shutil.copy(QWEN / "inputs.safetensors", path)
    code, out, err = run(capsys, "inspect", path, "--microbatches", "4", "--config", QWEN / "config.json")
    assert code == 0 and err == ""
    assert "adapter qwen2_5_vl (qwen2_5_vl); per-sample counts from placeholder tokens" in out
    assert out.splitlines()[-1] == "4 microbatches of 8 samples; text-only: [2]"
