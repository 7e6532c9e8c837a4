"""Page pool and KV cache manager: unit tests plus a hypothesis state machine against a model."""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from specdec.kv.block_table import BlockTable, TableAllocator
from specdec.kv.page_pool import OutOfPagesError, PagePool

# ---------------------------------------------------------------- unit tests


def test_pool_rejects_bad_size():
    with pytest.raises(ValueError, match="num_pages"):
        PagePool(0)


def test_allocate_all_or_nothing():
    pool = PagePool(4)
    a = pool.allocate(3)
    assert sorted(a) == [0, 1, 2] and pool.num_free == 1
    with pytest.raises(OutOfPagesError, match="asked for 2 pages but only 1"):
        pool.allocate(2)
    assert pool.num_free == 1 and [pool.refcount(p) for p in range(4)] == [1, 1, 1, 0]
    assert pool.allocate(0) == []
    assert pool.allocate(1) == [3]


def test_allocate_changes_nothing_when_on_evict_raises():
    """A tier's write that fails (a closed or broken tier) fails the allocation, all or
    nothing: no page is lost, the cached pages keep their keys and their LRU order."""
    pool = PagePool(4)
    pages = pool.allocate(3)
    for p, key in zip(pages, (b"k0", b"k1", b"k2")):
        pool.register(p, key)
    pool.free(pages)  # 0, 1, 2 evictable (oldest first), 3 free
    before = (list(pool._free), list(pool._evictable), dict(pool._key_of), pool.num_evicted)
    seen = []

    def failing(page, key):
        seen.append((page, key))
        if len(seen) == 2:
            raise OSError("tier write failed")

    pool.on_evict = failing
    with pytest.raises(OSError, match="tier write failed"):
        pool.allocate(3)  # the free page, then two evictions: the second one fails
    assert seen == [(0, b"k0"), (1, b"k1")]
    after = (list(pool._free), list(pool._evictable), dict(pool._key_of), pool.num_evicted)
    assert after == before and pool.num_free == 4
    assert pool.lookup([b"k0", b"k1", b"k2"]) == [0, 1, 2]
    pool.on_evict = None
    assert sorted(pool.allocate(4)) == [0, 1, 2, 3] and pool.num_cached == 0


def test_refcount_and_free():
    pool = PagePool(3)
    (p,) = pool.allocate(1)
    pool.incref(p)
    assert pool.refcount(p) == 2
    pool.free([p])
    assert pool.refcount(p) == 1 and pool.num_free == 2
    pool.free([p])
    assert pool.refcount(p) == 0 and pool.num_free == 3


def test_double_free_is_value_error_and_changes_nothing():
    pool = PagePool(3)
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(ValueError, match=f"double free of page {a}"):
        pool.free([a])
    with pytest.raises(ValueError, match=f"double free of page {b}"):
        pool.free([b, b])
    assert pool.refcount(b) == 1 and pool.num_free == 2
    with pytest.raises(ValueError, match="is free"):
        pool.incref(a)
    with pytest.raises(ValueError, match="page must be"):
        pool.free([7])


def test_slot_ids_hand_built():
    mgr = TableAllocator(PagePool(10), page_size=4)
    table = BlockTable(pages=[7, 2], num_slots=6)
    assert mgr.slot_ids(table, 0, 6).tolist() == [28, 29, 30, 31, 8, 9]
    assert mgr.slot_ids(table, 2, 6).tolist() == [30, 31, 8, 9]
    assert mgr.slot_ids(table, 3, 3).tolist() == []
    out = mgr.slot_ids(table, 5, 8)
    assert out.dtype == torch.int64 and out.tolist() == [9, 10, 11]
    with pytest.raises(AssertionError):
        mgr.slot_ids(table, 0, 9)


