"""Registry: built-ins, alias table, run-time registration, entry-point plugins (faked like pluggy's tests)."""

import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import typing

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
    for name in [m for m in sys.modules if m.startswith(("ppmedia_llava_plugin", "broken_plugin", "bad_plugin", "lazy_plugin"))]:
        del sys.modules[name]


@pytest.mark.parametrize("family", FAMILIES)
def test_builtin_adapter_found_from_the_tiny_model(family):
    tiny = load(family)
    model = tiny.build_model()
    adapter = ppmedia.get_adapter(model)
    assert adapter.name == getattr(tiny, "ADAPTER", family)  # a variant names the adapter serving it
    assert model.config.model_type in adapter.model_types
    assert ppmedia.get_adapter(model.config) is adapter
    assert ppmedia.get_adapter(model.config.model_type) is adapter


def test_every_declared_model_type_and_alias_resolves():
    registry = AdapterRegistry(entry_point_group=None)
    expected = {"qwen2_5_vl": "qwen2_5_vl", "qwen2_vl": "qwen2_5_vl", "llava_next": "llava_next", "step3_vl": "step3",
                "step3p7": "step3", "kimi_vl": "kimi_vl", "kimi_k25": "kimi_vl", "qwen2_5_vl_text": "qwen2_5_vl",
                "kimi-vl": "kimi_vl", "llava-next": "llava_next", "qwen3_vl": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl",
                "qwen3_5": "qwen3_vl", "qwen3_5_moe": "qwen3_vl", "gemma3": "gemma3", "mistral3": "mistral3",
                "mistral_large4": "mistral_large4", "llava": "llava", "minimax_m3_vl": "minimax_m3_vl",
                "inkling2": "inkling2", "gemma4": "gemma4", "qwen2_5_omni_thinker": "qwen2_5_omni",
                "qwen2_5_omni": "qwen2_5_omni", "qwen3_omni_moe_thinker": "qwen3_omni", "qwen3_omni_moe": "qwen3_omni",
                "qwen3_omni": "qwen3_omni", "inkling_mm_model": "inkling", "inkling": "inkling",
                "llava_onevision": "llava_onevision", "idefics3": "idefics3", "smolvlm": "smolvlm",
                "paligemma": "paligemma", "aya_vision": "aya_vision", "llama4": "llama4", "internvl": "internvl",
                "glm4v": "glm4v", "glm4v_moe": "glm4v", "glm46v": "glm4v", "ernie4_5_vl_moe": "ernie4_5_vl_moe"}

    for model_type, name in expected.items():
        assert registry.get(model_type).name == name, model_type
    assert [i.name for i in registry.list()] == ["qwen2_5_vl", "llava_next", "step3", "kimi_vl", "qwen3_vl", "gemma3",
                                                 "mistral3", "mistral_large4", "llava", "minimax_m3_vl", "inkling2",
                                                 "gemma4", "qwen2_5_omni", "qwen3_omni", "inkling",
                                                 "llava_onevision", "idefics3", "smolvlm", "paligemma", "aya_vision",
                                                 "llama4", "internvl", "glm4v", "ernie4_5_vl_moe", "phi4_multimodal",
                                                 "video_llama_3"]
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
    (type("BadMerge", (_Claims,), {"merge_path": "model..extend"}),
     r"BadMerge.merge_path is 'model..extend'; expected None or a dotted module path such as 'model.embed_tokens_extend'"),
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
    registry = AdapterRegistry()
    for _ in range(2):  # and again on the next use: never a registry without the plugin
        with pytest.raises(PluginError, match=r"ppmedia plugin broken \(broken-dist 2.0\): entry point broken = broken_plugin .*failed to import: ImportError: needs a library"):
            registry.get("qwen2_5_vl")


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
        "class Twin(LlavaAdapter):\n    name = 'twin'\n    override = False\n"
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
    assert {f.__name__ for f in specs} == {"ppmedia_adapter_paths", "ppmedia_adapters", "ppmedia_media_layouts",
                                           "ppmedia_model_type_aliases"}
    for f in specs:
        body = inspect.getsource(f).split('"""')
        assert len(body) == 3 and body[2].strip() == "", f.__name__


# ---------------------------------------------------------------- lazy table (the built-ins, plugins' rows)

