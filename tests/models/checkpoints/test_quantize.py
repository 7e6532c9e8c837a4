"""Quantizing float matrices at load (specdec.models.checkpoints.quantize): Q8_0 bitwise gguf-py's (the
ggml reference), Q4_K the blocks of a scalar port of llama.cpp's quantize_row_q4_K_ref, valid
for gguf-py's dequantizer (bitwise ours) and within an error bound."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as ggml_dequantize
from gguf.quants import quantize as ggml_quantize
from q4_k_reference import q4_k_block

from specdec.models.checkpoints import quantize as qz
from specdec.models.gguf import blocks as gb

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _awkward(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random weights with the cases a quantizer can get wrong: an all-positive stretch (its
    min clamps to 0), an all-zero super-block, a constant negative sub-block, heavy tails."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * 0.05
    x[0, :300] += 0.3
    x[1, 256:512] = 0.0
    x[2, 512:544] = -2.0
    x[3] = torch.randn(cols, generator=g) ** 3
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_q8_0_is_bitwise_gguf_py(dtype, monkeypatch):
    monkeypatch.setattr(qz, "CHUNK_ROWS", 7)  # several chunks, a short last one
    w = _awkward(20, 512).to(dtype)
    b = qz.quantize_matrix(w, "Q8_0")
    want = ggml_quantize(w.float().numpy(), GGMLQuantizationType.Q8_0)
    assert b.kind == "Q8_0" and b.in_features == 512
    assert np.array_equal(b.rows.numpy(), want)


def test_q4_k_is_llama_cpp_s_reference():
    x = _awkward(4, 1024)
    got = qz.quantize_matrix(x, "Q4_K").rows.reshape(-1, 144).numpy()
    want = np.array([q4_k_block(sb) for sb in x.reshape(-1, 256).numpy()], dtype=np.uint8)
    same = (got == want).all(1)
    # identical blocks, bar a near tie that a different order of float sums can flip
    assert same.mean() >= 0.85, np.nonzero(~same)


def test_q4_k_dequantizes_within_a_bound(monkeypatch):
    monkeypatch.setattr(qz, "CHUNK_ROWS", 3)
    x = _awkward(10, 768, seed=1)
    b = qz.quantize_matrix(x.bfloat16(), "Q4_K")
    assert b.rows.shape == (10, 3 * 144)
    ours = gb.dequantize(b)
    theirs = ggml_dequantize(b.rows.numpy(), GGMLQuantizationType.Q4_K).reshape(10, 768)
    assert torch.equal(ours, torch.from_numpy(theirs))  # valid blocks, read alike
    xs = x.bfloat16().float().reshape(-1, 256)
    err = (ours.reshape(-1, 256) - xs).abs().amax(1)
    span = xs.amax(1) - xs.amin(1).clamp(max=0)  # 4 bits over a super-block's range
    assert (err <= span / 15).all(), (err / span * 15).max()
    rel = (ours - x.bfloat16().float()).norm() / x.norm()
    assert rel < 0.1, rel
    zero = torch.zeros(2, 256)
    assert torch.equal(gb.dequantize(qz.quantize_matrix(zero, "Q4_K")), zero)


def test_kind_for_mixes_types_by_width():
    assert qz.kind_for("q4_k", 512) == "Q4_K"
    assert qz.kind_for("q4_k", 576) == "Q8_0"  # not a multiple of 256, as llama.cpp mixes
    assert qz.kind_for("q8_0", 512) == "Q8_0"
    with pytest.raises(ValueError, match="a matrix of 40 inputs .* has no GGUF block type"):
        qz.kind_for("q8_0", 40)
    with pytest.raises(ValueError, match=r"quantize must be None or one of q8_0, q4_k, got "
                                         r"'Q4_K'"):
        qz.kind_for("Q4_K", 256)


def test_a_non_finite_weight_is_refused():
    w = torch.ones(5, 256)
    w[4, 7] = float("inf")
    with pytest.raises(ValueError, match=r"cannot quantize to Q4_K: rows 0\.\.4 hold a NaN or "
                                         r"infinite weight"):
        qz.quantize_matrix(w, "Q4_K")
    with pytest.raises(ValueError, match="Q4_K needs in_features a multiple of 256, got 96"):
        qz.quantize_matrix(torch.ones(2, 96), "Q4_K")
