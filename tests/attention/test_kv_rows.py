"""The K/V write every paged backend does first: one index_put_ from the fused projection's
adjacent k | v columns (a view), or from separate k and v tensors (a stacked copy); same cache."""

from __future__ import annotations

import torch

from specdec.attention.kv_rows import _pairs, kv_write_index, write_kv


def test_write_kv_from_adjacent_views_and_from_separate_tensors_writes_the_same():
    g = torch.Generator().manual_seed(0)
    pages, page, h, d, s = 5, 4, 2, 8, 6
    qkv = torch.randn(s, 3 * h * d, generator=g)  # [q | k | v], q of h heads too
    k = qkv[:, h * d:2 * h * d].view(s, h, d)
    v = qkv[:, 2 * h * d:].view(s, h, d)
    index = kv_write_index(torch.tensor([9, 10, 11, 12, 3, 17]), page)
    assert _pairs(k, v).data_ptr() == k.data_ptr()  # a view, no copy
    assert _pairs(k.clone(), v.clone()).data_ptr() != k.data_ptr()
    a, b = torch.zeros(pages, 2, page, h, d), torch.zeros(pages, 2, page, h, d)
    write_kv(a, index, k, v)
    write_kv(b, index, k.contiguous(), v.contiguous())
    assert torch.equal(a, b)
    # slot 9 = page 2, offset 1: its K at [2, 0, 1], its V at [2, 1, 1]
    assert torch.equal(a[2, 0, 1], k[0]) and torch.equal(a[2, 1, 1], v[0])
    assert torch.equal(a[4, 1, 1], v[5])
