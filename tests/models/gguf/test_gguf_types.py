"""The GGUF types' table (specdec/models/gguf/types.py) and the repacking of each into a kernel
format (gguf_blocks.repack): what they refuse, and Q4_0's fallback where -8d overflows fp16.
(Bitwise dequantization of random blocks of every type: test_gguf_weights.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_helpers import random_blocks
from native_helpers import KERNELS, needs_kernels

from specdec.models.gguf import blocks as gb
from specdec.models.gguf import types as gt


def test_block_bytes_are_gguf_py_s():
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    for kind, t in gt.TYPES.items():
        assert GGML_QUANT_SIZES[GGMLQuantizationType[kind]] == (t.width, t.nbytes), kind
    assert gb.BLOCK_BYTES == {k: t.nbytes for k, t in gt.TYPES.items()}
    assert set(gb.KERNEL_FORMAT) == set(gt.TYPES)


@pytest.mark.parametrize("kind, inp, rows, message", [
    ("Q4_K", 288, (4, 162), "Q4_K blocks need in_features a multiple of 256, got 288"),
    ("Q6_K", 0, (4, 0), "Q6_K blocks need in_features a multiple of 256, got 0"),
    ("Q4_0", 64, (4, 35), r"Q4_0 rows of 64 inputs are \[out, 36\] uint8, got \(4, 35\)"),
    ("IQ2_XS", 256, (4, 66), "GGUF type IQ2_XS is not one of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
                             "Q4_K, Q5_K, Q6_K"),
])
def test_what_does_not_fit_is_named(kind, inp, rows, message):
    b = gb.Blocks(kind, torch.zeros(rows, dtype=torch.uint8), inp)
    for f in (gb.dequantize, gb.repack):
        with pytest.raises(ValueError, match=message):
            f(b)


def test_q4_0_whose_minus_8d_overflows_fp16_runs_with_fp32_scales():
    """d = 9000: -8d = -72000 is no fp16, so the matrix is Q4_F (m = -8d in float32), still
    bitwise gguf-py's weights; a matrix without such a block stays Q4_1."""
    from gguf import GGMLQuantizationType, quants

    b = random_blocks("Q4_0", 20, 96, seed=4)
    assert gb.repack(b).fmt == "Q4_1"
    rows = b.rows.clone().reshape(20, 3, 18)
    rows[3, 1, 0:2] = torch.tensor([9000.0], dtype=torch.float16).view(torch.uint8)
    big = gb.Blocks("Q4_0", rows.reshape(20, -1), 96)
    r = gb.repack(big)
    ref = quants.dequantize(big.rows.numpy(), GGMLQuantizationType.Q4_0).reshape(20, 96)
    assert r.fmt == "Q4_F" and r.d.dtype == torch.float32
    assert torch.equal(r.weights(), torch.from_numpy(ref))
    assert np.isfinite(ref).all()
    if KERNELS is not None:
        x = torch.randn(5, 96)
        assert torch.equal(KERNELS.linear(x, gb.prepare(big)),
                           KERNELS.linear(x, KERNELS.prepare(torch.from_numpy(ref))))


@needs_kernels
def test_kernel_bytes_per_weight():
    """What each kernel format streams per weight, against the file's type (module docstring
    of gguf_blocks): at most 1.25 bytes a weight (the 8-bit formats), 0.625 (Q4_1), the
    K-quants' super-block formats within 3 % of the file (Q4_K 148 bytes per 256 against 144,
    Q5_K 180 against 176, Q6_K 210 as the file)."""
    per_weight = {}
    for kind in gt.TYPES:
        inp = gt.TYPES[kind].width * (8 if kind.endswith("_K") else 64)
        p = gb.prepare(random_blocks(kind, 64, inp))
        per_weight[kind] = p.nbytes / (64 * inp)
    assert per_weight == {"Q4_0": 0.625, "Q4_1": 0.625, "Q5_0": 1.0625, "Q5_1": 1.25,
                          "Q8_0": 1.0625, "Q4_K": 148 / 256, "Q5_K": 180 / 256,
                          "Q6_K": 210 / 256}
