"""A pool of KV-cache pages: a free list plus a reference count per page.

Pages are plain ints ``0 .. num_pages-1`` indexing dim 0 of each layer's KV tensor
``[num_pages, 2, page_size, num_kv_heads, head_dim]``. A page is free exactly when its
refcount is 0; forked sequences share pages by raising the count.

Example::

    pool = PagePool(4)
    a = pool.allocate(2)        # [0, 1], refcounts 1
    pool.incref(a[0])           # page 0 shared by two block tables
    pool.free(a)                # page 0 -> refcount 1, page 1 -> back on the free list
    pool.num_free               # 3

Every operation costs O(pages touched).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


class OutOfPagesError(RuntimeError):
    """Not enough free pages; raised before any state changes."""


class PagePool:
    """Free list (a stack, so recently freed pages are reused first) and refcounts."""

    def __init__(self, num_pages: int) -> None:
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be an int >= 1, got {num_pages!r}")
        self.num_pages = num_pages
        # Reversed so that a fresh pool hands out 0, 1, 2, ... in order.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._refcount: list[int] = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free pages (refcount 1 each), all or nothing."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"number of pages to allocate must be an int >= 0, got {n!r}")
        if n > len(self._free):
            raise OutOfPagesError(
                f"asked for {n} pages but only {len(self._free)} of {self.num_pages} are free"
            )
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        pages.reverse()  # pop order: the top of the stack comes first
        for p in pages:
            assert self._refcount[p] == 0, f"page {p} on the free list has refcount {self._refcount[p]}"
            self._refcount[p] = 1
        return pages

    def incref(self, page: int) -> None:
        """Add a reference to an allocated page (e.g. when a block table is forked)."""
        self._check_page(page)
        if self._refcount[page] == 0:
            raise ValueError(f"cannot incref page {page}: it is free")
        self._refcount[page] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference per listed page; a page reaching 0 goes back on the free list.

        A page may be listed several times (one decref each). Checked first, applied after:
        on ``ValueError("double free of page N")`` nothing has changed.
        """
        counts = Counter(pages)
        for p, c in counts.items():
            self._check_page(p)
            if c > self._refcount[p]:
                raise ValueError(f"double free of page {p}")
        for p, c in counts.items():
            self._refcount[p] -= c
            if self._refcount[p] == 0:
                self._free.append(p)

    def refcount(self, page: int) -> int:
        self._check_page(page)
        return self._refcount[page]

    def _check_page(self, page: int) -> None:
        if not isinstance(page, int) or not 0 <= page < self.num_pages:
            raise ValueError(f"page must be an int in [0, {self.num_pages}), got {page!r}")
