"""Float matrices quantized into GGUF blocks at load: ``quantize="q8_0" | "q4_k"``.

A checkpoint without a GGUF (bf16 / fp16 / fp32 safetensors) can still run on the kernels'
quantized formats: each matrix is quantized once, as it is read, into the blocks a GGUF file
would hold, and from then on is computed exactly like a GGUF's (``BlockWeight``, the same
panels, float or q8 activations). The model that runs is the fp32 model whose weights are
these blocks dequantized (bitwise gguf-py's dequantization), so speculation stays exactly
plain decoding; its numbers are the quantized model's, not the checkpoint's.

* ``Q8_0``: gguf-py's ``gguf.quants.quantize``, bitwise llama.cpp's reference quantizer.
* ``Q4_K``: gguf-py cannot write K-quants; ``q4_k_blocks`` follows llama.cpp's
  ``quantize_row_q4_K_ref``: per sub-block of 32 a weighted least-squares search of scale and
  min (``make_qkx2_quants``: weights sqrt(mean x^2) + |x|, 21 trial scales), the 8 scales and
  mins of a super-block of 256 rounded to 6 bits against fp16 d and dmin, then every weight
  rounded again against its final scale and min (a better trial also moves the min the
  next trials start from, as there). Its float sums are vectorized (pairwise), not
  llama.cpp's sequential ones (which its compiler may also fuse into multiply-adds), so a
  block can differ from llama.cpp's where a choice is a near tie; the tests check it against
  a scalar port of the C code (the same blocks, bar such ties), gguf-py's dequantizer and an
  error bound.

Rows are quantized in chunks (``CHUNK_ROWS``), so a matrix's float32 copy is never whole; the
blocks of a checkpoint are cached (specdec.models.checkpoints.quantized_cache).
A matrix whose inputs are not a multiple of 256 cannot be Q4_K: ``kind_for`` gives Q8_0 for
it (llama.cpp mixes types the same way).

    kind = kind_for("q4_k", in_features=576)     # "Q8_0"
    blocks = quantize_matrix(weight_bf16, kind)  # gguf_blocks.Blocks
"""

from __future__ import annotations

import numpy as np
import torch

from specdec.models.gguf.blocks import Blocks
from specdec.models.gguf.types import BLOCK, QK_K

CHOICES = ("q8_0", "q4_k")
KINDS = {"q8_0": "Q8_0", "q4_k": "Q4_K"}
CHUNK_ROWS = 64  # rows quantized at once (a 2048-wide chunk: 0.5 MB of float32, ~15x in temporaries)
# cost (indicative, one thread of a loaded 2-core EPYC): Q8_0 60 M weights/s, Q4_K 5 M weights/s
Q4_K_BYTES = 144


def check_choice(quantize: str | None) -> None:
    if quantize is not None and quantize not in CHOICES:
        raise ValueError(f"quantize must be None or one of {', '.join(CHOICES)}, got "
                         f"{quantize!r}")


def kind_for(quantize: str, in_features: int) -> str:
    """The GGUF type a matrix of ``in_features`` inputs is quantized to under ``quantize``:
    Q4_K needs a multiple of 256 (else Q8_0); every type needs a multiple of 32 (ValueError)."""
    check_choice(quantize)
    if in_features % BLOCK:
        raise ValueError(f"quantize={quantize!r}: a matrix of {in_features} inputs (not a "
                         f"multiple of {BLOCK}) has no GGUF block type")
    kind = KINDS[quantize]
    return "Q8_0" if kind == "Q4_K" and in_features % QK_K else kind


def quantize_matrix(weight: torch.Tensor, kind: str) -> Blocks:
    """weight [out, in] (any float dtype, e.g. a bf16 view of a checkpoint) -> its blocks of
    ``kind`` ("Q8_0" | "Q4_K"), quantized CHUNK_ROWS rows at a time from float32 values.
    ValueError for a non-finite weight (no block can hold it)."""
    out, inp = weight.shape
    width = QK_K if kind == "Q4_K" else BLOCK
    if inp % width:
        raise ValueError(f"{kind} needs in_features a multiple of {width}, got {inp}")
    make = {"Q8_0": _q8_0_rows, "Q4_K": q4_k_blocks}[kind]
    chunks = []
    for start in range(0, out, CHUNK_ROWS):
        x = weight[start:start + CHUNK_ROWS].float()
        if not torch.isfinite(x).all():
            raise ValueError(f"cannot quantize to {kind}: rows {start}..{start + len(x) - 1} "
                             "hold a NaN or infinite weight")
        chunks.append(make(x))
    return Blocks(kind, torch.cat(chunks) if len(chunks) > 1 else chunks[0], inp)


def _q8_0_rows(x: torch.Tensor) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rows = quantize(x.numpy(), GGMLQuantizationType.Q8_0)
    return torch.from_numpy(np.ascontiguousarray(rows))


