"""GGUF quantized blocks as tensors: a matrix as the file stores it (``Blocks``), its
dequantization (bitwise gguf-py's: specdec.models.gguf.types), and its repacking into one of
the compiled kernels' block formats (``repack``) and their panel layout (``prepare``; float
activations). ``specdec.models.gguf.weights`` reads the blocks from a file (a fused matrix whose
file tensors differ in type as one ``Blocks`` per run of a type, prepared into parts:
native.PanelParts); ``specdec.models.gguf.q8_activations`` lays them out for int8 activations.

The kernels take five block formats (per block of 32 inputs and output row; kernels.h), and
every GGUF type is repacked into one whose arithmetic gives gguf-py's float32 weights exactly:

    format  scales            quants             weight               from
    Q4_1    fp16 d, m         4-bit 0..15        fl(d * q) + m        Q4_1; Q4_0 (q + 8, m = -8d)
    Q8_0    fp16 d            int8               fl(d * q)            Q8_0; Q5_0 (q - 16)
    Q4_F    f32 d, m          4-bit 0..15        fl(d * q) + m        Q4_0 where -8d overflows fp16
                                                                      (Q4_K's values: d = D, m = -M)
    Q5_F    f32 d, m          5-bit, one a byte  fl(d * q) + m        Q5_1 (Q5_K's values)
    I8_F16  f32 d per 16      int8               fl(d * q)            (Q6_K's values: q - 32)

and three super-block formats (per 256 inputs; specdec.models.gguf.kquant_blocks), Q4_K, Q5_K and
Q6_K as the file holds them (fp16 d, dmin per 256, integer sub-block scales), whose kernels make
each sub-block's float32 scales as gguf-py does and then compute exactly as Q4_F / Q5_F /
I8_F16 over those values (``repack`` gives them: the references), streaming 4.625 / 5.625 /
6.5625 bits a weight instead of 6 / 10 / 10.

Why exact: fp16 d times a 4- or 5-bit q is exact in float32 (11 + 5 bits), so Q4_0's
d * (q - 8) = d * q - 8d has no rounding either way; a K-quant's sub-block scale D = fl(d * sc)
is not fp16-representable, so it is kept as the float32 gguf-py computes. The tests check every
one of these against gguf-py bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.models.gguf import kquant_blocks
from specdec.models.gguf import types as gguf_types
from specdec.models.gguf.types import BLOCK, TYPES
from specdec.native import PANEL, Panels

BLOCK_BYTES = {kind: t.nbytes for kind, t in TYPES.items()}  # bytes of one block in the file
BLOCK_WIDTH = {kind: t.width for kind, t in TYPES.items()}  # inputs of one block in the file
# the kernel's format codes (kernels.h), float activations
FORMATS = {"Q4_1": 3, "Q8_0": 4, "Q4_F": 7, "Q5_F": 8, "I8_F16": 9, **kquant_blocks.FORMATS}
# the format ``prepare`` lays each GGUF type out in
KERNEL_FORMAT = {"Q4_0": "Q4_1", "Q4_1": "Q4_1", "Q5_0": "Q8_0", "Q5_1": "Q5_F",
                 "Q8_0": "Q8_0", "Q4_K": "Q4_K", "Q5_K": "Q5_K", "Q6_K": "Q6_K"}
NIBBLES = ("Q4_1", "Q4_F")  # the formats whose quants are 4-bit (two a byte)


@dataclass(frozen=True)
class Blocks:
    """One weight matrix as the file stores it: ``rows`` [out, in / width * block bytes] uint8
    (``BLOCK_WIDTH`` / ``BLOCK_BYTES`` of ``kind``)."""
    kind: str  # a GGUF type in BLOCK_BYTES
    rows: torch.Tensor
    in_features: int

    @property
    def out_features(self) -> int:
        return self.rows.shape[0]

    @property
    def nbytes(self) -> int:
        return self.rows.numel()


@dataclass(frozen=True)
class Repacked:
    """A matrix in one of the kernels' block formats (module docstring), per block of 32."""
    fmt: str  # a key of FORMATS
    d: torch.Tensor  # [out, in / 32, g] fp16 | float32 (g = 2: I8_F16, a scale per 16)
    m: torch.Tensor | None  # [out, in / 32] as d
    q: torch.Tensor  # [out, in / 32, 32] uint8 (Q4_1, Q4_F: 0..15; Q5_F: 0..31) | int8

    def weights(self) -> torch.Tensor:
        """[out, in] float32 as the kernels compute them: fl(d * q) (+ m)."""
        m = None if self.m is None else self.m.float()
        return gguf_types.apply(self.d.float(), m, self.q)


