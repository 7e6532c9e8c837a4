"""The torch attention backend and the paged KV cache, against a naive float64 softmax.

Layout under test (one layer): [num_pages, 2, page_size, num_kv_heads, head_dim], K at index 0
and V at index 1 of dim 1; slot i of a request lives in page table[i // page_size] at offset
i % page_size.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import native
from specdec.attention import torch_backend
from specdec.attention.metadata import build_metadata
from specdec.attention.torch_backend import TorchAttentionBackend, _groups
from specdec.kv.cache import KVCache
from specdec.models.loader import load_model
from specdec.tree import DraftTree, verify_mask

PAGE = 4
NUM_PAGES = 16
H, HKV, D = 4, 2, 8
SCALE = D**-0.5
F64 = torch.float64


def _randn(gen, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=F64)


def _empty_cache() -> torch.Tensor:
    return torch.zeros(NUM_PAGES, 2, PAGE, HKV, D, dtype=F64)


def _slot(table: list[int], i: int) -> tuple[int, int]:
    return table[i // PAGE], i % PAGE


def _write(cache: torch.Tensor, table: list[int], start: int, k: torch.Tensor, v: torch.Tensor):
    """Put K/V of slots start.. straight into the layout (independently of the backend)."""
    for j in range(k.shape[0]):
        page, off = _slot(table, start + j)
        cache[page, 0, off] = k[j]
        cache[page, 1, off] = v[j]


def _read(cache: torch.Tensor, table: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [n, HKV, D] of slots 0..n-1."""
    slots = [_slot(table, i) for i in range(n)]
    k = torch.stack([cache[p, 0, o] for p, o in slots])
    v = torch.stack([cache[p, 1, o] for p, o in slots])
    return k, v


def _causal(qo: int, kv: int) -> torch.Tensor:
    """[qo, kv] bool: new row i sits at position kv - qo + i and sees every column up to it."""
    return torch.arange(kv)[None, :] <= (torch.arange(qo) + kv - qo)[:, None]


def _naive(q, k, v, mask) -> torch.Tensor:
    """Plain softmax attention with GQA: q [T, H, D], k/v [L, HKV, D], mask [T, L] -> [T, H, D]."""
    rep = H // HKV
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("thd,lhd->htl", q, k) * SCALE
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("htl,lhd->thd", scores.softmax(-1), v)


@dataclass
class Req:
    """One request of a step: its full logical K/V, its new query rows, pages and mask."""

    table: list[int]
    k: torch.Tensor  # [kv_len, HKV, D] float64, the whole sequence
    v: torch.Tensor  # [kv_len, HKV, D] float64
    q: torch.Tensor  # [qo_len, H, D] float64, the new rows
    mask: torch.Tensor | None = None  # [qo_len, kv_len] bool, None = causal

    @property
    def kv_len(self) -> int:
        return self.k.shape[0]

    @property
    def qo_len(self) -> int:
        return self.q.shape[0]

    def expected(self) -> torch.Tensor:
        mask = _causal(self.qo_len, self.kv_len) if self.mask is None else self.mask
        return _naive(self.q, self.k, self.v, mask)


def _req(gen, table, kv_len, qo_len, mask=None) -> Req:
    return Req(table, _randn(gen, kv_len, HKV, D), _randn(gen, kv_len, HKV, D),
               _randn(gen, qo_len, H, D), mask)


def _run(reqs: list[Req], cache: torch.Tensor) -> list[torch.Tensor]:
    """Cached prefixes written into `cache`, then ONE plan + run over all requests' new rows."""
    for r in reqs:
        old = r.kv_len - r.qo_len
        _write(cache, r.table, 0, r.k[:old], r.v[:old])
    md = build_metadata([r.table for r in reqs], [r.kv_len for r in reqs],
                        [r.qo_len for r in reqs], PAGE, [r.mask for r in reqs])
    backend = TorchAttentionBackend()
    backend.plan(md)
    q = torch.cat([r.q for r in reqs])
    k = torch.cat([r.k[r.kv_len - r.qo_len :] for r in reqs])
    v = torch.cat([r.v[r.kv_len - r.qo_len :] for r in reqs])
    out = backend.run(q, k, v, cache, SCALE)
    assert out.shape == q.shape
    return list(out.split([r.qo_len for r in reqs]))


# ---- (c) mixed batches in one plan == each request alone == naive softmax ------------------

