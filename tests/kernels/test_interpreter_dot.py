"""The interpreter's stand-in tl.dot (tests/kernels/interpreter_helpers.py) is the product, row by row."""

from __future__ import annotations

import numpy as np
from interpreter_helpers import row_by_row_dot


def test_the_stand_in_dot_is_the_product_and_row_invariant():
    """Its rows match numpy's product to rounding, and a row alone is bitwise the row in a
    batch at any place, whatever the host's BLAS does."""
    gen = np.random.default_rng(0)
    a, b = gen.standard_normal((16, 64), np.float32), gen.standard_normal((64, 32), np.float32)
    acc = gen.standard_normal((16, 32), np.float32)
    full = row_by_row_dot(a, b, acc)
    np.testing.assert_allclose(full, a.astype(np.float64) @ b + acc, rtol=1e-5, atol=1e-5)
    for i in (0, 7, 15):
        assert np.array_equal(row_by_row_dot(a[i:i + 1], b, acc[i:i + 1]), full[i:i + 1])
        shuffled = np.roll(a, 5, axis=0)
        place = (i + 5) % 16
        got = row_by_row_dot(shuffled, b, np.roll(acc, 5, axis=0))[place]
        assert np.array_equal(got, full[i])
