import pytest
import torch

import ppmedia
from ppmedia.testing.tiny_models import capture_merged_embeds


@pytest.fixture
def first_stage() -> torch.nn.Module:
    """A stand-in first-stage module: any nn.Module carries staged lists."""
    return torch.nn.Linear(2, 2)


def same_storage(view: torch.Tensor, base: torch.Tensor) -> bool:
    return view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


# Family test modules import their tiny module as ``tiny`` (``from ppmedia.testing.tiny_models import kimi_vl as tiny``);
# these fixtures build that family's seeded model, batch and reference once per module.


@pytest.fixture
def one_thread():
    """torch on one thread for the test, the previous count restored after it (a module opts in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def check_microbatches(family, n, atol, **kwargs):
    """``check_adapter(family, microbatches=[n], **kwargs)``, asserting ``n`` checks all within ``atol``
    and, at ``n = 4``, that only microbatch 2 (the tiny batches' text-only one) has no media."""
    from ppmedia.testing import check_adapter

    checks = check_adapter(family, microbatches=[n], **kwargs)
    assert len(checks) == n and max(c.max_abs_diff for c in checks) <= atol
    if n == 4:
        assert [c.has_media for c in checks] == [True, True, False, True]
    return checks


@pytest.fixture(scope="module")
def model(request) -> torch.nn.Module:
    torch.set_num_threads(1)
    return request.module.tiny.build_model(seed=0)


@pytest.fixture(scope="module")
def batch(request) -> dict[str, torch.Tensor]:
    return request.module.tiny.build_batch(seed=0)


@pytest.fixture(scope="module")
def reference(request, model, batch) -> torch.Tensor:
    """The model's own merged ``inputs_embeds`` [B, S, H] for the full batch."""
    return capture_merged_embeds(model, **request.module.tiny.reference_inputs(batch))


@pytest.fixture(scope="module")
def adapter(request):
    """The family's adapter, as the registry finds it from the tiny model type."""
    return ppmedia.get_adapter(request.module.tiny.MODEL_TYPE)


def text_embeds(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The model's text embeddings [b, S, H] of ``input_ids``."""
    with torch.no_grad():
        return model.get_input_embeddings()(input_ids)


@pytest.fixture(scope="module")
def world_of_one():
    """A gloo process group of one rank in this process (127.0.0.1, a free port), destroyed after the
    module: for PipelineStage, DeviceMesh and FSDP2 objects in-process."""
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def pixtral_processor_batch(layout, sizes_per_sample, seed=3):
    """A batch of real ``PixtralImageProcessorPil`` output for a tiny Pixtral-tower family
    (``ppmedia.testing.tiny_models._pixtral.PixtralLayout``): synthetic images of ``sizes_per_sample``
    resized to multiples of ``layout.step`` (the patch size x merge the processor is given), at most
    ``layout.max_size``, padded to the largest, and the text ``PixtralProcessor`` writes for them."""
    import numpy as np
    from PIL import Image
    from transformers import PixtralImageProcessorPil

    from ppmedia.testing.tiny_models._pixtral import image_ids

    rng = np.random.default_rng(seed)
    processor = PixtralImageProcessorPil(
        patch_size={"height": layout.step, "width": layout.step}, size={"longest_edge": layout.max_size}
    )
    images = [[Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in s] for s in sizes_per_sample if s]
    out = processor(images=images, return_tensors="pt")
    true_sizes = out["image_sizes"].tolist()
    rows, k = [], 0
    for sizes in sizes_per_sample:
        ids = rng.integers(layout.first_text_id, layout.vocab, 2).tolist()
        for _ in sizes:
            ids += image_ids(layout, tuple(true_sizes[k])) + rng.integers(layout.first_text_id, layout.vocab, 1).tolist()
            k += 1
        rows.append(ids)
    seq = max(map(len, rows))
    input_ids = torch.full((len(rows), seq), layout.pad, dtype=torch.int64)
    mask = torch.zeros_like(input_ids)
    for i, ids in enumerate(rows):
        input_ids[i, : len(ids)], mask[i, : len(ids)] = torch.tensor(ids), 1
    return {"input_ids": input_ids, "attention_mask": mask, **out}


# -- multi-process family modules (tests/test_*_mp.py): one spawn per module, every test reads its report --


def parity_once(families, scenarios, *, tolerance, steps=2, n_microbatches=4, **more):
    """A function returning ``run_parity(families, scenarios, ...)``'s report, run on its first call only:
    one spawn for the whole test module. A :class:`~ppmedia.testing.parity.ParityError` is kept too and
    raised again by every later call, so each test of the module fails with it (not only the first).
    ``more`` goes to ``run_parity`` as is (``family_scenarios=``)."""
    from ppmedia.testing.parity import ParityError, run_parity

    report: list[object] = []

    def run():
        if not report:
            try:
                report.append(run_parity(families, scenarios, steps=steps, n_microbatches=n_microbatches, tolerance=tolerance,
                                         **more))
            except ParityError as exc:  # one spawn for the module, failure included
                report.append(exc)
        if isinstance(report[0], Exception):
            raise report[0]
        return report[0]

    return run


def assert_pipeline_matches(result, family, scenario, tolerance, layers_per_stage):
    """The checks every family gets from a 2-step, 4-microbatch parity run of one scenario: all
    parameters placed, the expected layers per stage, loss and gradients (vision and language model,
    both non-trivial) within ``tolerance`` at every step, stage 0 called once per microbatch (plus the
    shape-inference call on an inferred schedule's first step) consuming the chunks in order, and
    the SGD step changing the reference loss."""
    assert result.missing_params == [], "every parameter on some stage"
    assert result.layers_per_stage == layers_per_stage
    for st in result.steps:
        where = f"{family} {scenario} step {st.step}"
        assert st.loss_diff <= tolerance, f"{where}: loss {st.loss_pipeline} vs {st.loss_reference}"
        assert st.grad_diff_vision <= tolerance and st.grad_diff_lm <= tolerance, f"{where}: {st.grad_diff_vision}, {st.grad_diff_lm}"
        assert st.vision_params_compared > 0 and st.reference_grad_max_vision > 1e-4 and st.reference_grad_max_lm > 1e-4
        inference = scenario.endswith("inferred") and st.step == 0
        assert st.first_stage_calls == st.expected_first_stage_calls == 4 + inference
        assert st.chunk_trace == [0] * inference + [0, 1, 2, 3]
    assert result.steps[0].loss_reference != result.steps[1].loss_reference  # the SGD step happened
    assert result.passed(tolerance)