_LOOKUP_SCRIPT = """
import json, sys
import ppmedia
try:
    ppmedia.get_adapter(sys.argv[1])
except ValueError as exc:
    error = str(exc)
else:
    error = None
print(json.dumps({"modules": sorted(m for m in sys.modules if m.startswith(("ppmedia.adapters.", "transformers.models."))),
                  "error": error}))
"""


def _lookups_in_fresh_processes(model_types):
    env = {k: v for k, v in os.environ.items() if k != "PPMEDIA_PLUGINS"}
    procs = {t: subprocess.Popen([sys.executable, "-c", _LOOKUP_SCRIPT, t], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=env) for t in model_types}
    out = {}
    for t, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        out[t] = json.loads(stdout.strip().splitlines()[-1])
    return out


def test_a_lookup_imports_only_that_family():
    from ppmedia.adapters.builtin import ADAPTERS

    families = {path.split(":")[0] for path in ADAPTERS.values()}
    seen = _lookups_in_fresh_processes(["qwen2_5_vl", "step3p7", "gpt2"])
    qwen = seen["qwen2_5_vl"]["modules"]
    assert [m for m in qwen if m in families] == ["ppmedia.adapters.qwen2_5_vl"]
    assert not [m for m in qwen if m.startswith("transformers.models.") and "qwen" not in m], qwen  # no LLaVA-NeXT modeling
    assert [m for m in seen["step3p7"]["modules"] if m in families] == ["ppmedia.adapters.step3"]
    unknown = seen["gpt2"]
    assert not [m for m in unknown["modules"] if m in families]  # the error lists types without importing any family
    for known in ADAPTERS:
        assert known in unknown["error"]


def test_builtin_rows_match_the_adapters_model_types():
    from ppmedia.adapters.builtin import ADAPTERS

    registry = AdapterRegistry(entry_point_group=None, plugins_env=None)
    by_path = {}
    for model_type, path in ADAPTERS.items():
        by_path.setdefault(path, set()).add(model_type)
    for path, types in by_path.items():
        adapter = registry.get(next(iter(types)))
        assert set(adapter.model_types) == types, path
        assert all(registry.get(t) is adapter for t in types)  # rows sharing a path share one adapter


def test_builtin_aliases_come_through_the_hook():
    import ppmedia.registry as registry_module
    from ppmedia.adapters import builtin

    assert not hasattr(registry_module, "MODEL_TYPE_ALIASES")  # no family knowledge in the generic registry
    bare = AdapterRegistry(entry_point_group=None, builtins=False, plugins_env=None)
    assert bare.aliases() == {} and bare.model_types() == []
    with pytest.raises(UnknownModelTypeError, match="known model types: ."):
        bare.get("kimi-vl")
    full = AdapterRegistry(entry_point_group=None, plugins_env=None)
    assert full.aliases() == builtin.MODEL_TYPE_ALIASES
    assert full.get("kimi-vl").name == "kimi_vl"


def test_get_adapter_is_typed():
    from ppmedia.adapters.base import VlmAdapter
    from ppmedia.registry import AdapterRegistry as Registry

    assert typing.get_type_hints(ppmedia.get_adapter)["return"] is VlmAdapter
    assert typing.get_type_hints(Registry.get)["return"] is VlmAdapter
    assert typing.get_type_hints(ppmedia.registry.AdapterInfo)["adapter"] is VlmAdapter


def _write(tmp_path, name, source):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))


_LAZY_IMPL = """
    from tests_registry_support import Tiny
    class LazyTiny(Tiny):
        name = "lazy_tiny"
        model_types = ("tiny_a", "tiny_b")
"""


