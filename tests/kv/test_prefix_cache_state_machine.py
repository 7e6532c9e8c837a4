"""Prefix caching over the page pool: a hypothesis state machine of requests against a model of
what every page holds.

Requests draw their tokens from a 3-token vocabulary so prefixes collide often. The model keeps,
for every page, what each of its slots holds: the KV of slot i depends on tokens 0..i, so a slot
holds the tuple of tokens 0..i of the request that wrote it (a draft node's slot holds a marker).
Copy-on-write copies that list (``make_writable``'s pairs); nothing else changes it, so a page the
pool hands out again, or a cached page whose key lies about its content, shows up as a running
request reading the wrong KV or a key naming other tokens.

Rules follow the engine and the scheduler (``Scheduler._reuse_prefix``, ``CommitStage._register``):
admit (look up the capped keys, adopt the hit if the rest fits, a drafter restoring fewer pages,
reserve, compute the rest, register full pages), decode with a draft tree (reserve draft slots,
write drafts, keep the accepted ones, truncate), fork + copy-on-write, truncate (dropping draft
slots, or rolling back computed tokens), preempt and re-admit, finish, forgetting a key, and
memory pressure so cached pages get evicted.

Invariants after every rule: each page is exactly one of in use / evictable / free; refcounts
equal the number of live tables mapping the page; every running request's computed slots hold
its own tokens; every key names exactly the content of its page; the evictable pages are the ones
the model expects, in release order (a table's tail first), and eviction takes the oldest; a
preempted request re-admitted with nothing evicted meanwhile finds its cached pages; teardown
frees every page.

Not checked: that a full computed page stays named while in use. ``register_full`` counts a page
whose ``register`` failed (an equal page in use already holds the key) as keyed, so once that
other page is released and evicted the content is not cached although a running request still
holds it (a lost hit, never a wrong one). An equal page that is only evictable gives its key to
the page in use (checked).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import hypothesis.strategies as st
import pytest
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
from specdec.kv.prefix import extend_keys, root_key

VOCAB = 3
tokens_st = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)

# A request that rolls back computed tokens to the middle of a page and then writes other tokens
# there overwrites that page in place; if the page carries a content key (registered when it was
# full), the key would then name content the page no longer holds. ``truncate`` keeps the key
# (``num_keyed = min(num_keyed, ceil(n / page_size))``), so the caller must forget it first
# (``PagePool.drop_key``: "it will be overwritten", and lower the table's ``num_keyed`` so the
# page is named again once full). The engine never rolls back below ``num_computed``; this
# machine does, and follows that contract (False: the machine finds the stale key).
DROP_KEY_BEFORE_REWRITE = True


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Request:
    tokens: list[int]
    table: BlockTable = field(default_factory=BlockTable)
    computed: int = 0  # slots 0..computed-1 hold the KV of tokens 0..i (all tokens, when running)
    running: bool = False
    # set at preemption: (hits its capped keys had, pool.num_evicted, drops) at that moment
    preempted_at: tuple[int, int, int] | None = None


class PrefixCacheMachine(RuleBasedStateMachine):
    @initialize(num_pages=st.integers(6, 12), page_size=st.integers(2, 4))
    def setup(self, num_pages, page_size):
        self.pool = PagePool(num_pages)
        self.kv = TableAllocator(self.pool, page_size)
        self.ps = page_size
        self.root = root_key("test-model")
        self.content: dict[int, list] = {p: [None] * page_size for p in range(num_pages)}
        self.key_tokens: dict[bytes, tuple[int, ...]] = {}  # every key computed -> its tokens
        self.reqs: dict[int, Request] = {}
        self.history: list[tuple[int, ...]] = []  # tokens of every request so far
        self.next_name = 0
        self.drops = 0  # keys dropped (a cached page lost without eviction)
        self.lru: list[int] = []  # the evictable pages we expect, least recently released first
        self.pool.on_evict = self._on_evict

    # ---------------------------------------------------------------- helpers

    def _live_pages(self) -> Counter:
        return Counter(p for r in self.reqs.values() for p in r.table.pages)

    def _snapshot(self):
        pool = self.pool
        return ([pool.refcount(p) for p in range(pool.num_pages)], pool.num_free,
                {n: (list(r.table.pages), r.table.num_slots, r.table.num_keyed)
                 for n, r in self.reqs.items()},
                dict(pool._key_of), list(pool._free), list(pool._evictable))

    def _on_evict(self, page: int, key: bytes) -> None:
        """A cached page handed out for new content: the least recently released one, nobody
        maps it, and it held its key's content until now."""
        assert self.pool.refcount(page) == 0
        assert page not in self._live_pages(), f"evicted page {page} is mapped by a request"
        assert self.lru and self.lru[0] == page, f"evicted {page}, expected the oldest {self.lru}"
        self.lru.pop(0)
        self._check_key_content(page, key)

    def _freeing(self, op, order: list[int]) -> None:
        """Run ``op``, which drops one reference per page of ``order`` in that order (the tail
        of a sequence first): pages reaching 0 with a key join the LRU in that order."""
        refs = {p: self.pool.refcount(p) for p in order}
        op()
        for p in order:
            refs[p] -= 1
            if refs[p] == 0 and self.pool.key_of(p) is not None:
                self.lru.append(p)

    def _release(self, table: BlockTable) -> None:
        self._freeing(lambda: self.kv.release(table), table.pages[::-1])

    def _truncate(self, table: BlockTable, n: int) -> None:
        keep = _ceil_div(n, self.ps)
        self._freeing(lambda: self.kv.truncate(table, n), table.pages[keep:][::-1])

    def _drop_key(self, page: int) -> None:
        self.pool.drop_key(page)
        self.drops += 1
        if page in self.lru:
            self.lru.remove(page)

    def _keys(self, tokens: list[int]) -> list[bytes]:
        """Keys of every full page of ``tokens``, remembered with the tokens they name."""
        keys = extend_keys([], tokens, self.ps, self.root)
        for j, k in enumerate(keys):
            named = tuple(tokens[:(j + 1) * self.ps])
            assert self.key_tokens.setdefault(k, named) == named, "key collision"
        return keys

    def _expected(self, tokens, page_index: int) -> list[tuple[int, ...]]:
        """What a page at ``page_index`` holds once full with ``tokens``'s KV."""
        start = page_index * self.ps
        return [tuple(tokens[:start + o + 1]) for o in range(self.ps)]

    def _check_key_content(self, page: int, key: bytes) -> None:
        assert key in self.key_tokens, f"page {page} carries a key nobody computed"
        named = self.key_tokens[key]
        assert len(named) % self.ps == 0
        assert self.content[page] == self._expected(named, len(named) // self.ps - 1), (
            f"page {page}'s key names tokens {named} but it holds {self.content[page]}")

    def _pick(self, data, running: bool) -> int:
        names = sorted(n for n, r in self.reqs.items() if r.running == running)
        return data.draw(st.sampled_from(names))

    def _has(self, running: bool) -> bool:
        return any(r.running == running for r in self.reqs.values())

    def _write(self, req: Request, start: int, values: list) -> bool:
        """Write slots start.. (copy-on-write first, like ``KVManager.copy_on_write``); False
        (nothing changed) when copy-on-write is out of pages."""
        table, pool, ps = req.table, self.pool, self.ps
        assert start + len(values) <= table.num_slots
        first = start // ps
        shared = [p for p in table.pages[first:] if pool.refcount(p) > 1]
        before = self._snapshot()
        if len(shared) > pool.num_free:
            with pytest.raises(OutOfPagesError):
                self.kv.make_writable(table, start)
            assert self._snapshot() == before
            return False
        free_before = {p for p in range(pool.num_pages) if pool.refcount(p) == 0}
        pairs = self.kv.make_writable(table, start)
        assert [src for src, _ in pairs] == shared
        for src, dst in pairs:
            assert dst in free_before and pool.refcount(dst) == 1 and pool.key_of(dst) is None
            self.content[dst] = list(self.content[src])
        if pairs:  # a copy holds no key yet: it must be named again once full
            assert table.num_keyed <= table.pages.index(pairs[0][1])
        if values and start % ps and DROP_KEY_BEFORE_REWRITE:
            page = table.pages[first]  # private now: rewriting it must not keep its key
            if pool.key_of(page) is not None:
                self._drop_key(page)
                table.num_keyed = min(table.num_keyed, first)  # so that it is named again
        for i, v in enumerate(values, start):
            page = table.pages[i // ps]
            assert pool.refcount(page) == 1, f"writing into shared page {page}"
            self.content[page][i % ps] = v
        return True

    def _compute(self, req: Request, end: int, bonus: list[int] = ()) -> None:
        """Compute tokens computed..end-1 (their slots are reserved) and register full pages;
        ``bonus``: tokens emitted after them, with no KV yet."""
        tokens = req.tokens
        values = [tuple(tokens[:i + 1]) for i in range(req.computed, end)]
        assert self._write(req, req.computed, values) or not values
        req.computed = end
        self._register(req, bonus)

    def _register(self, req: Request, bonus: list[int] = ()) -> None:
        """Name the full computed pages, given keys of every full page of the tokens so far
        (the bonus tokens' pages too: register_full must stop at the computed slots)."""
        if req.computed >= self.ps:
            self.history.append(tuple(req.tokens))
        keys = self._keys(req.tokens + list(bonus))
        keyed, final = req.table.num_keyed, req.computed // self.ps
        holders = {j: self.pool._page_of.get(keys[j]) for j in range(keyed, min(final, len(keys)))}
        self.kv.register_full(req.table, keys, req.computed)
        for j, other in holders.items():  # an evictable equal page gives its key up: free now
            if other is not None and self.pool.key_of(other) is None and other in self.lru:
                self.lru.remove(other)
                assert req.table.pages[j] == self.pool._page_of[keys[j]]
        assert req.table.num_keyed == max(keyed, min(final, len(req.table.pages)))
        for j in range(keyed, final):  # named now: by this page, or an equal page has it
            assert keys[j] in self.pool._page_of
            if self.pool.key_of(req.table.pages[j]) == keys[j]:
                self._check_key_content(req.table.pages[j], keys[j])

    def _admit(self, req: Request, data) -> bool:
        """The scheduler's admission with prefix caching; False (nothing changed) if it does not
        fit."""
        kv, pool, ps, tokens = self.kv, self.pool, self.ps, req.tokens
        assert not req.table.pages and req.computed == 0
        keys = self._keys(tokens)
        cap = max(0, (len(tokens) - 1) // ps)  # the last token is always computed
        hits = kv.cached_prefix(keys[:cap])
        assert len(hits) <= cap and len(set(hits)) == len(hits)
        for j, p in enumerate(hits):  # a hit serves this request's own tokens
            assert pool.key_of(p) == keys[j]
            assert self.content[p] == self._expected(tokens, j)
        before = self._snapshot()
        if hits:
            revived = [p for p in hits if pool.refcount(p) == 0]
            evictable = len(revived)
            rest = _ceil_div(len(tokens) - len(hits) * ps, ps)
            if rest > kv.num_free_pages - evictable:
                assert self._snapshot() == before  # lookup changes nothing
                return False
            refs = [pool.refcount(p) for p in hits]
            kv.adopt(req.table, hits)
            self.lru = [p for p in self.lru if p not in revived]
            assert [pool.refcount(p) for p in hits] == [r + 1 for r in refs]
            assert req.table.num_keyed == len(hits) and req.table.num_slots == len(hits) * ps
            restored = data.draw(st.integers(0, len(hits)), label="restored")
            self._truncate(req.table, restored * ps)
            req.computed = restored * ps
            if restored == len(hits):  # the check above guarantees the rest fits
                assert kv.can_reserve(req.table, len(tokens))
        if not kv.can_reserve(req.table, len(tokens)):
            self._release(req.table)  # undo the hit: the request waits as it was
            req.computed = 0
            assert self._snapshot()[:4] == before[:4]
            return False
        kv.reserve(req.table, len(tokens))
        req.running = True
        self._compute(req, len(tokens))
        return True

    def _new(self, tokens: list[int]) -> tuple[int, Request]:
        name, self.next_name = self.next_name, self.next_name + 1
        req = Request(list(tokens))
        self.reqs[name] = req
        return name, req

    # ---------------------------------------------------------------- rules

    @rule(tokens=tokens_st, data=st.data())
    def admit(self, tokens, data):
        name, req = self._new(tokens)
        if not self._admit(req, data):
            del self.reqs[name]

    @precondition(lambda self: self.history)
    @rule(data=st.data(), extra=st.lists(st.integers(0, VOCAB - 1), max_size=3))
    def admit_shared_prefix(self, data, extra):
        """A new request that starts with (part of) the tokens of an earlier one (running,
        waiting or gone): its pages may be in use, evictable or evicted."""
        src = data.draw(st.sampled_from(self.history), label="earlier")
        n = data.draw(st.integers(0, len(src)), label="prefix")
        name, req = self._new((list(src[:n]) + extra) or [0])
        if not self._admit(req, data):
            del self.reqs[name]

    @precondition(lambda self: self._has(running=True))
    @rule(data=st.data(), accepted=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3),
          drafts=st.integers(0, 3), bonus=st.integers(0, VOCAB - 1))
    def decode(self, data, accepted, drafts, bonus):
        """One speculative step: reserve draft slots, write draft KV, keep the accepted tokens'
        KV (moved into place), drop the rest, register full pages."""
        req = self.reqs[self._pick(data, running=True)]
        n, m = req.computed, max(drafts, len(accepted))
        before = self._snapshot()
        try:
            self.kv.reserve(req.table, n + m)
        except OutOfPagesError:
            assert self._snapshot() == before
            return
        if not self._write(req, n, [("draft", n + i) for i in range(m)]):
            self._truncate(req.table, n)  # gives the draft slots back
            return
        req.tokens.extend(accepted)
        self._compute(req, n + len(accepted), [bonus])
        self._truncate(req.table, req.computed)

    @precondition(lambda self: self._has(running=True))
    @rule(data=st.data())
    def fork(self, data):
        """A parallel sample: shares every page; either side copies before it writes."""
        parent = self.reqs[self._pick(data, running=True)]
        _, child = self._new(parent.tokens)
        refs = Counter(parent.table.pages)
        before = {p: self.pool.refcount(p) for p in refs}
        child.table = self.kv.fork(parent.table)
        child.computed, child.running = parent.computed, True
        assert child.table.pages == parent.table.pages
        assert child.table.num_keyed == parent.table.num_keyed
        for p, c in refs.items():
            assert self.pool.refcount(p) == before[p] + c

    @precondition(lambda self: self._has(running=True))
    @rule(data=st.data())
    def truncate(self, data):
        """Drop reserved slots past the computed ones, or roll back computed tokens (the table
        may keep a partly cut keyed page: see DROP_KEY_BEFORE_REWRITE)."""
        req = self.reqs[self._pick(data, running=True)]
        n = data.draw(st.integers(0, req.table.num_slots), label="keep")
        keyed = req.table.num_keyed
        self._truncate(req.table, n)
        assert req.table.num_slots == n and len(req.table.pages) == _ceil_div(n, self.ps)
        assert req.table.num_keyed == min(keyed, len(req.table.pages))
        if n < req.computed:
            req.computed = n
            del req.tokens[n:]

    @precondition(lambda self: self._has(running=True))
    @rule(data=st.data())
    def finish(self, data):
        """Finish or abort: the pages go back; full ones stay cached (evictable)."""
        name = self._pick(data, running=True)
        self._release(self.reqs[name].table)
        self.kv.release(self.reqs[name].table)  # idempotent
        del self.reqs[name]

    def _preempt(self, req: Request) -> None:
        keys = self._keys(req.tokens)[:max(0, (len(req.tokens) - 1) // self.ps)]
        hits = len(self.kv.cached_prefix(keys))
        self._release(req.table)
        assert req.table.pages == [] and req.table.num_slots == 0 == req.table.num_keyed
        req.computed, req.running = 0, False
        req.preempted_at = (hits, self.pool.num_evicted, self.drops)

    @precondition(lambda self: self._has(running=True))
    @rule(data=st.data())
    def preempt(self, data):
        self._preempt(self.reqs[self._pick(data, running=True)])

    @precondition(lambda self: self._has(running=False))
    @rule(data=st.data())
    def readmit(self, data):
        """A preempted request comes back: unless something was evicted or dropped since, it
        finds at least the cached pages it had."""
        req = self.reqs[self._pick(data, running=False)]
        hits, evicted, drops = req.preempted_at
        keys = self._keys(req.tokens)[:max(0, (len(req.tokens) - 1) // self.ps)]
        if self.pool.num_evicted == evicted and self.drops == drops:
            assert len(self.kv.cached_prefix(keys)) >= hits
        self._admit(req, data)

    @precondition(lambda self: self._has(running=False))
    @rule(data=st.data())
    def abort_waiting(self, data):
        del self.reqs[self._pick(data, running=False)]

    @rule(data=st.data())
    def pressure(self, data):
        """A long request without prefix lookup takes many pages: cached ones get evicted (the
        least recently released first), in-use ones never."""
        if self.pool.num_free == 0:
            return
        n = data.draw(st.integers(1, self.pool.num_free), label="pages")
        tokens = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=(n - 1) * self.ps + 1,
                                    max_size=n * self.ps), label="tokens")
        lru, num_free = list(self.lru), len(self.pool._free)
        evicted = self.pool.num_evicted
        _, req = self._new(tokens)
        self.kv.reserve(req.table, len(tokens))
        assert len(req.table.pages) == n
        taken = max(0, n - num_free)  # free pages first, then the oldest released cached ones
        assert self.pool.num_evicted - evicted == taken
        assert req.table.pages[num_free:] == lru[:taken]
        req.running = True
        self._compute(req, len(tokens))

    @precondition(lambda self: self.pool.num_cached)
    @rule(data=st.data())
    def forget(self, data):
        """Drop a cached page's key (its content is about to change, or the tier forgets it):
        an evictable page becomes free, an in-use one stays mapped."""
        page = data.draw(st.sampled_from(sorted(self.pool._key_of)), label="page")
        rc = self.pool.refcount(page)
        self._drop_key(page)
        assert self.pool.key_of(page) is None and self.pool.refcount(page) == rc
        assert (page in self.pool._free) == (rc == 0)

    # ---------------------------------------------------------------- invariants

    @invariant()
    def page_states_partition(self):
        if not hasattr(self, "pool"):
            return
        pool = self.pool
        live = self._live_pages()
        free, evictable = list(pool._free), set(pool._evictable)
        assert len(set(free)) == len(free), f"free list has duplicates: {free}"
        in_use = 0
        for p in range(pool.num_pages):
            rc, key = pool.refcount(p), pool.key_of(p)
            assert rc == live[p], f"page {p}: refcount {rc}, mapped {live[p]} times"
            if rc >= 1:
                in_use += 1
                assert p not in evictable and p not in free
            elif key is not None:
                assert p in evictable and p not in free
            else:
                assert p in free and p not in evictable
        assert pool.num_free == pool.num_pages - in_use == len(free) + len(evictable)
        assert pool.num_evictable == len(evictable)
        assert list(pool._evictable) == self.lru, "evictable pages out of release order"
        assert pool.num_cached == len(pool._key_of) == len(pool._page_of)
        assert all(pool._page_of[k] == p for p, k in pool._key_of.items())

    @invariant()
    def running_requests_read_their_own_kv(self):
        if not hasattr(self, "pool"):
            return
        ps = self.ps
        for name, r in self.reqs.items():
            t = r.table
            assert len(t.pages) == _ceil_div(t.num_slots, ps)
            assert 0 <= t.num_keyed <= len(t.pages)
            if not r.running:
                assert not t.pages and r.computed == 0
                continue
            assert r.computed == len(r.tokens) <= t.num_slots
            for i in range(r.computed):
                got = self.content[t.pages[i // ps]][i % ps]
                assert got == tuple(r.tokens[:i + 1]), (
                    f"request {name} slot {i} (page {t.pages[i // ps]}) holds {got}, "
                    f"expected tokens {r.tokens[:i + 1]}")

    @invariant()
    def keys_name_their_content(self):
        if not hasattr(self, "pool"):
            return
        for page, key in self.pool._key_of.items():
            self._check_key_content(page, key)
            assert self.pool.lookup([key]) == [page]

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        for r in self.reqs.values():
            self._release(r.table)
        pool = self.pool
        assert pool.num_free == pool.num_pages
        assert all(pool.refcount(p) == 0 for p in range(pool.num_pages))
        assert pool.num_evictable == pool.num_cached
        assert sorted(pool._free + list(pool._evictable)) == list(range(pool.num_pages))
        assert len(pool.allocate(pool.num_pages)) == pool.num_pages  # all of it can be had
        assert pool.num_cached == 0


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_prefix_cache_machine = PrefixCacheMachine.TestCase
