"""Stage modules are separate modules: a hook registered on one stage reaches no other stage and not
the full model (pipeline._shallow used to share the hook dicts of the modules it copied)."""

from __future__ import annotations

import pytest
import torch

import ppmedia.testing.tiny_models as tiny
from ppmedia.pipeline import build_stage_modules

_HOOK_KINDS = {
    "forward_pre": lambda m, h: m.register_forward_pre_hook(h),
    "forward_pre_kwargs": lambda m, h: m.register_forward_pre_hook(h, with_kwargs=True),
    "forward": lambda m, h: m.register_forward_hook(h),
    "forward_kwargs_always": lambda m, h: m.register_forward_hook(h, with_kwargs=True, always_call=True),
    "backward_pre": lambda m, h: m.register_full_backward_pre_hook(h),
    "backward": lambda m, h: m.register_full_backward_hook(h),
    "state_dict": lambda m, h: m.register_state_dict_post_hook(h),
    "state_dict_pre": lambda m, h: m.register_state_dict_pre_hook(h),
    "load_state_dict_pre": lambda m, h: m.register_load_state_dict_pre_hook(h),
    "load_state_dict_post": lambda m, h: m.register_load_state_dict_post_hook(h),
}


def _hook_entries(module: torch.nn.Module) -> set[int]:
    """The handle ids (the keys) of every entry of every hook dict of ``module``."""
    out: set[int] = set()
    for name, value in vars(module).items():
        if "hook" in name and isinstance(value, dict):
            out |= set(value)
    return out


@pytest.fixture(scope="module")
def kimi_stages():
    torch.set_num_threads(1)
    model = tiny.load("kimi_vl").build_model(0)
    stage0, stage2 = build_stage_modules(model, 4, stages=[0, 2])
    return model, stage0, stage2


@pytest.mark.parametrize("kind", sorted(_HOOK_KINDS))
def test_a_hook_on_one_stage_is_in_no_other_hook_dict(kimi_stages, kind):
    model, stage0, stage2 = kimi_stages
    full_lm, lm0, lm2 = model.model.language_model, stage0.stage_language_model, stage2.stage_language_model
    assert lm0 is not full_lm and lm2 is not full_lm and lm0 is not lm2
    inner0, inner2 = stage0.model, stage2.model  # the shells of model.model
    before = {id(m): _hook_entries(m) for m in (full_lm, lm2, model.model, inner2)}

    def hook(*args, **kwargs):
        return None

    handles = [_HOOK_KINDS[kind](lm0, hook), _HOOK_KINDS[kind](inner0, hook)]
    try:
        assert handles[0].id in _hook_entries(lm0) and handles[1].id in _hook_entries(inner0)
        for other in (full_lm, lm2, model.model, inner2):
            assert _hook_entries(other) == before[id(other)], f"{kind} hook leaked to {type(other).__name__}"
    finally:
        for handle in handles:
            handle.remove()


def test_forward_pre_hook_on_stage_0_fires_only_there(kimi_stages):
    """The reported case: a forward pre-hook on stage 0's language model, then stage 2 and the full
    model run; only stage 0's call is seen."""
    model, stage0, stage2 = kimi_stages
    module = tiny.load("kimi_vl")
    seen: list[str] = []
    handle = stage0.stage_language_model.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append("stage0" if m is stage0.stage_language_model else "other"),
        with_kwargs=True,
    )
    try:
        batch = module.build_batch(0)
        with torch.no_grad():
            model(**module.reference_inputs(batch))
            assert seen == [], "the full model's language model fired stage 0's hook"
            hidden = torch.zeros(2, batch["input_ids"].shape[1], model.config.text_config.hidden_size)
            stage2(hidden, batch["attention_mask"][:2])
            assert seen == [], "stage 2's language model fired stage 0's hook"
            stage0.stage_language_model(inputs_embeds=hidden, attention_mask=batch["attention_mask"][:2], use_cache=False)
        assert seen == ["stage0"]
    finally:
        handle.remove()


def test_hooks_registered_before_the_split_are_carried_over():
    """A hook the full model's language model had before the split still fires on every stage copy."""
    torch.set_num_threads(1)
    model = tiny.load("kimi_vl").build_model(0)
    calls: list[int] = []
    model.model.language_model.register_forward_pre_hook(lambda m, args: calls.append(1))
    (stage1,) = build_stage_modules(model, 2, stages=[1])
    hidden = torch.zeros(1, 4, model.config.text_config.hidden_size)
    with torch.no_grad():
        stage1(hidden, torch.ones(1, 4, dtype=torch.int64))
    assert calls == [1]
