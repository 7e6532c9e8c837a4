"""A GGUF's blocks with 8-bit activations: the kernel's layout and its pure-torch reference.

``EngineConfig.activations="q8"`` computes every matrix held in the file's Q4_1 / Q8_0 blocks
the way llama.cpp's CPU backend does: each row of activations is rounded, per block of 32
inputs, to int8 with one scale, and each block's product is an exact integer dot product
(specdec/native/linear_q8.c, which states the arithmetic). A row's result depends on that row
alone, so speculation stays exactly plain decoding in this mode; the numbers are no longer the
fp32 model's (each activation is off by at most 1/254 of its block's largest), in exchange for
rows that cost a fraction of an fp32 row's FMAs.

    panels = prepare(blocks)             # gguf_blocks.Blocks -> native.Panels (fmt 5 / 6)
    y = kernels.linear(x, panels)        # the compiled kernel
    y == reference_linear(x, blocks)     # bitwise, pure torch (the oracle of the tests)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdec.models import gguf_blocks
from specdec.models.gguf_blocks import BLOCK, Blocks, pair_rows, pair_scales, split
from specdec.models.native import PANEL, Panels

FORMATS = {"Q4_1": 5, "Q8_0": 6}  # the kernel's format codes (kernels.h: SD_*_Q8)


def prepare(b: Blocks) -> Panels:
    """The layout linear_q8.c reads: per pair of 8-row panels and block of 32 inputs, the 16
    rows' fp16 scales (Q4_1: d then m), then chunks of 8 rows x 4 inputs (Q4_1: chunk c, byte
    4r + j = q[r][4c + j] | q[8 + r][4c + j] << 4; Q8_0: chunk (c, panel p), byte 4r + j =
    q[8p + r][4c + j])."""
    d, m, q = split(b)
    pairs, nb = -(-b.out_features // (2 * PANEL)), b.in_features // BLOCK
    # [pairs, 16 rows, nb, 32 k] -> [pairs, nb, 2 panels, 8 rows, 8 chunks, 4 k]
    q = pair_rows(q).reshape(pairs, 2, PANEL, nb, 8, 4).permute(0, 3, 1, 2, 4, 5)
    if b.kind == "Q8_0":
        quants = q.permute(0, 1, 4, 2, 3, 5).contiguous().view(torch.uint8)  # [.., c, p, r, j]
        parts = [pair_scales(d), quants.reshape(pairs, nb, -1)]
    else:
        packed = (q[:, :, 0] | (q[:, :, 1] << 4)).permute(0, 1, 3, 2, 4)  # [.., c, r, j]
        parts = [pair_scales(d), pair_scales(m), packed.contiguous().reshape(pairs, nb, -1)]
    data = torch.cat(parts, dim=-1).contiguous()
    return Panels(data, b.out_features, in_features=b.in_features, fmt=FORMATS[b.kind],
                  panels=2 * pairs)


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
    """x [T, in] float32 -> [T, out]: bitwise the compiled kernel's result over ``prepare(b)``
    (the same roundings, blocks summed in ascending order from 0)."""
    q, d, s = quantize_rows(x.float())
    dw, mw, qw = split(b)  # [out, nb] fp16, [out, nb] | None, [out, nb, 32]
    # exact integer dot products per (row, output, block); float64 holds them exactly
    isum = torch.einsum("tbk,obk->tob", q.double(), qw.to(torch.int64).double()).float()
    dw, y = dw.float(), torch.zeros(x.shape[0], b.out_features)
    for j in range(d.shape[1]):
        term = (dw[:, j] * d[:, j, None]) * isum[:, :, j]
        if mw is not None:
            term = term + mw[:, j].float() * s[:, j, None]
        y = y + term
    return y
