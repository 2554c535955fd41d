"""Stages straight from a Hugging Face checkpoint (``stages_from_pretrained``) and back
(``save_pretrained_stages``), for every built-in family and model type, in one process.

Every tiny model is written with ``save_pretrained`` in 40 KB shards (9-21 files) once per module.

* Each stage equals the same stage cut from ``from_pretrained(path, dtype=...)``, tensor for tensor:
  parameter and buffer names, dtypes and values (non-persistent buffers such as rotary ``inv_freq``
  included), float32 and bfloat16, 2 and 3 stages and an uneven split. Without the buffers'
  computation the comparison fails (a planted bug, below).
* The shard files a rank opens (the kernel's inotify events on the checkpoint directory) are exactly
  those holding its stages' tensors, found independently with transformers' save-side mapping.
* A missing tensor, an unexpected one, a damaged or truncated shard: ``ValueError`` naming it.
* The export round trip is exact: ``from_pretrained`` of the export loads with no missing, unexpected
  or mismatched keys, equal tensors, and the files hold the names ``save_pretrained`` writes
  (per-expert MoE tensors where the class stores them so).

The 2-process pipeline built from a checkpoint rides in test_pipeline_mp.py's spawns (``pretrained``
scenario); ``--model`` / ``--export`` of examples/train.py in test_train_data.py.
"""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import shutil
import struct
from typing import Any

import pytest
import torch
import transformers

import ppmedia.testing.tiny_models as tiny
from ppmedia import pipeline
from ppmedia.pipeline import build_stage_modules, save_pretrained_stages, stages_from_pretrained
from ppmedia.pipeline import pretrained as pretrained_module
from ppmedia.testing.tiny_models import kimi_vl, qwen3_vl

#: every model type a built-in adapter serves that transformers itself can load (step3_vl and kimi_vl
#: are remote code: refused below), with a tiny model each
VARIANTS = ("qwen2_5_vl", "qwen2_vl", "llava_next", "step3p7", "kimi_k25", "qwen3_vl", "qwen3_vl_moe", "qwen3_5",
            "qwen3_5_moe", "gemma3", "mistral3", "mistral_large4", "mistral_small4", "llava", "llava_pixtral",
            "minimax_m3_vl", "inkling2", "idefics3", "paligemma",  # idefics3: LM at model.text_model; paligemma: Gemma 2, tied head
            "gemma4", "qwen2_5_omni_thinker", "qwen3_omni_moe_thinker", "inkling_mm_model")
#: model type -> its tiny family, where the names differ
_FAMILY_OF = {"step3p7": "step3", "qwen2_5_omni_thinker": "qwen2_5_omni", "qwen3_omni_moe_thinker": "qwen3_omni",
              "inkling_mm_model": "inkling"}


def splits(model_layers: int) -> tuple[tuple[int, Any], ...]:
    """2 and 3 stages by the default split, and an uneven 2-stage split (every layer on the last)."""
    return ((2, None), (3, None), (2, (0, model_layers)))


def _qwen2_vl(seed: int) -> torch.nn.Module:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from ppmedia.testing.tiny_models import qwen2_5_vl as q

    config = Qwen2VLConfig(
        text_config={"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": q.PAD_TOKEN_ID,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2,
                       "patch_size": q.PATCH_SIZE, "temporal_patch_size": q.TEMPORAL_PATCH_SIZE,
                       "spatial_merge_size": q.MERGE},
        image_token_id=q.IMAGE_TOKEN_ID, video_token_id=q.VIDEO_TOKEN_ID,
        vision_start_token_id=q.VISION_START_TOKEN_ID, vision_end_token_id=q.VISION_END_TOKEN_ID,
    )
    return tiny.seeded(Qwen2VLForConditionalGeneration, config, seed)


def build_variant(variant: str, seed: int = 0) -> torch.nn.Module:
    if variant == "qwen2_vl":
        return _qwen2_vl(seed)
    if variant == "kimi_k25":
        return kimi_vl.build_checkpoint_model(seed)  # q_lora_rank set: see test_kimi_without_q_lora_is_refused
    if variant in qwen3_vl.VARIANTS:
        return qwen3_vl.build_variant(variant, seed)
    return tiny.load(_FAMILY_OF.get(variant, variant)).build_model(seed)


