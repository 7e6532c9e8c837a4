"""Tests for specdec.sampling: filters against hand-worked distributions (drawing from them:
test_randomness.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import sampling
from specdec.sampling import greedy, logits_to_probs, params_to_tensors
from specdec.sampling_params import SamplingParams

# A V=6 distribution with round numbers, stored out of sorted order so that the filters must map
# sorted positions back to token ids. By probability the tokens rank 3, 0, 5, 1, 4, 2.
P = np.array([0.25, 0.10, 0.04, 0.40, 0.06, 0.15])
LOGITS = np.log(P) + 1.7  # any shift gives the same softmax


def _filter(n: int = 1, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0,
            min_p: float = 0.0, logits: np.ndarray = LOGITS) -> np.ndarray:
    """logits_to_probs on ``n`` identical float64 rows [n, V] -> numpy [n, V]."""
    x = torch.tensor(np.tile(logits, (n, 1)), dtype=torch.float64)
    t, k, p, m = params_to_tensors(
        [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)] * n,
        "cpu")
    return logits_to_probs(x, t, k, p, m).numpy()


def _keep(tokens: list[int]) -> np.ndarray:
    """P restricted to ``tokens`` and renormalised [V]."""
    q = np.zeros_like(P)
    q[tokens] = P[tokens]
    return q / q.sum()


# ---- filters against hand-worked distributions ---------------------------------------------

def test_no_filters_is_softmax() -> None:
    np.testing.assert_allclose(_filter()[0], P, rtol=1e-12)


@pytest.mark.parametrize("k, kept", [(1, [3]), (2, [3, 0]), (3, [3, 0, 5]), (6, list(range(6))),
                                     (100, list(range(6))), (0, list(range(6)))])
def test_top_k(k: int, kept: list[int]) -> None:
    np.testing.assert_allclose(_filter(top_k=k)[0], _keep(kept), rtol=1e-12)


def test_top_k_3_worked_by_hand() -> None:
    # 0.40 + 0.25 + 0.15 = 0.8 -> 0.5, 0.3125, 0.1875
    expected = [0.3125, 0.0, 0.0, 0.5, 0.0, 0.1875]
    np.testing.assert_allclose(_filter(top_k=3)[0], expected, rtol=1e-12, atol=0)


# Sorted cumulative mass: 0.40, 0.65, 0.80, 0.90, 0.96, 1.0.
@pytest.mark.parametrize("p, kept", [(0.3, [3]), (0.4, [3]), (0.6, [3, 0]), (0.7, [3, 0, 5]),
                                     (0.85, [3, 0, 5, 1]), (0.99, list(range(6))),
                                     (1e-9, [3]), (1.0, list(range(6)))])
def test_top_p(p: float, kept: list[int]) -> None:
    np.testing.assert_allclose(_filter(top_p=p)[0], _keep(kept), rtol=1e-12)


def test_top_p_worked_by_hand() -> None:
    # top_p 0.6: 0.40 < 0.6, 0.65 >= 0.6 -> keep {3, 0}: 0.4/0.65, 0.25/0.65
    expected = [0.25 / 0.65, 0, 0, 0.40 / 0.65, 0, 0]
    np.testing.assert_allclose(_filter(top_p=0.6)[0], expected, rtol=1e-12, atol=0)


# Ratios to the max (0.40): 1, 0.625, 0.375, 0.25, 0.15, 0.1.
@pytest.mark.parametrize("m, kept", [(0.3, [3, 0, 5]), (0.2, [3, 0, 5, 1]), (0.5, [3, 0]),
                                     (0.7, [3]), (1.0, [3]), (0.05, list(range(6)))])
def test_min_p(m: float, kept: list[int]) -> None:
    np.testing.assert_allclose(_filter(min_p=m)[0], _keep(kept), rtol=1e-12)


def test_top_p_sees_distribution_renormalised_after_top_k() -> None:
    # top_p 0.7 alone keeps 3 tokens (0.65 < 0.7). After top_k 4 the mass is 0.9, so the
    # sorted cumulative mass is 0.444, 0.722 -> only 2 tokens reach 0.7.
    np.testing.assert_allclose(_filter(top_p=0.7)[0], _keep([3, 0, 5]), rtol=1e-12)
    np.testing.assert_allclose(_filter(top_k=4, top_p=0.7)[0], _keep([3, 0]), rtol=1e-12)


def test_top_k_top_p_min_p_together() -> None:
    # top_k 4 -> {3, 0, 5, 1}; renormalised cumulative 0.444, 0.722, 0.889, 1.0 so top_p 0.95
    # keeps all 4; min_p 0.3 drops token 1 (0.10 / 0.40 = 0.25 < 0.3).
    expected = [0.25 / 0.8, 0, 0, 0.40 / 0.8, 0, 0.15 / 0.8]
    got = _filter(top_k=4, top_p=0.95, min_p=0.3)[0]
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=0)
    # top_p 0.8 now cuts at 0.889 (3 tokens); min_p 0.5 then drops token 5 (0.375).
    np.testing.assert_allclose(_filter(top_k=4, top_p=0.8, min_p=0.5)[0], _keep([3, 0]),
                               rtol=1e-12)


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 2.0, 10.0])
def test_temperature_is_exact_softmax_of_scaled_logits(temperature: float) -> None:
    expected = torch.softmax(torch.tensor(LOGITS) / temperature, dim=-1).numpy()
    np.testing.assert_array_equal(_filter(temperature=temperature)[0], expected)


def test_temperature_then_top_k() -> None:
    # T = 2 gives weights sqrt(p); top_k 2 keeps tokens 3, 0: sqrt(.4), sqrt(.25) renormalised.
    w = np.sqrt([0.40, 0.25])
    expected = np.zeros(6)
    expected[[3, 0]] = w / w.sum()
    np.testing.assert_allclose(_filter(temperature=2.0, top_k=2)[0], expected, rtol=1e-12)


def test_temperature_applies_before_top_p() -> None:
    # At T = 0.5 the weights are p^2: .16, .0625, .0225, ... -> token 3 alone has mass
    # .16 / .2658 = 0.60 >= 0.55, so only it survives (at T = 1 two tokens would).
    np.testing.assert_allclose(_filter(temperature=0.5, top_p=0.55)[0], _keep([3]), atol=0)
    np.testing.assert_allclose(_filter(temperature=1.0, top_p=0.55)[0], _keep([3, 0]), rtol=1e-12)


def test_top_k_ties_at_boundary_keep_exactly_k() -> None:
    logits = np.array([1.0, 3.0, 2.0, 2.0, 2.0, 0.0])
    got = _filter(top_k=2, logits=logits)[0]
    assert np.count_nonzero(got) == 2
    # Among equal logits the lowest token id ranks first (as greedy's argmax does).
    expected = np.zeros(6)
    expected[[1, 2]] = np.exp([3.0, 2.0]) / np.exp([3.0, 2.0]).sum()
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    assert np.count_nonzero(_filter(top_k=4, logits=logits)[0]) == 4


def test_all_tied_logits_top_k() -> None:
    got = _filter(top_k=3, logits=np.zeros(6))[0]
    np.testing.assert_allclose(got, [1 / 3, 1 / 3, 1 / 3, 0, 0, 0], rtol=1e-12)
    # Large enough that an unstable sort scrambles equal keys.
    got = _filter(n=2, top_k=10, logits=np.zeros(5000))
    assert np.flatnonzero(got[0]).tolist() == list(range(10))
    np.testing.assert_array_equal(got[0], got[1])


def test_tiny_top_p_keeps_top_token_in_float32() -> None:
    # 1e-50 rounds to 0.0 in float32; the top token must survive anyway.
    x = torch.tensor(LOGITS, dtype=torch.float32).unsqueeze(0)
    probs = logits_to_probs(x, *params_to_tensors([SamplingParams(top_p=1e-50)], "cpu"))
    assert probs[0].tolist() == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]


def test_top_p_one_keeps_tiny_tail_in_float32() -> None:
    # In float32 the mass before the last token rounds to exactly 1.0; top_p = 1 must still
    # keep it, also when another row in the batch switches top-p on.
    x = torch.tensor([[0.0, -30.0], [0.0, -30.0]])
    t, k, p, m = params_to_tensors([SamplingParams(), SamplingParams(top_p=0.5)], "cpu")
    probs = logits_to_probs(x, t, k, p, m)
    torch.testing.assert_close(probs[0], torch.softmax(x[0], -1), rtol=0, atol=0)
    assert probs[0, 1] > 0 and probs[1].tolist() == [1.0, 0.0]


def test_rows_with_different_params_are_independent() -> None:
    configs = [dict(), dict(top_k=3), dict(top_p=0.6), dict(min_p=0.2),
               dict(temperature=2.0, top_k=2), dict(top_k=4, top_p=0.95, min_p=0.3)]
    params = [SamplingParams(**c) for c in configs]
    x = torch.tensor(np.tile(LOGITS, (len(params), 1)))
    batched = logits_to_probs(x, *params_to_tensors(params, "cpu")).numpy()
    for row, c in zip(batched, configs):
        np.testing.assert_array_equal(row, _filter(**c)[0])


def test_unfiltered_rows_unchanged_when_other_rows_filter() -> None:
    params = [SamplingParams(), SamplingParams(top_k=1), SamplingParams(top_p=0.3)]
    x = torch.tensor(np.tile(LOGITS, (3, 1)))
    probs = logits_to_probs(x, *params_to_tensors(params, "cpu"))
    np.testing.assert_array_equal(probs[0].numpy(), torch.softmax(x[0], -1).numpy())


# ---- dtypes, fast paths, argument checks ------------------------------------------------------

@pytest.mark.parametrize("dtype, out", [(torch.float64, torch.float64),
                                        (torch.float32, torch.float32),
                                        (torch.float16, torch.float32),
                                        (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("top_k", [-1, 3])
def test_output_dtype(dtype: torch.dtype, out: torch.dtype, top_k: int) -> None:
    x = torch.tensor(np.tile(LOGITS, (2, 1))).to(dtype)
    probs = logits_to_probs(x, *params_to_tensors([SamplingParams(top_k=top_k)] * 2, "cpu"))
    assert probs.dtype == out
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, dtype=out))


def test_no_sort_when_top_k_and_top_p_are_off(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_sort(*args: object, **kwargs: object) -> None:
        raise AssertionError("sorted although no row filters")

    monkeypatch.setattr(sampling.torch, "sort", no_sort)
    monkeypatch.setattr(sampling, "_apply_min_p", no_sort)
    params = [SamplingParams(temperature=0.5), SamplingParams(), SamplingParams(temperature=0)]
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    probs = logits_to_probs(x, *params_to_tensors(params, "cpu"))
    torch.testing.assert_close(probs[1], torch.softmax(x[1], -1))


def test_params_to_tensors() -> None:
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9,
                                                            min_p=0.1)]
    t, k, p, m = params_to_tensors(params, "cpu")
    assert t.tolist() == [1.0, 0.7] and k.tolist() == [-1, 5]
    assert p.tolist() == [1.0, 0.9] and m.tolist() == [0.0, 0.1]
    assert k.dtype == torch.int64 and all(v.shape == (2,) for v in (t, k, p, m))
    assert all(v.shape == (0,) for v in params_to_tensors([], "cpu"))


@pytest.mark.parametrize("field, value", [("temperature", 0.0), ("temperature", float("nan")),
                                          ("top_p", 0.0), ("top_p", 1.5), ("min_p", -0.1),
                                          ("min_p", 2.0)])
def test_bad_param_values_raise(field: str, value: float) -> None:
    t, k, p, m = params_to_tensors([SamplingParams()] * 2, "cpu")
    args = {"temperature": t, "top_k": k, "top_p": p, "min_p": m}
    args[field] = args[field].clone()
    args[field][1] = value
    with pytest.raises(ValueError):
        logits_to_probs(torch.zeros(2, 4), **args)


def test_bad_shapes_raise() -> None:
    t, k, p, m = params_to_tensors([SamplingParams()] * 2, "cpu")
    with pytest.raises(ValueError, match="logits"):
        logits_to_probs(torch.zeros(4), t, k, p, m)
    with pytest.raises(ValueError, match="logits"):
        logits_to_probs(torch.zeros(2, 4, dtype=torch.int64), t, k, p, m)
    with pytest.raises(ValueError, match="top_k"):
        logits_to_probs(torch.zeros(2, 4), t, k[:1], p, m)


def _reference(logits: np.ndarray, t: float, k: int, p: float, m: float) -> np.ndarray:
    """Row-by-row numpy oracle for logits_to_probs on one row [V]."""
    x = logits / t
    order = np.argsort(-x, kind="stable")
    w = np.exp(x[order] - x[order].max())
    if k > 0:
        w[k:] = 0
    w /= w.sum()
    if p < 1:
        before = np.cumsum(w) - w
        w[1:][before[1:] >= p] = 0
        w /= w.sum()
    w[w < m * w.max()] = 0
    out = np.zeros_like(w)
    out[order] = w / w.sum()
    return out


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), v=st.integers(1, 40),
       rows=st.lists(st.tuples(st.floats(0.2, 5.0), st.integers(-1, 45), st.floats(0.05, 1.0),
                               st.floats(0.0, 1.0)), min_size=1, max_size=5))
def test_matches_row_by_row_reference(seed: int, v: int,
                                      rows: list[tuple[float, int, float, float]]) -> None:
    logits = np.random.default_rng(seed).normal(scale=3.0, size=(len(rows), v))
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in rows]
    got = logits_to_probs(torch.tensor(logits), *params_to_tensors(params, "cpu")).numpy()
    for i, (t, k, p, m) in enumerate(rows):
        np.testing.assert_allclose(got[i], _reference(logits[i], t, k, p, m), atol=1e-12)


def test_greedy() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, -1.0, 0.0, 5.0]])
    assert greedy(logits).tolist() == [1, 0]
    assert greedy(torch.tensor(LOGITS)).item() == 3
    assert greedy(torch.zeros(2, 3, 5)).shape == (2, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_greedy_is_torchs_argmax(dtype) -> None:
    """The CPU fast path (numpy's argmax) gives torch.argmax's index on every row: ties to the
    lowest id, a NaN row its first NaN, infinities, -0.0 beside 0.0, strided views."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3001, generator=gen).to(dtype)
    x[1, 17] = x[1, 2000] = 50.0  # a tie
    x[2, 5] = x[2, 9] = float("nan")
    x[3, 11] = float("inf")
    x[4] = 0.0
    x[4, 30] = -0.0
    x[5] = float("-inf")
    for view in (x, x[:, ::2], x[::3], x.t().contiguous().t(), x[0]):
        got = greedy(view)
        assert got.dtype == torch.int64 and torch.equal(got, view.argmax(dim=-1)), view.shape
