"""Tests of the LLaVA-1.5 adapter plugin, on ppmedia's testing kit (the ``ppmedia_kit`` fixture)."""

import pathlib

import pytest

GOLDENS = pathlib.Path(__file__).parent / "goldens" / "llava"


@pytest.fixture(scope="module")
def llava(ppmedia_kit):
    # the plugin's tiny seeded model (ppmedia_llava_plugin/tiny.py) and the plugin's hooks
    return ppmedia_kit.family("ppmedia_llava_plugin.tiny", plugins=["ppmedia_llava_plugin"])


def test_adapter_is_found(llava):
    assert llava.adapter.name == "llava"


def test_merge_matches_the_model(llava):
    # split -> stage -> next chunk -> adapter.merge equals the model's own merged embeddings
    checks = llava.check_adapter(microbatches=[1, 2, 4, 8])
    assert len(checks) == 1 + 2 + 4 + 8


def test_goldens(llava):
    # config and inputs regenerate byte for byte, expected embeddings within 1e-6, and the adapter reproduces them
    # (write them once with: pytest --ppmedia-write-goldens)
    llava.check_goldens(GOLDENS)


def test_pipeline_parity(llava):
    # 2 processes, gloo on 127.0.0.1: loss and every gradient equal the model's own within 1e-5
    report = llava.check_pipeline_parity(["gpipe", "1f1b/static"], steps=1)
    assert report.ok