@pytest.fixture(scope="module", autouse=True)
def quiet_transformers():
    verbosity, threads = transformers.logging.get_verbosity(), torch.get_num_threads()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)  # tiny models: more intra-op threads only spin
    yield
    transformers.logging.set_verbosity(verbosity)
    transformers.utils.logging.enable_progress_bar()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(variant)``: the directory of its tiny model written in 40 KB shards (once per module)."""
    root = tmp_path_factory.mktemp("checkpoints")
    made: dict[str, pathlib.Path] = {}

    def get(variant: str) -> pathlib.Path:
        if variant not in made:
            build_variant(variant).save_pretrained(root / variant, max_shard_size="40KB")
            made[variant] = root / variant
        return made[variant]

    return get


def _class_of(path: pathlib.Path) -> Any:
    return getattr(transformers, json.loads((path / "config.json").read_text())["architectures"][0])


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters(remove_duplicate=False)), **dict(module.named_buffers(remove_duplicate=False))}


def _assert_same(got: torch.nn.Module, want: torch.nn.Module, where: str) -> None:
    a, b = _tensors(got), _tensors(want)
    assert a.keys() == b.keys(), f"{where}: {sorted(a.keys() ^ b.keys())}"
    for name in a:
        assert a[name].dtype == b[name].dtype, f"{where}: {name} {a[name].dtype} vs {b[name].dtype}"
        assert torch.equal(a[name], b[name]), f"{where}: {name} differs"


def _non_persistent(module: torch.nn.Module) -> list[str]:
    return [f"{p}.{b}" if p else b for p, sub in module.named_modules() for b in sub._non_persistent_buffers_set]


# ----------------------------------------------------------------------------------------------
# every stage equals the stage cut from from_pretrained


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_stage_equals_the_stage_cut_from_from_pretrained(checkpoint, variant, dtype):
    path = checkpoint(variant)
    reference = _class_of(path).from_pretrained(path, dtype=dtype)
    buffers = []
    for n_stages, layers in splits(len(pipeline.find_language_model(reference)[1].layers)):
        modules = stages_from_pretrained(path, n_stages, layers_per_stage=layers, dtype=dtype)
        cut = build_stage_modules(reference, n_stages, layers_per_stage=layers)
        assert [m.stage_index for m in modules] == list(range(n_stages))
        for got, want in zip(modules, cut):
            where = f"{variant} {dtype} {n_stages} stages {layers} stage {got.stage_index}"
            _assert_same(got, want, where)
            assert not any(m.training for m in got.modules()), where  # eval, as from_pretrained leaves a model
            assert got.tied == want.tied, where
        buffers += [name for m in modules for name in _non_persistent(m)]
    assert buffers, f"{variant}: a stage with non-persistent (rotary) buffers to compare"
    # a rank building only its stage gets the same stage
    (alone,) = stages_from_pretrained(path, 3, stages=[2], dtype=dtype)
    _assert_same(alone, build_stage_modules(reference, 3, stages=[2])[0], f"{variant} stage 2 alone")


def test_without_computing_the_non_persistent_buffers_the_comparison_fails(checkpoint, monkeypatch):
    """The planted bug: non-persistent buffers allocated but not computed (what ``to_empty`` leaves)."""
    path = checkpoint("qwen2_5_vl")
    reference = build_stage_modules(transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(path), 2)

    class Uninitialised:
        def __init__(self, model: Any) -> None:
            self.model = model

        def __getattr__(self, name: str) -> Any:
            return (lambda: None) if name == "initialize_weights" else getattr(self.model, name)

    real = pretrained_module._computed_buffers
    monkeypatch.setattr(pretrained_module, "_computed_buffers",
                        lambda model, modules, plan, device: real(Uninitialised(model), modules, plan, device))
    modules = stages_from_pretrained(path, 2)
    with pytest.raises(AssertionError, match="inv_freq"):
        for got, want in zip(modules, reference):
            _assert_same(got, want, "planted")


def test_tied_lm_head_on_the_last_stage_is_the_embedding_from_the_checkpoint(checkpoint):
    path = checkpoint("gemma3")  # lm_head tied to the embedding: the file holds the embedding only
    with open(path / "model.safetensors.index.json") as fh:
        assert not any("lm_head" in k for k in json.load(fh)["weight_map"])
    first, last = stages_from_pretrained(path, 2)
    embedding = first.get_parameter("model.language_model.embed_tokens.weight")
    assert torch.equal(last.get_parameter("lm_head.weight"), embedding)
    [group] = first.tied
    assert group.names == ("model.language_model.embed_tokens.weight", "lm_head.weight")
    (whole,) = stages_from_pretrained(path, 1)  # one stage holds both: one tensor, as tie_weights makes it
    assert whole.get_parameter("lm_head.weight") is whole.get_parameter("model.language_model.embed_tokens.weight")


# ----------------------------------------------------------------------------------------------
# a rank opens only the shards holding its tensors


class OpenedFiles:
    """The names of files opened in a directory while the block runs: the kernel's inotify ``IN_OPEN``
    events (any open by this process, from Python or from safetensors' Rust code alike)."""

    IN_OPEN, IN_NONBLOCK = 0x20, 0o4000

    def __init__(self, directory: pathlib.Path) -> None:
        self.directory = directory
        self.names: set[str] = set()

    def __enter__(self) -> "OpenedFiles":
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(self.IN_NONBLOCK)
        assert self.fd >= 0 and self.libc.inotify_add_watch(self.fd, os.fsencode(self.directory), self.IN_OPEN) >= 0
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            while True:
                data = os.read(self.fd, 1 << 16)
                offset = 0
                while offset < len(data):
                    _, _, _, length = struct.unpack_from("iIII", data, offset)
                    name = data[offset + 16 : offset + 16 + length].rstrip(b"\0").decode()
                    if name:
                        self.names.add(name)
                    offset += 16 + length
        except BlockingIOError:
            pass
        finally:
            os.close(self.fd)


def _files_holding(path: pathlib.Path, stage: Any, reference: Any) -> set[str]:
    """The shards holding ``stage``'s tensors, by transformers' own save-side mapping of the reference
    model (``revert_weight_conversion``; a tie's target is read from its source)."""
    from transformers.core_model_loading import revert_weight_conversion

    ties = dict(reference.all_tied_weights_keys)
    state = {ties.get(k, k): reference.state_dict()[ties.get(k, k)] for k in stage.state_dict()}
    with open(path / "model.safetensors.index.json") as fh:
        weight_map = json.load(fh)["weight_map"]
    return {weight_map[k] for k in revert_weight_conversion(reference, state)}


@pytest.mark.parametrize("variant", ["gemma3", "qwen3_5_moe", "llava_next"])
def test_a_rank_opens_exactly_the_shards_holding_its_stage(checkpoint, variant):
    path = checkpoint(variant)
    reference = _class_of(path).from_pretrained(path)
    shards = {p.name for p in path.glob("*.safetensors")}
    assert len(shards) >= 9
    for index in range(3):
        with OpenedFiles(path) as opened:
            (stage,) = stages_from_pretrained(path, 3, stages=[index])
        expected = _files_holding(path, stage, reference)
        assert {n for n in opened.names if n.endswith(".safetensors")} == expected, f"stage {index}"
        assert opened.names - expected == {"config.json", "model.safetensors.index.json"}
        assert len(expected) < len(shards)


@pytest.mark.parametrize("variant", ["qwen2_5_vl", "llava_next"])  # llava_next: a root-level image_newline
def test_the_vision_side_alone_equals_from_pretrained_and_opens_only_its_shards(checkpoint, variant):
    """``vision_from_pretrained`` (the encoder spread's copy on a rank without stage 0): the tensors of
    ``vision_replica(from_pretrained(path))``, buffers included, read from only the shards holding them."""
    path = checkpoint(variant)
    reference = _class_of(path).from_pretrained(path)
    with OpenedFiles(path) as opened:
        vision = pipeline.vision_from_pretrained(path)
    _assert_same(vision, pipeline.vision_replica(reference), f"{variant} vision side")
    assert _non_persistent(vision) or variant == "llava_next"  # Qwen's vision rotary inv_freq compared too
    expected = _files_holding(path, vision, reference)
    assert {n for n in opened.names if n.endswith(".safetensors")} == expected
    assert len(expected) < len({p.name for p in path.glob("*.safetensors")})
    (first, _) = build_stage_modules(reference, 2)
    vision_names = {n for n, _ in first.named_parameters() if not first.is_language_parameter(n)}
    assert {n for n, _ in vision.named_parameters()} == vision_names  # no language tensor read


def test_a_vision_tensor_missing_from_the_checkpoint_is_an_error(checkpoint, tmp_path):
    path = _copy(checkpoint("qwen2_5_vl"), tmp_path)
    gone = "visual.blocks.0.mlp.up_proj.weight"  # the file's name (model.visual... in memory)

    def drop(tensors, weight_map, file):
        del tensors[gone], weight_map[gone]

    _rewrite_shard(path, gone, drop)
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\) the vision side need.*model\.visual\.blocks\.0\.mlp\.up_proj"):
        pipeline.vision_from_pretrained(path)


