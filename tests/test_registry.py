"""Registry: built-ins, alias table, run-time registration, entry-point plugins (faked like pluggy's tests)."""

import importlib.metadata
import pathlib
import sys

import pytest
import torch

import ppmedia
from ppmedia.adapters.base import VlmAdapter
from ppmedia.registry import AdapterRegistry, PluginError, UnknownModelTypeError
from ppmedia.testing.tiny_models import FAMILIES, capture_merged_embeds, load

PLUGIN_DIR = pathlib.Path(__file__).parent / "plugin"


class FakeDist:
    """Stands in for an installed distribution: what importlib.metadata.distributions() yields."""

    def __init__(self, name, *entry_points, version="0.1.0"):
        self.metadata = {"name": name}
        self.version = version
        self.entry_points = [importlib.metadata.EntryPoint(n, v, "ppmedia.adapters") for n, v in entry_points]


@pytest.fixture
def fake_dists(monkeypatch):
    dists = []
    calls = []

    def distributions():
        calls.append(1)
        return list(dists)

    monkeypatch.setattr(importlib.metadata, "distributions", distributions)
    monkeypatch.syspath_prepend(str(PLUGIN_DIR))
    yield dists, calls
    for name in [m for m in sys.modules if m.startswith(("ppmedia_llava_plugin", "broken_plugin", "bad_plugin"))]:
        del sys.modules[name]


@pytest.mark.parametrize("family", FAMILIES)
def test_builtin_adapter_found_from_the_tiny_model(family):
    tiny = load(family)
    model = tiny.build_model()
    adapter = ppmedia.get_adapter(model)
    assert adapter.name == family
    assert model.config.model_type in adapter.model_types
    assert ppmedia.get_adapter(model.config) is adapter
    assert ppmedia.get_adapter(model.config.model_type) is adapter


def test_every_declared_model_type_and_alias_resolves():
    registry = AdapterRegistry(entry_point_group=None)
    expected = {"qwen2_5_vl": "qwen2_5_vl", "qwen2_vl": "qwen2_5_vl", "llava_next": "llava_next", "step3_vl": "step3",
                "step3p7": "step3", "kimi_vl": "kimi_vl", "kimi_k25": "kimi_vl", "qwen2_5_vl_text": "qwen2_5_vl",
                "kimi-vl": "kimi_vl", "llava-next": "llava_next"}
    for model_type, name in expected.items():
        assert registry.get(model_type).name == name, model_type
    assert [i.name for i in registry.list()] == ["qwen2_5_vl", "llava_next", "step3", "kimi_vl"]
    assert {i.provider for i in registry.list()} == {"ppmedia (built-in)"}


def test_unknown_type_lists_the_known_ones():
    registry = AdapterRegistry(entry_point_group=None)
    with pytest.raises(UnknownModelTypeError) as info:
        registry.get("gpt2")
    message = str(info.value)
    assert "no ppmedia adapter for model type 'gpt2'" in message
    for known in ("qwen2_5_vl", "llava_next", "step3p7", "kimi_k25"):
        assert known in message
    assert isinstance(info.value, ValueError)


def test_objects_without_a_model_type():
    with pytest.raises(TypeError, match="expected a model"):
        AdapterRegistry(entry_point_group=None).get(torch.nn.Linear(1, 1))


class _Claims(VlmAdapter):
    name = "mine"
    model_types = ("llava_next", "mine_vl")
    layout = "test"

    def media_per_sample(self, input_ids, config, *, media=None):
        raise NotImplementedError

    def placeholder_masks(self, input_ids, config):
        raise NotImplementedError

    def feature_counts(self, chunk, config, host):
        raise NotImplementedError

    def encode(self, model, chunk, host):
        raise NotImplementedError


def test_two_providers_for_one_type_is_an_error_naming_both():
    registry = AdapterRegistry(entry_point_group=None)
    with pytest.raises(PluginError, match=r"'llava_next' is claimed by two adapters: llava_next from ppmedia \(built-in\) and mine from my-tests"):
        registry.register_adapter(_Claims, provider="my-tests")
    assert registry.get("llava_next").name == "llava_next"
    with pytest.raises(UnknownModelTypeError):
        registry.get("mine_vl")  # nothing half-registered


def test_override_replaces():
    registry = AdapterRegistry(entry_point_group=None)
    info = registry.register_adapter(_Claims(), override=True)
    assert registry.get("llava_next") is info.adapter and registry.get("mine_vl") is info.adapter
    assert info.provider == f"register_adapter() from {__name__}"


@pytest.mark.parametrize("bad, match", [
    (object(), "got object"),
    (type("NoTypes", (_Claims,), {"model_types": ()}), r"NoTypes.model_types is \(\); expected a non-empty tuple"),
    (type("NoName", (_Claims,), {"name": ""}), r"NoName.name is ''"),
])
def test_malformed_adapters_name_the_provider(bad, match):
    with pytest.raises(PluginError, match=rf"ppmedia plugin tester: .*{match}"):
        AdapterRegistry(entry_point_group=None).register_adapter(bad, provider="tester")