@pytest.mark.parametrize("start,end", [(0, 300), (5, 200), (17, 18), (63, 64), (100, 400)])
def test_slot_ids_long_path_matches_reference(start, end):
    mgr = TableAllocator(PagePool(200), page_size=16)
    table = BlockTable(pages=list(range(199, 199 - 25, -1)), num_slots=400)
    ref = [table.pages[i // 16] * 16 + i % 16 for i in range(start, end)]
    assert mgr.slot_ids(table, start, end).tolist() == ref


def test_reserve_truncate_release():
    mgr = TableAllocator(PagePool(5), page_size=4)
    t = BlockTable(pages=[])
    mgr.reserve(t, 5)
    assert len(t.pages) == 2 and t.num_slots == 5
    mgr.reserve(t, 3)  # smaller: no-op
    assert len(t.pages) == 2 and t.num_slots == 5
    with pytest.raises(OutOfPagesError):
        mgr.reserve(t, 100)
    assert len(t.pages) == 2 and t.num_slots == 5 and mgr.pool.num_free == 3
    mgr.truncate(t, 4)
    assert len(t.pages) == 1 and t.num_slots == 4 and mgr.pool.num_free == 4
    with pytest.raises(ValueError, match="cannot grow"):
        mgr.truncate(t, 5)
    mgr.release(t)
    mgr.release(t)
    assert t.pages == [] and t.num_slots == 0 and mgr.pool.num_free == 5


def test_fork_and_make_writable():
    mgr = TableAllocator(PagePool(8), page_size=4)
    a = BlockTable(pages=[])
    mgr.reserve(a, 10)  # 3 pages
    b = mgr.fork(a)
    assert b.pages == a.pages and all(mgr.pool.refcount(p) == 2 for p in a.pages)
    pairs = mgr.make_writable(b, 5)  # slots 5.. live in pages 1 and 2
    assert [src for src, _ in pairs] == a.pages[1:]
    assert b.pages[0] == a.pages[0] and b.pages[1:] == [dst for _, dst in pairs]
    assert [mgr.pool.refcount(p) for p in a.pages] == [2, 1, 1]
    assert mgr.make_writable(b, 5) == []  # already private
    mgr.release(a)
    mgr.release(b)
    assert mgr.pool.num_free == 8


def test_make_writable_is_atomic_when_out_of_pages():
    mgr = TableAllocator(PagePool(4), page_size=2)
    a = BlockTable(pages=[])
    mgr.reserve(a, 6)
    b = mgr.fork(a)
    with pytest.raises(OutOfPagesError):
        mgr.make_writable(b, 0)  # needs 3 fresh pages, 1 free
    assert b.pages == a.pages and all(mgr.pool.refcount(p) == 2 for p in a.pages)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheMachine(RuleBasedStateMachine):
    """Random workloads (new, append, truncate, fork, copy-on-write, finish, preempt).

    The model is ``self.slots`` (name -> reserved slots) and ``self.expect_pages``
    (name -> the page list we predict, filled in from fresh allocations).
    """

    @initialize(num_pages=st.integers(1, 12), page_size=st.integers(1, 4))
    def setup(self, num_pages, page_size):
        self.mgr = TableAllocator(PagePool(num_pages), page_size)
        self.tables: dict[int, BlockTable] = {}
        self.slots: dict[int, int] = {}
        self.expect_pages: dict[int, list[int]] = {}
        self.next_name = 0

    # -- helpers

    def _snapshot(self):
        pool = self.mgr.pool
        return (pool.num_free, [pool.refcount(p) for p in range(pool.num_pages)],
                {n: (list(t.pages), t.num_slots) for n, t in self.tables.items()})

    def _pick(self, data) -> int:
        return data.draw(st.sampled_from(sorted(self.tables)))

    def _grow(self, name: int, num_slots: int) -> None:
        """Reserve and check against the model, including the OutOfPagesError path."""
        t, ps = self.tables[name], self.mgr.page_size
        before, free_before = self._snapshot(), set(self._free_pages())
        need = max(0, _ceil_div(num_slots, ps) - len(t.pages))
        assert self.mgr.pages_needed(t, num_slots) == need
        assert self.mgr.can_reserve(t, num_slots) == (need <= before[0])
        if need > before[0]:
            with pytest.raises(OutOfPagesError):
                self.mgr.reserve(t, num_slots)
            assert self._snapshot() == before
            return
        self.mgr.reserve(t, num_slots)
        old = self.expect_pages[name]
        assert t.pages[:len(old)] == old
        assert set(t.pages[len(old):]) <= free_before and len(t.pages) == len(old) + need
        self.expect_pages[name] = list(t.pages)
        self.slots[name] = max(self.slots[name], num_slots)

    def _free_pages(self) -> list[int]:
        pool = self.mgr.pool
        return [p for p in range(pool.num_pages) if pool.refcount(p) == 0]

    def _drop(self, name: int) -> None:
        self.mgr.release(self.tables[name])
        self.slots[name] = 0
        self.expect_pages[name] = []

    # -- rules

    @rule(size=st.integers(0, 20))
    def new_sequence(self, size):
        name = self.next_name
        self.next_name += 1
        self.tables[name] = BlockTable(pages=[])
        self.slots[name] = 0
        self.expect_pages[name] = []
        self._grow(name, size)

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), k=st.integers(0, 6))
    def append(self, data, k):
        name = self._pick(data)
        self._grow(name, self.slots[name] + k)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def truncate(self, data):
        name = self._pick(data)
        n = data.draw(st.integers(0, self.slots[name]))
        self.mgr.truncate(self.tables[name], n)
        self.slots[name] = n
        self.expect_pages[name] = self.expect_pages[name][:_ceil_div(n, self.mgr.page_size)]

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork(self, data):
        src = self._pick(data)
        name = self.next_name
        self.next_name += 1
        self.tables[name] = self.mgr.fork(self.tables[src])
        self.slots[name] = self.slots[src]
        self.expect_pages[name] = list(self.expect_pages[src])

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def make_writable(self, data):
        name = self._pick(data)
        t, pool = self.tables[name], self.mgr.pool
        start = data.draw(st.integers(0, self.slots[name] + 2))
        first = start // self.mgr.page_size
        shared = [p for p in t.pages[first:] if pool.refcount(p) > 1]
        before, free_before = self._snapshot(), set(self._free_pages())
        if len(shared) > before[0]:
            with pytest.raises(OutOfPagesError):
                self.mgr.make_writable(t, start)
            assert self._snapshot() == before
            return
        pairs = self.mgr.make_writable(t, start)
        assert [src for src, _ in pairs] == shared
        assert {dst for _, dst in pairs} <= free_before
        for src, _ in pairs:
            assert pool.refcount(src) == before[1][src] - 1
        assert t.pages[:first] == self.expect_pages[name][:first]
        assert all(pool.refcount(p) == 1 for p in t.pages[first:])
        self.expect_pages[name] = list(t.pages)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def finish(self, data):
        """Finish or abort: release and forget the table."""
        name = self._pick(data)
        self._drop(name)
        del self.tables[name], self.slots[name], self.expect_pages[name]

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def preempt(self, data):
        """Preemption: release, but the sequence stays around to be re-reserved later."""
        self._drop(self._pick(data))

    # -- invariants

    @invariant()
    def tables_match_model(self):
        if not hasattr(self, "mgr"):
            return
        ps = self.mgr.page_size
        for name, t in self.tables.items():
            assert t.num_slots == self.slots[name]
            assert t.pages == self.expect_pages[name]
            assert len(t.pages) == _ceil_div(t.num_slots, ps)  # no over-allocation
            cap = self.mgr.capacity(t)
            assert cap >= t.num_slots and (cap < t.num_slots + ps or t.num_slots == 0 == cap)

    @invariant()
    def refcounts_match_references(self):
        if not hasattr(self, "mgr"):
            return
        pool = self.mgr.pool
        refs = Counter(p for t in self.tables.values() for p in t.pages)
        assert sum(pool.refcount(p) for p in range(pool.num_pages)) == sum(refs.values())
        for p in range(pool.num_pages):
            assert pool.refcount(p) == refs[p]
        free = set(self._free_pages())
        # The real free list (private, checked here on purpose): no duplicates, refcount 0.
        assert sorted(pool._free) == sorted(free)
        assert not free & refs.keys()
        assert pool.num_free + len(refs) == pool.num_pages

    def teardown(self):
        if not hasattr(self, "mgr"):
            return
        for name in list(self.tables):
            self._drop(name)
        assert self.mgr.pool.num_free == self.mgr.pool.num_pages


KVCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_kv_cache_machine = KVCacheMachine.TestCase
