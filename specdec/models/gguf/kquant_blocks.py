"""Q4_K, Q5_K and Q6_K in the kernels' super-block formats (kernels.h: SD_Q4_K, SD_Q5_K,
SD_Q6_K and their 8-bit-activation layouts): the file's own fields, so a decoded token streams
about the file's bytes, laid out per panel pair (16 output rows) and super-block of 256 inputs.

    format  per row and super-block (256 k)            bytes / 256   file      bits / weight
    Q4_K    fp16 d, dmin; 8 x (sc, m) a byte each;     148           144       4.625 (+2.8 %)
            4-bit q
    Q5_K    Q4_K's header; 5-bit q (4 bits + 1)        180           176       5.625 (+2.3 %)
    Q6_K    fp16 d; 16 x int8 sc; 6-bit q (4 + 2 bits) 210           210       6.5625 (+0 %)

(the per-32 formats they replace: Q4_F 6.0 bits a weight, +33 %; Q5_F 10.0, +82 %; I8_F16
10.0, +52 %). The kernels make each sub-block's scales as gguf-py does, in float32
(D = fl(d * sc), M = fl(dmin * m); Q6_K: D = fl(d * sc) per 16), then run the sub-block exactly
as a block of the per-32 format holding those values (``PER_32``: Q4_F / Q5_F with m = -M,
I8_F16 with q - 32), so the results are bitwise those of the per-32 layout of the same file, in
both activation modes (the references: gguf_blocks.repack's values). Q5_K and Q6_K keep the
file's bits (4 + 1, 4 + 2) rather than a byte a quant (+45 %, +30 %): the extra bits cost a few
shifts and masks per 32 bytes, shared by every row of a call, and the bytes are the decode time.

A pair's super-block (linear.c / linear_q8.c read it): the header, then per sub-block j of 32
inputs its quants: Q4_K 320 + 8 x 256 = 2368 bytes (d[16], dmin[16] fp16; sc[8][16],
m[8][16] uint8), Q5_K 320 + 8 x 320 = 2880 (Q4_K's header; per sub-block 256 bytes of the low
4 bits, then 64 of the 5th bits), Q6_K 288 + 8 x 384 = 3360 (d[16] fp16, sc[16][16] int8; per
sub-block 256 bytes of the low 4 bits, then 128 of the high 2 bits). Per sub-block:

  Q4_K    as a block of Q4_F (gguf_blocks.prepare: per k one uint32 per panel;
          q8_activations.prepare: chunks c of 8 rows x 4 k, a byte holding both panels).
  Q5_K    q8: the low 4 bits as Q4_K's; then byte t of the 5th bits holds at bit c the bit of
          chunk c's element t = 32p + 4r + j (q[row 8p + r][k = 4c + j], the order of the
          512-bit kernel's 64 weight bytes of a chunk), so a chunk's bits are one shift and a
          mask from bit 4 of every byte (a bit plane per chunk, as llama.cpp's, would need a
          shuffle, an or and a compare per 32 bytes on AVX2). Float: the elements e = 16k + row
          (the order of Q5_F's quants), low 4 bits of e in byte e % 256 (bits 4 (e // 256)),
          5th bit in byte 256 + e % 64 (bit e // 64): the kernel makes a sub-block's uint8 q 32
          at a time with a shift and a few masks, then runs Q5_F's step over them (Q4_K's
          per-k nibble words with a 16-bit mask of 5th bits per k measured slower: 4 and 8
          rows 1.35 x / 1.2 x Q5_F's time, one 8192 x 2048 matrix).
  Q6_K    q8: in chunks c of 64 elements t = 32p + 4r + j (q[row 8p + r][k = 4c + j]), 4
          vectors of 64 bytes of the low 4 bits (vector u's byte t: chunk u's element t in the
          low nibble, chunk u + 4's in the high one), then 2 of the high 2 bits (vector v's
          byte t: chunk 2f + v's element t at bits 2f). Float: the elements e = 16k + row (the
          order of I8_F16's quants), low 4 bits of e in byte e % 256 (bits 4 (e // 256)), high
          2 bits in byte 256 + e % 128 (bits 2 (e // 128)), so the kernel makes 32 int8 q - 32
          at a time with a few byte shifts and masks.
"""

from __future__ import annotations

import torch

from specdec.models.gguf import types as gguf_types
from specdec.native import PANEL, Panels

QK = gguf_types.QK_K  # inputs of a super-block
SUB = gguf_types.BLOCK  # inputs of a sub-block
FORMATS = {"Q4_K": 13, "Q5_K": 17, "Q6_K": 14}  # kernels.h format codes, float activations
Q8_FORMATS = {"Q4_K": 15, "Q5_K": 18, "Q6_K": 16}  # ... and 8-bit activations
PAIR_BYTES = {"Q4_K": 2368, "Q5_K": 2880, "Q6_K": 3360}  # one super-block of a panel pair
# the per-32 format computing the same values
PER_32 = {"Q4_K": "Q4_F", "Q5_K": "Q5_F", "Q6_K": "I8_F16"}
ACTIVATIONS = ("float", "q8")


