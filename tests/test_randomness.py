"""specdec.randomness: per-(seed, position, stream) noise against a pure-Python reference, its
uniformity and independence, and exact draws (chi-square against the distribution drawn from)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_spec_sampling import chi_square_pvalue

from specdec import randomness as R

M32 = 0xFFFFFFFF


def _pvalue(counts, expected_p=None) -> float:
    counts = torch.as_tensor(np.asarray(counts), dtype=torch.float64)
    if expected_p is None:
        expected_p = torch.full_like(counts, 1.0 / len(counts))
    return chi_square_pvalue(counts, torch.as_tensor(np.asarray(expected_p), dtype=torch.float64))


def _mix32(x: int) -> int:
    x &= M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def _reference_bits(key: int, vocab: int) -> list[int]:
    """The documented hash, in Python ints: mix(mix(t * G + k1) ^ k2) per token t."""
    k1, k2 = key & M32, (key >> 32) & M32
    return [_mix32(_mix32(t * 0x9E3779B9 + k1) ^ k2) for t in range(vocab)]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), position=st.integers(0, 1 << 20),
       stream=st.integers(0, 40))
def test_tensor_hash_equals_the_python_reference(seed, position, stream):
    k = R.key(seed, position, stream)
    assert 0 <= k < 1 << 64
    got = [b & M32 for b in R.hash_bits([k], 37).tolist()[0]]
    assert got == _reference_bits(k, 37)


def test_keys_differ_by_seed_position_and_stream():
    keys = {R.key(s, p, t) for s in range(20) for p in range(20) for t in range(5)}
    assert len(keys) == 2000
    assert R.key(3, 4) == R.key(3, 4, R.SAMPLE) != R.key(4, 3)


def test_uniforms_are_uniform_and_rows_independent():
    u = R.uniforms([R.key(s, p) for s in range(40) for p in range(25)], 500)  # [1000, 500]
    assert u.dtype == torch.float64 and 0 < float(u.min()) and float(u.max()) < 1
    counts = np.histogram(u.numpy().ravel(), bins=50, range=(0, 1))[0]
    assert _pvalue(counts) > 1e-3
    # neighbouring positions and tokens are uncorrelated (pairs fall uniformly in a 10x10 grid)
    for a, b in ((u[:-1, :], u[1:, :]), (u[:, :-1], u[:, 1:])):
        cells = (np.floor(a.numpy() * 10) * 10 + np.floor(b.numpy() * 10)).ravel()
        assert _pvalue(np.bincount(cells.astype(int), minlength=100)) > 1e-3


def test_noise_is_exponential():
    e = R.noise([R.key(7, p) for p in range(400)], 250).numpy().ravel()  # 100k values
    assert abs(e.mean() - 1) < 0.02 and abs(e.var() - 1) < 0.05
    edges = -np.log1p(-np.linspace(0, 1, 21)[:-1])  # 20 equal-mass bins of Exp(1)
    counts = np.bincount(np.searchsorted(edges, e, side="right") - 1, minlength=20)
    assert _pvalue(counts) > 1e-3


P = torch.tensor([0.25, 0.10, 0.04, 0.40, 0.06, 0.15], dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_draw_follows_the_distribution(dtype):
    n = 20_000
    tokens = R.draw(P.to(dtype).expand(n, -1), [R.key(s, 5) for s in range(n)])
    counts = np.bincount(tokens.numpy(), minlength=6)
    assert _pvalue(counts, P.numpy()) > 1e-3


def test_draw_never_picks_zero_probability_tokens():
    probs = torch.zeros(4000, 1000, dtype=torch.float64)
    probs[:, 7], probs[:, 500] = 1e-30, 1.0 - 1e-30
    assert set(R.draw(probs, [R.key(1, p) for p in range(4000)]).tolist()) <= {7, 500}


def test_draw_is_a_function_of_row_and_key_only():
    probs = torch.softmax(torch.randn(5, 300, generator=torch.Generator().manual_seed(4)), -1)
    keys = [R.key(s, 3) for s in (5, 11, 6, 11, 9)]
    batched = R.draw(probs, keys)
    assert batched.dtype == torch.int64 and batched.shape == (5,)
    for i in range(5):
        assert int(R.draw(probs[i:i + 1], keys[i:i + 1])[0]) == int(batched[i])
    with torch.random.fork_rng():
        torch.manual_seed(123)  # the global RNG plays no part
        assert torch.equal(R.draw(probs, keys), batched)


def test_different_seeds_and_positions_give_different_tokens():
    probs = torch.full((1, 1000), 1e-3, dtype=torch.float64)
    by_seed = [int(R.draw(probs, [R.key(s, 0)])[0]) for s in range(50)]
    by_position = [int(R.draw(probs, [R.key(0, p)])[0]) for p in range(50)]
    assert len(set(by_seed)) > 40 and len(set(by_position)) > 40


def test_draw_checks_shapes():
    with pytest.raises(ValueError, match="R keys"):
        R.draw(torch.full((2, 4), 0.25), [R.key(0, 0)])
