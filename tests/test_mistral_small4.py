"""Mistral Small 4: a ``mistral3`` model whose text model is ``mistral4`` (MLA with a query LoRA, MoE),
served by the Mistral 3 adapter; tiny seeded model, merges and stage splits against the model's own."""

from __future__ import annotations

import pytest
import torch

import ppmedia
from ppmedia.adapters.mistral3 import Mistral3Adapter
from ppmedia.testing import check_adapter, check_stage_splits
from ppmedia.testing.tiny_models import constant_parameters
from ppmedia.testing.tiny_models import mistral_small4 as tiny

ATOL = 1e-5


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_mistral3_model_with_a_mistral4_text_model(model):
    assert model.config.model_type == "mistral3" and model.config.text_config.model_type == "mistral4"
    assert type(ppmedia.get_adapter(model)) is Mistral3Adapter
    attention = model.model.language_model.layers[1].self_attn
    assert hasattr(attention, "q_a_proj") and hasattr(model.model.language_model.layers[1].mlp, "experts")
    assert constant_parameters(model) == []


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_merge_matches_the_models_own_per_microbatch(model, batch, n):
    checks = check_adapter(tiny, microbatches=[n], model=model, batch=batch)
    assert len(checks) == n and max(c.max_abs_diff for c in checks) <= ATOL
    if n == 4:
        assert [c.has_media for c in checks] == [True, True, False, True]


def test_stage_splits_match_the_model(model, batch):
    checks = check_stage_splits(tiny, [(1, 1), (2, 0), (0, 2)], model=model, batch=batch)
    assert all(c.max_logit_diff <= ATOL and c.max_grad_diff <= ATOL and c.wire == ((),) for c in checks)
