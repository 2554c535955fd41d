import torch
import pytest


@pytest.fixture
def first_stage() -> torch.nn.Module:
    """A stand-in first-stage module: any nn.Module carries staged lists."""
    return torch.nn.Linear(2, 2)


def same_storage(view: torch.Tensor, base: torch.Tensor) -> bool:
    return view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
