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
