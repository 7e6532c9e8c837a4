"""The compiled CPU kernels against float64 references, and their row invariance (bitwise).

Linear: every weight format (fp32, bf16, fp16), shapes with panel padding (out % 8 != 0) and
odd in; any subset of rows, in any order and batch size, gives bitwise the rows of the full call.
Attention: random key lists (with GQA), bitwise the same per row alone and in a batch. The
PreparedLinears hook: dtypes it covers go to the kernel, others (float64, grad) to F.linear.
A weight in parts (PanelParts: a fused matrix whose row ranges differ in format, as a Q4_K_M
file's q|k|v): every row count 0..64 bitwise the concatenation of its parts' own references
(the fp32 panels of the dequantized blocks; q8_activations.reference_linear), on one thread and
on several; what is not a valid weight in parts refused in Python and, built by hand past
Python, by the C check.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import native
from specdec.models.gguf import blocks as gb
from specdec.models.gguf import q8_activations as qa
from specdec.models.matmul.prepared import PreparedLinears
from specdec.native import PanelParts, Panels, Weight

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
def test_the_kernels_key_names_the_build_and_the_instruction_sets():
    """Step costs are cached under this key (specdec.engine.step_profile): costs profiled with
    another build (a rebuilt kernel keeps its ABI number) or instruction set must not be
    reused."""
    key = PreparedLinears(KERNELS).key
    library = Path(KERNELS.lib._name).read_bytes()
    assert KERNELS.build == hashlib.blake2b(library, digest_size=8).hexdigest()
    for part in (f"ABI {native.ABI}", f"build {KERNELS.build}", f"q8 {KERNELS.q8_isa}",
                 f"float {KERNELS.float_isa}"):
        assert part in key


# ---- a weight in parts ------------------------------------------------------------------------


def _random_blocks(kind: str, out: int, inp: int, seed: int):
    from gguf_helpers import random_blocks

    return random_blocks(kind, out, inp, seed=seed)


def _parts_case(activations: str, seed: int = 0):
    """(PanelParts, x [64, 512], the 64-row reference): q Q4_K (64 rows) | k Q5_K (32) | v
    Q6_K (40, padded panels), each part's reference its own, concatenated."""
    blocks = [_random_blocks(k, n, 512, seed + i)
              for i, (k, n) in enumerate((("Q4_K", 64), ("Q5_K", 32), ("Q6_K", 40)))]
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(seed))
    if activations == "q8":
        parts, refs = [qa.prepare(b) for b in blocks], [qa.reference_linear(x, b) for b in blocks]
    else:
        parts = [gb.prepare(b) for b in blocks]
        refs = [KERNELS.linear(x, KERNELS.prepare(gb.dequantize(b))) for b in blocks]
    return PanelParts(tuple(parts)), x, torch.cat(refs, 1)


@needs_kernels
@pytest.mark.parametrize("activations", ["float", "q8"])
def test_a_weight_in_parts_is_its_parts_side_by_side(activations):
    w, x, ref = _parts_case(activations)
    assert (w.out_features, w.in_features, w.panels, w.fmt) == (136, 512, 18, native.PARTS)
    assert w.nbytes == sum(p.nbytes for p in w.parts)
    assert torch.equal(KERNELS.linear(x, w), ref)
    g = torch.Generator().manual_seed(1)
    for t in range(65):  # every row count, rows drawn from the 64: row-invariant
        rows = torch.randint(0, 64, (t,), generator=g)
        y = KERNELS.linear(x[rows].contiguous(), w)
        assert y.shape == (t, 136) and torch.equal(y, ref[rows]), t
    assert torch.equal(KERNELS.linear(x[:6].view(2, 3, 512), w), ref[:6].view(2, 3, 136))


@needs_kernels
@pytest.mark.parametrize("activations", ["float", "q8"])
def test_a_weight_in_parts_on_several_threads(activations):
    """The parts run one after another in one team, a barrier between them: the same bits."""
    w, x, ref = _parts_case(activations, seed=5)
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        for t in (1, 3, 17, 64):
            assert torch.equal(KERNELS.linear(x[:t].contiguous(), w), ref[:t]), t
    finally:
        torch.set_num_threads(before)


