"""ppmedia.testing: tiny-family loading, the adapter check, golden files, the pytest plugin, the docs' plugin test.

The sabotaged adapters are real adapters with one deliberate bug each; the kit must name the family
and the microbatch that shows it.
"""

import pathlib
import re
import subprocess
import sys
import types

import pytest
import torch

import ppmedia
from ppmedia.testing import AdapterMismatch, FamilyKit, check_adapter, check_goldens, write_goldens
from ppmedia.testing.tiny_models import PROTOCOL, family_name, load

ROOT = pathlib.Path(__file__).resolve().parents[1]
PLUGIN_DIR = ROOT / "tests" / "plugin"
LLAVA = "ppmedia_llava_plugin.tiny"


@pytest.fixture(scope="module")
def plugin_path():
    sys.path.insert(0, str(PLUGIN_DIR))
    yield
    sys.path.remove(str(PLUGIN_DIR))


@pytest.fixture(scope="module")
def llava(plugin_path):
    """The example plugin's family with its adapter given directly (no registry involved)."""
    from ppmedia_llava_plugin import LlavaAdapter

    return FamilyKit(LLAVA, adapter=LlavaAdapter)


# ---------------------------------------------------------------- tiny_models.load


def test_load_takes_names_dotted_names_and_modules(plugin_path):
    import ppmedia_llava_plugin.tiny as tiny

    assert load("kimi_vl").__name__ == "ppmedia.testing.tiny_models.kimi_vl"
    assert load(LLAVA) is tiny and load(tiny) is tiny
    assert family_name("kimi_vl") == "kimi_vl" and family_name(tiny) == LLAVA


def test_load_errors_say_what_is_expected():
    with pytest.raises(ValueError, match=r"unknown family 'nope'; expected a built-in tiny family \(qwen2_5_vl, .*\) or the dotted name"):
        load("nope")
    with pytest.raises(ValueError, match=r"tiny family 'no_such.module': cannot import it"):
        load("no_such.module")
    partial = types.ModuleType("partial_family")
    partial.MODEL_TYPE = "x"
    partial.build_model = lambda seed=0: None
    with pytest.raises(TypeError, match=r"partial_family lacks build_config, build_batch, reference_inputs; expected " + ", ".join(PROTOCOL)):
        load(partial)
    with pytest.raises(TypeError, match="got int"):
        load(3)


# ---------------------------------------------------------------- check_adapter


def test_a_correct_adapter_passes_for_every_split(llava):
    checks = llava.check_adapter(microbatches=[1, 2, 4, 8])
    assert [(c.n_microbatches, c.microbatch) for c in checks][:4] == [(1, 0), (2, 0), (2, 1), (4, 0)]
    assert len(checks) == 15 and max(c.max_abs_diff for c in checks) <= 1e-5
    # samples 4 and 5 are text-only: with 4 microbatches, microbatch 2 has no media
    assert [c.has_media for c in checks if c.n_microbatches == 4] == [True, True, False, True]
    assert [c.samples for c in checks if c.n_microbatches == 4] == [(0, 2), (2, 4), (4, 6), (6, 8)]


def _sabotaged(base, **methods):
    return type(f"Sabotaged{base.__name__}", (base,), methods)


def test_features_in_the_wrong_order_are_caught(llava):
    from ppmedia_llava_plugin import LlavaAdapter

    def encode(self, model, chunk, host):  # the images' feature blocks in reverse order
        features = LlavaAdapter.encode(self, model, chunk, host)["image"]
        return {"image": features.reshape(chunk.pixel_values.shape[0], 16, -1).flip(0).reshape(features.shape)}

    sabotaged = FamilyKit(LLAVA, adapter=_sabotaged(LlavaAdapter, encode=encode))
    sabotaged.__dict__.update(model=llava.model, batch=llava.batch, _captured=llava._captured)  # build once
    with pytest.raises(AdapterMismatch, match=r", 8 microbatches, microbatch 1 \(samples 1..1\): merged embeddings differ"):
        sabotaged.check_adapter(microbatches=[8])  # sample 1 is the one sample with two images
    with pytest.raises(AdapterMismatch) as info:
        sabotaged.check_adapter(microbatches=[4])
    message = str(info.value)
    # microbatch 0 (samples 0, 1) holds 3 images: the first microbatch with two images shows it
    assert message.startswith(
        "ppmedia_llava_plugin.tiny (adapter llava), 4 microbatches, microbatch 0 (samples 0..1): merged embeddings "
        "differ from the model's own by "
    ), message
    assert re.search(r"worst at sample [01], token \d+ \(a image placeholder\); \d+ of \d+ tokens differ$", message), message
    assert (info.value.family, info.value.n_microbatches, info.value.microbatch) == (LLAVA, 4, 0)


