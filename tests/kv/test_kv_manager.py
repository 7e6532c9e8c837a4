"""KVManager: the slot operations of a speculative step (try_reserve, shrink, commit) on a
real KV tensor, against a model of the slots; no page is leaked."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.kv.block_table import BlockTable, slot_of
from specdec.kv.manager import KVManager
from specdec.tree import DraftTree

LAYERS, HEADS, DIM = 2, 2, 3


def manager(num_pages: int = 16, page_size: int = 4) -> KVManager:
    return KVManager(LAYERS, num_pages, page_size, HEADS, DIM, torch.float64, "cpu")


def fill(kv: KVManager, table: BlockTable) -> None:
    """Give every reserved slot s of the table K = s + 1 and V = -(s + 1) in layer 0 (and
    scaled copies in the other layers), so a slot's content names the slot it came from."""
    for s in range(table.num_slots):
        page, off = divmod(slot_of(table.pages, s, kv.page_size), kv.page_size)
        for layer in range(LAYERS):
            kv.cache.tensor[layer, page, 0, off] = (s + 1) * (layer + 1)
            kv.cache.tensor[layer, page, 1, off] = -(s + 1) * (layer + 1)


def origin(kv: KVManager, table: BlockTable, s: int) -> int:
    """Which slot's KV slot s holds now (checked in every layer, K and V)."""
    page, off = divmod(slot_of(table.pages, s, kv.page_size), kv.page_size)
    k = kv.cache.tensor[:, page, 0, off]
    v = kv.cache.tensor[:, page, 1, off]
    src = int(k[0, 0, 0]) - 1
    for layer in range(LAYERS):
        assert (k[layer] == (src + 1) * (layer + 1)).all()
        assert (v[layer] == -(src + 1) * (layer + 1)).all()
    return src


def all_free(kv: KVManager) -> bool:
    return kv.pool.num_free == kv.num_pages


def test_commit_docstring_example():
    kv = manager(page_size=4)
    table = BlockTable()
    kv.reserve(table, 9)  # n = 6 tokens, nodes 0, 1, 2 in slots 6, 7, 8
    fill(kv, table)
    kv.commit(table, 6, [1, 2])  # tree parents [-1, -1, 1]: node 1 then its child 2
    assert table.num_slots == 8 and len(table.pages) == 2
    assert [origin(kv, table, s) for s in range(8)] == [0, 1, 2, 3, 4, 5, 7, 8]
    assert kv.pool.num_free == kv.num_pages - 2  # the third page (slot 8) went back
    kv.release(table)
    assert all_free(kv)


def test_commit_in_place_path_moves_nothing_and_empty_path_drops_every_node(monkeypatch):
    kv = manager()
    table = BlockTable()
    kv.reserve(table, 10)
    fill(kv, table)
    moves = []
    move = kv.cache.move_slots
    monkeypatch.setattr(kv.cache, "move_slots", lambda s, d: (moves.append((s, d)), move(s, d)))
    kv.commit(table, 5, [0, 1])  # a chain's accepted prefix is already in place
    assert moves == [] and table.num_slots == 7
    assert [origin(kv, table, s) for s in range(7)] == list(range(7))
    kv.commit(table, 7, [])
    assert table.num_slots == 7 and moves == []


def test_try_reserve_and_shrink():
    kv = manager(num_pages=3, page_size=4)
    a, b = BlockTable(), BlockTable()
    assert kv.try_reserve(a, 9) and len(a.pages) == 3
    assert not kv.try_reserve(b, 1) and b.pages == [] and b.num_slots == 0
    assert not kv.try_reserve(a, 13) and a.num_slots == 9 and len(a.pages) == 3
    kv.shrink(a, 12)  # larger than reserved: nothing to give back
    assert a.num_slots == 9
    kv.shrink(a, 5)
    assert a.num_slots == 5 and len(a.pages) == 2 and kv.pool.num_free == 1
    assert kv.try_reserve(b, 4)
    kv.release(a)
    kv.release(b)
    assert all_free(kv)


def test_commit_moves_cross_pages_in_every_layer():
    kv = manager(page_size=2)
    table = BlockTable()
    kv.reserve(table, 8)
    table.pages.reverse()  # pages out of order: slot -> page arithmetic must use the table
    fill(kv, table)
    # nodes 1, 5, 6 after base 1: slots 2, 6, 7 -> 1, 2, 3 (slot 2 is read before it is written)
    kv.commit(table, 1, [1, 5, 6])
    assert [origin(kv, table, s) for s in range(4)] == [0, 2, 6, 7]


@st.composite
def step(draw):
    """A request with base committed slots and a tree, and an accepted root path of it."""
    n = draw(st.integers(1, 8))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tree = DraftTree(torch.zeros(n, dtype=torch.int64), torch.tensor(parents))
    path, cur = [], -1
    while tree.children(cur) and draw(st.booleans()):
        cur = draw(st.sampled_from(tree.children(cur)))
        path.append(cur)
    return draw(st.integers(0, 13)), tree, path


@settings(max_examples=150, deadline=None)
@given(case=step(), page_size=st.integers(1, 5))
def test_commit_moves_the_accepted_path_and_truncates(case, page_size):
    base, tree, path = case
    kv = manager(num_pages=32, page_size=page_size)
    other = BlockTable()
    kv.reserve(other, 3)  # another request's pages stay untouched
    table = BlockTable()
    kv.reserve(table, base + tree.num_nodes)
    fill(kv, table)
    fill(kv, other)
    kv.commit(table, base, path)
    assert table.num_slots == base + len(path)
    assert len(table.pages) == -(-table.num_slots // page_size)
    want = list(range(base)) + [base + a for a in path]
    assert [origin(kv, table, s) for s in range(table.num_slots)] == want
    assert [origin(kv, other, s) for s in range(3)] == [0, 1, 2]
    assert kv.pool.num_free == kv.num_pages - len(table.pages) - len(other.pages)
    kv.release(table)
    kv.release(other)
    assert all_free(kv)


def test_commit_all_is_the_commits_one_by_one_with_one_copy(monkeypatch):
    paths = [(6, [1, 2]), (5, [0, 1]), (3, [2]), (4, [])]
    kv, ref = manager(num_pages=24), manager(num_pages=24)
    tables, ref_tables = [], []
    for m, ts in ((kv, tables), (ref, ref_tables)):
        for base, _ in paths:
            t = BlockTable()
            m.reserve(t, base + 3)
            fill(m, t)
            ts.append(t)
    copies = []
    move = kv.cache.move_slots
    monkeypatch.setattr(kv.cache, "move_slots", lambda s, d: (copies.append(s), move(s, d)))
    kv.commit_all([(t, base, acc) for t, (base, acc) in zip(tables, paths)])
    for t, (base, acc) in zip(ref_tables, paths):
        ref.commit(t, base, acc)
    assert len(copies) == 1 and len(copies[0]) == 3  # nodes 1->0, 2->1 and 2->0 moved
    for t, r in zip(tables, ref_tables):
        assert t.num_slots == r.num_slots and t.pages == r.pages
        assert [origin(kv, t, s) for s in range(t.num_slots)] == [
            origin(ref, r, s) for s in range(r.num_slots)]
    assert kv.pool.num_free == ref.pool.num_free
