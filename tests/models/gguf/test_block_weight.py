"""BlockWeight (specdec/models/gguf/block_weight.py): a matrix that is a GGUF's blocks gives, for
every op, bitwise what its dequantized values give (gguf-py's dequantization is the oracle),
reads only the rows a lookup asks for, and refuses to be written."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf_helpers import KINDS, random_blocks
from torch import nn

from specdec.models.gguf import blocks as gb
from specdec.models.gguf.block_weight import BlockWeight, Part, dequantize


def _weight(kind: str = "Q4_1"):
    """q|k-like: two parts, the first in a row order of its own -> (weight, its values)."""
    a, b = random_blocks(kind, 24, 64, seed=1), random_blocks(kind, 8, 64, seed=2)
    order = torch.randperm(24, generator=torch.Generator().manual_seed(0))
    w = BlockWeight([Part(a, order, "a"), Part(b, None, "b")], "ab")
    return w, torch.cat([gb.dequantize(a)[order], gb.dequantize(b)])


@pytest.mark.parametrize("kind", ["Q4_0", "Q5_1", "Q6_K", "F16", "BF16", "F32", *KINDS])
def test_dequantize_is_gguf_pys(kind):
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[kind]
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    if kind.endswith("_K"):  # gguf-py does not quantize K-quants: random blocks, finite scales
        rows = random_blocks(kind, 5, 2 * block).rows.numpy()
    else:
        rows = quants.quantize(rng.standard_normal((5, 2 * max(block, 32))).astype(np.float32),
                               qtype)
    rows = rows.view(np.uint8).reshape(5, -1)
    width = rows.shape[1] // size * block
    ref = quants.dequantize(rows, qtype).reshape(5, width)
    got = dequantize(kind, torch.from_numpy(rows.copy()), width)
    assert torch.equal(got, torch.from_numpy(ref.astype(np.float32)))


def test_every_op_sees_the_dequantized_values():
    w, ref = _weight()
    p = nn.Parameter(w, requires_grad=False)  # as a module holds it
    assert isinstance(p, BlockWeight) and p.key == w.key and p.shape == (32, 64)
    assert p.dtype == torch.float32 and p.is_cpu
    x = torch.randn(3, 64)
    assert torch.equal(F.linear(x, p), F.linear(x, ref))
    ids = torch.tensor([[0, 23], [31, 24]])  # rows of both parts
    assert torch.equal(F.embedding(ids, p), ref[ids])
    assert torch.equal(p.double(), ref.double()) and torch.equal(p.detach().float(), ref)
    assert torch.equal(p.dequantize(), ref) and torch.equal(p.index_select(0, ids[0]), ref[ids[0]])
    with torch.inference_mode():
        assert torch.equal(F.linear(x, p), F.linear(x, ref))
    blocks = p.blocks()  # one Blocks in the model's row order, what the kernels are made from
    assert torch.equal(gb.dequantize(blocks), ref)


def test_a_lookup_reads_only_its_rows(monkeypatch):
    single = random_blocks("Q8_0", 50, 64)
    w = BlockWeight([Part(single)], "embed")
    seen = []
    real = gb.dequantize
    monkeypatch.setattr(gb, "dequantize", lambda b: seen.append(b.out_features) or real(b))
    out = F.embedding(torch.tensor([3, 3, 7]), w)
    assert seen == [3] and torch.equal(out, real(single)[[3, 3, 7]])


def test_it_cannot_be_written():
    w, _ = _weight()
    with pytest.raises(TypeError, match=r"would write into ab, a GGUF file's blocks"):
        w.add_(1.0)
    _, ref = _weight()
    assert torch.equal(torch.zeros(32, 64).copy_(w), ref)  # read from: allowed
    with pytest.raises(TypeError, match="read-only"):
        w.copy_(torch.zeros(32, 64))


def test_parts_of_different_types_are_named():
    w = BlockWeight([Part(random_blocks("Q8_0", 8, 64), name="q"),
                     Part(random_blocks("Q4_1", 8, 64), name="k")], "qk")
    with pytest.raises(ValueError, match=r"qk fuses tensors of different types \['Q8_0', 'Q4_1'\]"):
        w.blocks()
    assert w.dequantize().shape == (16, 64)  # still a weight (dequantized where it is used)


def test_runs_are_its_parts_of_one_type_in_row_order():
    """What the kernels prepare in parts: adjacent parts of one type joined (row orders
    applied), one Blocks per run."""
    q, k, v = (random_blocks(kind, 16, 64, seed=i) for i, kind in enumerate(("Q8_0", "Q8_0",
                                                                             "Q4_1")))
    order = torch.arange(16).flip(0)
    w = BlockWeight([Part(q, order), Part(k), Part(v)], "qkv")
    runs = w.runs()
    assert [(r.kind, r.out_features) for r in runs] == [("Q8_0", 32), ("Q4_1", 16)]
    assert torch.equal(torch.cat([gb.dequantize(r) for r in runs]), w.dequantize())
    one = BlockWeight([Part(q), Part(k)], "qk")
    assert len(one.runs()) == 1 and torch.equal(gb.dequantize(one.blocks()), one.dequantize())