def test_entry_point_plugin_end_to_end(fake_dists):
    dists, calls = fake_dists
    dists.append(FakeDist("ppmedia-llava-plugin", ("llava", "ppmedia_llava_plugin")))
    registry = AdapterRegistry()
    assert calls == []  # lazily: nothing scanned before first use
    infos = {i.name: i for i in registry.list()}
    registry.get("qwen2_5_vl")
    assert calls == [1]  # scanned once
    assert infos["llava"].provider == "llava (ppmedia-llava-plugin 0.1.0)"
    assert registry.get("llava_1_5") is infos["llava"].adapter  # the plugin's alias

    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                       image_size=16, patch_size=4),
        text_config=LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2),
        image_token_id=127,
    )
    model = LlavaForConditionalGeneration(config).eval()
    adapter = registry.get(model)
    assert adapter.name == "llava"
    # 4 samples: 1, 0, 2, 1 images of 16 tokens each
    gen = torch.Generator().manual_seed(1)
    counts = [1, 0, 2, 1]
    rows = []
    for c in counts:
        ids = torch.randint(3, 100, (44,), generator=gen)
        for j in range(c):
            ids[2 + j * 20 : 2 + j * 20 + 16] = 127
        rows.append(ids)
    input_ids = torch.stack(rows)
    pixels = torch.randn(4, 3, 16, 16, generator=gen)
    reference = capture_merged_embeds(model, input_ids=input_ids, pixel_values=pixels)
    images, _ = adapter.media_per_sample(input_ids, config)
    assert images.tolist() == counts
    batch = {"input_ids": input_ids, "pixel_values": pixels}
    staged = ppmedia.split_media(batch, 4, images_per_sample=images)
    stage = torch.nn.Module()
    with ppmedia.stage_media(stage, staged), torch.no_grad():
        for k in range(4):
            ids = input_ids[k : k + 1]
            chunk = ppmedia.next_vlm_media_chunk(stage)
            assert (chunk is None) == (counts[k] == 0)
            merged = adapter.merge(model, ids, model.get_input_embeddings()(ids), chunk)
            torch.testing.assert_close(merged, reference[k : k + 1], atol=1e-5, rtol=0)


def test_plugin_that_fails_to_import_names_itself(fake_dists, tmp_path, monkeypatch):
    dists, _ = fake_dists
    (tmp_path / "broken_plugin.py").write_text("raise ImportError('needs a library that is not installed')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    dists.append(FakeDist("broken-dist", ("broken", "broken_plugin"), version="2.0"))
    with pytest.raises(PluginError, match=r"ppmedia plugin broken \(broken-dist 2.0\): entry point broken = broken_plugin .*failed to import: ImportError: needs a library"):
        AdapterRegistry().get("qwen2_5_vl")


def test_plugin_returning_garbage_names_itself(fake_dists, tmp_path, monkeypatch):
    dists, _ = fake_dists
    (tmp_path / "bad_plugin.py").write_text(
        "import ppmedia\n@ppmedia.hookimpl\ndef ppmedia_adapters():\n    return [42]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    dists.append(FakeDist("bad-dist", ("bad", "bad_plugin")))
    with pytest.raises(PluginError, match=r"ppmedia plugin bad \(bad-dist 0.1.0\): got int 42; expected a ppmedia.adapters.base.VlmAdapter"):
        AdapterRegistry().list()


def test_two_plugins_claiming_one_type(fake_dists, tmp_path, monkeypatch):
    dists, _ = fake_dists
    dists.append(FakeDist("ppmedia-llava-plugin", ("llava", "ppmedia_llava_plugin")))
    (tmp_path / "bad_plugin_twin.py").write_text(
        "import ppmedia\nfrom ppmedia_llava_plugin import LlavaAdapter\n"
        "class Twin(LlavaAdapter):\n    name = 'twin'\n"
        "@ppmedia.hookimpl\ndef ppmedia_adapters():\n    return [Twin]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    dists.append(FakeDist("twin-dist", ("twin", "bad_plugin_twin")))
    with pytest.raises(PluginError, match=r"'llava' is claimed by two adapters: llava from llava \(ppmedia-llava-plugin 0.1.0\) and twin from twin \(twin-dist 0.1.0\)"):
        AdapterRegistry().list()


def test_hookspecs_are_docstring_only_and_prefixed():
    import inspect

    from ppmedia.registry import hookspecs

    specs = [f for n, f in vars(hookspecs).items() if inspect.isfunction(f) and hasattr(f, "ppmedia_spec")]
    assert {f.__name__ for f in specs} == {"ppmedia_adapters", "ppmedia_model_type_aliases"}
    for f in specs:
        body = inspect.getsource(f).split('"""')
        assert len(body) == 3 and body[2].strip() == "", f.__name__