BRANCHING = DraftTree(torch.tensor([11, 12, 13, 14, 15, 16]), torch.tensor([-1, -1, 0, 0, 1, 2]))


def _mixed(gen) -> list[Req]:
    prefix = 6  # committed tokens of the tree request, the last one re-run as row 0
    n = BRANCHING.num_nodes
    return [
        _req(gen, [5, 2, 9], 9, 4),  # prefill chunk: 5 cached + 4 new
        _req(gen, [0, 12], 7, 1),  # decode row over 6 cached
        _req(gen, [7, 3, 14, 1], 13, 1),  # decode row over 12 cached
        _req(gen, [10, 4, 8, 15], prefix + n, 1 + n, verify_mask(BRANCHING, prefix)),
    ]


BATCHES = {
    "mixed": _mixed,
    "decodes_equal_kv": lambda g: [_req(g, [3, 8], 6, 1), _req(g, [12, 0], 6, 1)],
    "decodes_unequal_kv": lambda g: [_req(g, [3, 8], 5, 1), _req(g, [12, 0, 6], 11, 1)],
    "chunks_equal_qo": lambda g: [_req(g, [9, 1], 8, 3), _req(g, [4, 13, 6], 10, 3)],
    "two_fresh_prefills": lambda g: [_req(g, [2, 11], 7, 7), _req(g, [5], 3, 3)],
}


@pytest.mark.parametrize("call_cells", [512, 0], ids=["grouped", "one_call_each"])
@pytest.mark.parametrize("name", sorted(BATCHES))
def test_batch_equals_each_request_alone(name, call_cells, monkeypatch):
    # call_cells 0: padding costs more than a call, so requests of different shapes go to
    # separate SDPA calls (the multi-group path); 512: these small batches stay one call
    monkeypatch.setattr(torch_backend, "CALL_CELLS", call_cells)
    reqs = BATCHES[name](torch.Generator().manual_seed(0))
    pages = [p for r in reqs for p in r.table]
    assert len(pages) == len(set(pages)), "test requests must not share pages"
    batch_cache = _empty_cache()
    together = _run(reqs, batch_cache)
    for r, out in zip(reqs, together):
        alone = _run([r], _empty_cache())[0]
        torch.testing.assert_close(out, alone, atol=1e-12, rtol=0)
        torch.testing.assert_close(out, r.expected(), atol=1e-12, rtol=0)
        k, v = _read(batch_cache, r.table, r.kv_len)  # every slot, old and new, in place
        assert torch.equal(k, r.k) and torch.equal(v, r.v)
    used = torch.zeros(NUM_PAGES, dtype=torch.bool)
    used[pages] = True
    assert not batch_cache[~used].any(), "the run wrote outside the requests' pages"


def test_groups_partition_requests_by_shape():
    # equal shapes: one call; a long prompt beside short decodes gets its own call
    assert _groups([1] * 8, [300] * 8) == [list(range(8))]
    parts = _groups([1, 1, 1, 1, 1], [40, 2000, 50, 45, 60])
    assert parts == [[0, 2, 3, 4], [1]]
    parts = _groups([1, 512, 1, 9], [400, 512, 410, 420])
    assert sorted(b for p in parts for b in p) == [0, 1, 2, 3]
    assert [1] in parts, "a prefill chunk is not padded together with decode rows"
    assert all(p == sorted(p) for p in parts)


def _group_cost(parts, qo_lens, kv_lens) -> int:
    from specdec.attention.torch_backend import CALL_CELLS

    return sum(len(p) * max(qo_lens[b] for b in p) * max(kv_lens[b] for b in p) + CALL_CELLS
               for p in parts)


def _groups_per_request(qo_lens: list[int], kv_lens: list[int]) -> int:
    """The cheapest cost of cutting the requests sorted by shape into runs (the definition)."""
    order = sorted(range(len(qo_lens)), key=lambda b: (qo_lens[b], kv_lens[b]))
    best = [0] + [None] * len(order)
    for j in range(1, len(order) + 1):
        best[j] = min(best[i] + _group_cost([order[i:j]], qo_lens, kv_lens) for i in range(j))
    return best[-1]


@settings(max_examples=80, deadline=None)
@given(shapes=st.lists(st.tuples(st.sampled_from([1, 2, 5, 64]),
                                 st.sampled_from([3, 40, 41, 300, 2000])), min_size=1, max_size=12))
