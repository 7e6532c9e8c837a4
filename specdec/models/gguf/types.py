"""The GGUF block types specdec reads: each one's width and bytes, how its bytes unpack, and
its dequantization, bitwise gguf-py's (``gguf.quants``: the same float32 operations in the
same order, so the weights are those transformers loads from the file).

Every type unpacks to one form, per block of 32 inputs (a K-quant's 256-wide super-block is
8 such blocks, its sub-block scales already multiplied out as gguf-py does):

    scale [out, in / 32, g] float32   g = 1, or 2 (Q6_K: one scale per 16 inputs)
    add   [out, in / 32] float32 | None
    q     [out, in / 32, 32] int16    the integer each weight multiplies
    w = fl(scale * q) (+ add: a second rounding), float32

  Q4_0  d * (q - 8)         Q4_1  (d * q) + m         Q8_0  q * d (the product commutes)
  Q5_0  d * (q - 16)        Q5_1  (d * q) + m
  Q4_K  D * q - M, D = fl(d * sc), M = fl(dmin * m) per 32 (6-bit sc, m): add = -M, exactly
  Q5_K  the same with 5-bit q
  Q6_K  D * (q - 32), D = fl(d * sc) per 16 (int8 sc)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

BLOCK = 32  # weights per block of the unpacked form, along the input dimension
QK_K = 256  # weights per K-quant super-block

Unpacked = tuple[torch.Tensor, "torch.Tensor | None", torch.Tensor]


@dataclass(frozen=True)
class BlockType:
    """One GGUF type: ``width`` weights of a row per ``nbytes`` bytes of the file, and how
    blocks [out, n, nbytes] uint8 unpack (see the module docstring)."""
    width: int
    nbytes: int
    unpack: Callable[[torch.Tensor], Unpacked]


def _f16(blk: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte ``at`` of every block, as float32 [out, n]."""
    return blk[..., at:at + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[.., 16] bytes -> [.., 32]: low nibbles (weights 0..15), then high ones (16..31)."""
    return torch.cat([qs & 15, qs >> 4], dim=-1).to(torch.int16)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """[.., 4] bytes (a little-endian uint32) -> [.., 32] its bits 0..31, as 0 / 16."""
    bits = (qh.to(torch.int16).unsqueeze(-1) >> torch.arange(8, dtype=torch.int16)) & 1
    return bits.reshape(*qh.shape[:-1], 32) << 4


def _q4_0(blk):
    return _f16(blk, 0).unsqueeze(-1), None, _nibbles(blk[..., 2:18]) - 8


def _q4_1(blk):
    return _f16(blk, 0).unsqueeze(-1), _f16(blk, 2), _nibbles(blk[..., 4:20])


def _q5_0(blk):
    return _f16(blk, 0).unsqueeze(-1), None, (_nibbles(blk[..., 6:22]) | _high_bits(
        blk[..., 2:6])) - 16


def _q5_1(blk):
    q = _nibbles(blk[..., 8:24]) | _high_bits(blk[..., 4:8])
    return _f16(blk, 0).unsqueeze(-1), _f16(blk, 2), q


def _q8_0(blk):
    return _f16(blk, 0).unsqueeze(-1), None, blk[..., 2:].contiguous().view(torch.int8).to(
        torch.int16)


def k_scale_ints(blk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K blocks [out, n, nbytes] -> (sc, m) [out, n, 8] int16 0..63 of the 8
    sub-blocks (gguf-py's get_scale_min: 12 bytes of 6-bit scales and mins after d and dmin)."""
    s = blk[..., 4:16].to(torch.int16)
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return sc, mn


def _k_scales(blk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: (D, -M) [out, n, 8] float32 of the 8 sub-blocks."""
    sc, mn = k_scale_ints(blk)
    return _f16(blk, 0).unsqueeze(-1) * sc.float(), -(_f16(blk, 2).unsqueeze(-1) * mn.float())


def _by_32(t: torch.Tensor) -> torch.Tensor:
    """[out, n, 8, ...] per super-block -> [out, 8n, ...] per block of 32."""
    return t.reshape(t.shape[0], -1, *t.shape[3:])


def _k_low(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes -> [.., 8, 32]: sub-block 2i low nibbles of bytes 32i.., 2i + 1 their high."""
    qs = qs.reshape(*qs.shape[:-1], 4, 1, 32).to(torch.int16)
    return torch.cat([qs & 15, qs >> 4], dim=-2).reshape(*qs.shape[:-3], 8, 32)


def _q4_k(blk):
    d, m = _k_scales(blk)
    return _by_32(d.unsqueeze(-1)), _by_32(m), _by_32(_k_low(blk[..., 16:144]))


def q5_k_quants(blk: torch.Tensor) -> torch.Tensor:
    """Q5_K blocks [out, n, 176] -> q [out, n, 8, 32] int16 0..31, per sub-block of 32: the
    nibbles as Q4_K's (qs), bit 4 from qh (sub-block j: bit j of each of its 32 bytes)."""
    qh = blk[..., 16:48].to(torch.int16).unsqueeze(-2)
    high = ((qh >> torch.arange(8, dtype=torch.int16).unsqueeze(-1)) & 1) << 4
    return _k_low(blk[..., 48:176]) | high


def _q5_k(blk):
    d, m = _k_scales(blk)
    return _by_32(d.unsqueeze(-1)), _by_32(m), _by_32(q5_k_quants(blk))


def q6_k_quants(blk: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks [out, n, 210] -> q [out, n, 8, 32] int16 0..63 (before gguf-py's - 32), per
    sub-block of 32 (ql's nibbles, qh's 2-bit fields as gguf-py reads them)."""
    ql = blk[..., 0:128].reshape(*blk.shape[:-1], 2, 1, 64).to(torch.int16)
    ql = torch.cat([ql & 15, ql >> 4], dim=-2).reshape(*blk.shape[:-1], 8, 32)
    qh = blk[..., 128:192].reshape(*blk.shape[:-1], 2, 1, 32).to(torch.int16)
    qh = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.int16).unsqueeze(-1)) & 3
    return ql | (qh.reshape(*blk.shape[:-1], 8, 32) << 4)


def _q6_k(blk):
    q = q6_k_quants(blk) - 32
    sc = blk[..., 192:208].contiguous().view(torch.int8).float()  # one per 16 weights
    d = (_f16(blk, 208).unsqueeze(-1) * sc).reshape(*blk.shape[:-1], 8, 2)
    return _by_32(d), None, _by_32(q)


TYPES = {
    "Q4_0": BlockType(32, 18, _q4_0),
    "Q4_1": BlockType(32, 20, _q4_1),
    "Q5_0": BlockType(32, 22, _q5_0),
    "Q5_1": BlockType(32, 24, _q5_1),
    "Q8_0": BlockType(32, 34, _q8_0),
    "Q4_K": BlockType(QK_K, 144, _q4_k),
    "Q5_K": BlockType(QK_K, 176, _q5_k),
    "Q6_K": BlockType(QK_K, 210, _q6_k),
}


def unpack(kind: str, rows: torch.Tensor, in_features: int) -> Unpacked:
    """rows [out, in / width * nbytes] uint8 of ``kind`` -> (scale, add, q) (module docstring).
    ValueError when ``kind`` is not one of TYPES or the shapes do not fit it."""
    blk = blocks(kind, rows, in_features)
    return TYPES[kind].unpack(blk)


def blocks(kind: str, rows: torch.Tensor, in_features: int) -> torch.Tensor:
    """rows [out, in / width * nbytes] uint8 of ``kind`` -> its blocks [out, in / width,
    nbytes]. ValueError when ``kind`` is not one of TYPES or the shapes do not fit it."""
    t = TYPES.get(kind)
    if t is None:
        raise ValueError(f"GGUF type {kind} is not one of {', '.join(TYPES)}")
    if in_features < 1 or in_features % t.width:
        raise ValueError(f"{kind} blocks need in_features a multiple of {t.width}, got "
                         f"{in_features}")
    per_row = in_features // t.width * t.nbytes
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != per_row:
        raise ValueError(f"{kind} rows of {in_features} inputs are [out, {per_row}] uint8, got "
                         f"{tuple(rows.shape)} {rows.dtype}")
    return rows.reshape(rows.shape[0], -1, t.nbytes)


def apply(scale: torch.Tensor, add: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The unpacked form's weights [out, in] float32: fl(scale * q) (+ add)."""
    out, nb, g = scale.shape
    w = (scale.unsqueeze(-1) * q.float().reshape(out, nb, g, BLOCK // g)).reshape(out, nb, BLOCK)
    if add is not None:
        w = w + add.unsqueeze(-1)
    return w.reshape(out, nb * BLOCK)
