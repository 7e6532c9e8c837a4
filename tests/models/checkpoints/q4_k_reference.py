"""A scalar port of llama.cpp's quantize_row_q4_K_ref / make_qkx2_quants (ggml-quants.c), for
the tests of specdec.models.checkpoints.quantize: every float operation in float32, in the C code's order,
without fused multiply-adds. Slow (pure Python): a few super-blocks at a time."""

from __future__ import annotations

import numpy as np

f32 = np.float32


def nearest(v) -> int:
    """nearest_int: round half to even."""
    return int(np.rint(f32(v)))


def _level(v, iscale, lo, nmax: int) -> int:
    return max(0, min(nmax, nearest(f32(iscale * f32(v - lo)))))


def _error(x, w, levels, scale, lo):
    err = f32(0)
    for v, wi, q in zip(x, w, levels):
        diff = f32(f32(f32(scale * f32(q)) + lo) - v)
        err = f32(err + f32(wi * f32(diff * diff)))
    return err


def make_qkx2(x, w, nmax: int = 15, rmin: float = -1.0, rdelta: float = 0.1, nstep: int = 20):
    """(scale, the_min, levels) of one sub-block x with weights w (use_mad false)."""
    lo, hi, sum_w, sum_x = x[0], x[0], w[0], f32(w[0] * x[0])
    for v, wi in zip(x[1:], w[1:]):
        lo, hi = min(lo, v), max(hi, v)
        sum_w, sum_x = f32(sum_w + wi), f32(sum_x + f32(wi * v))
    lo = min(lo, f32(0))
    if hi == lo:
        return f32(0), f32(-lo), [0] * len(x)
    iscale = f32(f32(nmax) / f32(hi - lo))
    scale = f32(f32(1) / iscale)
    levels = [_level(v, iscale, lo, nmax) for v in x]
    best = _error(x, w, levels, scale, lo)
    for step in range(nstep + 1):
        trial = f32(f32(f32(rmin) + f32(f32(rdelta) * f32(step))) + f32(nmax))
        iscale = f32(trial / f32(hi - lo))
        aux = [_level(v, iscale, lo, nmax) for v in x]
        sl = sl2 = sxl = f32(0)
        for v, wi, q in zip(x, w, aux):
            wq = f32(wi * f32(q))
            sl, sl2, sxl = f32(sl + wq), f32(sl2 + f32(wq * f32(q))), f32(sxl + f32(wq * v))
        det = f32(f32(sum_w * sl2) - f32(sl * sl))
        if det > 0:
            this_scale = f32(f32(f32(sum_w * sxl) - f32(sum_x * sl)) / det)
            this_min = f32(f32(f32(sl2 * sum_x) - f32(sl * sxl)) / det)
            if this_min > 0:
                this_min, this_scale = f32(0), f32(sxl / sl2)
            err = _error(x, w, aux, this_scale, this_min)
            if err < best:
                levels, best, scale, lo = aux, err, this_scale, this_min
    return scale, f32(-lo), levels


def q4_k_block(x) -> list[int]:
    """One super-block x [256] float32 -> its 144 bytes."""
    scales, mins, levels = [], [], []
    for j in range(8):
        xs = x[32 * j:32 * j + 32]
        s2 = f32(0)
        for v in xs:
            s2 = f32(s2 + f32(v * v))
        av = f32(np.sqrt(f32(s2 / f32(32))))
        sc, m, lv = make_qkx2(xs, np.array([f32(av + abs(v)) for v in xs], dtype=np.float32))
        scales.append(sc)
        mins.append(m)
        levels += lv
    max_scale, max_min = max([f32(0), *scales]), max([f32(0), *mins])
    inv_s = f32(f32(63) / max_scale) if max_scale > 0 else f32(0)
    inv_m = f32(f32(63) / max_min) if max_min > 0 else f32(0)
    packed, ls, lm = [0] * 12, [], []
    for j in range(8):
        ls.append(min(63, nearest(f32(inv_s * scales[j]))))
        lm.append(min(63, nearest(f32(inv_m * mins[j]))))
        if j < 4:
            packed[j], packed[j + 4] = ls[j], lm[j]
        else:
            packed[j + 4] = (ls[j] & 15) | ((lm[j] & 15) << 4)
            packed[j - 4] |= (ls[j] >> 4) << 6
            packed[j] |= (lm[j] >> 4) << 6
    d, dmin = np.float16(f32(max_scale / f32(63))), np.float16(f32(max_min / f32(63)))
    for j in range(8):
        dd = f32(f32(d) * f32(ls[j]))
        if not dd:
            continue
        dm = f32(f32(dmin) * f32(lm[j]))
        for i in range(32):
            levels[32 * j + i] = max(0, min(15, nearest(f32(f32(x[32 * j + i] + dm) / dd))))
    qs = [levels[64 * c + i] | (levels[64 * c + i + 32] << 4) for c in range(4) for i in range(32)]
    head = np.array([d, dmin], dtype=np.float16).view(np.uint8).tolist()
    return head + packed + qs
