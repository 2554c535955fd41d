"""A family that merges inside its decoder stack, declared once (``VlmAdapter.merge_path``).

The example plugin ``tests/plugin/ppmedia_phi4_plugin`` serves Phi-4-multimodal (transformers'
``Phi4MultimodalForCausalLM``, tiny, images only), whose encoders and merge sit at
``model.embed_tokens_extend`` inside the decoder stack. Its adapter declares
``merge_path = "model.embed_tokens_extend"`` and nothing else about it; the kit (reference,
``check_adapter``, goldens, stage check), the stage cutter and the encoder spread's replica read it.
The same adapter without the declaration is the planted bug.
"""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

from ppmedia.testing import AdapterMismatch, FamilyKit

PLUGIN_DIR = pathlib.Path(__file__).resolve().parent / "plugin"
FAMILY = "ppmedia_phi4_plugin.tiny"
MERGE = "model.embed_tokens_extend"


@pytest.fixture(scope="module")
def phi4():
    sys.path.insert(0, str(PLUGIN_DIR))
    try:
        # plugins=: registered in the kit's own registry only (not installed, not process-wide)
        yield FamilyKit(FAMILY, plugins=["ppmedia_phi4_plugin"])
    finally:
        sys.path.remove(str(PLUGIN_DIR))


def _undeclared():
    from ppmedia_phi4_plugin import Phi4ImagesAdapter

    class Undeclared(Phi4ImagesAdapter):  # the planted bug: where it merges is not said
        merge_path = None

    return Undeclared()


def test_the_kit_takes_its_reference_where_the_family_merges(phi4, tmp_path):
    """The reference is embed_tokens_extend's output, the adapter matches it for 1, 2, 4 and 8
    microbatches, and the goldens written there check; without the declaration the reference cannot
    be taken, and the message says what to declare."""
    batch = phi4.batch
    image = phi4.model.config.vision_config.image_token_id
    embeds = phi4.model.model.embed_tokens(batch["input_ids"])
    assert phi4.reference.shape == embeds.shape
    at_images = (batch["input_ids"] == image)
    assert torch.equal(phi4.reference[~at_images], embeds[~at_images].detach())  # text rows: the embeddings
    assert not torch.allclose(phi4.reference[at_images], embeds[at_images].detach())  # images: features
    checks = phi4.check_adapter(microbatches=(1, 2, 4, 8))
    assert len(checks) == 15 + 7 and max(c.max_abs_diff for c in checks) <= 1e-5  # build_batch, build_batches' 4 samples
    phi4.write_goldens(tmp_path)
    assert {(f.stat().st_mode & 0o777) for f in tmp_path.iterdir()} == {0o644}  # like any checked-in file
    phi4.check_goldens(tmp_path)  # 1, 2, 4 and 8 microbatches by default
    with pytest.raises(RuntimeError, match=r"got no inputs_embeds \(the model merges inside it: declare where "
                                           r"with the adapter's merge_path"):
        FamilyKit(FAMILY, adapter=_undeclared()).check_adapter(microbatches=(1,))


def test_features_in_the_wrong_order_are_caught(phi4):
    from ppmedia_phi4_plugin import Phi4ImagesAdapter

    class Reversed(Phi4ImagesAdapter):
        def encode(self, model, chunk, host):
            return {m: rows.flip(0) for m, rows in super().encode(model, chunk, host).items()}

    with pytest.raises(AdapterMismatch, match="merged embeddings differ"):
        FamilyKit(FAMILY, adapter=Reversed()).check_adapter(microbatches=(2,))


def test_the_kit_checks_the_familys_other_batches(phi4):
    """The plugin's build_batches holds portrait images (its build_batch only square and landscape
    ones): an adapter that counts an image's crop rows from its shorter side passes build_batch and
    fails there, named."""
    import ppmedia_phi4_plugin as plugin

    class LandscapeOnly(plugin.Phi4ImagesAdapter):
        def feature_counts(self, chunk, config, host):
            if chunk.pixel_values is None:
                return {"image": 0}
            return {"image": sum(plugin.image_tokens(min(h, w), w, config) for h, w in host.rows("image_sizes", 2))}

    kit = FamilyKit(FAMILY, adapter=LandscapeOnly())
    from ppmedia.testing import check_adapter

    check_adapter(FAMILY, adapter=LandscapeOnly(), model=kit.model, batch=kit.batch, microbatches=(1, 2, 4, 8))
    with pytest.raises(AdapterMismatch, match=r"batch 1 of build_batches: .*1 microbatches"):
        kit.check_adapter(microbatches=(1, 2))


def test_the_stage_cutter_keeps_the_merge_on_the_first_stage(phi4):
    """Stage 1 holds no part of embed_tokens_extend (encoders included); on stage 0 its parameters
    are the vision side's, though they sit under the language model's path."""
    from ppmedia.pipeline import build_stage_modules
    from ppmedia.testing.stages import held_twice

    stages = build_stage_modules(phi4.model, 2, adapter=phi4.adapter)
    first, second = ({n for n, _ in s.named_parameters()} for s in stages)
    merge = {n for n in first if n.startswith(MERGE + ".")}
    assert merge and any(".image_embed.img_processor." in n for n in merge)
    assert not {n for n in second if n.startswith(MERGE + ".")}
    assert second and all(n.startswith(("model.layers.1.", "model.norm.", "lm_head.")) for n in second)
    assert not any(stages[0].is_language_parameter(n) for n in merge)
    assert stages[0].is_language_parameter("model.layers.0.mlp.down_proj.weight")
    assert held_twice(stages) == {}
    assert not hasattr(phi4.model.model, "_ppmedia_cut")  # the model keeps its own tree
    assert "embed_tokens_extend" in phi4.model.model._modules


def test_a_duplicate_on_a_later_stage_fails_the_stage_check_by_name(phi4):
    """The one-process stage check passes with the declaration; without it stage 1 holds a copy of
    embed_tokens_extend (whose gradients match here, the copy sharing the model's parameters) and
    the check fails, naming the parameters and what to declare."""
    assert phi4.check_stage_splits([(1, 1)])[0].params_compared > 0
    with pytest.raises(AdapterMismatch, match=r"\d+ parameters are on more than one stage: those of "
                                              r"model\.embed_tokens_extend \(e\.g\. model\.embed_tokens_extend\.\S+ "
                                              r"on stages \[0, 1\]\).*merge_path"):
        FamilyKit(FAMILY, adapter=_undeclared()).check_stage_splits([(1, 1)])


def test_the_encoder_spread_replica_keeps_a_merge_inside_the_decoder(phi4):
    """vision_replica keeps embed_tokens_extend under its own path (and nothing else of the decoder
    stack); the adapter's encode runs on it as on the model."""
    import ppmedia
    from ppmedia.pipeline import vision_replica

    replica = vision_replica(phi4.model, phi4.adapter)
    names = {n for n, _ in replica.named_parameters()}
    assert names == {n for n, _ in phi4.model.named_parameters() if n.startswith(MERGE + ".")}
    batch = dict(phi4.batch)
    staged = ppmedia.split_media(batch, 4, **phi4.adapter.media_counts(batch, phi4.model.config))
    chunk = staged.chunk(0)
    a, b = staged.samples[0]
    _, host = phi4.adapter.check_counts(phi4.batch["input_ids"][a:b], chunk, phi4.model.config)
    with torch.no_grad():
        on_replica = phi4.adapter.encode(replica, chunk, host)["image"]
        on_model = phi4.adapter.encode(phi4.model, chunk, host)["image"]
    assert torch.equal(on_replica, on_model)