@pytest.fixture
def support(tmp_path, monkeypatch):
    """An importable module with a minimal adapter class, plus tmp_path on sys.path for inline plugins."""
    _write(tmp_path, "tests_registry_support", """
        from ppmedia.adapters.base import VlmAdapter
        class Tiny(VlmAdapter):
            name = "tiny"
            model_types = ("tiny",)
            layout = "test"
            def media_per_sample(self, input_ids, config, *, media=None): raise NotImplementedError
            def placeholder_masks(self, input_ids, config): raise NotImplementedError
            def feature_counts(self, chunk, config, host): raise NotImplementedError
            def encode(self, model, chunk, host): raise NotImplementedError
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith(("tests_registry_support", "lazy_plugin"))]:
        del sys.modules[name]


def test_plugin_rows_are_imported_on_first_lookup(support):
    _write(support, "lazy_plugin_impl", _LAZY_IMPL)
    _write(support, "lazy_plugin", """
        import ppmedia
        @ppmedia.hookimpl
        def ppmedia_adapter_paths():
            return {"tiny_a": "lazy_plugin_impl:LazyTiny", "tiny_b": "lazy_plugin_impl:LazyTiny"}
    """)
    import lazy_plugin

    registry = AdapterRegistry(entry_point_group=None, plugins_env=None)
    registry.register_plugin(lazy_plugin, provider="lazy-tests")
    assert "lazy_plugin_impl" not in sys.modules and registry.model_types()[-2:] == ["tiny_a", "tiny_b"]
    adapter = registry.get("tiny_b")
    assert "lazy_plugin_impl" in sys.modules and adapter.name == "lazy_tiny" and registry.get("tiny_a") is adapter
    assert [(i.name, i.provider) for i in registry.list()][-1] == ("lazy_tiny", "lazy-tests")


@pytest.mark.parametrize("row, problem", [
    ("lazy_plugin_impl", r"'lazy_plugin_impl'; expected 'package.module:Class'"),
    ("lazy_plugin_missing:LazyTiny", r"lazy_plugin_missing:LazyTiny \(model type 'tiny_a'\) failed to import: ModuleNotFoundError"),
    ("lazy_plugin_impl:Nope", r"lazy_plugin_impl:Nope \(model type 'tiny_a'\) failed to import: AttributeError"),
    ("lazy_plugin_impl:LazyTiny.name", r"got str 'lazy_tiny'; expected a ppmedia.adapters.base.VlmAdapter"),
])
def test_bad_plugin_rows_name_the_provider_and_the_row(support, row, problem):
    _write(support, "lazy_plugin_impl", _LAZY_IMPL)
    registry = AdapterRegistry(entry_point_group=None, plugins_env=None)

    class Plugin:
        @ppmedia.hookimpl
        def ppmedia_adapter_paths(self):
            return {"tiny_a": row}

    with pytest.raises(PluginError, match=rf"^ppmedia plugin rows: .*{problem}") as info:
        registry.register_plugin(Plugin(), provider="rows")
        registry.get("tiny_a")
    assert info.value.provider == "rows"


def test_a_row_whose_class_does_not_serve_it(support):
    _write(support, "lazy_plugin_impl", _LAZY_IMPL)

    class Plugin:
        @ppmedia.hookimpl
        def ppmedia_adapter_paths(self):
            return {"tiny_c": "lazy_plugin_impl:LazyTiny"}

    registry = AdapterRegistry(entry_point_group=None, plugins_env=None)
    registry.register_plugin(Plugin(), provider="rows")
    with pytest.raises(PluginError, match=r"maps 'tiny_c' to lazy_plugin_impl:LazyTiny, whose model_types are \('tiny_a', 'tiny_b'\)"):
        registry.get("tiny_c")


def test_a_row_claiming_a_builtin_type_names_both_providers():
    class Plugin:
        @ppmedia.hookimpl
        def ppmedia_adapter_paths(self):
            return {"kimi_vl": "somewhere:Else"}

    registry = AdapterRegistry(entry_point_group=None, plugins_env=None)
    with pytest.raises(PluginError) as info:
        registry.register_plugin(Plugin(), provider="claimer")
    assert "model type 'kimi_vl' is claimed by two adapters: kimi_vl from ppmedia (built-in) and somewhere:Else from claimer" in str(info.value)
    assert (info.value.provider, info.value.other_provider) == ("claimer", "ppmedia (built-in)")
    assert registry.get("kimi_vl").name == "kimi_vl"


# ---------------------------------------------------------------- hooks checked (pluggy's check_pending)

class _Misspelled:
    @ppmedia.hookimpl
    def ppmedia_adapter(self):  # should be ppmedia_adapters
        return [_Claims]


def test_misspelled_hook_names_the_hook_and_the_provider():
    registry = AdapterRegistry(entry_point_group=None, plugins_env=None)
    plugin = _Misspelled()
    with pytest.raises(PluginError) as info:
        registry.register_plugin(plugin, provider="my-plugin 1.0")
    assert str(info.value) == ("ppmedia plugin my-plugin 1.0: hook ppmedia_adapter is not a ppmedia hook; "
                               "did you mean ppmedia_adapters?")
    assert (info.value.provider, info.value.hook) == ("my-plugin 1.0", "ppmedia_adapter")
    assert not registry.plugin_manager.is_registered(plugin)  # nothing of it stays
    registry.register_plugin(_Unrelated(), provider="next")  # and the next plugin is not blamed for it


class _Unrelated:
    @ppmedia.hookimpl
    def ppmedia_model_type_aliases(self):
        return {"mine": "llava_next"}


def test_misspelled_hook_in_an_entry_point_plugin(fake_dists, tmp_path, monkeypatch):
    dists, _ = fake_dists
    (tmp_path / "bad_plugin_typo.py").write_text(
        "import ppmedia\n@ppmedia.hookimpl\ndef ppmedia_model_type_alias():\n    return {}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    dists.append(FakeDist("typo-dist", ("typo", "bad_plugin_typo"), version="3.1"))
    with pytest.raises(PluginError, match=r"^ppmedia plugin typo \(typo-dist 3.1\): hook ppmedia_model_type_alias is not a ppmedia hook; did you mean ppmedia_model_type_aliases\?$") as info:
        AdapterRegistry().get("qwen2_5_vl")
    assert info.value.hook == "ppmedia_model_type_alias"


def test_unmarked_hook_and_hookless_plugins_are_errors():
    class Unmarked:
        def ppmedia_adapters(self):
            return [_Claims]

    registry = AdapterRegistry(entry_point_group=None, plugins_env=None)
    with pytest.raises(PluginError, match=r"^ppmedia plugin u: ppmedia_adapters is not marked with @ppmedia.hookimpl"):
        registry.register_plugin(Unmarked(), provider="u")
    with pytest.raises(PluginError, match=r"^ppmedia plugin empty: provides no ppmedia hook"):
        registry.register_plugin(object(), provider="empty")


def test_plugins_named_in_the_environment(fake_dists, monkeypatch):
    dists, _ = fake_dists
    dists.append(FakeDist("ppmedia-llava-plugin", ("llava", "ppmedia_llava_plugin")))
    monkeypatch.setenv("PPMEDIA_PLUGINS", "ppmedia_llava_plugin, ")
    registry = AdapterRegistry()
    assert [i.provider for i in registry.list() if i.name == "llava"] == ["llava (ppmedia-llava-plugin 0.1.0)"]  # once
    monkeypatch.setenv("PPMEDIA_PLUGINS", "ppmedia_llava_plugin")
    registry = AdapterRegistry(entry_point_group=None)
    assert registry.get("llava_1_5").name == "llava"
    assert [i.provider for i in registry.list() if i.name == "llava"] == ["ppmedia_llava_plugin (PPMEDIA_PLUGINS)"]
    monkeypatch.setenv("PPMEDIA_PLUGINS", "no_such_plugin_module")
    with pytest.raises(PluginError, match=r"^ppmedia plugin no_such_plugin_module \(PPMEDIA_PLUGINS\): module no_such_plugin_module failed to import"):
        AdapterRegistry(entry_point_group=None).get("qwen2_5_vl")


def test_a_class_named_by_a_row_and_returned_eagerly_is_one_adapter():
    # e.g. a family added to adapters/builtin.py in both forms: no conflict, one adapter for its rows
    from ppmedia.adapters.kimi_vl import KimiVLAdapter

    class Plugin:
        @ppmedia.hookimpl
        def ppmedia_adapter_paths(self):
            return {"kimi_vl": "ppmedia.adapters.kimi_vl:KimiVLAdapter", "kimi_k25": "ppmedia.adapters.kimi_vl:KimiVLAdapter"}

        @ppmedia.hookimpl
        def ppmedia_adapters(self):
            return [KimiVLAdapter]

    registry = AdapterRegistry(entry_point_group=None, builtins=False, plugins_env=None)
    registry.register_plugin(Plugin(), provider="both-forms")
    assert registry.get("kimi_vl") is registry.get("kimi_k25")
    assert [i.name for i in registry.list()] == ["kimi_vl"]