def prepare(kind: str, rows: torch.Tensor, in_features: int, activations: str) -> Panels:
    """rows [out, in / 256 * block bytes] uint8 of ``kind`` (Q4_K | Q5_K | Q6_K, as the file holds
    them) -> the kernels' panels for ``activations`` ("float" | "q8"); rows are padded with
    zero blocks to a multiple of 16. ValueError for another kind, mode, or a shape that does
    not fit the kind (gguf_types.blocks)."""
    if kind not in FORMATS or activations not in ACTIVATIONS:
        raise ValueError(f"super-block formats take {', '.join(FORMATS)} with activations "
                         f"{' or '.join(ACTIVATIONS)}, got {kind} with {activations!r}")
    blk = _pad(gguf_types.blocks(kind, rows, in_features))  # [pairs, 16, n, nbytes]
    pairs, n = blk.shape[0], blk.shape[2]
    q8 = activations == "q8"
    if kind in ("Q4_K", "Q5_K"):
        sc, m = gguf_types.k_scale_ints(blk)
        head = [_rows_last(blk[..., 0:2]), _rows_last(blk[..., 2:4]),  # d, dmin
                _rows_last(sc.to(torch.uint8).unsqueeze(-1)),  # [.., 8 sub-blocks, 16 rows]
                _rows_last(m.to(torch.uint8).unsqueeze(-1))]
        if kind == "Q4_K":
            quants = _nibbles(gguf_types._k_low(blk[..., 16:144]), q8)  # q [pairs, 16, n, 8, 32]
        else:
            q = gguf_types.q5_k_quants(blk)  # [pairs, 16, n, 8, 32] 0..31
            quants = _five_bits_q8(q) if q8 else _five_bits(q)
    else:
        head = [_rows_last(blk[..., 208:210]),  # d
                _rows_last(blk[..., 192:208].unsqueeze(-1))]  # sc: [.., 16 groups, 16 rows]
        q = gguf_types.q6_k_quants(blk)  # [pairs, 16, n, 8, 32] 0..63
        quants = _six_bits_q8(q) if q8 else _six_bits(q)
    data = torch.cat([*(h.reshape(pairs, n, -1) for h in head), quants.reshape(pairs, n, -1)],
                     dim=-1).contiguous()
    assert data.shape[-1] == PAIR_BYTES[kind], data.shape
    code = (Q8_FORMATS if q8 else FORMATS)[kind]
    return Panels(data, rows.shape[0], in_features=in_features, fmt=code, panels=2 * pairs)


def _pad(blk: torch.Tensor) -> torch.Tensor:
    """[out, n, nbytes] -> [pairs, 16, n, nbytes]: rows padded with zero blocks to whole pairs
    of 8-row panels."""
    pad = -blk.shape[0] % (2 * PANEL)
    blk = torch.cat([blk, blk.new_zeros(pad, *blk.shape[1:])]) if pad else blk
    return blk.reshape(-1, 2 * PANEL, *blk.shape[1:])


def _rows_last(t: torch.Tensor) -> torch.Tensor:
    """[pairs, 16 rows, n, g, b] (or [pairs, 16, n, b]) -> [pairs, n, g, 16 rows, b] uint8:
    per super-block and group, the pair's 16 rows."""
    t = t.unsqueeze(-2) if t.dim() == 4 else t
    return t.permute(0, 2, 3, 1, 4).contiguous().view(torch.uint8)


def _sub_blocks(q: torch.Tensor) -> torch.Tensor:
    """[pairs, 16, n, 8, 32] -> [pairs, 16, n * 8, 32] uint8: per sub-block (a block of 32).
    Everything after this is uint8 (one byte a weight: a 1.7B model's 100M-weight head would
    take 800 MB as int64)."""
    return q.reshape(q.shape[0], q.shape[1], -1, SUB).to(torch.uint8)


def _nibbles(q: torch.Tensor, q8: bool) -> torch.Tensor:
    """4-bit values [pairs, 16, n, 8, 32] -> [pairs, n * 8, 256] uint8, a sub-block as a block of
    Q4_F: float (gguf_blocks.prepare_repacked), per k one uint32 per panel, row i at bits 4i;
    q8 (q8_activations.prepare), chunk c byte 4r + j = q[r][4c + j] | q[8 + r][4c + j] << 4."""
    q = _sub_blocks(q)
    pairs, nb = q.shape[0], q.shape[2]
    if q8:  # [pairs, 2 panels, 8 rows, nb, 8 chunks, 4 k] -> [pairs, nb, c, r, j]
        q = q.reshape(pairs, 2, PANEL, nb, 8, 4).permute(0, 3, 1, 4, 2, 5)
        return (q[:, :, 0] | (q[:, :, 1] << 4)).to(torch.uint8).reshape(pairs, nb, -1)
    q = q.permute(0, 2, 3, 1).reshape(pairs, nb, SUB, 2, PANEL)  # [.., k, panel, row]
    # the uint32 of a (k, panel) little-endian: byte b holds row 2b (low nibble), 2b + 1 (high)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).reshape(pairs, nb, -1)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """[.., 8] uint8 0 / 1 -> [..] uint8, element i at bit i (or-ed in uint8: no int64 copy)."""
    out = bits[..., 0].clone()
    for i in range(1, 8):
        out |= bits[..., i] << i
    return out


