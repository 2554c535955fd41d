"""Sequence packing (ppmedia.packing): the row plan, the packed batch, and exactness on the stages."""

import pytest
import torch

from ppmedia.packing import enable_packing, pack_samples, packing_problem, plan_rows, sample_positions
from ppmedia.pipeline import make_labels
from ppmedia.pipeline.loss import IGNORE_INDEX, SHIFTED_MARK

pytestmark = pytest.mark.usefixtures("one_thread")


def test_plan_rows_first_fit_decreasing_every_sample_once():
    rows = plan_rows([5, 3, 7, 2, 4], 8)
    assert rows == [[2], [0, 1], [3, 4]]
    assert sorted(i for r in rows for i in r) == list(range(5))


def test_plan_rows_orders_by_cost_and_makes_a_multiple():
    # rows [2] (cost 5), [0, 1] (1), [3, 4] (2): heavy, light, middle
    assert plan_rows([5, 3, 7, 2, 4], 8, [1, 0, 5, 0, 2]) == [[2], [0, 1], [3, 4]]
    rows = plan_rows([5, 3, 7, 2, 4], 8, [1, 0, 5, 0, 2], n_microbatches=2, multiple_of=2)
    assert len(rows) == 4 and sorted(i for r in rows for i in r) == list(range(5))
    loads = [sum([1, 0, 5, 0, 2][i] for r in rows[k:k + 2] for i in r) for k in (0, 2)]
    assert sorted(loads) == [3, 5]  # {5, 0} and {1, 2}: the best split of these rows


def test_plan_rows_names_a_sample_too_long():
    with pytest.raises(ValueError, match=r"sample 1 has 9 tokens, over max_length=8"):
        plan_rows([3, 9], 8)


def _sample(ids, image=None):
    ids = torch.tensor([ids])
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[0, :-1] = ids[0, 1:]
    labels[0, -1] = SHIFTED_MARK
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    if image is not None:
        out["pixel_values"] = image
    return out


def test_pack_samples_rows_labels_media_positions():
    a, b, c = _sample([11, 12, 13], torch.zeros(1, 2)), _sample([21, 22]), _sample([31, 32, 33, 34], torch.ones(2, 2))
    batch = pack_samples([a, b, c], [[0, 1], [2]], pad_id=0, max_length=6)
    assert batch["input_ids"].tolist() == [[11, 12, 13, 21, 22, 0], [31, 32, 33, 34, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0]]
    # no label crosses a boundary: 13 -> 21 is not a target; the row's last column is the mark
    assert batch["labels"].tolist() == [[12, 13, -100, 22, -100, SHIFTED_MARK], [32, 33, 34, -100, -100, SHIFTED_MARK]]
    assert batch["pixel_values"].tolist() == [[0, 0], [1, 1], [1, 1]]
    assert sample_positions(batch["attention_mask"]).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]
    with pytest.raises(ValueError, match=r"sample 1 is also in row 0"):
        pack_samples([a, b, c], [[0, 1], [1, 2]], pad_id=0)
    with pytest.raises(ValueError, match=r"samples \[2\] are in no row"):
        pack_samples([a, b, c], [[0, 1]], pad_id=0)


def test_make_labels_ignores_packed_boundaries():
    ids = torch.tensor([[11, 12, 13, 21, 22, 0]])
    mask = torch.tensor([[1, 1, 1, 2, 2, 0]])
    assert make_labels(ids, None, _NoMedia(), pad_id=0, attention_mask=mask).tolist() == [[12, 13, -100, 22, -100, SHIFTED_MARK]]


class _NoMedia:
    def placeholder_masks(self, input_ids, config):
        return {}
