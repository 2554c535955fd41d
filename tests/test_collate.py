"""collate_for_pipeline inside real DataLoader worker processes."""

import pickle

import pytest
import torch
from torch.utils.data import DataLoader

from conftest import same_storage
from ppmedia import PipelineBatch, collate_for_pipeline, next_vlm_media_chunk, stage_media


def _sample(i):
    n_images = i % 3  # 0, 1 or 2 images of 4 patch rows each
    return {"input_ids": torch.full((4,), i), "images": [torch.full((4, 6), float(i))] * n_images}


def _collate(samples):
    images = [img for s in samples for img in s["images"]]
    return {
        "input_ids": torch.stack([s["input_ids"] for s in samples]),
        "pixel_values": torch.cat(images) if images else torch.empty(0, 6),
        "image_grid_thw": torch.tensor([[1, 2, 2]] * len(images), dtype=torch.long).reshape(-1, 3),
        "n_images_per_sample": torch.tensor([len(s["images"]) for s in samples]),
    }


@pytest.mark.parametrize("workers", [0, 2])
def test_workers_split_and_training_loop_stages(workers):
    loader = DataLoader([_sample(i) for i in range(12)], batch_size=6, num_workers=workers,
                        collate_fn=collate_for_pipeline(_collate, 3), multiprocessing_context="spawn" if workers else None)
    module = torch.nn.Linear(1, 1)
    seen = []
    for batch in loader:
        assert isinstance(batch, PipelineBatch) and set(batch.text) == {"input_ids"}
        views = batch.media.chunks["pixel_values"]
        assert all(same_storage(v, batch.media.tensors["pixel_values"]) for v in views)
        with stage_media(module, batch.media):
            for _ in range(3):
                chunk = next_vlm_media_chunk(module)
                seen.append(None if chunk is None else sorted(set(chunk.pixel_values[:, 0].tolist())))
    # samples i, i+1 per microbatch; sample i carries images filled with i when i % 3 != 0
    expected = []
    for first in range(0, 12, 2):
        ids = [i for i in (first, first + 1) if i % 3]
        expected.append([float(i) for i in ids] or None)
    assert seen == expected


def test_picklable_wrapper_and_result():
    wrap = collate_for_pipeline(_collate, 2)
    batch = pickle.loads(pickle.dumps(wrap))([_sample(1), _sample(2)])
    back = pickle.loads(pickle.dumps(batch))
    assert back.media.images == (1, 2) and torch.equal(back.text["input_ids"], batch.text["input_ids"])


def test_errors():
    with pytest.raises(TypeError, match="collate_fn: got int"):
        collate_for_pipeline(3, 2)
    with pytest.raises(ValueError, match="adapter and config go together"):
        collate_for_pipeline(_collate, 2, adapter=object())
    with pytest.raises(TypeError, match="collate_fn returned list"):
        collate_for_pipeline(lambda s: [1], 2)([_sample(0)])