def _five_bits_q8(q: torch.Tensor) -> torch.Tensor:
    """Q5_K's 5-bit quants [pairs, 16, n, 8, 32] -> [pairs, n * 8, 320] uint8, q8 (module
    docstring): per sub-block the low 4 bits as Q4_K's (``_nibbles``), then 64 bytes of 5th
    bits, byte t = 32p + 4r + j holding at bit c the bit of q[8p + r][4c + j]."""
    q = _sub_blocks(q)
    pairs, nb = q.shape[0], q.shape[2]
    # [pairs, p, r, nb, c, j] -> [pairs, nb, t, c]
    h = (q >> 4).reshape(pairs, 2, PANEL, nb, 8, 4).permute(0, 3, 1, 2, 5, 4)
    return torch.cat([_nibbles(q & 15, True), _pack_bits(h.reshape(pairs, nb, 64, 8))], dim=-1)


def _five_bits(q: torch.Tensor) -> torch.Tensor:
    """Q5_K's 5-bit quants [pairs, 16, n, 8, 32] -> [pairs, n * 8, 320] uint8, float (module
    docstring): per sub-block the elements e = 16k + row, low 4 bits of e in byte e % 256 (bits
    4 (e // 256)), then 5th bits in byte 256 + e % 64 (bit e // 64)."""
    q = _sub_blocks(q)
    pairs, nb = q.shape[0], q.shape[2]
    e = q.permute(0, 2, 3, 1).reshape(pairs, nb, 2, 256)  # [.., e // 256, e % 256]
    low = (e[:, :, 0] & 15) | ((e[:, :, 1] & 15) << 4)
    h = (e >> 4).reshape(pairs, nb, 8, 64).transpose(-1, -2)  # [.., e % 64, e // 64]
    return torch.cat([low, _pack_bits(h)], dim=-1)


def _six_bits_q8(q: torch.Tensor) -> torch.Tensor:
    """Q6_K's 6-bit quants [pairs, 16, n, 8, 32] -> [pairs, n * 8, 384] uint8, q8 (module
    docstring): per sub-block, chunks c of 64 elements t = 32p + 4r + j (q[8p + r][4c + j]);
    low 4 bits: vector u byte t = chunk u's | chunk u + 4's << 4; high 2 bits: vector v byte
    t = sum over f of chunk 2f + v's << 2f."""
    q = _sub_blocks(q)
    pairs, nb = q.shape[0], q.shape[2]
    # [pairs, p, r, nb, c, j] -> [pairs, nb, c, p, r, j]
    e = q.reshape(pairs, 2, PANEL, nb, 8, 4).permute(0, 3, 4, 1, 2, 5).reshape(pairs, nb, 8, 64)
    low = (e & 15).reshape(pairs, nb, 2, 4, 64)  # [.., c // 4, c % 4, t]
    low = low[:, :, 0] | (low[:, :, 1] << 4)
    h = (e >> 4).reshape(pairs, nb, 4, 2, 64)  # [.., f, v, t]: chunk 2f + v
    high = (h[:, :, 0] | (h[:, :, 1] << 2)) | ((h[:, :, 2] << 4) | (h[:, :, 3] << 6))
    return torch.cat([low.reshape(pairs, nb, -1), high.reshape(pairs, nb, -1)], dim=-1)


def _six_bits(q: torch.Tensor) -> torch.Tensor:
    """Q6_K's 6-bit quants [pairs, 16, n, 8, 32] -> [pairs, n * 8, 384] uint8, float (module
    docstring): per sub-block the elements e = 16k + row, low 4 bits of e in byte e % 256
    (bits 4 (e // 256)), then high 2 bits in byte 256 + e % 128 (bits 2 (e // 128))."""
    q = _sub_blocks(q)
    pairs, nb = q.shape[0], q.shape[2]
    e = q.permute(0, 2, 3, 1).reshape(pairs, nb, 2, 256)  # [.., e // 256, e % 256]
    low = (e[:, :, 0] & 15) | ((e[:, :, 1] & 15) << 4)
    h = (e >> 4).reshape(pairs, nb, 4, 128)
    high = (h[:, :, 0] | (h[:, :, 1] << 2)) | ((h[:, :, 2] << 4) | (h[:, :, 3] << 6))
    return torch.cat([low, high], dim=-1)
