"""A drafter's weights quantized for the compiled kernels: drafts need no exactness.

Verification makes speculation lossless whatever the drafts are, so a draft model may compute
with cheaper weights than the target. On a CPU a learned drafter's step is bound by streaming
its matrices (an EAGLE-3 head for SmolLM2: 9.7 M weights, 39 MB in fp32, ~2 ms a pass at
20 GB/s, run once per tree level); in Q8_0 blocks it streams 10 MB, in Q4_1 6 MB. The blocks are
made with gguf-py (the ggml reference quantizers) and laid out by ``gguf_blocks.prepare`` for
the same kernels that run the target's GGUF blocks.

The model's own weights are left as they are (a head being trained keeps its fp32 values; a
weight changed in place is prepared again from its new values): only the kernel's copy is
quantized, so the drafts of a quantized drafter are what ``dequantize`` of these blocks gives.

    adopted = draft_panels([head], "auto", torch.float32, cpu, "invariant")  # [(weight, panels)]
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from specdec import native
from specdec.models.gguf import q8_activations, repack
from specdec.models.gguf.blocks import BLOCK, FORMATS, Blocks
from specdec.native import Panels

# "auto": where the kernels run, a model's ``auto_draft_weights`` (the learned heads: Q4_1), else
# Q8_0 (a draft model); float where they do not
CHOICES = ("auto", "q8_0", "q4_1", "float")
logger = logging.getLogger("specdec")


def mode_of(panels: list[tuple[torch.Tensor, Panels]]) -> str:
    """The ``draft_weights`` mode some quantized panels were made in ("q8_0" | "q4_1")."""
    names = {code: kind.lower() for formats in (FORMATS, q8_activations.FORMATS)
             for kind, code in formats.items()}
    return names[panels[0][1].fmt]


def quantize(weight: torch.Tensor, kind: str) -> Blocks:
    """weight [out, in] (in a multiple of 32) -> its blocks of ``kind`` ("Q8_0" | "Q4_1")."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as ggml_quantize

    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise ValueError(f"a {kind} weight needs [out, in] with in a multiple of {BLOCK}, got "
                         f"{tuple(weight.shape)}")
    rows = ggml_quantize(weight.detach().float().cpu().numpy(), GGMLQuantizationType[kind])
    return Blocks(kind, torch.from_numpy(np.ascontiguousarray(rows)), int(weight.shape[1]))


def draft_panels(models: list, mode: str, dtype: torch.dtype, device: torch.device,
                 linear_kernels: str, activations: str = "float"
                 ) -> list[tuple[torch.Tensor, Panels]]:
    """(weight, quantized panels) for every matrix of the draft ``models`` that ``mode`` (one
    of CHOICES) quantizes, laid out for ``activations`` ("float" | "q8", as the target's):
    [] for "float"; "q8_0" / "q4_1" raise ValueError saying why they cannot run here; "auto"
    is, where they can, each model's ``auto_draft_weights`` (Q4_1 for the learned heads:
    SmolLM2's EAGLE-3, MTP and block-diffusion drafters accept within 1 % of their Q8_0
    figures, and an EAGLE-3 level streams half the bytes) or Q8_0 (a draft model), else
    float (logged)."""
    if mode not in CHOICES:
        raise ValueError(f"draft_weights must be one of {', '.join(CHOICES)}, got {mode!r}")
    if mode == "float" or not models:
        return []
    reason = None
    if dtype != torch.float32:
        reason = f"the kernels take them beside float32 activations, not " \
                 f"{str(dtype).removeprefix('torch.')}"
    elif device.type != "cpu" or linear_kernels != "invariant" or native.load() is None:
        reason = "they need the compiled CPU kernels (linear_kernels='invariant' on a CPU)"
    else:
        shapes = [tuple(w.shape) for m in models for w in m.matrices() if w.shape[1] % BLOCK]
        if shapes:
            reason = f"a matrix of {shapes[0]} has inputs not a multiple of {BLOCK}"
    if reason is not None:
        if mode != "auto":
            raise ValueError(f"draft_weights={mode!r} cannot run here: {reason}")
        logger.info("draft weights: float (quantized draft weights: %s)", reason)
        return []
    make = repack.preparer(activations)
    out, kinds = [], []
    for m in models:
        kind = mode.upper() if mode != "auto" else getattr(m, "auto_draft_weights", "Q8_0")
        kinds.append(kind)
        out += [(w, make(quantize(w, kind))) for w in m.matrices()]
    logger.info("draft weights: %s, %d matrices (%.1f MB)", "/".join(dict.fromkeys(kinds)),
                len(out), sum(p.nbytes for _, p in out) / 1e6)
    return out
