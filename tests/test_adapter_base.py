"""The adapter base (``ppmedia.adapters.base``) and the built-ins' shared helpers (``adapters/_helpers.py``).

A small concrete adapter (fixed tokens per image, like LLaVA-1.5) exercises the base ``merge``: one host
read, the count check before the encoder, the values read handed to ``feature_counts`` and ``encode``.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor

from ppmedia import HostReadCounter, VlmMediaChunk
from ppmedia.adapters import _helpers
from ppmedia.adapters.base import HostValues, VlmAdapter, config_get, config_value, read_host

IMG = 9


class _Fixed(VlmAdapter):
    """Images ``[images, C, H, W]`` of ``TOKENS`` placeholders each; asks for ``image_grid`` on the host."""

    name = "fixed"
    model_types = ("fixed",)
    layout = "test"
    TOKENS = 3

    def __init__(self) -> None:
        self.seen: list[HostValues] = []

    def media_per_sample(self, input_ids, config, *, media=None):
        images = _helpers.count_runs(input_ids == IMG)
        return images, torch.zeros_like(images)

    def placeholder_masks(self, input_ids, config):
        return {"image": input_ids == IMG}

    def host_inputs(self, chunk, config):
        return {} if chunk.image_grid is None else {"grid": chunk.image_grid}

    def feature_counts(self, chunk, config, host):
        self.seen.append(host)
        return {"image": 0 if chunk.pixel_values is None else chunk.pixel_values.shape[0] * self.TOKENS}

    def encode(self, model, chunk, host):
        self.seen.append(host)
        n = chunk.pixel_values.shape[0]
        return {"image": torch.arange(n * self.TOKENS, dtype=torch.float32).unsqueeze(-1).expand(-1, 4)}


def _model() -> Any:
    model = torch.nn.Linear(1, 1)
    model.config = SimpleNamespace()
    return model


def test_merge_reads_once_and_hands_the_values_on():
    adapter, model = _Fixed(), _model()
    ids = torch.tensor([[1, IMG, IMG, IMG, 2], [IMG, IMG, IMG, 2, 0]])
    embeds = torch.zeros(2, 5, 4)
    chunk = VlmMediaChunk(torch.zeros(2, 3, 2, 2), torch.tensor([[5, 6], [7, 8]]), None, None)
    with HostReadCounter() as reads:
        merged = adapter.merge(model, ids, embeds, chunk)
    assert reads.total == 1
    first, second = adapter.seen
    assert first is second  # the same HostValues reach feature_counts and encode
    assert first.placeholders["image"] == [3, 3] and first.total("image") == 6
    assert first.values["grid"] == [5, 6, 7, 8]
    assert merged[ids == IMG][:, 0].tolist() == [0, 1, 2, 3, 4, 5]
    assert merged[ids != IMG].abs().sum() == 0


def test_merge_refuses_before_encoding():
    adapter, model = _Fixed(), _model()
    ids = torch.tensor([[1, IMG, IMG, IMG, 2], [IMG, IMG, 2, 0, 0]])
    chunk = VlmMediaChunk(torch.zeros(2, 3, 2, 2), None, None, None)
    with pytest.raises(ValueError, match=r"^image: the microbatch has 5 placeholder tokens but its media give 6 feature rows; placeholders per sample: \[3, 2\]$"):
        adapter.merge(model, ids, torch.zeros(2, 5, 4), chunk)
    with pytest.raises(ValueError, match=r"5 placeholder tokens .* give 0 feature rows \(no media: a text-only chunk\)"):
        adapter.merge(model, ids, torch.zeros(2, 5, 4), None)
    assert len(adapter.seen) == 1  # feature_counts ran once, encode never
    text = torch.zeros(2, 5, 4)
    assert adapter.merge(model, torch.ones(2, 5, dtype=torch.int64), text, None) is text


def test_read_host_one_read_and_integer_dtypes_only():
    masks = {"image": torch.tensor([[True, False], [True, True]]), "video": torch.tensor([[False, True], [False, False]])}
    inputs = {"a": torch.tensor([[1, 2], [3, 4]], dtype=torch.int32), "b": torch.tensor([2**40])}
    with HostReadCounter() as reads:
        host = read_host(masks, inputs)
    assert reads.total == 1
    assert host.placeholders["image"] == [1, 2] and host.placeholders["video"] == [1, 0]
    assert host.values["a"] == [1, 2, 3, 4] and host.values["b"] == [2**40]
    assert host.total("video") == 1 and host.total("audio") == 0 and host.totals == {"image": 3, "video": 1}
    assert host.rows("a", 2) == [[1, 2], [3, 4]]
    for dtype in (torch.float32, torch.bool):
        with pytest.raises(TypeError, match=rf"grid: dtype {dtype}, shape \[2\]; expected an integer dtype"):
            read_host(masks, {"grid": torch.ones(2, dtype=dtype)})
    assert read_host({}, {}).placeholders == {}


def test_config_get_is_getattr():
    from transformers import LlavaNextConfig

    config = LlavaNextConfig(image_token_index=7)
    for name in ("image_token_id", "image_token_index", "vision_feature_select_strategy", "model_type", "nope"):
        assert config_get(config, name) == getattr(config, name, None), name
    assert config_value(config, "vision_config.patch_size") == config.vision_config.patch_size
    assert config_get(SimpleNamespace(a=1), "a") == 1 and config_get(object(), "a") is None
    with pytest.raises(AttributeError, match="has none of x, y.z"):
        config_value(config, "x", "y.z")


# -- helpers ---------------------------------------------------------------------------------------


def _runs_reference(mask: list[list[bool]]) -> tuple[list[int], list[int]]:
    per_sample, lengths = [], []
    for row in mask:
        runs = 0
        for i, hit in enumerate(row):
            if hit and (i == 0 or not row[i - 1]):
                runs += 1
                lengths.append(0)
            if hit:
                lengths[-1] += 1
        per_sample.append(runs)
    return per_sample, lengths


def test_run_lengths_match_a_python_count():
    rng = random.Random(0)
    for _ in range(200):
        b, s = rng.randint(1, 5), rng.randint(1, 12)
        mask = [[rng.random() < 0.5 for _ in range(s)] for _ in range(b)]
        per_sample, lengths = _runs_reference(mask)
        cap = rng.randint(0, len(lengths) + 2)
        runs, got = _helpers.run_lengths(torch.tensor(mask), cap)
        assert runs.tolist() == per_sample
        assert got.tolist() == (lengths + [0] * cap)[:cap]
        assert _helpers.count_runs(torch.tensor(mask)).tolist() == per_sample


def test_images_from_runs_pairs_runs_with_images():
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.bool)

    def run(tokens: list[int]) -> list[int]:
        meta = torch.tensor(tokens)
        with HostReadCounter() as reads:
            out = _helpers.images_from_runs(mask, meta, lambda v: v, token="ids", metadata="sizes")
        assert reads.total == 1
        return out.tolist()

    assert run([2, 3, 2, 1, 2]) == [3, 0, 2]  # runs 5 = 2 + 3, 2, 3 = 1 + 2
    assert run([5, 2, 3]) == [2, 0, 1]
    with pytest.raises(ValueError, match=r"ids: sample 0 has a run of 5 placeholder tokens, but images 0..1 of sizes \(batch order\) give \[4, 4\] tokens"):
        run([4, 4, 3])
    with pytest.raises(ValueError, match=r"sample 2 has a run of 3 placeholder tokens but all 3 images of sizes are taken"):
        run([2, 3, 2])
    with pytest.raises(ValueError, match=r"the placeholder runs hold 3 images but sizes describes 4; pass n_images_per_sample"):
        run([5, 2, 3, 1])
    with pytest.raises(ValueError, match=r"3 runs of placeholder tokens but sizes describes 2 images"):
        run([5, 2])


def test_grid_thw_and_products():
    hw = torch.tensor([[2, 3], [4, 5]])
    assert _helpers.grid_thw(hw, "g").tolist() == [[1, 2, 3], [1, 4, 5]]
    thw = torch.tensor([[2, 2, 3]])
    assert _helpers.grid_thw(thw, "g") is thw
    with pytest.raises(ValueError, match=r"video grid: shape \[3\]; expected \[n, 3\]"):
        _helpers.grid_thw(torch.tensor([1, 2, 3]), "video grid")
    assert _helpers.grid_products([2**40, 2**40, 2, 3], 2) == [2**80, 6]  # exact: no int64 wrap-around
    assert _helpers.grid_products([2, 3, 4], 3) == [24] and _helpers.grid_products([], 3) == []


def test_refuse_videos_and_tower_dtype():
    chunk = VlmMediaChunk(None, None, torch.zeros(4, 6), torch.ones(1, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"fam takes images only, but the chunk carries videos: pixel_values_videos \[4, 6\], video_grid \[1, 3\]"):
        _helpers.refuse_videos(chunk, "fam")
    _helpers.refuse_videos(VlmMediaChunk(torch.zeros(1), None, None, None), "fam")
    tower = torch.nn.Linear(2, 2).to(torch.float64)
    pixels = torch.zeros(3, 2)
    assert _helpers.as_tower_dtype(pixels, tower).dtype == torch.float64
    same = torch.zeros(3, 2, dtype=torch.float64)
    assert _helpers.as_tower_dtype(same, tower) is same
    assert _helpers.as_tower_dtype(pixels, torch.nn.ReLU()) is pixels  # no parameters
    assert _helpers.tower_dtype(None) is None
    # the first-children chain ends in a module without parameters: the full walk finds the Linear
    assert _helpers.tower_dtype(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(2, 2).double())) == torch.float64
    assert _helpers.tower_dtype(torch.nn.Embedding(3, 2).to(torch.bfloat16)) == torch.bfloat16


def test_every_builtin_takes_the_base_signatures():
    import inspect

    import importlib

    from ppmedia.adapters.builtin import ADAPTERS

    classes = {getattr(importlib.import_module(path.split(":")[0]), path.split(":")[1]) for path in ADAPTERS.values()}
    assert len(classes) == len(set(ADAPTERS.values())) >= 20  # one class per distinct row
    for cls in classes:
        assert "merge" not in vars(cls), cls  # one merge for all
        for method in ("media_per_sample", "placeholder_masks", "host_inputs", "feature_counts", "encode",
                       "wire_tensors", "first_stage", "decoder_kwargs", "stage_hooks", "prune_stage", "logits"):
            ours, base = inspect.signature(getattr(cls, method)), inspect.signature(getattr(VlmAdapter, method))
            assert list(ours.parameters) == list(base.parameters), (cls.__name__, method)
        assert inspect.signature(cls.media_per_sample).parameters["media"].kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava_next", "step3", "kimi_vl", "qwen3_vl", "gemma3", "mistral3",
                                    "llava_onevision", "idefics3", "paligemma", "aya_vision",
                                    "internvl", "glm4v", "ernie4_5_vl_moe"])
def test_pixels_are_cast_to_the_towers_dtype(family):
    """float32 pixels into a float64 model: every built-in casts them to the vision tower's dtype."""
    import ppmedia
    from ppmedia.testing.tiny_models import capture_merged_embeds, load

    tiny = load(family)
    model, batch = tiny.build_model(seed=0), tiny.build_batch(seed=0)
    reference = capture_merged_embeds(model, **tiny.reference_inputs(dict(batch)))  # float32
    model = model.to(torch.float64)
    adapter = ppmedia.get_adapter(model)
    staged = ppmedia.split_media(dict(batch), 2, **adapter.media_counts(batch, model.config))
    for k, (s0, s1) in enumerate(staged.samples):
        chunk = staged.chunk(k)
        assert chunk.pixel_values.dtype == torch.float32
        ids = batch["input_ids"][s0:s1]
        with torch.no_grad():
            merged = adapter.merge(model, ids, model.get_input_embeddings()(ids), chunk)
        assert merged.dtype == torch.float64
        torch.testing.assert_close(merged, reference[s0:s1].double(), atol=1e-5, rtol=0)
