"""The compiled repacker (specdec/native/repack.c, specdec/models/gguf/repack.py) makes bitwise the
panels the torch layouts make (gguf_blocks.prepare for float activations,
q8_activations.prepare for 8-bit ones) for every GGUF type, both layouts, rows padded to whole
panel pairs, random bytes, a quantizer's blocks and extreme scales, a view whose rows are not
contiguous, and Q4_0 whose -8d overflows fp16 (Q4_F); it refuses what does not fit."""

from __future__ import annotations

import pytest
import torch
from gguf_helpers import random_blocks
from native_helpers import KERNELS, needs_kernels
from test_kquant_formats import make_blocks

from specdec.models.gguf import blocks as gb
from specdec.models.gguf import q8_activations as qa
from specdec.models.gguf import repack

pytestmark = [needs_kernels, pytest.mark.usefixtures("one_torch_thread")]
KINDS = list(gb.BLOCK_BYTES)


def _same(got, want) -> None:
    assert (got.fmt, got.panels, got.out_features, got.in_features) == (
        want.fmt, want.panels, want.out_features, want.in_features)
    assert got.data.shape == want.data.shape and torch.equal(got.data, want.data)


@pytest.mark.parametrize("activations", ["float", "q8"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_type_is_the_torch_layout(kind, activations):
    blocks = 2 if kind.endswith("_K") else 3  # K-quants: 512 inputs; others: 96
    inp = blocks * gb.BLOCK_WIDTH[kind]
    sources = ["bytes", "bench", "extreme"] if kind.endswith("_K") else ["bytes"]
    for out in (1, 16, 37):  # 37: 11 padding rows
        for i, source in enumerate(sources):
            b = make_blocks(source, kind, out, inp, seed=out + i)
            _same(repack.repack(KERNELS, b, activations), qa.preparer(activations)(b))


@pytest.mark.parametrize("activations", ["float", "q8"])
def test_q4_0_whose_m_overflows_fp16_is_q4_f(activations):
    b = random_blocks("Q4_0", 21, 64, seed=1)
    for d, fmt in ((8188.0, "Q4_1"), (8192.0, "Q4_F"), (-60000.0, "Q4_F")):
        rows = b.rows.clone().view(21, 2, 18)
        rows[3, 1, 0:2] = torch.tensor([d], dtype=torch.float16).view(torch.uint8)
        big = gb.Blocks("Q4_0", rows.reshape(21, -1), 64)
        got = repack.repack(KERNELS, big, activations)
        _same(got, qa.preparer(activations)(big))
        codes = gb.FORMATS if activations == "float" else qa.FORMATS
        assert got.fmt == codes[fmt]


def test_rows_of_a_view_are_read_where_they_are():
    b = random_blocks("Q4_K", 40, 512, seed=2)
    wide = torch.cat([b.rows, torch.zeros_like(b.rows)], 1)  # row stride twice the row
    view = gb.Blocks("Q4_K", wide[:, :b.rows.shape[1]], 512)
    assert not view.rows.is_contiguous()
    for activations in ("float", "q8"):
        _same(repack.repack(KERNELS, view, activations), qa.preparer(activations)(b))


def test_the_preparer_is_the_compiled_one_where_the_kernels_are():
    b = random_blocks("Q8_0", 16, 64)
    make = repack.preparer("q8")
    assert make is not qa.preparer("q8")
    _same(make(b), qa.prepare(b))
    with pytest.raises(ValueError, match="activations must be one of"):
        repack.preparer("int4")


def test_what_does_not_fit_is_refused():
    b = random_blocks("Q4_K", 16, 512)
    with pytest.raises(ValueError, match="Q4_K"):
        repack.repack(KERNELS, gb.Blocks("Q4_K", b.rows[:, :-1], 512), "float")
    with pytest.raises(ValueError, match="not one of"):
        repack.repack(KERNELS, gb.Blocks("Q2_K", b.rows, 512), "float")
    assert KERNELS.lib.sd_repack(b.rows.data_ptr(), b.rows.stride(0), 16, 512, 5,
                                 gb.FORMATS["Q6_K"], b.rows.data_ptr(), 1) == -1
