"""Every entry point of the compiled kernels at every row count (malformed arguments:
test_native_arguments.py).

Fuzz, in one process per 8-bit-activation instruction set this CPU has (so a crash fails one
test instead of killing pytest): rows 0..16 and a sample up to 64, each call a random choice of
rows of one 64-row batch, for every weight format (fp32 / bf16 / fp16 panels, a GGUF's blocks of
every type with fp32 and with 8-bit activations, a weight in parts of three formats with each)
and for attention. Oracles: every row bitwise
the same row of the 64-row call (row invariance), and that call against the pure-torch
references the other tests use (bitwise: the GGUF blocks = the fp32 panels of the dequantized
weight, 8-bit activations = q8_activations.reference_linear; else float64 within
test_native's tolerance). Zero rows: an empty result of the right shape and dtype, also through
the C entry points directly (sd_linear, sd_attention, sd_layer), and leading batch dims / a
single vector as F.linear takes them.
"""

from __future__ import annotations

import ctypes
import os

import pytest
import torch
from gguf_helpers import inputs, random_blocks
from native_helpers import KERNELS, needs_kernels, run_capped

from specdec import native
from specdec.models.gguf import blocks as gb
from specdec.models.gguf import q8_activations as qa
from specdec.native import Q8_ISAS, LayerArgs, PanelParts, Panels, Weight

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BATCH = 64
# one GGUF type per kernel format (gguf_blocks.KERNEL_FORMAT: the others run the same kernels,
# their repacking is tested bitwise in test_gguf_weights), over a few blocks and over many (a
# 32-wide type for the AMX kernel's partial runs of blocks; the super-block formats: AMX runs of
# one super-block each)
GGUF = ["Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
WIDE = ["Q4_1", "Q8_0", "Q4_K", "Q5_1", "Q6_K", "Q5_K"]
FORMATS = ["float32", "bfloat16", "float16", *GGUF, *(f"{k}+q8" for k in GGUF), "parts",
           "parts+q8"]
PARTS = ("Q4_K", "Q8_0", "Q6_K")  # a weight in parts (native.PanelParts): q|k|v of three types


def fuzz_rows(seed: int = 0) -> list[int]:
    """Every row count 0..16, and a sample of 17..64 (always 64)."""
    g = torch.Generator().manual_seed(seed)
    return list(range(17)) + sorted(set(torch.randint(17, BATCH, (5,), generator=g).tolist())
                                    | {BATCH})


def _case(fmt: str, seed: int) -> tuple[Panels | PanelParts, torch.Tensor, torch.Tensor, str]:
    """(panels, x [BATCH, in], the 64-row reference, "bitwise" | "close") for one format:
    out not a multiple of 16 (padded panels), in odd for the float formats."""
    g = torch.Generator().manual_seed(seed)
    out = int(torch.randint(1, 60, (1,), generator=g))
    if fmt in ("float32", "bfloat16", "float16"):
        inp = 2 * int(torch.randint(1, 50, (1,), generator=g)) + 1
        w = (0.1 * torch.randn(out, inp, generator=g)).to(getattr(torch, fmt))
        x = torch.randn(BATCH, inp, generator=g)
        return KERNELS.prepare(w), x, x.double() @ w.double().T, "close"
    kind, q8 = fmt.split("+")[0], fmt.endswith("+q8")
    if kind == "parts":  # whole pairs of panels but the last part; 1 to 3 blocks of 256
        inp = 256 * int(torch.randint(1, 4, (1,), generator=g))
        rows = [16 * int(torch.randint(1, 4, (1,), generator=g)) for _ in PARTS[:-1]] + [out]
        bs = [random_blocks(k, n, inp, seed=seed + i) for i, (k, n) in enumerate(zip(PARTS, rows))]
        x = torch.randn(BATCH, inp, generator=g)
        if q8:
            ref = torch.cat([qa.reference_linear(x, b) for b in bs], 1)
            return PanelParts(tuple(qa.prepare(b) for b in bs)), x, ref, "bitwise"
        ref = torch.cat([KERNELS.linear(x, KERNELS.prepare(gb.dequantize(b))) for b in bs], 1)
        return PanelParts(tuple(gb.prepare(b) for b in bs)), x, ref, "bitwise"
    inp = inputs(kind, int(torch.randint(1, 6, (1,), generator=g)))
    b = random_blocks(kind, out, inp, seed=seed)
    x = torch.randn(BATCH, inp, generator=g)
    if q8:
        return qa.prepare(b), x, qa.reference_linear(x, b), "bitwise"
    return gb.prepare(b), x, KERNELS.linear(x, KERNELS.prepare(gb.dequantize(b))), "bitwise"


def _c_linear_rc(x: torch.Tensor, w: Panels | PanelParts, t: int) -> int:
    """sd_linear (sd_linear_weight for parts) called directly (no Python check in between)
    with t rows."""
    y = torch.empty(max(t, 1), w.panels * native.PANEL)
    if isinstance(w, PanelParts):
        return KERNELS.lib.sd_linear_weight(x.data_ptr(), t, w.in_features,
                                            ctypes.byref(w.c_weight), y.data_ptr(), y.shape[1], 1)
    return KERNELS.lib.sd_linear(x.data_ptr(), t, w.in_features, w.data.data_ptr(), w.fmt,
                                 w.panels, y.data_ptr(), y.shape[1], 1)


def fuzz_linear(fmt: str, seed: int) -> None:
    w, x, ref, oracle = _case(fmt, seed)
    full = KERNELS.linear(x, w)
    assert full.shape == (BATCH, w.out_features) and full.dtype == torch.float32
    if oracle == "bitwise":
        assert torch.equal(full, ref), fmt
    else:
        torch.testing.assert_close(full.double(), ref, rtol=1e-5,
                                   atol=1e-5 * w.in_features ** 0.5)
    g = torch.Generator().manual_seed(seed + 1)
    for t in fuzz_rows(seed):
        rows = torch.randint(0, BATCH, (t,), generator=g)
        y = KERNELS.linear(x[rows].contiguous(), w)
        assert y.shape == (t, w.out_features) and y.dtype == torch.float32, (fmt, t)
        assert torch.equal(y, full[rows]), (fmt, t)
    assert _c_linear_rc(x, w, 0) == 0  # the C entry point itself takes zero rows
    k, n = w.in_features, w.out_features
    assert torch.equal(KERNELS.linear(x[5], w), full[5])  # [in] -> [out]
    assert torch.equal(KERNELS.linear(x[:12].view(3, 4, k), w), full[:12].view(3, 4, n))
    for lead in ((0,), (0, 3), (2, 0), (2, 0, 5)):
        y = KERNELS.linear(torch.empty(*lead, k), w)
        assert y.shape == (*lead, n) and y.dtype == torch.float32


def _keys(seed: int, rows: int, keys: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randperm(keys, generator=g)[:c].sort().values
            for c in torch.randint(1, keys + 1, (rows,), generator=g).tolist()]


def fuzz_attention(dtype: torch.dtype, seed: int) -> None:
    """Rows of a 64-row call bitwise the same alone or with any others; the 64-row call
    against float64 (test_native's tolerance)."""
    g = torch.Generator().manual_seed(seed)
    h, hkv, d, keys = 4, 2, 16, 40
    cache = torch.randn(2 * keys, hkv, d, generator=g).to(dtype)
    q = torch.randn(BATCH, h, d, generator=g)
    lists = _keys(seed, BATCH, keys)

    def call(rows: list[int]) -> torch.Tensor:
        ks = [lists[r] for r in rows]
        indptr = torch.tensor([0] + [len(k) for k in ks], dtype=torch.int64).cumsum(0)
        index = torch.cat(ks) if ks else torch.zeros(0, dtype=torch.int64)
        return KERNELS.attention(q[rows].contiguous(), cache, keys, indptr, index, keys, 0.25)

    full = call(list(range(BATCH)))
    for t, k in enumerate(lists[:8]):
        kk = cache[k].double().repeat_interleave(h // hkv, 1)
        vv = cache[k + keys].double().repeat_interleave(h // hkv, 1)
        p = (torch.einsum("hd,nhd->hn", q[t].double(), kk) * 0.25).softmax(-1)
        torch.testing.assert_close(full[t].double(), torch.einsum("hn,nhd->hd", p, vv),
                                   rtol=1e-5, atol=1e-5)
    for t in fuzz_rows(seed):
        rows = torch.randint(0, BATCH, (t,), generator=g).tolist()
        y = call(rows)
        assert y.shape == (t, h, d) and torch.equal(y, full[rows]), (dtype, t)
    out, scratch = torch.empty(1, h, d), torch.empty(1)
    rc = KERNELS.lib.sd_attention(q.data_ptr(), 0, h, d, cache.data_ptr(),
                                  native.FORMATS[dtype], hkv, keys, None, None, 0, 0.25,
                                  out.data_ptr(), scratch.data_ptr(), 1)
    assert rc == 0  # zero rows through the C entry point: nothing read, nothing written


def _layer_args(t: int) -> tuple[LayerArgs, list[Panels]]:
    """A layer of hidden 16, 2 heads / 1 kv head of 8, inter 24, for t rows (no step tensors:
    with zero rows the kernel must read none)."""
    shapes = {"qkv": (32, 16), "o": (16, 16), "gate_up": (48, 16), "down": (16, 24)}
    keep = [KERNELS.prepare(torch.randn(*s)) for s in shapes.values()]
    a = LayerArgs(T=t, hidden=16, heads=2, kv_heads=1, head_dim=8, inter=24, eps=1e-6,
                  scale=8 ** -0.5, nthreads=1, page_size=4)
    for name, p in zip(shapes, keep):
        setattr(a, name, Weight.of(p))
    return a, keep


def check_c_layer() -> None:
    """sd_layer straight from ctypes: zero rows are a no-op that reads no step pointer; rows
    without their tensors, or no kv heads (a division by zero), are refused."""
    a, _keep = _layer_args(0)
    KERNELS.layer(a)  # every step pointer NULL: nothing read
    assert KERNELS.layer_scratch(a) == 1
    a.kv_heads = 0
    with pytest.raises(RuntimeError, match="sd_layer refused its arguments .*heads 2/0"):
        KERNELS.layer(a)
    a, _keep = _layer_args(2)
    with pytest.raises(RuntimeError, match="sd_layer refused its arguments"):
        KERNELS.layer(a)
    # a qkv in parts (q | k v): zero rows run; parts whose rows do not make q|k|v are refused
    a, _keep = _layer_args(0)
    parts = PanelParts((KERNELS.prepare(torch.randn(16, 16)), KERNELS.prepare(torch.randn(16, 16))))
    a.qkv = Weight.of(parts)
    KERNELS.layer(a)
    assert KERNELS.layer_scratch(a) == 1
    short = PanelParts((KERNELS.prepare(torch.randn(16, 16)), KERNELS.prepare(torch.randn(8, 16))))
    a.qkv = Weight.of(short)
    with pytest.raises(RuntimeError, match="sd_layer refused its arguments"):
        KERNELS.layer(a)


def fuzz_q8_wide(kind: str, seed: int) -> None:
    """Rows 0..16 and a sample to 64 over 19 blocks of 32 (the AMX kernel's runs of 8 blocks and
    a partial last one; _case's at most 5; K-quants: 1792 inputs, 7 runs): bitwise the 64-row
    call and the pure-torch reference."""
    inp = inputs(kind, 19)
    b = random_blocks(kind, 40, inp, seed=seed)
    w, x = qa.prepare(b), torch.randn(BATCH, inp, generator=torch.Generator().manual_seed(seed))
    full = KERNELS.linear(x, w)
    assert torch.equal(full, qa.reference_linear(x, b)), kind
    for t in fuzz_rows(seed):
        assert torch.equal(KERNELS.linear(x[BATCH - t:].contiguous(), w), full[BATCH - t:]), (kind, t)


def fuzz_all(seed: int = 0) -> None:
    for i, fmt in enumerate(FORMATS):
        print("linear", fmt, flush=True)
        fuzz_linear(fmt, seed + 100 * i)
    for i, kind in enumerate(WIDE):
        print("linear wide", kind, flush=True)
        fuzz_q8_wide(kind, seed + 500 + i)
    for i, dtype in enumerate(native.FORMATS):
        print("attention", dtype, flush=True)
        fuzz_attention(dtype, seed + 1000 + i)
    print("layer", flush=True)
    check_c_layer()


@needs_kernels
@pytest.mark.parametrize("isa", Q8_ISAS)
def test_every_row_count_every_format_every_isa(isa):
    """In a process of its own per instruction set (the choice is made once per process; a
    crash there is this test's failure, not pytest's)."""
    out = run_capped("test_native_shapes",
                     "print(t.KERNELS.q8_isa, flush=True)\n"
                     f"if t.KERNELS.q8_isa == {isa!r}:\n"
                     "    t.fuzz_all()\n"
                     "    print('fuzzed')\n",
                     None if isa == Q8_ISAS[-1] else isa,  # the widest runs without the variable
                     threads=1)
    ran = out.split()[0]
    assert Q8_ISAS.index(ran) <= Q8_ISAS.index(isa), ran  # never wider than the one asked for
    if ran != isa:
        pytest.skip(f"this CPU runs {ran} when asked for {isa}")
    assert "fuzzed" in out


# the float-activation GGUF kernels, one case per kernel format: (GGUF type, repacked to its
# per-32 format first, out, in): odd out (padded panels), in not a multiple of the 64-k block
FLOAT_GGUF = {"Q4_1": ("Q4_1", False, 203, 160), "Q8_0": ("Q8_0", False, 33, 96),
              "Q4_F": ("Q4_K", True, 37, 288), "Q5_F": ("Q5_1", False, 21, 224),
              "I8_F16": ("Q6_K", True, 19, 544), "Q4_K": ("Q4_K", False, 203, 768),
              "Q6_K": ("Q6_K", False, 45, 512), "Q5_K": ("Q5_K", False, 37, 512)}


def _float_gguf_case(fmt: str) -> tuple[Panels, gb.Blocks, torch.Tensor]:
    kind, per_32, out, inp = FLOAT_GGUF[fmt]
    if per_32:
        inp = 256 * -(-inp // 256)
    b = random_blocks(kind, out, inp, seed=len(fmt) + out)
    w = gb.prepare_repacked(gb.repack(b), out, inp) if per_32 else gb.prepare(b)
    assert w.fmt == gb.FORMATS[fmt], (fmt, w.fmt)
    return w, b, torch.randn(BATCH, inp, generator=torch.Generator().manual_seed(out))


def float_gguf_outputs(path: str | None = None, threads: tuple[int, ...] = (1,)) -> dict:
    """Every FLOAT_GGUF format's outputs for 0..64 rows (rows picked from one x) on each of
    ``threads`` torch threads (the kernels take the count call by call) -> {threads: {fmt:
    [(rows, y)]}}, saved to ``path`` when given."""
    got, before = {}, torch.get_num_threads()
    try:
        for n in threads:
            torch.set_num_threads(n)
            got[n] = {}
            for fmt in FLOAT_GGUF:
                w, _, x = _float_gguf_case(fmt)
                g = torch.Generator().manual_seed(7)
                got[n][fmt] = [(rows, KERNELS.linear(x[rows].contiguous(), w))
                               for rows in (torch.randint(0, BATCH, (t,), generator=g)
                                            for t in range(BATCH + 1))]
    finally:
        torch.set_num_threads(before)
    if path is not None:
        torch.save(got, path)
    return got


@needs_kernels
def test_float_gguf_kernels_are_bitwise_on_every_isa(tmp_path):
    """The AVX-512 float-activation GGUF kernels (1-3 rows direct, more unpacked) against the
    AVX2 ones (SPECDEC_NATIVE_ISA=avx2, in a process of its own: the choice is made once per
    process), and both against the dequantized weights' fp32 kernel: bitwise, every row count
    0..64, every row what it is alone. The AVX2 ones also on 3 threads (one row runs each
    thread's pairs two at a time, an odd last one alone: 13 pairs split 4, 4, 5). The widest
    kernels are this process's own unless the environment caps them (then a process of their
    own too); a process costs seconds of imports, the outputs a fraction of one."""
    path = str(tmp_path / "avx2.pt")
    out = run_capped("test_native_shapes", "print(t.KERNELS.float_isa, flush=True)\n"
                     f"t.float_gguf_outputs({path!r}, threads=(1, 3))\n", "avx2")
    assert out.split()[0] == "avx2"
    avx2 = torch.load(path)
    for fmt in FLOAT_GGUF:
        for (rows, one), (rows3, three) in zip(avx2[1][fmt], avx2[3][fmt]):
            assert torch.equal(rows, rows3)
            assert torch.equal(three.view(torch.int32), one.view(torch.int32)), (fmt, len(rows))
    if "SPECDEC_NATIVE_ISA" in os.environ:
        path = str(tmp_path / "widest.pt")
        out = run_capped("test_native_shapes", "print(t.KERNELS.float_isa, flush=True)\n"
                         f"t.float_gguf_outputs({path!r})\n", None, threads=1)
        widest, isa = torch.load(path)[1], out.split()[0]
    else:
        widest, isa = float_gguf_outputs()[1], KERNELS.float_isa
    got = {"avx2": avx2[1], None: widest}
    if isa != "avx512":
        pytest.skip(f"this CPU runs {isa} float kernels: no AVX-512 to compare")
    for fmt in FLOAT_GGUF:
        w, b, x = _float_gguf_case(fmt)
        ref = KERNELS.linear(x, KERNELS.prepare(gb.dequantize(b)))
        assert ref.isfinite().all() and (ref != 0).all(), fmt
        for (rows, old), (rows_new, new) in zip(got["avx2"][fmt], got[None][fmt]):
            assert torch.equal(rows, rows_new)
            assert torch.equal(new.view(torch.int32), old.view(torch.int32)), (fmt, len(rows))
            assert torch.equal(new.view(torch.int32), ref[rows].view(torch.int32)), (
                fmt, len(rows))
