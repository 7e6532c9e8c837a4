"""invariant_linear (specdec/kernels/invariant_matmul.py) against an fp32-accumulated torch
reference, and its promise: a row's result is bitwise the same alone, at any place in a
batch, beside any other rows.

Without a GPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set before the
kernel module is imported: ``triton.jit`` reads it when it decorates); with one, compiled on it.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

# every interpreted tl.dot row by row, in order: what is tested is the kernel, not the host BLAS
from interpreter_helpers import host_independent_interpreter_dot  # noqa: E402, F401

from specdec.kernels.invariant_matmul import (  # noqa: E402
    BLOCK_M,
    invariant_linear,
    invariant_linear_reference,
    tile_config,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rand(gen: torch.Generator, *shape, dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


def operands(seed: int, m: int, n: int, k: int, dtype):
    """x [m, k], weight [n, k], bias [n] scaled so that outputs are O(1)."""
    gen = torch.Generator().manual_seed(seed)
    return (rand(gen, m, k, dtype=dtype), rand(gen, n, k, dtype=dtype, scale=k**-0.5),
            rand(gen, n, dtype=dtype))


def close_to_reference(y: torch.Tensor, want: torch.Tensor) -> None:
    if y.dtype == torch.float32:
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    else:  # the two fp32 sums may round to neighbouring 16-bit values: one ulp
        ulp = 2.0**-7 if y.dtype == torch.bfloat16 else 2.0**-10
        torch.testing.assert_close(y.float(), want.float(), rtol=ulp, atol=ulp)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", [(48, 40), (100, 130), (48, 320)])  # the last: 2 K ranges
def test_matches_reference_on_ragged_shapes(dtype, n, k):
    for m in (1, 5, 17, 33):
        x, w, b = operands(m, m, n, k, dtype)
        y = invariant_linear(x, w, b)
        assert y.shape == (m, n) and y.dtype == dtype
        close_to_reference(y, invariant_linear_reference(x, w, b))
    close_to_reference(invariant_linear(x, w), invariant_linear_reference(x, w))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_is_bitwise_the_same_alone_and_anywhere_in_a_batch(dtype):
    x, w, b = operands(0, 33, 100, 130, dtype)
    y = invariant_linear(x, w, b)
    gen = torch.Generator().manual_seed(1)
    for i in (0, 3, 16, 32):
        row = x[i:i + 1]
        assert torch.equal(invariant_linear(row, w, b), y[i:i + 1])
        # the row at another place of a 16-row tile, beside other random rows
        before = rand(gen, 7 + i % 5, 130, dtype=dtype)
        batch = torch.cat([before, row, rand(gen, 20, 130, dtype=dtype)])
        assert torch.equal(invariant_linear(batch, w, b)[len(before)], y[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_rows_are_bitwise_the_same_for_1_to_64_rows(dtype):
    """A weight whose K is cut into ranges (their partials added in range order by a second
    kernel): a row alone, and at random places of calls of 1 to 64 rows, is bitwise itself."""
    n, k = 40, 576
    assert tile_config(n, k, dtype).split_k == 3
    x, w, b = operands(2, 64, n, k, dtype)
    rows = (0, 9, 31, 63)
    alone = {i: invariant_linear(x[i:i + 1], w, b)[0] for i in rows}
    gen = torch.Generator().manual_seed(3)
    for m in (2, 17, 64):
        picks = torch.randperm(64, generator=gen)[:m]
        picks[torch.randperm(m, generator=gen)[:2]] = torch.tensor(rows[:2] if m < 64 else rows[2:])
        y = invariant_linear(x[picks], w, b)
        close_to_reference(y, invariant_linear_reference(x[picks], w, b))
        for place, i in enumerate(picks.tolist()):
            if i in alone:
                assert torch.equal(y[place], alone[i]), (m, i, place)


def test_empty_inputs():
    x, w, b = operands(0, 0, 48, 40, torch.float32)
    assert invariant_linear(x, w, b).shape == (0, 48)
    x = torch.zeros(3, 0, device=DEVICE)
    w = torch.zeros(4, 0, device=DEVICE)
    assert torch.equal(invariant_linear(x, w), torch.zeros(3, 4, device=DEVICE))
    bias = torch.arange(4.0, device=DEVICE)
    assert torch.equal(invariant_linear(x, w, bias), bias.expand(3, 4))


def test_tile_config_depends_on_the_weight_only():
    assert BLOCK_M == 16
    assert tile_config(576, 576, torch.bfloat16).block_n == 16  # 36 programs even at 16 wide
    assert tile_config(4096, 2048, torch.bfloat16).block_n == 32  # 128 programs
    assert tile_config(128256, 2048, torch.bfloat16).block_n == 64
    assert tile_config(48, 40, torch.float32).block_k == 64
    # K ranges: only where the column tiles are too few, whole BLOCK_K steps, none empty
    o_proj, down = tile_config(576, 576, torch.bfloat16), tile_config(576, 1536, torch.bfloat16)
    assert (o_proj.split_k, o_proj.k_per_split) == (3, 192)
    assert (down.split_k, down.k_per_split) == (4, 384)
    assert tile_config(49152, 576, torch.bfloat16).split_k == 1
    assert tile_config(100, 130, torch.float32).split_k == 1  # 3 steps: too few to split
    for n, k in [(576, 576), (576, 1536), (48, 320), (2048, 8192), (40, 64 * 9 + 1)]:
        cfg = tile_config(n, k, torch.bfloat16)
        assert cfg.k_per_split % cfg.block_k == 0
        assert (cfg.split_k - 1) * cfg.k_per_split < k <= cfg.split_k * cfg.k_per_split


def test_bad_inputs_are_value_errors():
    x, w, b = operands(0, 4, 48, 40, torch.float32)
    cases = [
        ((x[0], w, None), "needs x \\[M, K\\] and weight \\[N, K\\]"),
        ((x, w[:, :32], None), "x has K=40 columns but weight \\[N, K\\] has K=32"),
        ((x.to(torch.float64), w.to(torch.float64), None), "x dtype must be one of"),
        ((x, w.to(torch.bfloat16), None), "weight dtype torch.bfloat16 must equal"),
        ((x, w, b[:5]), "bias must be \\[N=48\\], got \\(5,\\)"),
        ((x, w, b.to(torch.float16)), "bias must be torch.float32"),
        ((x, w.T.contiguous().T, None), "must be contiguous"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            invariant_linear(*args)
