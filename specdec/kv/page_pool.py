"""A pool of KV-cache pages: reference counts, a free list, and content-addressed cached pages.

Pages are plain ints ``0 .. num_pages-1`` indexing dim 0 of each layer's KV tensor
``[num_pages, 2, page_size, num_kv_heads, head_dim]``. Every page is in exactly one state:

    in use      refcount >= 1 (mapped by that many block tables); may carry a content key
    evictable   refcount 0, carries a key: its KV is kept for a later request with the same
                prefix, until the pool needs the page (least recently released first)
    free        refcount 0, no key

``num_free`` counts free + evictable pages: both can be allocated. ``register(page, key)`` names
an in-use page's content (``specdec.kv.prefix``: a hash of everything before and in it);
``lookup`` finds the pages of the longest run of keys, ``take`` maps them (refcount up, out of
the evictable set). Pages of running requests are never evicted: only refcount-0 pages are.

Example::

    pool = PagePool(4)
    a = pool.allocate(2)        # [0, 1], refcounts 1
    pool.register(a[0], b"k0")  # page 0 holds the content named k0
    pool.free(a)                # page 0 -> evictable, page 1 -> free; num_free 4
    pool.lookup([b"k0", b"k1"]) # [0]
    pool.take([0])              # page 0 in use again (refcount 1), its KV reused

Every operation costs O(pages touched). ``on_evict(page, key)``, if set, is called before an
evictable page is handed out for new content (a slower tier may copy it first); if it raises,
the allocation changes nothing.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable


class OutOfPagesError(RuntimeError):
    """Not enough free pages; raised before any state changes."""


class PagePool:
    """Refcounts, a free stack (recently freed pages are reused first) and an LRU of evictable
    cached pages."""

    def __init__(self, num_pages: int) -> None:
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be an int >= 1, got {num_pages!r}")
        self.num_pages = num_pages
        # Reversed so that a fresh pool hands out 0, 1, 2, ... in order.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._refcount: list[int] = [0] * num_pages
        self._key_of: dict[int, bytes] = {}  # page -> content key (in use or evictable)
        self._page_of: dict[bytes, int] = {}  # content key -> page
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self.on_evict: Callable[[int, bytes], None] | None = None
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        """Pages ``allocate`` can hand out: truly free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Pages that carry a content key (in use or evictable)."""
        return len(self._key_of)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` pages (refcount 1 each), all or nothing: free ones first, then the least
        recently released evictable ones (their keys are dropped)."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"number of pages to allocate must be an int >= 0, got {n!r}")
        if n > self.num_free:
            raise OutOfPagesError(
                f"asked for {n} pages but only {self.num_free} of {self.num_pages} are free"
            )
        if n == 0:
            return []
        k = min(n, len(self._free))
        # on_evict (a tier's write) may raise: nothing has changed then (all or nothing), so
        # the pages of an allocation that failed are never lost
        victims = list(itertools.islice(self._evictable, n - k))
        if self.on_evict is not None:
            for page in victims:
                self.on_evict(page, self._key_of[page])
        pages = self._free[len(self._free) - k:]
        del self._free[len(self._free) - k:]
        pages.reverse()  # pop order: the top of the stack comes first
        for page in victims:
            del self._evictable[page]
            del self._page_of[self._key_of.pop(page)]
            self.num_evicted += 1
            pages.append(page)
        for p in pages:
            assert self._refcount[p] == 0, f"page {p} handed out with refcount {self._refcount[p]}"
            self._refcount[p] = 1
        return pages

    def incref(self, page: int) -> None:
        """Add a reference to an allocated page (e.g. when a block table is forked)."""
        self._check_page(page)
        if self._refcount[page] == 0:
            raise ValueError(f"cannot incref page {page}: it is free")
        self._refcount[page] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference per listed page; a page reaching 0 becomes evictable if it carries
        a key (in the order listed: the first listed is evicted first), else free.

        A page may be listed several times (one decref each). Checked first, applied after:
        on ``ValueError("double free of page N")`` nothing has changed.
        """
        pages = list(pages)
        counts = Counter(pages)
        for p, c in counts.items():
            self._check_page(p)
            if c > self._refcount[p]:
                raise ValueError(f"double free of page {p}")
        for p in pages:
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                if p in self._key_of:
                    self._evictable[p] = None
                else:
                    self._free.append(p)

    def refcount(self, page: int) -> int:
        self._check_page(page)
        return self._refcount[page]

    # ---- content keys ------------------------------------------------------------------------

    def register(self, page: int, key: bytes) -> bool:
        """Name an in-use page's content ``key``; False (nothing changes) when another page in
        use already holds that content or this page already has a key. An evictable page
        holding it gives the key up (and becomes free): the copy in use is the one that cannot
        be evicted."""
        self._check_page(page)
        if self._refcount[page] == 0:
            raise ValueError(f"cannot register page {page}: it is not in use")
        if page in self._key_of:
            return False
        other = self._page_of.get(key)
        if other is not None:
            if self._refcount[other] > 0:
                return False
            self.drop_key(other)
        self._key_of[page] = key
        self._page_of[key] = page
        return True

    def key_of(self, page: int) -> bytes | None:
        return self._key_of.get(page)

    def lookup(self, keys: Iterable[bytes]) -> list[int]:
        """Pages holding the longest leading run of ``keys`` (changes nothing)."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def take(self, pages: Iterable[int]) -> None:
        """Map cached pages into one more table: refcount up (an evictable one is in use
        again)."""
        pages = list(pages)
        for p in pages:
            self._check_page(p)
            if p not in self._key_of:
                raise ValueError(f"cannot take page {p}: it holds no cached content")
        for p in pages:
            if self._refcount[p] == 0:
                del self._evictable[p]
            self._refcount[p] += 1

    def drop_key(self, page: int) -> None:
        """Forget a page's content key (it will be overwritten); an evictable page becomes
        free."""
        key = self._key_of.pop(page, None)
        if key is None:
            return
        del self._page_of[key]
        if page in self._evictable:
            del self._evictable[page]
            self._free.append(page)

    def _check_page(self, page: int) -> None:
        if not isinstance(page, int) or not 0 <= page < self.num_pages:
            raise ValueError(f"page must be an int in [0, {self.num_pages}), got {page!r}")