def test_media_shifted_to_the_wrong_microbatch_are_caught(llava):
    from ppmedia_llava_plugin import LlavaAdapter

    def media_per_sample(self, input_ids, config, *, media=None):  # one sample late: images land in the wrong microbatch
        images, videos = LlavaAdapter.media_per_sample(self, input_ids, config, media=media)
        return images.roll(1), videos

    sabotaged = FamilyKit(LLAVA, adapter=_sabotaged(LlavaAdapter, media_per_sample=media_per_sample))
    sabotaged.__dict__.update(model=llava.model, batch=llava.batch, _captured=llava._captured)
    # 1 and 2 microbatches: the counts still add up per microbatch. 4: samples 0, 1 hold 3 images (48
    # placeholder tokens) but the shifted counts give microbatch 0 only 2 images (32 feature rows)
    with pytest.raises(AdapterMismatch, match=r"^ppmedia_llava_plugin.tiny \(adapter llava\), 4 microbatches, microbatch 0 "
                       r"\(samples 0..1\): ValueError: image: .*48 placeholder tokens.*32") as info:
        sabotaged.check_adapter(microbatches=[1, 2, 4])
    assert info.value.microbatch == 0 and isinstance(info.value.__cause__, ValueError)


@pytest.fixture(scope="module")
def qwen():
    return FamilyKit("qwen2_5_vl")


def test_a_builtin_family_passes_with_its_positions(qwen):
    checks = qwen.check_adapter(microbatches=[1, 2, 4])
    assert len(checks) == 7 and qwen.positions is not None and qwen.positions.shape == (3, *qwen.batch["input_ids"].shape)


def test_a_builtin_family_sabotaged(qwen):
    base = type(qwen.adapter)

    def encode(self, model, chunk, host):  # right count, rows shifted by one
        return {k: torch.roll(v, 1, dims=0) for k, v in base.encode(self, model, chunk, host).items()}

    def position_ids(self, model, input_ids, chunk, attention_mask=None):  # images' positions off by one
        positions = base.position_ids(self, model, input_ids, chunk, attention_mask)
        return positions + (input_ids == model.config.image_token_id).to(positions.dtype)

    for sabotage, what in [(dict(encode=encode), "merged embeddings differ"), (dict(position_ids=position_ids), "position_ids")]:
        kit = FamilyKit("qwen2_5_vl", adapter=_sabotaged(base, **sabotage))
        kit.__dict__.update(model=qwen.model, batch=qwen.batch, _captured=qwen._captured)
        with pytest.raises(AdapterMismatch, match=rf"^qwen2_5_vl \(adapter qwen2_5_vl\), 4 microbatches, microbatch 0 \(samples 0..1\): {what}"):
            kit.check_adapter(microbatches=[4])


# ---------------------------------------------------------------- goldens


def test_the_kit_writes_the_projects_fixtures(tmp_path):
    from safetensors.torch import load_file

    from ppmedia.testing.goldens import regeneration_tolerance

    sizes = write_goldens("kimi_vl", tmp_path / "kimi_vl")
    assert set(sizes) == {"config.json", "inputs.safetensors", "expected.safetensors"}
    for name in ("config.json", "inputs.safetensors"):  # byte for byte; the expected floats within the tolerance
        assert (tmp_path / "kimi_vl" / name).read_bytes() == (ROOT / "fixtures" / "kimi_vl" / name).read_bytes(), name
    fresh = load_file(str(tmp_path / "kimi_vl" / "expected.safetensors"))["inputs_embeds"]
    on_disk = load_file(str(ROOT / "fixtures" / "kimi_vl" / "expected.safetensors"))["inputs_embeds"]
    assert fresh.shape == on_disk.shape and (fresh - on_disk).abs().max().item() <= regeneration_tolerance(on_disk)
    check_goldens("kimi_vl", ROOT / "fixtures" / "kimi_vl", microbatches=[1, 4])