def dequantize(b: Blocks) -> torch.Tensor:
    """[out, in] float32, bitwise gguf-py's dequantization of the blocks."""
    return gguf_types.apply(*gguf_types.unpack(b.kind, b.rows, b.in_features))


def repack(b: Blocks) -> Repacked:
    """The blocks in their per-32 kernel format (``KERNEL_FORMAT``; Q4_0 whose -8d overflows
    fp16 somewhere: Q4_F; a super-block format's values: ``kquant_blocks.PER_32``, what its
    kernels compute bitwise). ValueError for a type or shape gguf_types does not take."""
    scale, add, q = gguf_types.unpack(b.kind, b.rows, b.in_features)
    fmt = KERNEL_FORMAT[b.kind]
    fmt = kquant_blocks.PER_32.get(fmt, fmt)
    if b.kind == "Q4_0":
        add, q = -8.0 * scale[..., 0], q + 8  # exact in float32 (an exponent shift)
        if not add.half().isfinite().all():
            fmt = "Q4_F"
    if fmt in ("Q4_1", "Q8_0"):  # fp16 scales: gguf-py's d and m are fp16 values
        scale, add = scale.half(), None if add is None else add.half()
    signed = fmt in ("Q8_0", "I8_F16")
    return Repacked(fmt, scale, add, q.to(torch.int8 if signed else torch.uint8))


def pair_rows(t: torch.Tensor) -> torch.Tensor:
    """[out, ...] -> [pairs, 16, ...]: rows padded with zeros to whole pairs of 8-row panels."""
    pairs = -(-t.shape[0] // (2 * PANEL))
    pad = pairs * 2 * PANEL - t.shape[0]
    t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t
    return t.reshape(pairs, 2 * PANEL, *t.shape[1:])


def pair_scales(s: torch.Tensor) -> torch.Tensor:
    """scales [out, nb] (fp16 / float32) -> bytes [pairs, nb, 16 * size]: per block, the
    pair's 16 rows."""
    return pair_rows(s).transpose(1, 2).contiguous().view(torch.uint8)


def scale_bytes(r: Repacked) -> list[torch.Tensor]:
    """A block's scales as the kernels read them: d (I8_F16: d of inputs 0..15, then d of
    16..31), then m; each the pair's 16 rows."""
    ds = [pair_scales(r.d[..., i].contiguous()) for i in range(r.d.shape[-1])]
    return ds + ([] if r.m is None else [pair_scales(r.m)])


def prepare(b: Blocks) -> Panels:
    """The float kernels' layout (linear.c): per pair of 8-row panels and block of 32 inputs,
    the 16 rows' scales (``scale_bytes``), then their quants k-major (4-bit formats: per k one
    uint32 per panel, row i at bits 4i; 8-bit ones: per k the 16 rows' bytes). Rows are padded
    with zero blocks to a multiple of 16. Q4_K, Q5_K, Q6_K: their super-block format
    (kquant_blocks)."""
    if KERNEL_FORMAT[b.kind] in kquant_blocks.FORMATS:
        return kquant_blocks.prepare(b.kind, b.rows, b.in_features, "float")
    return prepare_repacked(repack(b), b.out_features, b.in_features)


def prepare_repacked(r: Repacked, out: int, inp: int) -> Panels:
    """``prepare`` of blocks already repacked (``out`` x ``inp`` weights)."""
    pairs, nb = -(-out // (2 * PANEL)), inp // BLOCK
    q = pair_rows(r.q).permute(0, 2, 3, 1)  # [pairs, nb, 32 k, 16 rows]
    if r.fmt in NIBBLES:
        shifts = torch.arange(PANEL, dtype=torch.int64) * 4
        words = (q.reshape(pairs, nb, BLOCK, 2, PANEL).long() << shifts).sum(-1)  # [.., 2]
        quants = torch.stack([(words >> (8 * i)) & 255 for i in range(4)], dim=-1)
        quants = quants.to(torch.uint8).reshape(pairs, nb, -1)
    else:
        quants = q.contiguous().view(torch.uint8).reshape(pairs, nb, -1)
    data = torch.cat([*scale_bytes(r), quants], dim=-1).contiguous()
    return Panels(data, out, in_features=inp, fmt=FORMATS[r.fmt], panels=2 * pairs)
