"""Phi-4-multimodal (built in): the vision tower's causal flag under SDPA, the batch's audio projection
mode, the merge module on the first stage only. Merges against the model's own forward for 1, 2, 4
and 8 microbatches are in tests/test_goldens.py and tests/test_processors.py."""

from __future__ import annotations

import pytest
import torch

from ppmedia.adapters.phi4_multimodal import MERGE_PATH, Phi4MultimodalAdapter, eager_attention
from ppmedia.testing import AdapterMismatch, check_adapter
from ppmedia.testing.tiny_models import capture_reference
from ppmedia.testing.tiny_models import phi4_multimodal as tiny

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sdpa_model():
    model = tiny.build_model()
    model.model.embed_tokens_extend.image_embed.img_processor.config._attn_implementation = "sdpa"
    return model


def test_under_sdpa_a_crops_features_depend_on_the_batch_and_ppmedia_encodes_bidirectionally(sdpa_model):
    """Sample 0's one unpadded image: the model's own SDPA forward encodes it causally alone and
    bidirectionally beside a padded crop (the whole batch); ppmedia's merge of it alone equals the
    whole batch's (eager attention for the tower), and restores the tower's setting."""
    batch = tiny.build_batch()
    whole = capture_reference(sdpa_model, **tiny.reference_inputs(batch))[0]
    alone = {k: v[:1] for k, v in batch.items() if k not in ("audio_input_features", "audio_embed_sizes", "audio_attention_mask")}
    alone["input_ids"] = torch.where(alone["input_ids"] == tiny.AUDIO_TOKEN_ID, 5, alone["input_ids"])
    own_alone = capture_reference(sdpa_model, **tiny.reference_inputs(alone))[0]
    at_image = batch["input_ids"][0] == tiny.IMAGE_TOKEN_ID
    assert (own_alone[0, at_image] - whole[0, at_image]).abs().max() > 1e-2  # the bug: batch-dependent features
    checks = check_adapter("phi4_multimodal", model=sdpa_model, batch=batch, reference=whole, microbatches=(8,))
    assert max(c.max_abs_diff for c in checks) <= 1e-5  # microbatch 0 holds sample 0 alone
    tower = sdpa_model.model.embed_tokens_extend.image_embed.img_processor
    assert tower.config._attn_implementation == "sdpa"
    with eager_attention(tower):
        assert tower.config._attn_implementation == "eager"
    assert tower.config._attn_implementation == "sdpa"


def test_audio_is_projected_as_the_whole_batch_would():
    """The batch holds images, so the model projects every clip with its vision pair; without the
    staged mode, a microbatch of audio alone (sample 2 at 8 microbatches) would take the speech pair."""
    batch = tiny.build_batch()
    counts = Phi4MultimodalAdapter().media_counts(batch, tiny.build_config())
    assert counts["sample_inputs"]["audio_projection_mode"].tolist() == [1] * 8
    audio_only = tiny.build_batches()[0]
    assert Phi4MultimodalAdapter().media_counts(audio_only, tiny.build_config())["sample_inputs"][
        "audio_projection_mode"].tolist() == [0] * 4

    class PerMicrobatch(Phi4MultimodalAdapter):  # the planted bug: the mode decided per microbatch
        def sample_input_values(self, batch, config):
            return {}

    with pytest.raises(AdapterMismatch, match=r"8 microbatches, microbatch 2 .*audio placeholder"):
        check_adapter("phi4_multimodal", adapter=PerMicrobatch(), microbatches=(8,))
    mixed = dict(batch, audio_projection_mode=torch.tensor([1, 1, 0, 0, 0, 0, 0, 0]))
    with pytest.raises(AdapterMismatch, match="both audio projection modes"):
        check_adapter("phi4_multimodal", batch=mixed, microbatches=(1,))


def test_the_merge_module_is_on_the_first_stage_only():
    from ppmedia.pipeline import build_stage_modules
    from ppmedia.testing.stages import held_twice

    model = tiny.build_model()
    stages = build_stage_modules(model, 2)
    first, second = ({n for n, _ in s.named_parameters()} for s in stages)
    merge = {n for n in first if n.startswith(MERGE_PATH + ".")}
    assert any(".audio_embed.encoder." in n for n in merge) and any(".image_embed.img_processor." in n for n in merge)
    assert not {n for n in second if n.startswith(MERGE_PATH + ".")} and held_twice(stages) == {}
