"""One model's paged KV: its pages (pool + block tables) and its tensor, and every slot operation
of a speculative step in one place.

The slots of one request across a step (n tokens, c = num_computed, q = n - c fed this step,
a draft tree of m nodes, page_size 4)::

    slot:   0 ........ c-1 | c ...... n-1 | n ......... n+m-1 |
            committed KV   | rows fed now | draft node i at n+i |
                           '--- reserve(table, c + q + budget) --'   before drafting (scheduler)
                                           shrink(table, n + m)       after drafting (m <= budget)

    after verification, accepted nodes [a0, a1, ...] (a path, in depth order):
    commit(table, n, [a0, a1, ...]):  KV of slot n + a_j moves to slot n + j, then the table is
                                      truncated to n + k slots (k accepted); the last emitted token
                                      (bonus/correction) has no KV yet: it is next step's input.

    example, n = 6, tree parents [-1, -1, 1] (nodes 0, 1, 2), accepted [1, 2]:
        before:  ... 5 | 6:node0 7:node1 8:node2
        after:   ... 5 | 6:node1 7:node2            (2 moves, slot 8 dropped)

Moves of all layers are one tensor op (``KVCache.move_slots``); pages past the kept slots go back
to the pool at once, so no path leaks pages.
"""

from __future__ import annotations

import torch

from specdec.kv.block_table import BlockTable, KVCacheManager, slot_of
from specdec.kv.cache import KVCache
from specdec.kv.page_pool import PagePool


class KVManager(KVCacheManager):
    """Pages and tensor of one model's KV cache (the target's, or a drafter's)."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device) -> None:
        super().__init__(PagePool(num_pages), page_size)
        self.cache = KVCache(num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype,
                             device)

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    def try_reserve(self, table: BlockTable, num_slots: int) -> bool:
        """Reserve if the pages are there (True); otherwise change nothing (False)."""
        if not self.can_reserve(table, num_slots):
            return False
        self.reserve(table, num_slots)
        return True

    def shrink(self, table: BlockTable, num_slots: int) -> None:
        """Give back reserved slots past ``num_slots`` (a tree smaller than its budget)."""
        if num_slots < table.num_slots:
            self.truncate(table, num_slots)

    def commit(self, table: BlockTable, base: int, accepted: list[int]) -> None:
        """Move accepted nodes' KV (node a_j: slot base + a_j -> base + j) and drop the rest."""
        self.commit_all([(table, base, accepted)])

    def commit_all(self, items: list[tuple[BlockTable, int, list[int]]]) -> None:
        """``commit`` for many requests (table, base, accepted) with one copy for all of them
        (on a GPU, one index transfer and one kernel per step instead of one per request)."""
        src, dst, ps = [], [], self.page_size
        for table, base, accepted in items:
            for j, a in enumerate(accepted):
                if a != j:
                    src.append(slot_of(table.pages, base + a, ps))
                    dst.append(slot_of(table.pages, base + j, ps))
        if src:
            self.cache.move_slots(src, dst)
        for table, base, accepted in items:
            self.truncate(table, base + len(accepted))

    def copy_on_write(self, table: BlockTable, start_slot: int) -> None:
        """Private copies of shared pages holding slots >= start_slot (after ``fork``)."""
        self.cache.copy_pages(self.make_writable(table, start_slot))
