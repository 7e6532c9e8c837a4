"""Q4_K, Q5_K and Q6_K in their super-block formats (specdec/models/gguf/kquant_blocks.py;
kernels.h: SD_Q4_K, SD_Q5_K, SD_Q6_K and their 8-bit-activation layouts).

The strongest check: for the same blocks, the new formats give bitwise the outputs of the
per-32 formats they replace (Q4_F, Q5_F, I8_F16 over gguf_blocks.repack's values) and of the
references (float: the fp32 panels of the dequantized weights, themselves bitwise gguf-py's;
q8: q8_activations.reference_linear), for every number of rows from 0 to 64, odd out_features,
realistic blocks (specdec.bench.random_blocks), random bytes, and extreme ones (sc = m = 63,
d at fp16's largest and smallest, dmin = 0, negative d, Q5_K's q = 31 / 0 throughout, Q6_K's
sc = -128 / 127); each row
checked against the reference's row, so no row depends on the others of its call. Every
narrower q8 instruction set runs in a process of its own. And the bytes: the file's, +2.8 %
(Q4_K), +2.3 % (Q5_K) and +0 % (Q6_K); the layouts themselves, element by element, against the
file's quants (the pack / unpack round trip).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_helpers import random_blocks
from native_helpers import KERNELS, cpu_flags, needs_kernels, run_capped

from specdec.models.gguf import blocks as gb
from specdec.models.gguf import kquant_blocks as kb
from specdec.models.gguf import q8_activations as qa
from specdec.native import PANEL, Q8_ISAS, PanelParts, Panels

KINDS = ["Q4_K", "Q5_K", "Q6_K"]
SOURCES = ["bench", "bytes", "extreme"]
FP16_EXTREMES = np.array([65504.0, -65504.0, 2.0**-24, -(2.0**-24), 2.0**-14, 0.0, 1.0, -3.5])


def bench_blocks(kind: str, out: int, inp: int, seed: int) -> gb.Blocks:
    """Blocks as a quantizer leaves them (the bench's model files)."""
    from gguf import GGMLQuantizationType

    from specdec.bench.random_blocks import random_blocks as bench

    rows = bench(np.random.default_rng(seed), GGMLQuantizationType[kind], out, inp, 0.02)
    return gb.Blocks(kind, torch.from_numpy(np.ascontiguousarray(rows)), inp)


def extreme_blocks(kind: str, out: int, inp: int, seed: int) -> gb.Blocks:
    """Random bytes whose fp16 scales are fp16's extremes (largest, smallest subnormal and
    normal, zero, negative), dmin often 0, and whole rows of the largest sub-block scales."""
    g = np.random.default_rng(seed)
    n, nbytes = inp // kb.QK, gb.BLOCK_BYTES[kind]
    blk = g.integers(0, 256, (out, n, nbytes), dtype=np.uint8)

    def f16(values):
        return g.choice(values, (out, n, 1)).astype(np.float16).view(np.uint8)

    if kind in ("Q4_K", "Q5_K"):
        blk[..., 0:2] = f16(FP16_EXTREMES)
        blk[..., 2:4] = f16(np.array([0.0, 0.0, 65504.0, 2.0**-24, 1.0]))
        blk[::3, :, 4:16] = 255  # every sc and m = 63
        if kind == "Q5_K":
            blk[::3, :, 16:] = 255  # q = 31 throughout (with the largest sc, m)
            blk[1::3, :, 16:] = 0  # q = 0
    else:
        blk[..., 208:210] = f16(FP16_EXTREMES)
        blk[::3, :, 192:208] = 127
        blk[1::3, :, 192:208] = 128  # int8 -128
    return gb.Blocks(kind, torch.from_numpy(blk.reshape(out, -1)), inp)


def make_blocks(source: str, kind: str, out: int, inp: int, seed: int) -> gb.Blocks:
    make = {"bench": bench_blocks, "bytes": random_blocks, "extreme": extreme_blocks}[source]
    return make(kind, out, inp, seed=seed)


def test_bytes_are_the_files():
    """Per panel pair and super-block: Q4_K 148 bytes a row (the file's 144 + 4), Q5_K 180
    (5.625 bits a weight: the file's 176 + 4), Q6_K the file's 210; against 192 (Q4_F), 320
    (Q5_F) and 320 (I8_F16) before."""
    for kind, per_row, old in (("Q4_K", 148, 192), ("Q5_K", 180, 320), ("Q6_K", 210, 320)):
        b = random_blocks(kind, 32, 512)
        for mode in ("float", "q8"):
            p = kb.prepare(kind, b.rows, 512, mode)
            assert p.nbytes == 32 * 2 * per_row
            assert p.nbytes <= 1.03 * b.nbytes
        r = gb.repack(b)
        assert gb.prepare_repacked(r, 32, 512).nbytes == 32 * 2 * old


def unpack_q5_k(p: Panels, mode: str) -> tuple[torch.Tensor, ...]:
    """The fields of prepared Q5_K panels read back as kquant_blocks' docstring lays them out,
    per row and super-block (rows padded to whole pairs): d, dmin [rows, n] fp16, sc, m
    [rows, n, 8] uint8, q [rows, n, 8, 32] 0..31."""
    pairs, n = p.panels // 2, p.in_features // kb.QK
    data = p.data.reshape(pairs, n, kb.PAIR_BYTES["Q5_K"])

    d = data[..., 0:32].contiguous().view(torch.float16)  # [pairs, n, 16]
    dmin = data[..., 32:64].contiguous().view(torch.float16)
    sc, m = data[..., 64:192].reshape(pairs, n, 8, 16), data[..., 192:320].reshape(pairs, n, 8, 16)
    sub = data[..., 320:].reshape(pairs, n, 8, 320).long()
    nib, hb = sub[..., :256], sub[..., 256:]
    q = torch.empty(pairs, 16, n, 8, 32, dtype=torch.long)  # [pair, row, n, sub-block, k]
    for row in range(16):
        p_, i = divmod(row, PANEL)
        for k in range(32):
            if mode == "float":  # element e = 16k + row
                e = 16 * k + row
                low = (nib[..., e % 256] >> (4 * (e // 256))) & 15
                high = (hb[..., e % 64] >> (e // 64)) & 1
            else:
                c, j = divmod(k, 4)
                low = (nib[..., 32 * c + 4 * i + j] >> (4 * p_)) & 15
                high = (hb[..., 32 * p_ + 4 * i + j] >> c) & 1
            q[:, row, :, :, k] = low | (high << 4)
    return (d.transpose(1, 2).reshape(-1, n), dmin.transpose(1, 2).reshape(-1, n),
            sc.permute(0, 3, 1, 2).reshape(-1, n, 8), m.permute(0, 3, 1, 2).reshape(-1, n, 8),
            q.reshape(-1, n, 8, 32))


@pytest.mark.parametrize("mode", ["float", "q8"])
def test_q5_k_layout_round_trips(mode):
    """Every field of the prepared Q5_K panels is the file's, where the kernels read it: d,
    dmin, the integer sc, m, and each weight's 5-bit q (nibble and 5th bit), padding rows 0."""
    from specdec.models.gguf import types as gt

    out, inp = 37, 768
    b = make_blocks("bytes", "Q5_K", out, inp, seed=3)
    d, dmin, sc, m, q = unpack_q5_k(kb.prepare("Q5_K", b.rows, inp, mode), mode)
    blk = gt.blocks("Q5_K", b.rows, inp)
    want_sc, want_m = gt.k_scale_ints(blk)
    assert torch.equal(d[:out].view(torch.int16), blk[..., 0:2].contiguous().view(torch.int16)
                       .squeeze(-1))
    assert torch.equal(dmin[:out].view(torch.int16), blk[..., 2:4].contiguous().view(
        torch.int16).squeeze(-1))
    assert torch.equal(sc[:out].long(), want_sc.long()) and torch.equal(m[:out].long(),
                                                                        want_m.long())
    assert torch.equal(q[:out], gt.q5_k_quants(blk).long())
    assert not q[out:].any() and not sc[out:].any() and not d[out:].view(torch.int16).any()
    assert (q >= 16).any() and (q < 16).any()


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("out, inp", [(33, 512), (203, 256), (16, 768)])
@pytest.mark.parametrize("mode", ["float", "q8"])
def test_new_formats_are_bitwise_the_old_ones(kind, source, out, inp, mode):
    """0..64 rows (a window of 64 fixed ones, so each row meets different neighbours):
    bitwise the per-32 format's rows and the reference's."""
    b = make_blocks(source, kind, out, inp, seed=out + inp)
    x = torch.randn(64, inp, generator=torch.Generator().manual_seed(out))
    x[5] = 0.0  # a row of zeros (q8: scale 0)
    x[7] *= 1e4
    if mode == "float":
        new = gb.prepare(b)
        old = gb.prepare_repacked(gb.repack(b), out, inp)
        ref = KERNELS.linear(x, KERNELS.prepare(gb.dequantize(b)))
    else:
        new = qa.prepare(b)
        old = qa.prepare_repacked(gb.repack(b), out, inp)
        ref = qa.reference_linear(x, b)
    assert new.fmt == (kb.FORMATS if mode == "float" else kb.Q8_FORMATS)[kind]
    assert old.fmt != new.fmt
    assert ref.isfinite().all()
    for t in range(65):
        at = (7 * t) % (65 - t)
        rows = x[at:at + t]
        y = KERNELS.linear(rows, new)
        assert torch.equal(y, KERNELS.linear(rows, old)), t
        assert torch.equal(y.view(torch.int32), ref[at:at + t].view(torch.int32)), t  # -0.0 too


@pytest.mark.parametrize("kind", KINDS)
def test_extreme_blocks_dequantize_as_gguf_py(kind):
    """The extreme blocks' weights (the references above) are gguf-py's, bitwise."""
    from gguf import GGMLQuantizationType, quants

    b = extreme_blocks(kind, 24, 512, seed=1)
    ref = quants.dequantize(b.rows.numpy(), getattr(GGMLQuantizationType, kind))
    got = gb.dequantize(b)
    assert torch.equal(got.view(torch.int32), torch.from_numpy(ref).reshape(24, 512).view(
        torch.int32))
    assert got.isfinite().all() and got.abs().max() > 1e6  # the extremes are in there


@needs_kernels
@pytest.mark.parametrize("isa", ["avx2", "avx-vnni", "avx512-vnni"])
def test_every_narrower_isa_is_bitwise_the_old_formats(isa):
    """The q8 kernels of a narrower instruction set (the widest runs above: AMX from 9 or 11
    rows, the AVX512-VNNI kernels below), asked for by the environment in a process of its own
    (the choice is made once per process)."""
    if Q8_ISAS.index(isa) >= Q8_ISAS.index(KERNELS.q8_isa):
        pytest.skip(f"this CPU's widest q8 kernels are {KERNELS.q8_isa} (the tests above)")
    if isa == "avx-vnni" and "avx_vnni" not in cpu_flags():  # AMD Zen 4: AVX512-VNNI only
        pytest.skip("this CPU has AVX512-VNNI but not the 256-bit AVX-VNNI")
    out = run_capped("test_kquant_formats",
                     "print(t.KERNELS.q8_isa)\n"
                     "for kind in t.KINDS:\n"
                     "    for source in t.SOURCES:\n"
                     "        for out, inp in [(33, 512), (203, 256)]:\n"
                     "            t.test_new_formats_are_bitwise_the_old_ones(kind, source, out, "
                     "inp, 'q8')\n", isa, timeout=600)
    ran = out.split()[0]
    assert ran == isa, ran  # the one asked for (this CPU has every one below the widest)


# the AMX cases: odd out_features (a padded last pair), 1 and 4 super-blocks (AMX runs of one
# each), and a weight in parts of the three formats (native.PanelParts: one call per part)
AMX_CASES = [("Q4_K", 203, 256), ("Q5_K", 37, 1024), ("Q6_K", 45, 512), ("parts", 0, 512)]


def _amx_case(case: int) -> tuple[Panels | PanelParts, torch.Tensor, torch.Tensor]:
    """(panels, x [64, in], the reference's 64 rows) for AMX_CASES[case], every source of
    blocks mixed in (realistic, random bytes, extremes; a row of zeros, one of 1e4 x)."""
    kind, out, inp = AMX_CASES[case]
    x = torch.randn(64, inp, generator=torch.Generator().manual_seed(case))
    x[5], x[40] = 0.0, x[40] * 1e4
    if kind == "parts":
        bs = [make_blocks(src, k, n, inp, seed=case + i)
              for i, (src, k, n) in enumerate(zip(SOURCES, KINDS, (32, 16, 29)))]
        ref = torch.cat([qa.reference_linear(x, b) for b in bs], 1)
        return PanelParts(tuple(qa.prepare(b) for b in bs)), x, ref
    b = make_blocks(SOURCES[case % 3], kind, out, inp, seed=case)
    return qa.prepare(b), x, qa.reference_linear(x, b)


def amx_case_outputs(path: str) -> None:
    """Every AMX case's q8 outputs for 0..64 rows (a different window of x each) -> path."""
    got = {}
    for case in range(len(AMX_CASES)):
        w, x, _ = _amx_case(case)
        got[case] = [KERNELS.linear(x[(5 * t) % (65 - t):][:t].contiguous(), w)
                     for t in range(65)]
    torch.save(got, path)


@needs_kernels
def test_amx_is_bitwise_the_avx512_kernels(tmp_path):
    """From 9 (Q5_K, Q6_K) or 11 (Q4_K) rows AMX tiles make the sums of the super-block
    formats (linear_q8.c's q8_amx): 0..64 rows bitwise the AVX512-VNNI kernels'
    (SPECDEC_NATIVE_ISA=avx512-vnni, in a process of its own: the choice is made once per
    process) and the pure-torch reference's, row by row."""
    if KERNELS.q8_isa != "amx":
        pytest.skip(f"this CPU's widest q8 kernels are {KERNELS.q8_isa}: no AMX")
    out = run_capped("test_kquant_formats",
                     "print(t.KERNELS.q8_isa, flush=True)\n"
                     f"t.amx_case_outputs({str(tmp_path / 'avx512.pt')!r})\n", "avx512-vnni",
                     timeout=600)
    assert out.split()[0] == "avx512-vnni"
    amx_case_outputs(str(tmp_path / "amx.pt"))
    old, new = torch.load(tmp_path / "avx512.pt"), torch.load(tmp_path / "amx.pt")
    for case in range(len(AMX_CASES)):
        _, x, ref = _amx_case(case)
        assert ref.isfinite().all()
        for t in range(65):
            at = (5 * t) % (65 - t)
            assert torch.equal(new[case][t].view(torch.int32), old[case][t].view(torch.int32)), (
                AMX_CASES[case], t)
            assert torch.equal(new[case][t].view(torch.int32), ref[at:at + t].view(torch.int32)), (
                AMX_CASES[case], t)


def test_prepare_picks_the_super_block_formats():
    for kind in KINDS:
        b = random_blocks(kind, 8, 256)
        assert gb.KERNEL_FORMAT[kind] == kind
        assert gb.prepare(b).fmt == gb.FORMATS[kind] == kb.FORMATS[kind]
        assert qa.prepare(b).fmt == qa.FORMATS[kind] == kb.Q8_FORMATS[kind]
        assert gb.repack(b).fmt == kb.PER_32[kind]  # the values the kernels compute with


def test_what_does_not_fit_is_named():
    b = random_blocks("Q4_K", 8, 256)
    with pytest.raises(ValueError, match="super-block formats take Q4_K, Q5_K, Q6_K with "
                                         "activations float or q8, got Q5_1 with 'float'"):
        kb.prepare("Q5_1", b.rows, 256, "float")
    with pytest.raises(ValueError, match="got Q4_K with 'int4'"):
        kb.prepare("Q4_K", b.rows, 256, "int4")
    with pytest.raises(ValueError, match="Q4_K blocks need in_features a multiple of 256"):
        kb.prepare("Q4_K", b.rows, 288, "q8")
    for code in (*kb.FORMATS.values(), *kb.Q8_FORMATS.values()):
        data = torch.zeros(1 * 9 * 296, dtype=torch.uint8)  # 288 inputs: 9 blocks of 32
        with pytest.raises(ValueError, match="super-block format needs in_features % 256 == 0"):
            Panels(data, 16, 288, code, 2)


@needs_kernels
def test_the_kernel_refuses_a_partial_super_block():
    """The C side's own check (sd_check_weight): K a multiple of 32 but not of 256."""
    x, y = torch.zeros(1, 288), torch.zeros(1, 2 * PANEL)
    w = torch.zeros(9 * 420, dtype=torch.uint8)
    for code in (*kb.FORMATS.values(), *kb.Q8_FORMATS.values()):
        assert KERNELS.lib.sd_linear(x.data_ptr(), 1, 288, w.data_ptr(), code, 2, y.data_ptr(),
                                     2 * PANEL, 1) == -1