def test_groups_by_shape_cost_what_the_per_request_program_costs(shapes):
    qo = [min(q, kv) for q, kv in shapes]
    kv = [k for _, k in shapes]
    parts = _groups(qo, kv)
    assert sorted(b for p in parts for b in p) == list(range(len(qo)))
    assert all(p == sorted(p) for p in parts)
    assert _group_cost(parts, qo, kv) == _groups_per_request(qo, kv)


def _ancestors_or_self(parents: list[int], i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


def test_tree_rows_equal_causal_attention_along_their_path():
    """Node i of a tree sees the prefix and its own root path, as if that path were a chain."""
    gen = torch.Generator().manual_seed(1)
    prefix, n = 5, BRANCHING.num_nodes
    r = _req(gen, [6, 1, 13], prefix + n, 1 + n, verify_mask(BRANCHING, prefix))
    out = _run([r], _empty_cache())[0]
    parents = BRANCHING.parents.tolist()
    cols0 = list(range(prefix))
    torch.testing.assert_close(out[0], _naive(r.q[:1], r.k[cols0], r.v[cols0], _causal(1, prefix))[0],
                               atol=1e-12, rtol=0)
    for i in range(n):
        path = _ancestors_or_self(parents, i)
        cols = cols0 + [prefix + j for j in path]
        chain = _naive(r.q[1 + i : 2 + i], r.k[cols], r.v[cols], _causal(1, len(cols)))
        torch.testing.assert_close(out[1 + i], chain[0], atol=1e-12, rtol=0)


# ---- (b) a custom mask equal to the causal mask -------------------------------------------


@pytest.mark.parametrize("kv_len, qo_len", [(11, 6), (9, 9)])
def test_custom_causal_mask_equals_causal(kv_len, qo_len):
    gen = torch.Generator().manual_seed(2)
    plain = _req(gen, [7, 2, 12], kv_len, qo_len)
    masked = Req(plain.table, plain.k, plain.v, plain.q, _causal(qo_len, kv_len))
    a = _run([plain], _empty_cache())[0]
    b = _run([masked], _empty_cache())[0]
    if qo_len < kv_len:  # same gather path: bit-identical
        assert torch.equal(a, b)
    else:  # fresh prefill takes SDPA's is_causal path without a mask: equal up to rounding
        torch.testing.assert_close(a, b, atol=1e-13, rtol=0)
    torch.testing.assert_close(a, plain.expected(), atol=1e-12, rtol=0)


def test_chain_verify_mask_equals_causal():
    gen = torch.Generator().manual_seed(3)
    prefix, chain = 7, DraftTree.chain([4, 5, 6])
    mask = verify_mask(chain, prefix)
    assert torch.equal(mask, _causal(1 + 3, prefix + 3))
    plain = _req(gen, [1, 9, 4], prefix + 3, 1 + 3)
    as_tree = Req(plain.table, plain.k, plain.v, plain.q, mask)
    assert torch.equal(_run([plain], _empty_cache())[0], _run([as_tree], _empty_cache())[0])


def test_custom_mask_changes_the_result():
    """Guard for the tests above: a non-causal mask must not be ignored."""
    gen = torch.Generator().manual_seed(4)
    plain = _req(gen, [0, 1, 2], 10, 4)
    mask = _causal(4, 10)
    mask[2, 3] = False
    out = _run([Req(plain.table, plain.k, plain.v, plain.q, mask)], _empty_cache())[0]
    base = _run([plain], _empty_cache())[0]
    assert torch.equal(out[[0, 1, 3]], base[[0, 1, 3]])
    assert not torch.allclose(out[2], base[2])
    torch.testing.assert_close(out[2], _naive(plain.q, plain.k, plain.v, mask)[2], atol=1e-12, rtol=0)


# ---- (d) non-contiguous, shuffled pages, written by the backend itself ---------------------


def _two_steps(table: list[int], req: Req, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill `first` rows, then the rest, both through the backend; (last output, cache)."""
    cache = _empty_cache()
    for start, end in ((0, first), (first, req.kv_len)):
        step = Req(table, req.k[:end], req.v[:end], req.q[start:end])
        md = build_metadata([table], [end], [end - start], PAGE)
        backend = TorchAttentionBackend()
        backend.plan(md)
        out = backend.run(step.q, req.k[start:end], req.v[start:end], cache, SCALE)
    return out, cache


def test_shuffled_pages_equal_contiguous_pages():
    gen = torch.Generator().manual_seed(5)
    req = _req(gen, [], 10, 10)  # q rows for all 10 positions
    out_a, cache_a = _two_steps([0, 1, 2], req, 7)
    out_b, cache_b = _two_steps([5, 2, 9], req, 7)
    assert torch.equal(out_a, out_b)
    torch.testing.assert_close(out_b, _naive(req.q, req.k, req.v, _causal(10, 10))[7:],
                               atol=1e-12, rtol=0)
    # physical placement: slots 0-3 in page 5, 4-7 in page 2, 8-9 at the start of page 9
    assert torch.equal(cache_b[5, 0], req.k[0:4]) and torch.equal(cache_b[5, 1], req.v[0:4])
    assert torch.equal(cache_b[2, 0], req.k[4:8]) and torch.equal(cache_b[2, 1], req.v[4:8])
    assert torch.equal(cache_b[9, 0, :2], req.k[8:10]) and torch.equal(cache_b[9, 1, :2], req.v[8:10])
    assert not cache_b[9, :, 2:].any()
    others = [p for p in range(NUM_PAGES) if p not in (5, 2, 9)]
    assert not cache_b[others].any()
    assert torch.equal(cache_a[[0, 1, 2]], cache_b[[5, 2, 9]])


# ---- (a) chunked prefill through the model == one-shot prefill ------------------------------


def _prefill(model, cfg, table, ids, chunks):
    kv = KVCache(cfg.num_layers, NUM_PAGES, PAGE, cfg.num_kv_heads, cfg.head_dim, F64, "cpu")
    start, rows = 0, []
    for n in chunks:
        backend = TorchAttentionBackend()
        backend.plan(build_metadata([table], [start + n], [n], PAGE))
        out = model(ids[start : start + n], torch.arange(start, start + n), backend, kv)
        rows.append(model.compute_logits(out.hidden))
        start += n
    assert start == len(ids)
    slots = [_slot(table, i) for i in range(len(ids))]
    # [num_layers, 2, len(ids), HKV, D]: every used slot of every layer
    contents = torch.stack([kv.tensor[:, p, :, o] for p, o in slots], dim=2)
    return torch.cat(rows), contents


@pytest.mark.parametrize("chunks", [(7, 6, 7), (13, 7), (1, 18, 1)])
def test_chunked_prefill_equals_one_shot(tiny_llama, chunks):
    model, cfg, _ = load_model(tiny_llama, F64, "cpu", 64)
    ids = torch.randint(0, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(6))
    one_logits, one_kv = _prefill(model, cfg, [3, 8, 1, 12, 6], ids, (20,))
    chunk_logits, chunk_kv = _prefill(model, cfg, [9, 2, 5, 0, 13], ids, chunks)
    assert one_kv.abs().sum() > 0
    torch.testing.assert_close(chunk_kv, one_kv, atol=1e-12, rtol=0)
    torch.testing.assert_close(chunk_logits, one_logits, atol=1e-12, rtol=0)
    assert torch.equal(chunk_logits[-1].argmax(), one_logits[-1].argmax())


# ---- (e) KVCache.move_slots and copy_pages --------------------------------------------------


def _random_kv_cache(num_layers=3, num_pages=8) -> KVCache:
    kv = KVCache(num_layers, num_pages, PAGE, HKV, D, F64, "cpu")
    kv.tensor.copy_(_randn(torch.Generator().manual_seed(7), *kv.tensor.shape))
    return kv


def _slot_values(t: torch.Tensor, slot: int) -> torch.Tensor:
    """[num_layers, 2, HKV, D] K and V of flat slot id `slot` in every layer."""
    return t[:, slot // PAGE, :, slot % PAGE]


@pytest.mark.parametrize("src, dst", [
    ([1, 6, 13, 30], [20, 9, 2, 31]),  # across pages, out of order
    ([5, 6, 7, 8], [4, 5, 6, 7]),  # overlapping shift left (accepted path compaction)
    ([4, 5, 6], [5, 6, 7]),  # overlapping shift right
    ([10, 3], [3, 10]),  # swap
])
def test_move_slots_moves_k_and_v_in_every_layer(src, dst):
    kv = _random_kv_cache()
    before = kv.tensor.clone()
    kv.move_slots(src, dst)
    for s, d in zip(src, dst):
        assert torch.equal(_slot_values(kv.tensor, d), _slot_values(before, s))
    untouched = [s for s in range(kv.num_pages * PAGE) if s not in dst]
    for s in untouched:
        assert torch.equal(_slot_values(kv.tensor, s), _slot_values(before, s))
    for i in range(kv.tensor.shape[0]):  # the per-layer view sees the move too
        layer = kv.layer(i)
        assert torch.equal(layer[dst[0] // PAGE, 0, dst[0] % PAGE], before[i, src[0] // PAGE, 0, src[0] % PAGE])


def test_move_slots_empty_is_a_no_op():
    kv = _random_kv_cache()
    before = kv.tensor.clone()
    kv.move_slots([], [])
    assert torch.equal(kv.tensor, before)


def test_copy_pages_copies_whole_pages_in_every_layer():
    kv = _random_kv_cache()
    before = kv.tensor.clone()
    kv.copy_pages([(1, 6), (4, 2)])
    assert torch.equal(kv.tensor[:, 6], before[:, 1]) and torch.equal(kv.tensor[:, 2], before[:, 4])
    keep = [0, 1, 3, 4, 5, 7]
    assert torch.equal(kv.tensor[:, keep], before[:, keep])


@pytest.mark.skipif(native.load() is None, reason="compiled kernels not built")
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_key_lists_are_each_rows_visible_keys_in_order(data):
    """The compiled path's plan (every row's cache rows, built for the whole step at once)
    against the definition, request by request: the rows of the keys its mask (tree or
    causal) lets it see, in position order."""
    from specdec.attention.kv_rows import kv_write_index
    from specdec.attention.torch_backend import _KeyLists
    from specdec.tree import causal_mask

    page = data.draw(st.sampled_from([1, 4, 16]))
    n = data.draw(st.integers(1, 5))
    kv = [data.draw(st.integers(1, 40)) for _ in range(n)]
    qo = [data.draw(st.integers(1, k)) for k in kv]
    pool = torch.randperm(200).tolist()
    tables, masks = [], []
    for k, q in zip(kv, qo):
        tables.append([pool.pop() for _ in range(-(-k // page))])
        if data.draw(st.booleans()):
            m = torch.rand(q, k, generator=torch.Generator().manual_seed(k * 7 + q)) < 0.5
            m[:, 0] = True
            masks.append(m)
        else:
            masks.append(None)
    md = build_metadata(tables, kv, qo, page, masks)
    plan = _KeyLists(md, native.load())
    want, counts = [], []
    for t, k, q, m in zip(tables, kv, qo, masks):
        pos = torch.arange(k)
        k_rows = kv_write_index(torch.tensor(t)[pos // page] * page + pos % page, page)[:k]
        m = causal_mask(q, k, "cpu") if m is None else m
        rows, cols = m.nonzero(as_tuple=True)
        want.append(k_rows[cols])
        counts.append(torch.bincount(rows, minlength=q))
    assert torch.equal(plan.index, torch.cat(want))
    assert torch.equal(plan.indptr[1:] - plan.indptr[:-1], torch.cat(counts))
    assert plan.max_keys == int(torch.cat(counts).max())
    assert torch.equal(plan.write_index, kv_write_index(md.slot_mapping, page))
    # a mask of another dtype or layout: the same lists (converted for the call)
    kinds = [None if m is None else m.to(torch.uint8) for m in masks]
    if any(m is not None for m in masks):
        kinds[[m is not None for m in masks].index(True)] *= 3  # any nonzero byte sees the key
    for other in (kinds, [None if m is None else m.t().contiguous().t().float() for m in masks]):
        md2 = build_metadata(tables, kv, qo, page, other)
        same = _KeyLists(md2, native.load())
        assert torch.equal(same.index, plan.index) and torch.equal(same.indptr, plan.indptr)


@pytest.mark.skipif(native.load() is None, reason="compiled kernels not built")
@pytest.mark.parametrize("page", [1, 4, 16])
def test_compiled_write_index_equals_kv_write_index(page):
    """Slots -> cache rows in C (the CPU plan's) and in torch ops, negative slots too (floor
    division: any negative slot gives a negative K row, refused before a layer writes)."""
    from specdec.attention.kv_rows import kv_write_index

    slots = torch.cat([torch.randint(-100, 1000, (40,)), torch.tensor([0, -1, page, -page])])
    rows = native.load().write_index(slots, page)
    assert torch.equal(rows, kv_write_index(slots, page))
    assert native.load().write_index(slots[:0], page).shape == (0,)
    with pytest.raises(TypeError, match="sd_write_index: slots"):
        native.load().write_index(slots.int(), page)
    with pytest.raises(ValueError, match="page_size 0"):
        native.load().write_index(slots, 0)
