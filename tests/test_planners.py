"""ppmedia.producer.planners: the exact integer helpers every planner relies on (no wrapped number ever trusted)."""

import numpy as np
import pytest

from ppmedia.producer.planners import check_range, exact_products, exact_sum, first_oversized, offsets

I64 = 2**63 - 1


def test_offsets_start_at_zero():
    assert offsets(np.array([2, 0, 3], dtype=np.int64)).tolist() == [0, 2, 2, 5]
    assert offsets(np.zeros(0, dtype=np.int64)).tolist() == [0]


def test_exact_sum_never_wraps():
    values = np.array([I64, I64, 4], dtype=np.int64)
    assert int(values.sum()) == 2  # what int64 arithmetic says
    assert exact_sum(values) == 2 * I64 + 4
    assert exact_sum(np.array([1, 2], dtype=np.int64), high=2) == 3


def test_check_range_names_the_first_bad_entry():
    with pytest.raises(ValueError, match=r"k: at 1 has -1 images; expected 0..5"):
        check_range("k", np.array([1, -1, 9], dtype=np.int64), 5, "images", lambda i: f"at {i}")
    with pytest.raises(ValueError, match=r"k: at 0 has 9223372036854775807"):
        check_range("k", np.array([I64, 1], dtype=np.int64), 5, "images", lambda i: f"at {i}")
    check_range("k", np.array([0, 5], dtype=np.int64), 5, "images", str)


def test_exact_products():
    at, total = exact_products("g", np.array([[1, 2, 3], [2, 2, 2]], dtype=np.int64), 14, str)
    assert at.tolist() == [0, 6, 14] and total == 14
    # 4 * (2**64 + 1) wraps to 4 in int64; exactly it exceeds any row count
    wrapping = np.array([[1, 2, 2], [4, 274177, 67280421310721]], dtype=np.int64)
    assert int(wrapping.prod(axis=1).sum()) == 8
    assert exact_products("g", wrapping, 8, str) is None
    assert first_oversized(wrapping, 8) == 1
    with pytest.raises(ValueError, match=r"g: row 1 \(at 1\) is \[1, 0, 2\]; expected positive entries"):
        exact_products("g", np.array([[1, 1, 1], [1, 0, 2]], dtype=np.int64), 4, lambda i: f"at {i}")
