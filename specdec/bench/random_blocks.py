"""Random GGUF blocks of every type the engine runs, for model files of a real shape whose
weights are noise (docs/bench/shape_gguf.py).

``random_blocks(rng, kind, rows, cols, std)`` -> [rows, cols / block * block bytes] uint8 whose
dequantized values (gguf-py's ``gguf.quants.dequantize``, the oracle) have mean ~0 and standard
deviation ~``std``. gguf-py quantizes Q4_0 / Q4_1 / Q5_x / Q8_0 but not the K-quants, so every
block is built here from its parts (layouts as ggml's ``block_q*`` structs):

    Q8_0  d:f16, q:int8[32]                         w = d q
    Q4_0  d:f16, q:4-bit[32]                        w = d (q - 8)
    Q4_1  d:f16, m:f16, q:4-bit[32]                 w = d q + m
    Q5_0  d:f16, qh:u32, q:4-bit[32]                w = d (q - 16)        (q 5 bits)
    Q5_1  d:f16, m:f16, qh:u32, q:4-bit[32]         w = d q + m           (q 5 bits)
    Q4_K  d:f16, dmin:f16, scales:12 B, q:4-bit[256]          w = d sc_j q - dmin m_j
    Q5_K  d:f16, dmin:f16, scales:12 B, qh:32 B, q:4-bit[256] w = d sc_j q - dmin m_j (5 bits)
    Q6_K  ql:128 B, qh:64 B, scales:int8[16], d:f16           w = d sc_j (q - 32)   (6 bits)

(the K-quants' sub-blocks j: 8 of 32 values with 6-bit sc_j, m_j packed in 12 bytes; Q6_K's:
16 of 16 values). The quants are uniform random bytes; the scales are a per-block ``d`` around
the value that gives ``std`` (log-normal jitter, 25 %) and, for the K-quants, sub-block scales
spread as a quantizer leaves them (sc_j uniform in 24..62, m_j = sc_j ± 1 with dmin = d times
the quants' midpoint, so each sub-block is centred within a step; Q6_K's sc_j signed, |sc_j| in
16..127, as ggml's signed 8-bit scales). Block types whose offset is fixed (Q4_0, Q5_0, Q6_K)
get a random sign on d or sc_j, so their mean is 0 too. Every scale is a finite fp16 (Q6_K's d,
as in real files, often subnormal).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

JITTER = 0.25  # log-normal sigma of the per-block scale
KSCALE = (24, 62)  # Q4_K / Q5_K sub-block scales
Q6SCALE = (16, 127)  # |Q6_K sub-block scale|


def _f16(x: np.ndarray) -> np.ndarray:
    """[n] float -> [n, 2] uint8, little-endian fp16."""
    h = np.asarray(x, dtype=np.float32).astype(np.float16)
    assert np.isfinite(h).all(), "a block scale overflowed fp16"
    return h.view(np.uint8).reshape(-1, 2)


def _mean_square(lo: int, hi: int) -> float:
    """E[s^2] of s uniform over the integers lo..hi."""
    s = np.arange(lo, hi + 1, dtype=np.float64)
    return float(np.mean(s * s))


def _jitter(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.exp(rng.normal(0.0, JITTER, n))


def _d(rng: np.random.Generator, n: int, std: float, unit_m2: float, signed: bool) -> np.ndarray:
    """Per-block d such that E[w^2] = std^2 when E[w^2 / d^2] = unit_m2 (the jitter's own
    E[j^2] = exp(2 sigma^2) divided out)."""
    d = std / math.sqrt(unit_m2 * math.exp(2 * JITTER**2)) * _jitter(rng, n)
    if signed:
        d *= rng.choice(np.array([-1.0, 1.0]), n)
    return d


def _q8_0(rng, nb: int, std: float) -> np.ndarray:
    jitter = np.exp(rng.normal(0.0, 0.25, nb)).astype(np.float32)  # as first written: same files
    d = (std / (127 / np.sqrt(3)) * jitter).astype(np.float16)
    q = rng.integers(-127, 128, (nb, 32), dtype=np.int8)
    return np.concatenate([d.view(np.uint8).reshape(nb, 2), q.view(np.uint8)], axis=1)


def _q4_1(rng, nb: int, std: float) -> np.ndarray:
    jitter = np.exp(rng.normal(0.0, 0.25, nb)).astype(np.float32)
    d32 = std / np.sqrt(255 / 12) * jitter
    d, m = d32.astype(np.float16), (-7.5 * d32).astype(np.float16)
    q = rng.integers(0, 256, (nb, 16), dtype=np.uint8)  # two uniform nibbles a byte
    return np.concatenate([d.view(np.uint8).reshape(nb, 2), m.view(np.uint8).reshape(nb, 2), q],
                          axis=1)


def _bytes(rng, nb: int, n: int) -> np.ndarray:
    return rng.integers(0, 256, (nb, n), dtype=np.uint8)


def _q4_0(rng, nb: int, std: float) -> np.ndarray:
    d = _d(rng, nb, std, 255 / 12 + 0.25, signed=True)  # E[(q - 8)^2], q uniform 0..15
    return np.concatenate([_f16(d), _bytes(rng, nb, 16)], axis=1)


def _q5_0(rng, nb: int, std: float) -> np.ndarray:
    d = _d(rng, nb, std, 1023 / 12 + 0.25, signed=True)  # E[(q - 16)^2], q uniform 0..31
    return np.concatenate([_f16(d), _bytes(rng, nb, 4 + 16)], axis=1)


def _q5_1(rng, nb: int, std: float) -> np.ndarray:
    d = _d(rng, nb, std, 1023 / 12, signed=False)
    m = -15.5 * d.astype(np.float16).astype(np.float64)  # centred on d's own fp16 value
    return np.concatenate([_f16(d), _f16(m), _bytes(rng, nb, 4 + 16)], axis=1)


def pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """[nb, 8] sub-block scales and mins (0..63) -> [nb, 12] uint8, ggml's ``get_scale_min_k4``
    layout: bytes 0-3 / 4-7 hold sc_0..3 / m_0..3 in their low 6 bits and the top 2 bits of
    sc_4..7 / m_4..7 in their high 2; bytes 8-11 hold the low 4 bits of sc_4..7 | m_4..7 << 4."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    assert sc.max(initial=0) < 64 and m.max(initial=0) < 64, "K-quant scales are 6 bits"
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    return out


