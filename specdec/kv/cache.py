"""The KV tensor itself: one allocation, one [num_pages, 2, page_size, H, D] view per layer."""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable

import torch

LAZY_BYTES = 1 << 20  # below this, torch.zeros: a mapping of its own is not worth it


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """Zeros that cost nothing until touched, on the CPU: an anonymous mapping, whose pages the
    OS hands out zero-filled at their first touch (torch.zeros wrote the whole budget at every
    start, 1 GiB by default: ~0.5-0.9 s, all of it resident at once; now a page of memory
    costs its first write, by the request that uses it). The KV stays zeros until written, as
    before: a padding slot's masked attention weight (0) never meets a NaN of garbage memory.
    On CUDA (or small): torch.zeros. The mapping goes when the tensor does."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < LAZY_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    buffer = mmap.mmap(-1, nbytes)  # private, anonymous: zero-filled (the tensor keeps it)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)


class KVCache:
    """All layers' paged KV in one tensor so that moving slots costs one op for every layer.

    `tensor`: [num_layers, num_pages, 2, page_size, num_kv_heads, head_dim]; `layer(i)` is
    flashinfer's NHD paged layout for layer i.
    """

    def __init__(self, num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device):
        self.page_size = page_size
        self.num_pages = num_pages
        self.copies = 0  # index arrays sent to the device for moves (one per move)
        # called with (method name, its arguments) as a move begins (tensor parallelism's
        # rank 0 sends the move to the other ranks: specdec.distributed.engine_tp); None: nothing
        self.on_move: Callable[[str, tuple], None] | None = None
        self.tensor = lazy_zeros(
            (num_layers, num_pages, 2, page_size, num_kv_heads, head_dim), dtype, device)

    def layer(self, i: int) -> torch.Tensor:
        return self.tensor[i]

    def move_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy the K/V of slots `src` onto slots `dst` in every layer (accepted draft nodes).

        Slot s = page * page_size + offset. The copy reads all sources before writing, so
        overlapping src/dst lists are safe.
        """
        if self.on_move is not None:
            self.on_move("move_slots", (src, dst))
        if not src:
            return
        s, d = self._indices(src, dst)
        # indices on dims 1 and 3 around a slice: the result is [n, layers, 2, H, D] (a copy)
        values = self.tensor[:, s // self.page_size, :, s % self.page_size]
        self.tensor[:, d // self.page_size, :, d % self.page_size] = values

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole pages (copy-on-write after a fork)."""
        if self.on_move is not None:
            self.on_move("copy_pages", (pairs,))
        if pairs:
            src, dst = self._indices([s for s, _ in pairs], [d for _, d in pairs])
            self.tensor[:, dst] = self.tensor[:, src]

    def _indices(self, src: list[int], dst: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """src and dst as int64 tensors on the cache's device, sent in one copy."""
        self.copies += 1
        both = torch.tensor(src + dst, dtype=torch.int64).to(self.tensor.device,
                                                              non_blocking=True)
        return both[:len(src)], both[len(src):]
