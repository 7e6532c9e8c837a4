"""The KV tensor itself: one allocation, one [num_pages, 2, page_size, H, D] view per layer."""

from __future__ import annotations

import torch


class KVCache:
    """All layers' paged KV in one tensor so that moving slots costs one op for every layer.

    `tensor`: [num_layers, num_pages, 2, page_size, num_kv_heads, head_dim]; `layer(i)` is
    flashinfer's NHD paged layout for layer i.
    """

    def __init__(self, num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device):
        self.page_size = page_size
        self.num_pages = num_pages
        self.copies = 0  # index arrays sent to the device for moves (one per move)
        self.tensor = torch.zeros(
            num_layers, num_pages, 2, page_size, num_kv_heads, head_dim, dtype=dtype, device=device
        )

    def layer(self, i: int) -> torch.Tensor:
        return self.tensor[i]

    def move_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy the K/V of slots `src` onto slots `dst` in every layer (accepted draft nodes).

        Slot s = page * page_size + offset. The copy reads all sources before writing, so
        overlapping src/dst lists are safe.
        """
        if not src:
            return
        s, d = self._indices(src, dst)
        # indices on dims 1 and 3 around a slice: the result is [n, layers, 2, H, D] (a copy)
        values = self.tensor[:, s // self.page_size, :, s % self.page_size]
        self.tensor[:, d // self.page_size, :, d % self.page_size] = values

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole pages (copy-on-write after a fork)."""
        if pairs:
            src, dst = self._indices([s for s, _ in pairs], [d for _, d in pairs])
            self.tensor[:, dst] = self.tensor[:, src]

    def _indices(self, src: list[int], dst: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """src and dst as int64 tensors on the cache's device, sent in one copy."""
        self.copies += 1
        both = torch.tensor(src + dst, dtype=torch.int64).to(self.tensor.device,
                                                              non_blocking=True)
        return both[:len(src)], both[len(src):]
