"""Where the language model sits: an adapter's ``language_model_path`` (Llama 4 / Nemotron
``language_model.model``, Idefics3 / SmolVLM ``model.text_model``, Omni ``thinker.model.language_model``)
and the output head found wherever it is. Two stage modules chained in one process equal the model."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

from ppmedia.adapters.base import VlmAdapter
from ppmedia.pipeline import build_stage_modules, find_language_model
from ppmedia.pipeline.surgery import find_output_head

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)


class TextOnly(VlmAdapter):
    """No media: what a stage chain needs of an adapter, and the path under test."""

    name, model_types, layout = "text_only", ("text_only",), "none"

    def __init__(self, path: str | None) -> None:
        self.language_model_path = path  # type: ignore[misc]

    def media_per_sample(self, input_ids, config, *, media=None):
        zeros = torch.zeros(input_ids.shape[0], dtype=torch.int64)
        return zeros, zeros

    def placeholder_masks(self, input_ids, config):
        return {}

    def feature_counts(self, chunk, config, host):
        return {}

    def encode(self, model, chunk, host):
        return {}


class Box(nn.Module):
    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


class Llama4Like(nn.Module):
    """Vision side at the root; ``language_model`` a ...ForCausalLM: layers at
    ``language_model.model.layers``, head at ``language_model.lm_head``."""

    def __init__(self) -> None:
        super().__init__()
        self.config = LlamaConfig(**CONFIG)
        self.vision_model = nn.Linear(4, 4)
        self.language_model = LlamaForCausalLM(self.config)

    def get_output_embeddings(self) -> nn.Module:
        return self.language_model.lm_head

    def logits(self, ids, mask):
        return self.language_model(input_ids=ids, attention_mask=mask).logits


class Idefics3Like(nn.Module):
    """``model.vision_model``, ``model.connector``, the text model at ``model.text_model``; ``lm_head`` at the root."""

    def __init__(self) -> None:
        super().__init__()
        self.config = LlamaConfig(**CONFIG)
        self.model = Box(vision_model=nn.Linear(4, 4), connector=nn.Linear(4, 4), text_model=LlamaModel(self.config))
        self.lm_head = nn.Linear(32, 64, bias=False)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def logits(self, ids, mask):
        return self.lm_head(self.model.text_model(input_ids=ids, attention_mask=mask).last_hidden_state)


class OmniLike(nn.Module):
    """The thinker (``thinker.model.language_model``, ``thinker.lm_head``) beside a talker."""

    def __init__(self) -> None:
        super().__init__()
        self.config = LlamaConfig(**CONFIG)
        self.thinker = Box(model=Box(audio_tower=nn.Linear(4, 4), language_model=LlamaModel(self.config)),
                           lm_head=nn.Linear(32, 64, bias=False))
        self.talker = nn.Linear(4, 4)

    def get_output_embeddings(self) -> nn.Module:
        return self.thinker.lm_head

    def logits(self, ids, mask):
        return self.thinker.lm_head(self.thinker.model.language_model(input_ids=ids, attention_mask=mask).last_hidden_state)


@pytest.mark.parametrize("cls, path, head, first_only, last_only", [
    (Llama4Like, "language_model.model", "language_model.lm_head", "vision_model.weight", "language_model.lm_head.weight"),
    (Idefics3Like, "model.text_model", "lm_head", "model.connector.weight", "lm_head.weight"),
    (OmniLike, "thinker.model.language_model", "thinker.lm_head", "thinker.model.audio_tower.weight", "thinker.lm_head.weight"),
])
def test_a_declared_language_model_path_cuts_the_model_right(cls, path, head, first_only, last_only):
    torch.manual_seed(0)
    model = cls().eval()
    assert find_language_model(model, TextOnly(path))[0] == path and find_output_head(model, path) == head
    first, last = build_stage_modules(model, 2, adapter=TextOnly(path))
    names = [dict(m.named_parameters()) for m in (first, last)]
    assert first_only in names[0] and first_only not in names[1]
    assert last_only in names[1] and last_only not in names[0]
    assert f"{path}.layers.0.mlp.up_proj.weight" in names[0] and f"{path}.layers.1.mlp.up_proj.weight" in names[1]
    ids = torch.randint(0, 64, (3, 7))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        assert (last(*first(ids, mask)) - model.logits(ids, mask)).abs().max() <= 1e-5


def test_without_a_declaration_the_default_paths_are_named():
    with pytest.raises(TypeError, match=r"Idefics3Like: no language model with a `layers` list at any of model.language_model, "
                       r"language_model, model.model; an adapter says where its family keeps it with language_model_path"):
        find_language_model(Idefics3Like(), TextOnly(None))
    with pytest.raises(TypeError, match=r"TextOnly.language_model_path is 'model.txt_model', but the model holds nothing there"):
        find_language_model(Idefics3Like(), TextOnly("model.txt_model"))
