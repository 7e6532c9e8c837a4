"""Block tables (one sequence's pages) and the ``TableAllocator`` that grows, shrinks and
forks them over a page pool (the pages of a ``KVManager``, which adds the KV tensor).

Slot ``i`` of a sequence lives in page ``pages[i // page_size]`` at offset ``i % page_size``;
its flat slot id (row of the KV tensor viewed as ``[num_pages * page_size, ...]``) is
``pages[i // page_size] * page_size + i % page_size``.

Example (page_size 4)::

    table.pages = [7, 2], table.num_slots = 6       # capacity 8, slots 0..5 reserved
    slot 0..3 -> page 7 -> ids 28 29 30 31
    slot 4..5 -> page 2 -> ids  8  9

A table never holds more pages than it needs: ``len(pages) == ceil(num_slots / page_size)``.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field

import torch

from specdec.kv.page_pool import OutOfPagesError, PagePool


def slot_of(pages: list[int], i: int, page_size: int) -> int:
    """Flat slot id of a sequence's slot i (see the module docstring)."""
    return pages[i // page_size] * page_size + i % page_size

# Below this many slots a list comprehension beats torch ops (measured on CPU, page_size 16:
# 2.5 us vs 8 us at 4 slots, 8 us each at 64, 25 us vs 9 us at 256).
_PY_SLOT_IDS_MAX = 64


@dataclass
class BlockTable:
    """One sequence's pages, in slot order."""

    pages: list[int] = field(default_factory=list)
    num_slots: int = 0  # KV slots reserved: valid KV plus slots reserved for draft nodes
    num_keyed: int = 0  # leading pages whose content key is registered (prefix caching)


class TableAllocator:
    """Allocates pages from a ``PagePool`` to block tables; never over-allocates or leaks.
    Pages only, no KV tensor: ``specdec.kv.manager.KVManager`` adds it."""

    def __init__(self, pool: PagePool, page_size: int) -> None:
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        self.pool = pool
        self.page_size = page_size

    def capacity(self, table: BlockTable) -> int:
        """Slots the table's pages can hold: ``len(pages) * page_size``."""
        return len(table.pages) * self.page_size

    def pages_needed(self, table: BlockTable, num_slots: int) -> int:
        """Extra pages needed so the table holds ``num_slots`` slots in total (0 if enough)."""
        _check_slots(num_slots)
        return max(0, -(-num_slots // self.page_size) - len(table.pages))

    @property
    def num_free_pages(self) -> int:
        """Pages a reservation can take: free plus evictable cached ones (``PagePool``)."""
        return self.pool.num_free

    def can_reserve(self, table: BlockTable, num_slots: int) -> bool:
        return self.pages_needed(table, num_slots) <= self.pool.num_free

    def reserve(self, table: BlockTable, num_slots: int) -> None:
        """Grow the table to hold ``num_slots`` in total; smaller is a no-op.

        Atomic: on ``OutOfPagesError`` the table and the pool are unchanged.
        """
        table.pages.extend(self.pool.allocate(self.pages_needed(table, num_slots)))
        table.num_slots = max(table.num_slots, num_slots)

    def truncate(self, table: BlockTable, num_slots: int) -> None:
        """Shrink the table to ``num_slots`` slots, dropping pages it no longer needs. A kept
        page that is registered keeps its key: never rewrite slots below ``num_keyed`` pages
        (the engine only ever cuts back draft slots, above everything registered)."""
        _check_slots(num_slots)
        if num_slots > table.num_slots:
            raise ValueError(
                f"truncate cannot grow a table: {num_slots} > {table.num_slots} reserved slots"
            )
        keep = -(-num_slots // self.page_size)
        self.pool.free(reversed(table.pages[keep:]))
        del table.pages[keep:]
        table.num_slots = num_slots
        table.num_keyed = min(table.num_keyed, keep)

    def release(self, table: BlockTable) -> None:
        """Return all the table's pages, the last first (cached ones stay evictable, the tail
        of a sequence is evicted before its head); the table becomes empty. Idempotent."""
        self.pool.free(reversed(table.pages))
        table.pages.clear()
        table.num_slots = 0
        table.num_keyed = 0

    # ---- prefix caching ------------------------------------------------------------------------

    def cached_prefix(self, keys: list[bytes]) -> list[int]:
        """Pages holding the longest leading run of ``keys`` (``specdec.kv.prefix``)."""
        return self.pool.lookup(keys)

    def tier_prefix(self, keys: list[bytes]) -> int:
        """Leading ``keys`` a second tier could bring back (none here; ``KVManager`` has one)."""
        return 0

    def adopt(self, table: BlockTable, pages: list[int]) -> None:
        """Start an empty table with cached pages (their KV is reused, not computed)."""
        if table.pages:
            raise ValueError(f"adopt needs an empty table, this one has {len(table.pages)} pages")
        self.pool.take(pages)
        table.pages = list(pages)
        table.num_slots = len(pages) * self.page_size
        table.num_keyed = len(pages)

    def register_full(self, table: BlockTable, keys: SequenceABC, num_final_slots: int) -> None:
        """Name the content of the table's full pages below ``num_final_slots`` (slots whose KV
        will never be written again) by ``keys[p]``, so that later requests can reuse them."""
        last = min(num_final_slots // self.page_size, len(keys), len(table.pages))
        for p in range(table.num_keyed, last):
            self.pool.register(table.pages[p], keys[p])
        table.num_keyed = max(table.num_keyed, last)

    def fork(self, table: BlockTable) -> BlockTable:
        """A new table sharing all of ``table``'s pages (copy-on-write via ``make_writable``)."""
        for p in table.pages:
            self.pool.incref(p)
        return BlockTable(pages=list(table.pages), num_slots=table.num_slots,
                          num_keyed=table.num_keyed)

    def make_writable(self, table: BlockTable, start_slot: int) -> list[tuple[int, int]]:
        """Copy-on-write: give the table private copies of shared pages holding slots >= start_slot.

        Returns ``(src_page, dst_page)`` pairs; the caller must copy ``kv[src] -> kv[dst]`` in
        every layer before writing. Atomic: on ``OutOfPagesError`` nothing changes.

        Example (page_size 4): pages [5, 6, 7], page 6 and 7 shared, start_slot 5 ->
        pages become [5, a, b] and the result is [(6, a), (7, b)].
        """
        _check_slots(start_slot)
        first = start_slot // self.page_size
        shared = [i for i in range(first, len(table.pages))
                  if self.pool.refcount(table.pages[i]) > 1]
        fresh = self.pool.allocate(len(shared))
        pairs = []
        for i, dst in zip(shared, fresh):
            pairs.append((table.pages[i], dst))
            table.pages[i] = dst
        self.pool.free(src for src, _ in pairs)
        if shared:
            table.num_keyed = min(table.num_keyed, shared[0])
        return pairs

    def slot_ids(self, table: BlockTable, start: int, end: int) -> torch.Tensor:
        """Flat slot ids of slots ``start .. end-1``: [end-start] int64.

        Example (page_size 4, pages [7, 2]): slot_ids(table, 2, 6) -> [30, 31, 8, 9].
        """
        ps = self.page_size
        assert 0 <= start <= end <= len(table.pages) * ps, (
            f"slots [{start}, {end}) outside capacity {len(table.pages) * ps}")
        pages = table.pages
        if end - start <= _PY_SLOT_IDS_MAX:
            return torch.tensor([slot_of(pages, i, ps) for i in range(start, end)],
                                dtype=torch.int64)
        first, last = start // ps, (end - 1) // ps + 1
        base = torch.tensor(pages[first:last], dtype=torch.int64) * ps
        flat = (base[:, None] + torch.arange(ps, dtype=torch.int64)).view(-1)
        return flat[start - first * ps:end - first * ps]


def _check_slots(n: int) -> None:
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"number of slots must be an int >= 0, got {n!r}")


__all__ = ["BlockTable", "TableAllocator", "OutOfPagesError"]
