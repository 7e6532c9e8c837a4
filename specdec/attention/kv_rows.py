"""The paged cache of one layer as rows, and the K/V write every paged backend does first.

One layer's cache [num_pages, 2, page_size, H, D] (flashinfer's NHD layout) viewed as
[num_pages * 2 * page_size, H, D] rows: K of slot s (page p = s // page_size, offset o) is row
p * 2 * page_size + o and its V is page_size rows later. Example, page_size 4, slots [5, 6]::

    kv_write_index([5, 6], 4) = [9, 10, 13, 14]      (K rows, then V rows)
"""

from __future__ import annotations

import numpy as np
import torch


def kv_write_index(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """[2 * S] int64 cache rows of slots [S]: the K rows, then the V rows."""
    page, offset = slots // page_size, slots % page_size
    k_rows = page * (2 * page_size) + offset
    return torch.cat([k_rows, k_rows + page_size])


def host_kv_write_index(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """``kv_write_index`` of host slots, the same values through numpy: a step's six tiny
    torch ops cost several times its few numpy ones, on the host path of every forward."""
    s = slots.numpy()
    k_rows = s // page_size * (2 * page_size) + s % page_size
    return torch.from_numpy(np.concatenate([k_rows, k_rows + page_size]))


def write_kv(kv_cache: torch.Tensor, index: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> torch.Tensor:
    """Write k, v [S, H, D] into the rows ``index`` ([2 * S], from kv_write_index) of one
    layer's cache, in one op (one kernel on a GPU); returns the cache's row view [rows, H, D]."""
    rows = kv_cache.view(-1, kv_cache.shape[-2], kv_cache.shape[-1])
    rows.index_put_((index.view(2, -1).t(),), _pairs(k, v))
    return rows


def _pairs(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[S, 2, H, D]: row s's K then V. When v sits right after k in each row of one buffer (the
    model's fused qkv projection: [q | k | v] per row), a view of it; else a stacked copy."""
    if (k.shape == v.shape and k.stride() == v.stride() and k.dtype == v.dtype
            and k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
            and v.storage_offset() - k.storage_offset() == k.shape[1] * k.stride(1)
            and k.stride(2) == 1 and k.stride(1) == k.shape[2]):
        s, h, d = k.shape
        return k.as_strided((s, 2, h, d), (k.stride(0), h * d, d, 1))
    return torch.stack([k, v], dim=1)