@needs_kernels
def test_parts_of_float_formats():
    """Parts of any format the kernels take (fp32 beside bf16 here): each column its part's."""
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(32, 40, generator=g), torch.randn(9, 40, generator=g).bfloat16()
    w = PanelParts((KERNELS.prepare(a), KERNELS.prepare(b)))
    x = torch.randn(7, 40, generator=g)
    want = torch.cat([KERNELS.linear(x, KERNELS.prepare(a)), KERNELS.linear(x, KERNELS.prepare(b))], 1)
    assert torch.equal(KERNELS.linear(x, w), want)


def _panels(kind: str, out: int, inp: int = 256, q8: bool = False) -> Panels:
    return (qa.prepare if q8 else gb.prepare)(_random_blocks(kind, out, inp, 0))


BAD_PARTS = [  # (parts, what the message says)
    (lambda: (_panels("Q4_K", 40), _panels("Q6_K", 16)), "part 0 has 40 rows, not whole pairs"),
    (lambda: (_panels("Q4_K", 16), _panels("Q6_K", 16, 512)), "the same in_features"),
    (lambda: (_panels("Q4_K", 16), _panels("Q6_K", 16, q8=True)), "8-bit activations, or none"),
    (lambda: (), "needs 1 to 8 parts, got 0"),
    (lambda: (_panels("Q8_0", 16),) * 9, "needs 1 to 8 parts, got 9"),
    (lambda: (PanelParts((_panels("Q8_0", 16),)), _panels("Q8_0", 16)), "no PanelParts inside"),
    (lambda: [_panels("Q8_0", 16)], "a tuple of Panels"),
]


@needs_kernels
@pytest.mark.parametrize("parts, message", BAD_PARTS, ids=[m for _, m in BAD_PARTS])
def test_what_is_not_a_weight_in_parts_is_refused(parts, message):
    with pytest.raises(ValueError, match="PanelParts of") as e:
        PanelParts(parts())
    assert message in str(e.value)


@needs_kernels
def test_the_c_side_refuses_parts_it_cannot_run():
    """sd_linear_weight (sd_check_weight) over structs made past PanelParts' checks: every one
    refused (-1, nothing written), the valid one run."""
    import ctypes

    a, b, c = _panels("Q4_K", 16), _panels("Q6_K", 24), _panels("Q6_K", 24, q8=True)
    x, y = torch.randn(2, 256), torch.full((2, 64), 7.0)

    def run(parts: list, panels: int, out: int, **change) -> int:
        items = (Weight * max(len(parts), 1))(*parts)
        w = Weight(None, native.PARTS, panels, out, None, ctypes.addressof(items), len(parts))
        for k, v in change.items():
            setattr(w, k, v)
        return KERNELS.lib.sd_linear_weight(x.data_ptr(), 2, 256, ctypes.byref(w),
                                            y.data_ptr(), 64, 1)

    wa, wb, wc = Weight.of(a), Weight.of(b), Weight.of(c)
    nested = PanelParts((a,)).c_weight
    assert run([wa, wb], 6, 40) == 0 and y[:, :40].ne(7.0).all()
    y.fill_(7.0)
    refused = [
        run([wb, wa], 6, 40),                     # part 0 (24 rows) not whole pairs
        run([wa, wb], 6, 39),                     # out is not the parts' sum
        run([wa, wb], 8, 40),                     # panels are not the parts' sum
        run([wa, wc], 6, 40),                     # float and q8 layouts mixed
        run([wa, nested], 4, 32),                 # a part in parts
        run([wa] * 9, 18, 144),                   # more than SD_MAX_PARTS
        run([], 0, 0),                            # no parts
        run([wa, wb], 6, 40, fmt=3),              # not SD_PARTS
        run([wa, wb], 6, 40, data=x.data_ptr()),  # data of its own
        run([wa, wb], 6, 40, nparts=-1),
    ]
    assert refused == [-1] * len(refused) and y.eq(7.0).all()
    with_bias = Weight.of(a, torch.zeros(16))
    assert run([with_bias, wb], 6, 40) == -1  # a part's bias: the whole matrix holds it
