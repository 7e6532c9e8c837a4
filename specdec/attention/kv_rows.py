"""The paged cache of one layer as rows, and the K/V write every paged backend does first.

One layer's cache [num_pages, 2, page_size, H, D] (flashinfer's NHD layout) viewed as
[num_pages * 2 * page_size, H, D] rows: K of slot s (page p = s // page_size, offset o) is row
p * 2 * page_size + o and its V is page_size rows later. Example, page_size 4, slots [5, 6]::

    kv_write_index([5, 6], 4) = [9, 10, 13, 14]      (K rows, then V rows)
"""

from __future__ import annotations

import torch


def kv_write_index(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """[2 * S] int64 cache rows of slots [S]: the K rows, then the V rows."""
    page, offset = slots // page_size, slots % page_size
    k_rows = page * (2 * page_size) + offset
    return torch.cat([k_rows, k_rows + page_size])


def write_kv(kv_cache: torch.Tensor, index: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> torch.Tensor:
    """Write k, v [S, H, D] into the rows ``index`` ([2 * S], from kv_write_index) of one
    layer's cache; returns the cache's row view [rows, H, D]."""
    rows = kv_cache.view(-1, kv_cache.shape[-2], kv_cache.shape[-1])
    rows.index_copy_(0, index, torch.cat([k, v]))
    return rows
