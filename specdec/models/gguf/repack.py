"""A GGUF matrix's blocks as the kernels' panels, made at load by the compiled repacker
(specdec/native/repack.c) in one pass over the file's bytes: bitwise what the torch layouts
make (``gguf_blocks.prepare`` for float activations, ``q8_activations.prepare`` for 8-bit
ones: the references, and the way without the compiled kernels).

Why compiled: the torch layouts take ~20 passes over a matrix (SmolLM2-1.7B Q4_K_M: 6.8 s per
activation mode on one core, 160 MB/s), so their result used to be cached on disk, a copy the
size of the file per mode; the repacker runs at memory speed and nothing is written
(docs/bench/repack_load.py measures both).

    make = preparer("q8")          # gguf_blocks.Blocks -> native.Panels
    panels = make(blocks)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdec import native
from specdec.models.gguf import blocks as gguf_blocks
from specdec.models.gguf import q8_activations
from specdec.models.gguf import types as gguf_types
from specdec.models.gguf.blocks import Blocks
from specdec.native import PANEL, Panels

# repack.c's type codes (RK_*)
KINDS = {"Q4_0": 0, "Q4_1": 1, "Q5_0": 2, "Q5_1": 3, "Q8_0": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 7}
# bytes of blocks per thread: one thread repacks ~2 GB/s, so a matrix under this takes a few ms
# alone, less than what a team's barrier can cost on a busy machine (a scheduler slice, ~20 ms,
# per call: SmolLM2's 121 matrices with 2 threads under load took 5 s instead of 0.05 s)
THREAD_BYTES = 16 << 20
ACTIVATIONS = ("float", "q8")


def preparer(activations: str) -> Callable[[Blocks], Panels]:
    """Blocks -> panels for ``activations`` ("float" | "q8"): the compiled repacker where the
    kernels are loaded, else the torch layout (the same bytes)."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    kernels = native.load()
    if kernels is None:
        return q8_activations.preparer(activations)
    return lambda b: repack(kernels, b, activations)


def kernel_format(b: Blocks, activations: str) -> int:
    """The format code the panels of ``b`` take (gguf_blocks.repack's choice: Q4_0 is Q4_1
    unless -8d overflows fp16 somewhere, then Q4_F)."""
    fmt = gguf_blocks.KERNEL_FORMAT[b.kind]
    if b.kind == "Q4_0":
        d = gguf_types.blocks("Q4_0", b.rows, b.in_features)[..., 0:2]
        m = -8.0 * d.contiguous().view(torch.float16).float()
        fmt = "Q4_1" if m.half().isfinite().all() else "Q4_F"
    return (gguf_blocks.FORMATS if activations == "float" else q8_activations.FORMATS)[fmt]


def repack(kernels: native.Kernels, b: Blocks, activations: str) -> Panels:
    """``b``'s panels for ``activations``, made by repack.c: [pairs, blocks, pair bytes] uint8
    as the torch layouts make them (pairs of 8-row panels; blocks of 32 inputs, or of 256 for
    a K-quant). ValueError for a type the kernels do not take or a shape that does not fit."""
    if b.kind not in KINDS:
        raise ValueError(f"GGUF type {b.kind} is not one of {', '.join(KINDS)}")
    gguf_types.blocks(b.kind, b.rows, b.in_features)  # ValueError unless the shape fits
    rows = b.rows if b.rows.stride(-1) == 1 and b.rows.stride(0) > 0 else b.rows.contiguous()
    fmt = kernel_format(b, activations)
    width = gguf_blocks.BLOCK_WIDTH[b.kind]
    pairs, blocks = -(-b.out_features // (2 * PANEL)), b.in_features // width
    per_block = native.PAIR_BYTES[fmt] * (width // gguf_blocks.BLOCK)
    data = torch.empty(pairs, blocks, per_block, dtype=torch.uint8)
    threads = max(1, min(torch.get_num_threads(), b.nbytes // THREAD_BYTES))
    rc = kernels.lib.sd_repack(rows.data_ptr(), rows.stride(0), b.out_features, b.in_features,
                               KINDS[b.kind], fmt, data.data_ptr(), threads)
    if rc != 0:
        raise ValueError(f"sd_repack refused {b.kind} blocks [{b.out_features}, "
                         f"{b.in_features}] into format {fmt}")
    return Panels(data, b.out_features, b.in_features, fmt, 2 * pairs)