def _nearest(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp's nearest_int: round half to even (|x| < 2^22)."""
    return torch.round(x)


def make_qkx2(x: torch.Tensor, w: torch.Tensor, nmax: int = 15, rmin: float = -1.0,
              rdelta: float = 0.1, nstep: int = 20) -> tuple[torch.Tensor, ...]:
    """llama.cpp's make_qkx2_quants (use_mad false) over sub-blocks x, w [n, 32] float32 ->
    (scale [n], the_min [n] (>= 0; the weight is scale * L - the_min), L [n, 32] int64)."""
    lo = x.amin(-1).clamp(max=0.0)
    hi = x.amax(-1)
    flat = hi == lo
    sum_w, sum_x = w.sum(-1), (w * x).sum(-1)
    iscale = nmax / torch.where(flat, 1.0, hi - lo)
    scale = 1.0 / iscale
    levels = _nearest(iscale[:, None] * (x - lo[:, None])).clamp(0, nmax)
    best = (w * (scale[:, None] * levels + lo[:, None] - x) ** 2).sum(-1)
    cur = lo  # the C code's ``min``: a better trial replaces it, and later trials start there
    for step in range(nstep + 1):
        # (rmin + rdelta * is + nmax) in float32, as the C code computes it
        trial = torch.tensor(rmin, dtype=torch.float32) + torch.tensor(
            rdelta, dtype=torch.float32) * step + nmax
        span = hi - cur
        iscale = trial / torch.where(span > 0, span, 1.0)
        laux = _nearest(iscale[:, None] * (x - cur[:, None])).clamp(0, nmax)
        sum_l, sum_l2 = (w * laux).sum(-1), (w * laux * laux).sum(-1)
        sum_xl = (w * laux * x).sum(-1)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = (det > 0) & ~flat
        safe = torch.where(ok, det, 1.0)
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        positive = this_min > 0
        this_min = torch.where(positive, 0.0, this_min)
        this_scale = torch.where(positive, sum_xl / torch.where(sum_l2 > 0, sum_l2, 1.0),
                                 this_scale)
        mad = (w * (this_scale[:, None] * laux + this_min[:, None] - x) ** 2).sum(-1)
        better = ok & (mad < best)
        levels = torch.where(better[:, None], laux, levels)
        best = torch.where(better, mad, best)
        scale = torch.where(better, this_scale, scale)
        cur = torch.where(better, this_min, cur)
    scale = torch.where(flat, 0.0, scale)
    levels = torch.where(flat[:, None], 0.0, levels)
    return scale, -cur, levels.long()


def q4_k_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [out, in] float32 (in a multiple of 256) -> Q4_K rows [out, in / 256 * 144] uint8:
    llama.cpp's quantize_row_q4_K_ref (module docstring)."""
    out, inp = x.shape
    n = out * inp // QK_K
    sub = x.reshape(n * 8, BLOCK)
    av = (sub.square().sum(-1) / BLOCK).sqrt()
    scales, mins, levels = make_qkx2(sub, av[:, None] + sub.abs())
    scales, mins, levels = scales.view(n, 8), mins.view(n, 8), levels.view(n, 8, BLOCK)
    # the C code starts both maxima at +0 (+ 0.0 turns an all -0.0 sub-block's -0.0 into it)
    max_scale = scales.amax(-1).clamp(min=0.0) + 0.0
    max_min = mins.amax(-1).clamp(min=0.0) + 0.0
    inv_scale = torch.where(max_scale > 0, 63.0 / torch.where(max_scale > 0, max_scale, 1.0), 0.0)
    inv_min = torch.where(max_min > 0, 63.0 / torch.where(max_min > 0, max_min, 1.0), 0.0)
    ls = _nearest(inv_scale[:, None] * scales).clamp(0, 63).long()
    lm = _nearest(inv_min[:, None] * mins).clamp(0, 63).long()
    d = (max_scale / 63.0).half()
    dmin = (max_min / 63.0).half()
    # every weight again against its sub-block's final (6-bit, fp16-scaled) scale and min
    sd = d.float()[:, None] * ls.float()
    sm = dmin.float()[:, None] * lm.float()
    requant = _nearest((sub.view(n, 8, BLOCK) + sm[..., None]) / torch.where(
        sd == 0, 1.0, sd)[..., None]).clamp(0, 15).long()
    levels = torch.where((sd != 0)[..., None], requant, levels)
    blk = torch.zeros(n, Q4_K_BYTES, dtype=torch.uint8)
    blk[:, 0:2] = d.view(-1, 1).view(torch.uint8)
    blk[:, 2:4] = dmin.view(-1, 1).view(torch.uint8)
    blk[:, 4:16] = _pack_scales(ls, lm)
    lv = levels.view(n, 4, 2, BLOCK)  # chunk of 64: sub-block 2c in low nibbles, 2c + 1 high
    blk[:, 16:] = (lv[:, :, 0] | (lv[:, :, 1] << 4)).reshape(n, 128).to(torch.uint8)
    return blk.view(out, -1)


def _pack_scales(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """6-bit scales and mins [n, 8] -> Q4_K's 12 bytes: sub-blocks 0..3 in bytes 0..3 (scale)
    and 4..7 (min), low 6 bits; 4..7 as nibbles in bytes 8..11 (scale low, min high) with
    their top 2 bits in bits 6..7 of bytes 0..3 (scale) and 4..7 (min)."""
    out = torch.zeros(ls.shape[0], 12, dtype=torch.int64)
    out[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    out[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:] & 15) | ((lm[:, 4:] & 15) << 4)
    return out.to(torch.uint8)