def test_a_single_file_checkpoint(tmp_path):
    model = build_variant("qwen2_5_vl")
    model.save_pretrained(tmp_path)  # one model.safetensors, no index
    with OpenedFiles(tmp_path) as opened:
        first, last = stages_from_pretrained(tmp_path, 2)
    assert {n for n in opened.names if n.endswith(".safetensors")} == {"model.safetensors"}
    _assert_same(last, build_stage_modules(type(model).from_pretrained(tmp_path), 2)[1], "single file")


# ----------------------------------------------------------------------------------------------
# bad checkpoints: named errors, never a random init


def _copy(path: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(shutil.copytree(path, tmp_path / "copy"))


def _rewrite_shard(path: pathlib.Path, name: str, change: Any) -> str:
    """Rewrite the shard holding ``name`` with ``change(tensors)``; returns the shard's file name."""
    from safetensors.torch import load_file, save_file

    index = json.loads((path / "model.safetensors.index.json").read_text())
    file = index["weight_map"][name]
    tensors = load_file(path / file)
    change(tensors, index["weight_map"], file)
    save_file(tensors, path / file, metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return str(file)


def test_a_missing_tensor_is_an_error_naming_it_for_the_stage_that_needs_it(checkpoint, tmp_path):
    path = _copy(checkpoint("qwen2_5_vl"), tmp_path)
    gone = "model.layers.1.mlp.up_proj.weight"  # the file's name for layer 1 (stage 1 of 2)

    def drop(tensors, weight_map, file):
        del tensors[gone], weight_map[gone]

    _rewrite_shard(path, gone, drop)
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*model\.language_model\.layers\.1\.mlp\.up_proj\.weight"):
        stages_from_pretrained(path, 2, stages=[1])
    stages_from_pretrained(path, 2, stages=[0])  # stage 0 needs nothing from it


def test_a_tensor_the_index_places_in_a_shard_that_lacks_it(checkpoint, tmp_path):
    path = _copy(checkpoint("qwen2_5_vl"), tmp_path)
    gone = "model.layers.1.mlp.up_proj.weight"
    file = _rewrite_shard(path, gone, lambda tensors, weight_map, file: tensors.pop(gone))
    with pytest.raises(ValueError, match=rf"{file}: has no tensor '{gone}'"):
        stages_from_pretrained(path, 2, stages=[1])


def test_an_unexpected_tensor_is_an_error_naming_it_and_its_file(checkpoint, tmp_path):
    path = _copy(checkpoint("qwen2_5_vl"), tmp_path)
    extra = "model.layers.1.mlp.surprise.weight"

    def add(tensors, weight_map, file):
        tensors[extra] = torch.zeros(2)
        weight_map[extra] = file

    file = _rewrite_shard(path, "model.layers.1.mlp.up_proj.weight", add)
    with pytest.raises(ValueError, match=rf"has no place for: '{extra}' \({file}\)"):
        stages_from_pretrained(path, 2, stages=[0])


def test_a_truncated_or_damaged_shard_is_an_error_naming_the_file(checkpoint, tmp_path):
    path = _copy(checkpoint("qwen2_5_vl"), tmp_path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    file = path / index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    data = file.read_bytes()
    file.write_bytes(data[:-100])
    with pytest.raises(ValueError, match=rf"{file}: damaged or truncated"):
        stages_from_pretrained(path, 2, stages=[1])
    stages_from_pretrained(path, 2, stages=[0])  # a stage that does not read it loads
    file.write_bytes(data[:8] + b"{not json" + data[17:])
    with pytest.raises(ValueError, match=rf"{file}: damaged or truncated"):
        stages_from_pretrained(path, 2, stages=[1])
    file.unlink()
    with pytest.raises(FileNotFoundError, match=str(file)):
        stages_from_pretrained(path, 2, stages=[1])


def test_a_wrong_shape_is_an_error_naming_the_tensor(checkpoint, tmp_path):
    path = _copy(checkpoint("qwen2_5_vl"), tmp_path)
    name = "model.layers.1.mlp.up_proj.weight"
    _rewrite_shard(path, name, lambda tensors, weight_map, file: tensors.update({name: tensors[name][:3]}))
    with pytest.raises(ValueError, match=r"model\.language_model\.layers\.1\.mlp\.up_proj\.weight has shape \[3, 64\]"):
        stages_from_pretrained(path, 2, stages=[1])


def test_remote_code_and_kimi_without_q_lora_are_refused(tmp_path):
    (tmp_path / "remote").mkdir()
    (tmp_path / "remote" / "config.json").write_text(json.dumps({"model_type": "kimi_vl"}))
    with pytest.raises(ValueError, match="trust_remote_code are not supported"):
        stages_from_pretrained(tmp_path / "remote", 2)
    # transformers 5.23 writes the text attention's q_proj of a q_lora_rank=None Kimi-K2.5 as a fused
    # vision wqkv, and cannot read it back (from_pretrained fails the same way)
    model = tiny.load("kimi_vl").build_model(0)
    model.save_pretrained(tmp_path / "kimi")
    with pytest.raises(ValueError, match=r"conversion fails for model\.language_model\.layers\.1\.self_attn\.q_proj"):
        stages_from_pretrained(tmp_path / "kimi", 2, stages=[1])
    with pytest.raises(ValueError, match=r"could not read model\.language_model\.layers\.0\.self_attn\.q_proj\.weight back"):
        save_pretrained_stages(build_stage_modules(model, 2), tmp_path / "kimi-export")
    assert not (tmp_path / "kimi-export").exists()  # refused before anything was written


def test_a_full_omni_model_is_refused_naming_its_thinker(tmp_path):
    """The top-level Qwen2.5-Omni (model type ``qwen2_5_omni``, served by the thinker's adapter) holds its
    thinker (and talker) as sub-models: cutting it, or loading its checkpoint, is a TypeError saying to
    cut the thinker; a checkpoint of the thinker alone loads (``qwen2_5_omni_thinker`` in VARIANTS)."""
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

    from ppmedia.testing.tiny_models import qwen2_5_omni

    talker = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 1, "embedding_size": 32}
    config = Qwen2_5OmniConfig(thinker_config=qwen2_5_omni.build_config().to_dict(), talker_config=talker,
                               enable_audio_output=False)  # the thinker alone: tiny, and saved in a blink
    model = tiny.seeded(Qwen2_5OmniForConditionalGeneration, config, 0)
    hint = r"as thinker \(decoder stacks at thinker\.model\.language_model\): cut the one you train, e\.g\. build_stage_modules\(model\.thinker"
    with pytest.raises(TypeError, match=hint):
        build_stage_modules(model, 2)
    model.save_pretrained(tmp_path / "omni", max_shard_size="40KB")
    with pytest.raises(TypeError, match=r"model\.thinker\.save_pretrained\(path\)"):
        stages_from_pretrained(tmp_path / "omni", 2)
    model.thinker.save_pretrained(tmp_path / "thinker", max_shard_size="40KB")
    first, last = stages_from_pretrained(tmp_path / "thinker", 2)
    _assert_same(last, build_stage_modules(model.thinker, 2)[1], "the thinker's checkpoint")


# ----------------------------------------------------------------------------------------------
# export


def _file_names(path: pathlib.Path) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for file in path.glob("*.safetensors"):
        with safe_open(file, "pt") as fh:
            names |= set(fh.keys())
    return names


@pytest.mark.parametrize("variant", VARIANTS)
def test_export_round_trip_is_exact(checkpoint, tmp_path, variant):
    path = checkpoint(variant)
    modules = stages_from_pretrained(path, 3)
    save_pretrained_stages(modules, tmp_path, max_shard_size="40KB")
    cls = _class_of(path)
    back, info = cls.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected, mismatched keys or conversion errors
    original = cls.from_pretrained(path).state_dict()
    state = back.state_dict()
    assert state.keys() == original.keys()
    assert all(torch.equal(state[k], original[k]) for k in state)
    assert _file_names(tmp_path) == _file_names(path)  # the files' own names (experts per expert on disk)
    assert (tmp_path / "model.safetensors.index.json").exists() and len(list(tmp_path.glob("*.safetensors"))) > 3


def test_export_in_bfloat16_one_file_replaces_an_earlier_save(checkpoint, tmp_path):
    path = checkpoint("qwen3_5_moe")
    save_pretrained_stages(stages_from_pretrained(path, 2), tmp_path, max_shard_size="40KB")
    modules = stages_from_pretrained(path, 2, dtype=torch.bfloat16)
    save_pretrained_stages(modules, tmp_path)  # one file now: the earlier shards and index are removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    back = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.bfloat16)
    for module, want in zip(modules, build_stage_modules(back, 2)):
        _assert_same(module, want, "bf16 export")


def test_export_refuses_an_incomplete_pipeline_and_differing_tied_copies(checkpoint, tmp_path):
    first, last = stages_from_pretrained(checkpoint("gemma3"), 2)
    with pytest.raises(ValueError, match=r"hold stages \[1\] of pipelines of \[2\] stages"):
        save_pretrained_stages([last], tmp_path)
    assert last.get_parameter("lm_head.weight") is first.get_parameter("model.language_model.embed_tokens.weight")
    (last,) = stages_from_pretrained(checkpoint("gemma3"), 2, stages=[1])  # as another rank holds it: a copy
    with torch.no_grad():
        last.get_parameter("lm_head.weight").add_(1.0)  # an update sync_tied_gradients would have kept equal
    with pytest.raises(ValueError, match=r"tied parameters \['lm_head.weight', 'model.language_model.embed_tokens.weight'\] differ"):
        save_pretrained_stages([first, last], tmp_path)
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------------------
# one process group of one rank (conftest's world_of_one): make_pipeline_stages on meta / prebuilt
# modules, FSDP2 export


def test_make_pipeline_stages_takes_a_meta_model_and_prebuilt_stages_without_copies(checkpoint, world_of_one):
    path = checkpoint("qwen2_5_vl")
    meta = pretrained_module.build_meta_model(pretrained_module.load_pretrained_config(path))
    stages = pipeline.make_pipeline_stages(meta, 2, [0, 1], "cpu")  # torch's `.to()` would fail on meta
    assert all(p.is_meta for st in stages for p in st.submod.parameters())
    modules = stages_from_pretrained(path, 2)
    pointers = [p.data_ptr() for m in modules for p in m.parameters()]
    stages = pipeline.make_pipeline_stages(modules, 2, [0, 1], "cpu")
    assert [st.submod for st in stages] == modules
    assert [p.data_ptr() for st in stages for p in st.submod.parameters()] == pointers  # no copy
    with pytest.raises(ValueError, match=r"stage_indices: got \[1, 0\]; the modules are stages \[0, 1\]"):
        pipeline.make_pipeline_stages(modules, 2, [1, 0], "cpu")
    with pytest.raises(TypeError, match="layers_per_stage and adapter apply when cutting a model"):
        pipeline.make_pipeline_stages(modules, layers_per_stage=[1, 1])


def test_export_gathers_fsdp2_sharded_parameters(checkpoint, tmp_path, world_of_one):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    path = checkpoint("qwen3_vl_moe")
    modules = stages_from_pretrained(path, 2)
    mesh = init_device_mesh("cpu", (1,))
    for module in modules:
        fully_shard(module, mesh=mesh)
    assert all(isinstance(p, DTensor) for m in modules for p in m.parameters())
    save_pretrained_stages(modules, tmp_path, group=None)
    back = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path).state_dict()
    original = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(path).state_dict()
    assert all(torch.equal(back[k], original[k]) for k in original)