def test_goldens_that_do_not_regenerate_are_named(llava, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "llava"
    with pytest.raises(AssertionError, match=r"no golden config.json, inputs.safetensors, expected.safetensors in .*write_goldens"):
        llava.check_goldens(folder)
    llava.write_goldens(folder)
    llava.check_goldens(folder, microbatches=[2])
    expected = load_file(str(folder / "expected.safetensors"))
    expected["inputs_embeds"][3, 5, 7] += 1e-3
    save_file(expected, str(folder / "expected.safetensors"))
    with pytest.raises(AssertionError, match=r"expected.safetensors does not regenerate within \S+ \(64 ulps of inputs_embeds's largest value \S+\): inputs_embeds max \|diff\| 0.001"):
        llava.check_goldens(folder)
    expected["inputs_embeds"][3, 5, 7] -= 1e-3 - 1e-7  # within the regeneration tolerance now, not bit for bit
    save_file(expected, str(folder / "expected.safetensors"))
    llava.check_goldens(folder, microbatches=[4])
    with pytest.raises(AssertionError, match=r"expected.safetensors does not regenerate bit for bit: inputs_embeds max \|diff\| 1e-07"):
        llava.check_goldens(folder, bit_identical=True)
    inputs = load_file(str(folder / "inputs.safetensors"))
    inputs["input_ids"][0, 0] += 1
    save_file(inputs, str(folder / "inputs.safetensors"))
    with pytest.raises(AssertionError, match=r"inputs.safetensors does not regenerate byte for byte: input_ids max \|diff\| 1"):
        llava.check_goldens(folder)


# ---------------------------------------------------------------- the pytest plugin


def test_pytest_plugin_loads_by_entry_point_without_transformers(tmp_path):
    (tmp_path / "test_uses_kit.py").write_text(
        "import sys\nimport pytest\n"
        "def test_fixture(ppmedia_kit, ppmedia_host_reads, tmp_path):\n"
        "    assert 'ppmedia.testing.pytest_plugin' in sys.modules\n"
        "    assert not [m for m in sys.modules if m.startswith('transformers')]\n"
        "    assert ppmedia_kit.write_goldens\n"
        "    import torch\n"
        "    torch.ones(2).sum().item()\n"
        "    assert ppmedia_host_reads.total == 1\n"
        "@pytest.mark.multiprocess\n"  # registered by the plugin: --strict-markers accepts it
        "def test_marked():\n"
        "    pass\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--strict-markers", "--ppmedia-write-goldens", str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    off = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:ppmedia", str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )
    assert off.returncode != 0 and "fixture 'ppmedia_kit' not found" in off.stdout


def test_kit_fixture_caches_families(ppmedia_kit, plugin_path):
    first = ppmedia_kit.family(LLAVA, plugins=["ppmedia_llava_plugin"])
    assert ppmedia_kit.family(LLAVA, plugins=["ppmedia_llava_plugin"]) is first
    assert ppmedia_kit.family(LLAVA) is not first
    assert first.adapter.name == "llava"
    assert [i.provider for i in first.registry.list() if i.name == "llava"] == ["ppmedia_llava_plugin (FamilyKit plugins)"]


# ---------------------------------------------------------------- docs


def test_docs_show_the_plugin_test_file_as_it_is():
    # docs/adding-a-family.md shows it under a `<!-- file: ... -->` comment, which tests/test_docs.py
    # compares with the file; here: that the page does show it, and verbatim
    page = (ROOT / "docs" / "adding-a-family.md").read_text()
    test_file = (PLUGIN_DIR / "tests" / "test_llava_plugin.py").read_text()
    marked = re.findall(r"<!-- file: tests/plugin/tests/test_llava_plugin.py -->\n```python\n(.*?)```", page, flags=re.S)
    assert marked == [test_file], "docs/adding-a-family.md must show tests/plugin/tests/test_llava_plugin.py verbatim"


def test_public_names_are_sorted_and_exported():
    import ppmedia.testing as testing

    assert testing.__all__ == sorted(testing.__all__)
    assert all(hasattr(testing, name) for name in testing.__all__)


# ---------------------------------------------------------------- merge checks what encode returned


@pytest.mark.parametrize("bug, message", [
    ("one row more", r"llava adapter: encode returned 49 rows \(shape \[49, 64\]\) of image features in microbatch 0; "
                     r"expected 48 rows, \[48, 64\] \(the image placeholder tokens, as feature_counts promised\)"),
    ("one row less", r"llava adapter: encode returned 47 rows \(shape \[47, 64\]\) of image features in microbatch 0; expected 48"),
    ("undeclared modality", r"llava adapter: encode returned 'images' features in microbatch 0, a modality placeholder_masks "
                            r"does not declare \(it declares 'image'\); expected only those"),
])
def test_encode_returning_what_feature_counts_did_not_promise_is_caught(llava, bug, message):
    from ppmedia_llava_plugin import LlavaAdapter

    def encode(self, model, chunk, host):
        features = LlavaAdapter.encode(self, model, chunk, host)["image"]
        if bug == "one row more":  # masked_scatter would drop it silently
            return {"image": torch.cat([features, features[:1]])}
        if bug == "one row less":  # masked_scatter would fail with a raw RuntimeError
            return {"image": features[:-1]}
        return {"images": features}  # scatter would fail with a raw KeyError

    sabotaged = FamilyKit(LLAVA, adapter=_sabotaged(LlavaAdapter, encode=encode))
    sabotaged.__dict__.update(model=llava.model, batch=llava.batch, _captured=llava._captured)
    with pytest.raises(AdapterMismatch, match=r"^ppmedia_llava_plugin.tiny \(adapter llava\), 4 microbatches, microbatch 0 "
                       r"\(samples 0..1\): ValueError: " + message) as info:
        sabotaged.check_adapter(microbatches=[4])
    assert info.value.microbatch == 0


# ---------------------------------------------------------------- the harness, the marker, the demo


def test_parity_refuses_a_rank_without_layers_in_one_line(capsys):
    from ppmedia.testing.parity import main, run_parity

    with pytest.raises(ValueError, match=r"^ZBVZeroBubble/static: 8 pipeline stages \(4 ranks x 2\) for the 2 decoder layers of "
                       r"llava_next \(per stage \[0, 1, 1, 0, 0, 0, 0, 0\]\): pipeline rank 3 would hold only stages \[3, 4\], "
                       r"without a layer; use at most 2 pipeline ranks for ZBVZeroBubble, or a schedule with one stage per rank$"):
        run_parity("llava_next", ["ZBVZeroBubble/static"], world_size=4)
    with pytest.raises(SystemExit) as exit_:  # the command line: one error line, exit status 2, nothing spawned
        main(["llava_next", "--scenario", "1f1b/static", "--world-size", "5"])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == ""
    assert err.splitlines() == [
        "python -m ppmedia.testing.parity: error: 1f1b/static: 5 pipeline stages (5 ranks x 1) for the 2 decoder layers of "
        "llava_next (per stage [0, 1, 1, 0, 0]): pipeline rank 3 would hold only stages [3], without a layer; use at most 4 "
        "pipeline ranks for 1F1B"]


def test_the_pytest_plugin_registers_the_multiprocess_marker(tmp_path):
    # with the plugin the marker is known (test_pytest_plugin_loads_by_entry_point_without_transformers runs the
    # same file with --strict-markers and passes); without it, --strict-markers refuses it
    (tmp_path / "test_marked.py").write_text("import pytest\n\n@pytest.mark.multiprocess\ndef test_spawns():\n    pass\n")
    off = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:ppmedia", "--strict-markers",
                          str(tmp_path)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert off.returncode != 0 and "'multiprocess' not found in `markers` configuration option" in off.stdout


def test_demo_takes_a_plugins_tiny_module(plugin_path, capsys):
    from ppmedia.cli import build_parser, main

    from ppmedia.cli.demo import selected_families

    args = build_parser().parse_args(["demo", "--family", LLAVA, "--steps", "1"])
    assert selected_families(args.family) == [LLAVA]
    both = build_parser().parse_args(["demo", "--family", "paligemma", "--family", LLAVA, "--family", "paligemma"])
    assert selected_families(both.family) == ["paligemma", LLAVA]  # both, in order, once each
    from ppmedia.testing.tiny_models import FAMILIES

    assert selected_families(build_parser().parse_args(["demo"]).family) == list(FAMILIES)
    from ppmedia.cli.demo import runs_finetune  # make demo (no --family) and --family all end with the fine-tune

    assert runs_finetune(build_parser().parse_args(["demo"]).family)
    assert runs_finetune(build_parser().parse_args(["demo", "--family", "all"]).family)
    assert not runs_finetune(args.family) and not runs_finetune(both.family)
    assert main(["demo", "--family", "no_such.tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ppmedia: error: argument --family: 'no_such.tiny': tiny family 'no_such.tiny': cannot import it"), err
    assert main(["demo", "--family", "nope"]) == 2
    assert "invalid choice: 'nope' (choose from all, qwen2_5_vl," in capsys.readouterr().err
