"""A forward's inputs staged in one copy (specdec/engine/staging.py): each array lands whole, at
a 128-byte aligned offset that is the same for every step of the same sizes (what a CUDA graph
keeps reading, and what keeps Triton from compiling a kernel per alignment)."""

from __future__ import annotations

import torch

from specdec.engine.staging import ALIGN, Staging


def _arrays(t: int, extra: int):
    g = torch.Generator().manual_seed(t + extra)
    return [torch.randint(0, 1000, (n,), generator=g) for n in (t, t, 2 * t, extra)]


def test_arrays_land_whole_aligned_and_at_fixed_addresses():
    staging = Staging(torch.device("cpu"), 1024)
    for t in (1, 5, 17):
        first = staging.stage(_arrays(t, 3))
        again = staging.stage(_arrays(t, 7))  # same T, another tail: the T-sized views stay put
        for got, want in zip(again, _arrays(t, 7)):
            assert torch.equal(got, want)
        assert [v.data_ptr() for v in first[:3]] == [v.data_ptr() for v in again[:3]]
        base = again[0].data_ptr()  # (a CUDA buffer's own start is 256-byte aligned)
        assert all((v.data_ptr() - base) % (ALIGN * 8) == 0 and v.data_ptr() % 16 == 0
                   for v in again)
    assert staging.copies == 6


def test_what_does_not_fit_gets_a_buffer_of_its_own():
    staging = Staging(torch.device("cpu"), 64)
    arrays = _arrays(40, 9)
    got = staging.stage(arrays)
    assert all(torch.equal(g, w) for g, w in zip(got, arrays))
    assert staging.copies == 1