def _k_scales(rng, nb: int, mid: float, var_q: float, std: float):
    """(d, dmin, [nb, 12] packed scales) of Q4_K / Q5_K: w = d sc (q - mid) - d mid (m - sc)
    with m - sc uniform in {-1, 0, 1}: E[w^2] = d^2 (E[sc^2] var_q + mid^2 2/3)."""
    sc = rng.integers(KSCALE[0], KSCALE[1] + 1, (nb, 8))
    m = sc + rng.integers(-1, 2, (nb, 8))
    d = _d(rng, nb, std, _mean_square(*KSCALE) * var_q + mid * mid * 2 / 3, signed=False)
    return d, mid * d.astype(np.float16).astype(np.float64), pack_k_scales(sc, m)


def _q4_k(rng, nb: int, std: float) -> np.ndarray:
    d, dmin, scales = _k_scales(rng, nb, 7.5, 255 / 12, std)
    return np.concatenate([_f16(d), _f16(dmin), scales, _bytes(rng, nb, 128)], axis=1)


def _q5_k(rng, nb: int, std: float) -> np.ndarray:
    d, dmin, scales = _k_scales(rng, nb, 15.5, 1023 / 12, std)
    return np.concatenate([_f16(d), _f16(dmin), scales, _bytes(rng, nb, 32 + 128)], axis=1)


def _q6_k(rng, nb: int, std: float) -> np.ndarray:
    mag = rng.integers(Q6SCALE[0], Q6SCALE[1] + 1, (nb, 16))
    sc = (mag * rng.choice(np.array([-1, 1]), (nb, 16))).astype(np.int8)
    d = _d(rng, nb, std, _mean_square(*Q6SCALE) * (4095 / 12 + 0.25), signed=False)
    return np.concatenate([_bytes(rng, nb, 128 + 64), sc.view(np.uint8), _f16(d)], axis=1)


def _builders() -> dict:
    from gguf import GGMLQuantizationType as Q

    return {Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1,
            Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k}


def supported_types() -> tuple:
    """The GGML types ``random_blocks`` writes."""
    return tuple(_builders())


def random_blocks(rng: np.random.Generator, kind, rows: int, cols: int, std: float) -> np.ndarray:
    """[rows, cols / block * block bytes] uint8: random ``kind`` blocks whose dequantized values
    have mean ~0 and standard deviation ~std (see the module docstring)."""
    from gguf import GGML_QUANT_SIZES

    build: Callable | None = _builders().get(kind)
    if build is None:
        names = ", ".join(k.name for k in supported_types())
        raise ValueError(f"no random blocks of type {getattr(kind, 'name', kind)} "
                         f"(allowed: {names})")
    block, nbytes = GGML_QUANT_SIZES[kind]
    if cols % block:
        raise ValueError(f"{kind.name} blocks hold {block} values: a row of {cols} does not "
                         f"split into them")
    if not (math.isfinite(std) and std > 0):
        raise ValueError(f"std must be a finite number > 0, got {std!r}")
    blocks = build(rng, rows * cols // block, std)
    assert blocks.shape[1] == nbytes, (kind.name, blocks.shape)
    return blocks.reshape(rows, -1)
