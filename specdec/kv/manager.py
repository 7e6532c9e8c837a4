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

from specdec.kv.block_table import BlockTable, TableAllocator, slot_of
from specdec.kv.cache import KVCache
from specdec.kv.host_tier import HostTier
from specdec.kv.page_pool import PagePool
from specdec.kv.tier import DiskTier


class KVManager(TableAllocator):
    """Pages and tensor of one model's KV cache (the target's, or a drafter's)."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device) -> None:
        super().__init__(PagePool(num_pages), page_size)
        self.cache = KVCache(num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype,
                             device)
        self.tier: DiskTier | HostTier | None = None
        # measured target seconds per prefill token (the engine keeps it): a tier read must
        # beat recomputing a page to be used
        self.prefill_seconds_per_token: float | None = None

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    # ---- the second tier ---------------------------------------------------------------------

    def attach_tier(self, tier: DiskTier | HostTier) -> None:
        """Copy every cached page the pool evicts into ``tier`` first (and, for a
        write-through tier, every released table's registered pages: ``release``)."""
        self.tier = tier
        self.pool.on_evict = lambda page, key: tier.put(key, self.cache.tensor[:, page])

    def release(self, table: BlockTable) -> None:
        """Return the table's pages (``TableAllocator.release``); with a write-through tier
        (the disk tier) its registered full pages are stored there first, so that a later
        engine on the same file finds them (their KV is final: nothing rewrites a registered
        page)."""
        tier = self.tier
        try:
            if tier is not None and tier.write_through:
                for page in table.pages[:table.num_keyed]:
                    key = self.pool.key_of(page)
                    if key is not None and key not in tier:
                        tier.put(key, self.cache.tensor[:, page])
        finally:
            super().release(table)

    def detach_tier(self) -> None:
        """No second tier any more (before it is closed): evictions drop pages, admissions
        find nothing there."""
        self.tier = None
        self.pool.on_evict = None

    def observe_prefill(self, seconds: float, prefill_tokens: int, rows: int) -> None:
        """A step's forward time: with a page or more of prefill in it, it updates what
        recomputing a token costs (a moving average), which a tier read must beat."""
        if prefill_tokens < self.page_size:
            return
        per_token, old = seconds / max(1, rows), self.prefill_seconds_per_token
        self.prefill_seconds_per_token = per_token if old is None else 0.8 * old + 0.2 * per_token

    def tier_prefix(self, keys: list[bytes]) -> int:
        """How many leading ``keys`` the tier holds, when reading is cheaper than recomputing
        (0 otherwise, or without a tier)."""
        tier = self.tier
        per_page = (None if self.prefill_seconds_per_token is None
                    else self.prefill_seconds_per_token * self.page_size)
        if tier is None or not tier.worth_it(per_page):
            return 0
        n = 0
        while n < len(keys) and keys[n] in tier:
            n += 1
        return n

    def load_from_tier(self, table: BlockTable, keys: list[bytes]) -> int:
        """Append pages holding ``keys`` to a table whose slots are all computed, read from the
        tier; stops at the first page the tier cannot serve (missing, torn). Returns how many."""
        assert table.num_slots == len(table.pages) * self.page_size, "table must end on a page"
        pages = self.pool.allocate(len(keys))
        got = 0
        for page, key in zip(pages, keys):
            if not self.tier.get(key, self.cache.tensor[:, page]):
                break
            got += 1
        self.pool.free(reversed(pages[got:]))
        for page, key in zip(pages[:got], keys):
            self.pool.register(page, key)
        table.pages += pages[:got]
        table.num_slots = len(table.pages) * self.page_size
        table.num_keyed = len(table.pages)
        return got

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
