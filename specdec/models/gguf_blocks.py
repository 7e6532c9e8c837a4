"""GGUF quantized blocks (Q4_1, Q8_0) as tensors: their layout, their dequantization (bitwise
gguf-py's) and the compiled kernels' panel layout of them (``prepare``; float activations).
``specdec.models.gguf_weights`` reads them from a file; ``specdec.models.q8_activations``
lays them out for int8 activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.models.native import PANEL, Panels

BLOCK = 32  # weights per block, along the input dimension
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}  # bytes of one block in the file
FORMATS = {"Q4_1": 3, "Q8_0": 4}  # the kernel's format codes (kernels.h)


@dataclass(frozen=True)
class Blocks:
    """One weight matrix as the file stores it: ``rows`` [out, in / 32 * block bytes] uint8."""
    kind: str  # "Q4_1" | "Q8_0"
    rows: torch.Tensor
    in_features: int

    @property
    def out_features(self) -> int:
        return self.rows.shape[0]

    @property
    def nbytes(self) -> int:
        return self.rows.numel()


def split(b: Blocks) -> tuple[torch.Tensor, ...]:
    """(d fp16 [out, nb], m fp16 | None, q [out, nb, 32] uint8 0..15 / int8)."""
    out, nb = b.out_features, b.in_features // BLOCK
    blk = b.rows.reshape(out, nb, BLOCK_BYTES[b.kind])
    d = blk[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
    if b.kind == "Q8_0":
        return d, None, blk[..., 2:].contiguous().view(torch.int8)
    m = blk[..., 2:4].contiguous().view(torch.float16).squeeze(-1)
    qs = blk[..., 4:]  # low nibbles: weights 0..15 of the block, high nibbles: 16..31
    return d, m, torch.cat([qs & 15, qs >> 4], dim=-1)


def dequantize(b: Blocks) -> torch.Tensor:
    """[out, in] float32, bitwise gguf-py's dequantization (two roundings, no fma)."""
    d, m, q = split(b)
    w = d.float().unsqueeze(-1) * q.float()  # Q4_1: (d * q) + m ; Q8_0: q * d (commutes)
    if m is not None:
        w = w + m.float().unsqueeze(-1)
    return w.reshape(b.out_features, b.in_features)


def pair_rows(t: torch.Tensor) -> torch.Tensor:
    """[out, ...] -> [pairs, 16, ...]: rows padded with zeros to whole pairs of 8-row panels."""
    pairs = -(-t.shape[0] // (2 * PANEL))
    pad = pairs * 2 * PANEL - t.shape[0]
    t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t
    return t.reshape(pairs, 2 * PANEL, *t.shape[1:])


def pair_scales(s: torch.Tensor) -> torch.Tensor:
    """fp16 scales [out, nb] -> bytes [pairs, nb, 32]: per block, the pair's 16 rows."""
    return pair_rows(s).transpose(1, 2).contiguous().view(torch.uint8)


def prepare(b: Blocks) -> Panels:
    """The kernel's layout: per pair of 8-row panels and block of 32 inputs, the 16 rows' fp16
    scales, then their quants k-major (Q4_1: per k one uint32 per panel, row i at bits 4i;
    Q8_0: per k the 16 rows' int8). Rows are padded with zero blocks to a multiple of 16."""
    d, m, q = split(b)
    pairs, nb = -(-b.out_features // (2 * PANEL)), b.in_features // BLOCK
    q = pair_rows(q).permute(0, 2, 3, 1)  # [pairs, nb, 32 k, 16 rows]
    if b.kind == "Q8_0":
        parts = [pair_scales(d), q.contiguous().view(torch.uint8).reshape(pairs, nb, -1)]
    else:
        shifts = torch.arange(PANEL, dtype=torch.int64) * 4
        words = (q.reshape(pairs, nb, BLOCK, 2, PANEL).long() << shifts).sum(-1)  # [.., 2]
        as_bytes = torch.stack([(words >> (8 * i)) & 255 for i in range(4)], dim=-1)
        parts = [pair_scales(d), pair_scales(m), as_bytes.to(torch.uint8).reshape(pairs, nb, -1)]
    data = torch.cat(parts, dim=-1).contiguous()
    return Panels(data, b.out_features, in_features=b.in_features, fmt=FORMATS[b.kind],
                  panels=2 * pairs)
