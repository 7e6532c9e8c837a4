"""invariant_moe_linear (specdec/kernels/invariant_moe.py): each (row, expert) pair's result is
bitwise invariant_linear's for that row over its expert's weight, alone or beside any other
pairs, and the layout it runs over is computed on the device without a host read.

Without a GPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set before the
kernel module is imported); with one, compiled on it.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from interpreter_helpers import host_independent_interpreter_dot  # noqa: E402, F401

from specdec.kernels.invariant_matmul import BLOCK_M, invariant_linear, tile_config  # noqa: E402
from specdec.kernels.invariant_moe import (  # noqa: E402
    invariant_moe_linear,
    invariant_moe_linear_reference,
    moe_layout,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def operands(seed: int, rows: int, e: int, n: int, k: int, dtype, top: int = 2):
    """x [rows, k], weights [e, n, k], each row's ``top`` distinct experts [rows * top]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(e, n, k, generator=gen) * k ** -0.5).to(DEVICE, dtype)
    experts = torch.stack([torch.randperm(e, generator=gen)[:top].sort().values
                           for _ in range(rows)]).reshape(-1).to(DEVICE)
    return x, w, experts


def test_the_layout_tiles_each_experts_pairs_in_order():
    experts = torch.tensor([3, 0, 3, 3, 1] + [2] * 20 + [3], device=DEVICE)
    layout = moe_layout(experts, 5)
    assert layout.tile_count.numel() == -(-experts.numel() // BLOCK_M) + 5
    assert int(layout.woken) == 4  # 0, 1, 2, 3 (not 4)
    got = {}
    for e, first, count in zip(layout.tile_expert.tolist(), layout.tile_first.tolist(),
                               layout.tile_count.tolist()):
        if count:
            assert count <= BLOCK_M
            got.setdefault(e, []).extend(layout.order[first:first + count].tolist())
    want = {e: [p for p, x in enumerate(experts.tolist()) if x == e] for e in range(5)}
    assert got == {e: v for e, v in want.items() if v}  # each expert's pairs, rows ascending
    assert sum(layout.tile_count.tolist()) == experts.numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(48, 40), (32, 320)])  # the second: split-K ranges
def test_each_pair_is_invariant_linear_over_its_expert(dtype, n, k):
    if n == 32:
        assert tile_config(n, k, dtype).split_k > 1  # the shape tests what it says
    x, w, experts = operands(0, 19, 6, n, k, dtype)  # 38 pairs: experts of 1-3 tiles
    rows = torch.arange(experts.numel(), device=DEVICE) // 2
    y = invariant_moe_linear(x, w, rows, moe_layout(experts, 6))
    assert y.shape == (experts.numel(), n) and y.dtype == dtype
    for e in range(6):
        pairs = (experts == e).nonzero().flatten()
        if pairs.numel():
            assert torch.equal(y[pairs], invariant_linear(x[rows[pairs]].contiguous(), w[e]))
    ref = invariant_moe_linear_reference(x, w, rows, experts)
    tol = 1e-5 if dtype == torch.float32 else 2.0 ** -7
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol)


def test_a_pairs_result_does_not_depend_on_the_other_pairs():
    x, w, experts = operands(1, 24, 4, 48, 72, torch.float32, top=2)
    rows = torch.arange(experts.numel(), device=DEVICE) // 2
    full = invariant_moe_linear(x, w, rows, moe_layout(experts, 4))
    for take in ([0, 1], [5], list(range(10, 41, 3)), list(range(48))[::-1]):
        sub = torch.tensor(take, device=DEVICE)
        got = invariant_moe_linear(x, w, rows[sub], moe_layout(experts[sub], 4))
        assert torch.equal(got, full[sub]), take


def test_no_pairs_and_bad_input():
    x, w, experts = operands(2, 3, 4, 16, 32, torch.float32)
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    assert invariant_moe_linear(x, w, empty, moe_layout(empty, 4)).shape == (0, 16)
    layout = moe_layout(experts, 4)
    rows = torch.arange(experts.numel(), device=DEVICE) // 2
    with pytest.raises(ValueError, match=r"weights \[E, N, K\]"):
        invariant_moe_linear(x, w[0], rows, layout)
    with pytest.raises(ValueError, match="one dtype"):
        invariant_moe_linear(x, w.double(), rows, layout)
    with pytest.raises(ValueError, match=r"rows must be \[P=6\] int64"):
        invariant_moe_linear(x, w, rows[:4], layout)
    with pytest.raises(ValueError, match="another num_experts"):
        invariant_moe_linear(x, w, rows, moe_layout(experts, 5))
    with pytest.raises(ValueError, match="experts \\[P\\] int64"):
        moe_layout(experts.int(), 4)
