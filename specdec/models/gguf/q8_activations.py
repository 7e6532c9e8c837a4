"""A GGUF's blocks with 8-bit activations: the kernel's layout and its pure-torch reference.

``EngineConfig.activations="q8"`` computes every matrix held in the file's blocks the way
llama.cpp's CPU backend does: each row of activations is rounded, per block of 32 inputs, to
int8 with one scale, and each block's product is an exact integer dot product
(specdec/native/linear_q8.c, which states the arithmetic). A row's result depends on that row
alone, so speculation stays exactly plain decoding in this mode; the numbers are no longer the
fp32 model's (each activation is off by at most 1/254 of its block's largest), in exchange for
rows that cost a fraction of an fp32 row's FMAs.

Every GGUF type runs in its kernel format (gguf_blocks.KERNEL_FORMAT: Q4_1, Q8_0, Q5_F, and
the super-block formats Q4_K, Q5_K, Q6_K, which give bitwise what Q4_F / Q5_F / I8_F16 give over
the same values), the K-quants too, against the same activation blocks of 32 (llama.cpp quantizes a
K-quant's activations to Q8_K, 256 wide, to multiply its integer sub-block scales into the
integer sums). Why 32: one rounding of a layer's input serves every matrix whatever its type (a
Q4_K_M file mixes Q4_K, Q6_K and, where in_features % 256 != 0, Q5_0 / Q8_0), a scale per 32
rounds the activations more finely than one per 256, and the kernel formats carry a float32
scale per block of 32 (Q6_K: per 16) anyway, so the float work per block is the same as Q4_1's.

A fused matrix whose parts differ in type (a Q4_K_M file's Q4_K q|k beside its Q6_K v) is one
panel set per part (native.PanelParts), each prepared here; the kernel rounds the rows again
for each part, to the same int8 values and scales (a row's rounding depends on that row alone),
so each part's columns are bitwise ``reference_linear`` of its own blocks.

    panels = prepare(blocks)             # gguf_blocks.Blocks -> native.Panels (FORMATS)
    y = kernels.linear(x, panels)        # the compiled kernel
    y == reference_linear(x, blocks)     # bitwise, pure torch (the oracle of the tests)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdec.models.gguf import blocks as gguf_blocks
from specdec.models.gguf import kquant_blocks
from specdec.models.gguf.blocks import BLOCK, NIBBLES, Blocks, Repacked, pair_rows, repack
from specdec.native import PANEL, Panels

# the kernel's format codes (kernels.h: SD_*_Q8), by kernel format (gguf_blocks.FORMATS)
FORMATS = {"Q4_1": 5, "Q8_0": 6, "Q4_F": 10, "Q5_F": 11, "I8_F16": 12,
           **kquant_blocks.Q8_FORMATS}


def prepare(b: Blocks) -> Panels:
    """The layout linear_q8.c reads: per pair of 8-row panels and block of 32 inputs, the 16
    rows' scales (gguf_blocks.scale_bytes), then chunks of 8 rows x 4 inputs (4-bit formats:
    chunk c, byte 4r + j = q[r][4c + j] | q[8 + r][4c + j] << 4; 8-bit ones: chunk (c, panel
    p), byte 4r + j = q[8p + r][4c + j]). Q4_K, Q5_K, Q6_K: their super-block format
    (kquant_blocks)."""
    if gguf_blocks.KERNEL_FORMAT[b.kind] in kquant_blocks.Q8_FORMATS:
        return kquant_blocks.prepare(b.kind, b.rows, b.in_features, "q8")
    return prepare_repacked(repack(b), b.out_features, b.in_features)


def prepare_repacked(r: Repacked, out: int, inp: int) -> Panels:
    """``prepare`` of blocks already repacked into a per-32 format (``out`` x ``inp``)."""
    pairs, nb = -(-out // (2 * PANEL)), inp // BLOCK
    # [pairs, 16 rows, nb, 32 k] -> [pairs, nb, 2 panels, 8 rows, 8 chunks, 4 k]
    q = pair_rows(r.q).reshape(pairs, 2, PANEL, nb, 8, 4).permute(0, 3, 1, 2, 4, 5)
    if r.fmt in NIBBLES:
        quants = (q[:, :, 0] | (q[:, :, 1] << 4)).permute(0, 1, 3, 2, 4)  # [.., c, r, j]
    else:
        quants = q.permute(0, 1, 4, 2, 3, 5).contiguous().view(torch.uint8)  # [.., c, p, r, j]
    data = torch.cat([*gguf_blocks.scale_bytes(r), quants.contiguous().reshape(pairs, nb, -1)],
                     dim=-1).contiguous()
    return Panels(data, out, in_features=inp, fmt=FORMATS[r.fmt], panels=2 * pairs)


def preparer(activations: str) -> Callable[[Blocks], Panels]:
    """The layout the kernels need for ``activations`` ("float" | "q8"): blocks -> panels."""
    return {"float": gguf_blocks.prepare, "q8": prepare}[activations]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, K] float32 -> (q [T, K / 32, 32] int8, d [T, K / 32], s [T, K / 32] float32):
    d = max|x| / 127 per block, q = round-half-even(x * (1 / d)), s = d * sum(q)."""
    t, k = x.shape
    blocks = x.reshape(t, k // BLOCK, BLOCK)
    d = blocks.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, 1.0), 0.0)
    q = (blocks * inv.unsqueeze(-1)).round().clamp(-127, 127)
    return q.to(torch.int8), d, d * q.sum(-1)


def reference_linear(x: torch.Tensor, b: Blocks) -> torch.Tensor:
    """x [T, in] float32 -> [T, out]: bitwise the compiled kernel's result over ``prepare(b)``.
    Per block j of 32 inputs, in ascending order from 0, with (dw, mw) the weight's scales in
    its kernel format and (d, s) the row's (``quantize_rows``), every operation rounded:
        Q4_1, Q4_F, Q5_F:  y += (dw * d) * isum + mw * s
        Q8_0:              y += (dw * d) * isum
        I8_F16:            y += (dw0 * d) * isum0 + (dw1 * d) * isum1   (per 16 inputs)
    isum the exact integer dot product of the block's (or half-block's) quants."""
    return _reference(x, repack(b))


def _reference(x: torch.Tensor, r: Repacked) -> torch.Tensor:
    q, d, s = quantize_rows(x.float())
    out, nb, g = r.d.shape
    # exact integer dot products per (row, output, block, group); float64 holds them exactly
    isum = torch.einsum("tbgk,obgk->tobg", q.double().reshape(-1, nb, g, BLOCK // g),
                        r.q.double().reshape(out, nb, g, BLOCK // g)).float()
    dw, y = r.d.float(), torch.zeros(x.shape[0], out)
    for j in range(nb):
        term = (dw[:, j, 0] * d[:, j, None]) * isum[:, :, j, 0]
        if g == 2:
            term = term + (dw[:, j, 1] * d[:, j, None]) * isum[:, :, j, 1]
        if r.m is not None:
            term = term + r.m[:, j].float() * s[:, j, None]
        y = y + term
    return y
