"""The compiled CPU kernels against float64 references, and their row invariance (bitwise).

Linear: every weight format (fp32, bf16, fp16), shapes with panel padding (out % 8 != 0) and
odd in; any subset of rows, in any order and batch size, gives bitwise the rows of the full call.
Attention: random key lists (with GQA), bitwise the same per row alone and in a batch. The
PreparedLinears hook: dtypes it covers go to the kernel, others (float64, grad) to F.linear.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.models import native
from specdec.models.prepared import PreparedLinears

pytestmark = pytest.mark.usefixtures("one_torch_thread")
KERNELS = native.load()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="the compiled kernels are not built")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def test_the_kernels_are_built_where_a_compiler_is():
    """CI installs with gcc: the kernels must be there (else every test below would skip)."""
    import shutil

    if shutil.which("gcc") and torch.backends.cpu.get_cpu_capability() != "DEFAULT":
        assert KERNELS is not None, "specdec._cpu_kernels missing: reinstall (pip install -e .)"


def test_panels_layout():
    w = torch.arange(10 * 3, dtype=torch.float32).view(10, 3)
    p = native.Kernels.prepare(w)
    assert p.data.shape == (2, 3, 8) and p.out_features == 10 and p.in_features == 3
    assert torch.equal(p.data[0, :, 2], w[2]) and torch.equal(p.data[1, :, 1], w[9])
    assert not p.data[1, :, 2:].any()  # rows 10..15 are padding
    with pytest.raises(ValueError, match="2-d weight"):
        native.Kernels.prepare(w.double())


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_features, in_features", [(1541, 577), (8, 8), (3, 1), (96, 64)])
def test_linear_matches_float64(dtype, out_features, in_features):
    g = torch.Generator().manual_seed(out_features)
    w = (0.1 * torch.randn(out_features, in_features, generator=g)).to(dtype)
    x = torch.randn(37, in_features, generator=g)
    y = KERNELS.linear(x, KERNELS.prepare(w))
    ref = x.double() @ w.double().T
    assert y.shape == (37, out_features) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * in_features ** 0.5)


@needs_kernels
@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.integers(0, 39), min_size=1, max_size=40), fmt=st.sampled_from(DTYPES))
def test_linear_rows_do_not_depend_on_the_call(rows, fmt):
    g = torch.Generator().manual_seed(1)
    w = KERNELS.prepare((0.1 * torch.randn(203, 129, generator=g)).to(fmt))
    x = torch.randn(40, 129, generator=g)
    full = KERNELS.linear(x, w)
    assert torch.equal(KERNELS.linear(x[rows].contiguous(), w), full[rows])


def _attention_case(seed: int, t: int = 6, h: int = 6, hkv: int = 2, d: int = 64):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(120, hkv, d, generator=g)
    q = torch.randn(t, h, d, generator=g)
    keys = [torch.randperm(60, generator=g)[:n].sort().values
            for n in torch.randint(1, 61, (t,), generator=g).tolist()]
    indptr = torch.tensor([0] + [len(k) for k in keys]).cumsum(0)
    return q, rows, keys, indptr, torch.cat(keys)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 8, 72, 136])  # V column blocks of 64: whole, and a part
def test_attention_matches_float64_and_rows_are_invariant(dtype, d):
    """Key counts 1..60 (the four-key dot products and their tail), every head_dim shape."""
    q, rows, keys, indptr, index = _attention_case(3, d=d)
    rows = rows.to(dtype)
    out = KERNELS.attention(q, rows, 60, indptr, index, 60, 0.125)
    for t, k in enumerate(keys):
        kk = rows[k].double().repeat_interleave(3, 1)
        vv = rows[k + 60].double().repeat_interleave(3, 1)
        p = (torch.einsum("hd,nhd->hn", q[t].double(), kk) * 0.125).softmax(-1)
        torch.testing.assert_close(out[t].double(), torch.einsum("hn,nhd->hd", p, vv),
                                   rtol=1e-5, atol=1e-5)
        alone = KERNELS.attention(q[t:t + 1].contiguous(), rows, 60,
                                  torch.tensor([0, len(k)]), k, len(k), 0.125)
        assert torch.equal(alone[0], out[t])


@needs_kernels
def test_prepared_linears_route_by_dtype_and_grad():
    mm = PreparedLinears(KERNELS)
    w, b = torch.randn(24, 16), torch.randn(24)
    x = torch.randn(5, 16)
    torch.testing.assert_close(mm(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert mm.covers(x, w) and len(mm._panels) == 1
    assert mm(x.bfloat16(), w.bfloat16()).dtype == torch.bfloat16
    assert not mm.covers(x.double(), w.double())
    assert torch.equal(mm(x.double(), w.double()), F.linear(x.double(), w.double()))
    trainable = w.clone().requires_grad_()
    assert not mm.covers(x, trainable)  # training takes F.linear (and its gradient)
    with torch.no_grad():
        w.mul_(2.0)  # updated in place: prepared again, never stale
    torch.testing.assert_close(mm(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_the_kernels_key_names_the_build_and_the_q8_instruction_set():
    """Step costs are cached under this key (specdec.engine.step_profile): costs profiled with
    another build or instruction set must not be reused."""
    key = PreparedLinears(KERNELS).key
    assert f"ABI {native.ABI}" in key and f"q8 {KERNELS.q8_isa}" in key
