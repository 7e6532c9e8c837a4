"""CPU linear kernels: every candidate against F.linear, dispatch, tune()'s cache and margin."""

from __future__ import annotations

import doctest
import json

import pytest
import torch
import torch.nn.functional as F

from specdec.models.matmul import linear as lin
from specdec.models.matmul.linear import LinearKernels, candidates, choose

# max |y - F.linear in float32 (float64 for float64)| / max |reference|
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}
SHAPES = [(64, 32), (48, 40), (7, 24), (2, 16)]  # (out, in); 7: odd, no batched paths


def _inputs(rows, out_features, in_features, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, w, b = (torch.randn(*s, generator=g, dtype=torch.float64)
               for s in ((rows, in_features), (out_features, in_features), (out_features,)))
    return x.to(dtype), w.to(dtype), b.to(dtype)


def _rel_err(y, ref):
    return ((y.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("rows", [1, 3, 9, 64, 65])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_candidate_equals_f_linear(dtype, rows, shape):
    x, w, b = _inputs(rows, *shape, dtype)
    ref_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    for bias in (None, b):
        ref = F.linear(x.to(ref_dtype), w.to(ref_dtype), None if bias is None else b.to(ref_dtype))
        for name, fn in candidates(rows, *shape).items():
            y = fn(x, w, bias)
            assert y.shape == (rows, shape[0]) and y.dtype == dtype, name
            assert _rel_err(y, ref) <= TOL[dtype], (name, _rel_err(y, ref))


def test_large_weight_splits_in_eighths_and_has_no_multiply_reduce():
    out_features, in_features = 8 * 1024, 520  # > 1 << 22 elements: an LM head
    x, w, b = _inputs(3, out_features, in_features, torch.float32)
    assert lin.block_splits(out_features, in_features) == 8
    assert "vecdot" not in candidates(1, out_features, in_features)
    ref = F.linear(x, w, b)
    for name, fn in candidates(3, out_features, in_features).items():
        assert _rel_err(fn(x, w, b), ref) <= 1e-5, name


def test_which_candidates_are_offered():
    assert list(candidates(1, 960, 576)) == ["linear", "vecdot", "weight_left", "rows_left"]
    assert list(candidates(8, 960, 576)) == ["linear", "weight_left", "rows_left"]
    assert list(candidates(9, 960, 576)) == ["linear", "rows_left"]
    assert list(candidates(1, 7, 576)) == ["linear", "vecdot"]  # 2 does not divide 7
    assert candidates(4, 49152, 576)["weight_left"].keywords == {"splits": 8}
    assert lin.block_splits(49153 * 2, 576) == 2  # 8 does not divide: halves
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert lin.supported_names(dtype) == set(candidates(1, 16, 16))


def test_buckets():
    assert [lin.bucket_of(t) for t in (1, 2, 3, 4, 5, 8, 9, 33, 64)] == [1, 2, 4, 4, 8, 8, 16,
                                                                          64, 64]


@pytest.fixture
def spy(monkeypatch):
    """Replaces weight_left by a recording wrapper (tables built after this use it)."""
    calls = []
    real = lin.weight_left

    def weight_left(x, weight, bias=None, splits=2):
        calls.append(x.shape[0])
        return real(x, weight, bias, splits)

    monkeypatch.setattr(lin, "weight_left", weight_left)
    return calls


def test_dispatch_uses_the_choice_of_the_smallest_bucket_that_fits(spy):
    kernels = LinearKernels(torch.float32, {(4, 64, 32): "weight_left"})
    for rows in (3, 4):
        x, w, b = _inputs(rows, 64, 32, torch.float32)
        assert _rel_err(kernels(x, w, b), F.linear(x, w, b)) <= 1e-5
    assert spy == [3, 4]
    for rows in (1, 2, 5, 8):  # other buckets: not chosen, F.linear
        kernels(*_inputs(rows, 64, 32, torch.float32))
    kernels(*_inputs(4, 32, 64, torch.float32)[:2])  # another shape
    assert spy == [3, 4]


def test_dispatch_falls_back_to_f_linear(spy):
    kernels = LinearKernels(torch.float32, {(b, 64, 32): "rows_left" for b in lin.BUCKETS}
                            | {(4, 64, 32): "weight_left"})
    x, w, _ = _inputs(4, 64, 32, torch.float32)
    kernels(x.double(), w.double())  # not the tuned dtype
    kernels(x.clone().requires_grad_(), w)
    kernels(x, w.clone().requires_grad_())
    kernels(x.unsqueeze(0), w)  # not 2-d
    LinearKernels.plain()(x, w)
    assert spy == []
    y = kernels(*_inputs(65, 64, 32, torch.float32)[:2])  # more rows than any bucket
    assert y.shape == (65, 64)


def test_a_choice_that_does_not_apply_is_refused():
    with pytest.raises(ValueError, match="weight_left"):
        LinearKernels(torch.float32, {(16, 64, 32): "weight_left"})


def test_choose_needs_the_margin():
    assert choose({"linear": 1.0, "vecdot": 0.96, "rows_left": 0.951}) == "linear"
    assert choose({"linear": 1.0, "vecdot": 0.95, "rows_left": 0.97}) == "vecdot"
    assert choose({"linear": 1.0, "vecdot": 2.0}) == "linear"
    assert choose({"linear": 1.0}) == "linear"


def _fake_timer(ms):
    """A timer that answers ms[name] milliseconds without running anything."""
    return lambda name, fn, x, weight, bias: ms[name] * 1e-3


@pytest.mark.parametrize("vecdot_ms,expected", [(0.96, "linear"), (0.94, "vecdot")])
def test_tune_chooses_another_path_only_with_the_margin(vecdot_ms, expected):
    ms = {"linear": 1.0, "vecdot": vecdot_ms, "weight_left": 0.97, "rows_left": 3.0}
    kernels = LinearKernels.tune([(64, 32)], torch.float32, cache_dir=None,
                                 timer=_fake_timer(ms))
    desc = kernels.describe()
    assert desc["choices"]["1x64x32"] == expected
    assert desc["timings_ms"]["1x64x32"] == pytest.approx(ms)
    assert set(desc["choices"].values()) == {expected, "linear"}  # others: linear is nearest
    assert desc["timings_ms"]["16x64x32"] == pytest.approx({"linear": 1.0, "rows_left": 3.0})


def test_tune_round_trips_through_the_cache(tmp_path):
    shapes = [(16, 8), (24, 16)]
    # fake timings: what is tested is the cache, and a busy machine must not starve the budget
    ms = {"linear": 1.0, "vecdot": 0.5, "weight_left": 0.6, "rows_left": 0.7}
    first = LinearKernels.tune(shapes, torch.float32, cache_dir=tmp_path, budget_s=0.3,
                               timer=_fake_timer(ms))
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].suffix == ".json"  # no temporary file left
    desc = first.describe()
    assert not desc["from_cache"] and len(desc["choices"]) == 14
    assert all(ms["linear"] > 0 for ms in desc["timings_ms"].values())
    assert "torch.float32" in desc["key"] and torch.__version__ in desc["key"]
    second = LinearKernels.tune(shapes, torch.float32, cache_dir=tmp_path, budget_s=0.3,
                                timer=_fake_timer({}))  # would raise if anything were timed
    assert second.describe()["from_cache"]
    assert second.describe()["choices"] == desc["choices"]
    for rows in (1, 3, 9, 64, 65):
        x, w, b = _inputs(rows, 24, 16, torch.float32)
        assert _rel_err(second(x, w, b), F.linear(x, w, b)) <= 1e-5


def test_cache_is_per_dtype_and_threads(tmp_path):
    ms = {"linear": 1.0, "vecdot": 0.5, "weight_left": 0.5, "rows_left": 0.5}
    threads = torch.get_num_threads()
    for dtype, n in ((torch.float32, 1), (torch.bfloat16, 1), (torch.float32, 2)):
        k = LinearKernels.tune([(8, 8)], dtype, cache_dir=tmp_path, threads=n,
                               timer=_fake_timer(ms))
        assert not k.describe()["from_cache"] and f"{n} threads" in k.describe()["key"]
        assert torch.get_num_threads() == threads  # restored
    assert len(list(tmp_path.iterdir())) == 3


def test_cache_gains_the_shapes_it_lacked(tmp_path):
    ms = {"linear": 1.0, "vecdot": 2.0, "weight_left": 0.5, "rows_left": 2.0}

    def tune(shapes):
        return LinearKernels.tune(shapes, torch.float32, cache_dir=tmp_path, timer=_fake_timer(ms))

    assert not tune([(8, 8)]).describe()["from_cache"]
    both = tune([(8, 8), (16, 8)])
    assert not both.describe()["from_cache"] and len(both.describe()["choices"]) == 14
    assert tune([(16, 8), (8, 8)]).describe()["from_cache"]


@pytest.mark.parametrize("content", [
    "{not json", "\xff\xfe", "[]", '{"format": 1}',
    '{"format": 1, "key": "KEY", "choices": {"1x8x8": "nope"}, "timings_ms": {}}',
    '{"format": 1, "key": "KEY", "choices": {"3x8x8": "linear"}, "timings_ms": {}}',
    '{"format": 1, "key": "KEY", "choices": {"16x8x8": "weight_left"}, "timings_ms": {}}',
    '{"format": 1, "key": "other machine", "choices": {}, "timings_ms": {}}',
    '{"format": 1, "key": "KEY", "choices": {}, "timings_ms": {"1x8": {"linear": 1}}}',
])
def test_corrupt_cache_is_retimed_and_overwritten(tmp_path, content):
    key = lin.cache_key(torch.float32, torch.get_num_threads())
    path = tmp_path / lin.cache_file_name(key)
    path.write_text(content.replace("KEY", key), encoding="latin-1")
    ms = {"linear": 1.0, "vecdot": 0.5, "weight_left": 0.5, "rows_left": 0.5}
    with pytest.warns(UserWarning, match="unusable"):
        k = LinearKernels.tune([(8, 8)], torch.float32, cache_dir=tmp_path, timer=_fake_timer(ms))
    assert not k.describe()["from_cache"]
    assert json.loads(path.read_text())["choices"]["1x8x8"] == "vecdot"
    again = LinearKernels.tune([(8, 8)], torch.float32, cache_dir=tmp_path, timer=_fake_timer({}))
    assert again.describe()["from_cache"]


def test_no_budget_times_nothing_and_caches_nothing(tmp_path):
    k = LinearKernels.tune([(8, 8)], torch.float32, cache_dir=tmp_path, budget_s=0.0)
    assert k.describe()["choices"] == {} and not k.describe()["from_cache"]
    x, w, _ = _inputs(3, 8, 8, torch.float32)
    assert torch.equal(k(x, w), F.linear(x, w))
    assert json.loads(next(tmp_path.iterdir()).read_text())["choices"] == {}


def test_budget_skips_entries_predicted_to_overrun_it(tmp_path):
    # each fake call "takes" 0.1 s: bucket 1 is measured (nothing predicts it); bucket 2 would
    # need ~2 x (2 warm-up calls + a round) x 4 candidates x 0.1 s > 1 s, so it and all larger
    # buckets of the shape are skipped, use F.linear and are not cached
    ms = {"linear": 100.0, "vecdot": 50.0, "weight_left": 100.0, "rows_left": 100.0}
    k = LinearKernels.tune([(8, 8)], torch.float32, cache_dir=tmp_path, budget_s=1.0,
                           timer=_fake_timer(ms))
    assert k.describe()["choices"] == {"1x8x8": "vecdot"}
    assert json.loads(next(tmp_path.iterdir()).read_text())["choices"] == {"1x8x8": "vecdot"}


def test_tune_rejects_bad_arguments():
    with pytest.raises(TypeError, match="dtype"):
        LinearKernels.tune([(8, 8)], torch.int32, cache_dir=None)
    with pytest.raises(ValueError, match="threads"):
        LinearKernels.tune([(8, 8)], torch.float32, cache_dir=None, threads=0)
    with pytest.raises(ValueError, match="shapes"):
        LinearKernels.tune([(0, 8)], torch.float32, cache_dir=None)


def test_docstring_examples():
    assert doctest.testmod(lin).failed == 0
