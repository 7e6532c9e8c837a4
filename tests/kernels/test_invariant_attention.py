"""invariant_attention (specdec/kernels/invariant_attention.py) against the torch backend (SDPA
over the step's masks) and a per-row torch reference, on random paged steps; and its promise:
a row's output is bitwise the same whatever else is in the call.

Without a GPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set before the
kernel module is imported: ``triton.jit`` reads it when it decorates); with one, compiled on it.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from gpu.gpu_helpers import random_cache, random_step  # noqa: E402

from specdec.attention.metadata import build_metadata  # noqa: E402
from specdec.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from specdec.kernels.invariant_attention import (  # noqa: E402
    RowMetadata,
    invariant_attention,
    invariant_attention_reference,
    row_metadata,
)
from specdec.tree import DraftTree, step_mask  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
D = 64
SCALE = D**-0.5
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rows_of(md) -> RowMetadata:
    return row_metadata(md.qo_lens(), md.kv_lens(), md.custom_masks).to(DEVICE)


def attend(q, cache, rows, md, out=None):
    return invariant_attention(q, cache, rows, md.kv_indptr, md.kv_indices, SCALE, out=out)


def make_rows(requests, limits, trees) -> RowMetadata:
    return RowMetadata(torch.tensor(requests, dtype=torch.int32, device=DEVICE),
                       torch.tensor(limits, dtype=torch.int32, device=DEVICE),
                       torch.tensor(trees, dtype=torch.int64, device=DEVICE))


def test_row_metadata_example():
    """The example of row_metadata's docstring: a prefill chunk, then a decode row + tree."""
    tree = DraftTree(torch.tensor([7, 8, 9]), torch.tensor([-1, -1, 0]))
    mask = step_mask(tree, 2, 3)
    assert mask.int().tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0],
                                   [1, 1, 1, 0, 1, 0], [1, 1, 1, 1, 0, 1]]
    rows = row_metadata([2, 4], [5, 6], [None, mask])
    assert rows.row_request.tolist() == [0, 0, 1, 1, 1, 1]
    assert rows.row_limit.tolist() == [4, 5, 3, 4, 3, 4]
    assert rows.row_tree.tolist() == [0, 0, 0, 0, 2, 2]
    assert rows.row_request.dtype == rows.row_limit.dtype == torch.int32
    assert rows.row_tree.dtype == torch.int64


def test_row_metadata_of_a_chain_is_causal():
    chain = step_mask(DraftTree.chain(torch.arange(5)), 9, 10)
    causal = row_metadata([6], [15])
    got = row_metadata([6], [15], [chain])
    for name in ("row_request", "row_limit", "row_tree"):
        assert torch.equal(getattr(got, name), getattr(causal, name))


def test_row_metadata_bit_63_and_bad_masks():
    mask = torch.zeros(70, 80, dtype=torch.bool)  # context: the first 10 slots
    mask[:, :10] = mask[:, 11] = mask[:, 10 + 63] = True
    rows = row_metadata([70], [80], [mask])
    assert rows.row_limit.tolist() == [10] * 70
    assert rows.row_tree.tolist() == [2 - 2**63] * 70  # bits 1 and 63
    mask[5, 10 + 64] = True
    with pytest.raises(ValueError, match="row 5 of its custom mask sees a slot more than 64"):
        row_metadata([70], [80], [mask])
    mask[5, 10 + 64] = False
    # a row that does not see all the context (an EAGLE-3 head's row beside its uncles): its
    # leading run ends at the first hidden slot, and what it sees past it are bits
    mask[3, 4] = False  # row 3 then sees slot 73, 69 past its first hidden slot
    with pytest.raises(ValueError, match="row 3 of its custom mask sees a slot more than 64"):
        row_metadata([70], [80], [mask])
    head = torch.ones(2, 12, dtype=torch.bool)
    head[0, 5] = head[0, 8:] = False  # row 0 sees 0..4, 6, 7; row 1 every slot
    rows = row_metadata([2], [12], [head])
    assert rows.row_limit.tolist() == [5, 12] and rows.row_tree.tolist() == [0b110, 0]
    with pytest.raises(ValueError, match="custom mask must be bool \\[70, 80\\]"):
        row_metadata([70], [80], [mask[:, :79]])
    with pytest.raises(ValueError, match="need 0 <= qo_len <= kv_len"):
        row_metadata([3], [2])
    with pytest.raises(ValueError, match="one entry per request"):
        row_metadata([1, 1], [2])


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The many small torch ops of the references crawl when torch's threads compete with
    another process for a small machine's cores (0.02 s -> 4 s on 2 busy cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


MIXED = ["tree", "chunk", "decode", "tree", "prefill"]
CASES = [  # (dtype, page_size, (H, Hkv, D), kinds): GQA groups 1, 3 and 4
    (torch.float32, 4, (2, 2, D), MIXED),
    (torch.bfloat16, 16, (6, 2, D), MIXED[:4]),  # 16-slot pages: prefills get long
    (torch.float32, 16, (3, 1, D), MIXED[:4]),
    (torch.bfloat16, 4, (4, 1, D), MIXED),
]


@pytest.mark.parametrize("dtype, page_size, heads, kinds", CASES)
def test_matches_torch_backend_and_reference(dtype, page_size, heads, kinds):
    """Prefill chunks, decode rows and random trees mixed in one call over shuffled pages."""
    gen = torch.Generator().manual_seed(page_size * 10 + heads[0])
    step = random_step(gen, kinds, 64, page_size, heads, DEVICE, dtype)
    md = step.md
    cache = random_cache(gen, 64, page_size, heads[1], D, DEVICE, dtype)
    backend = TorchAttentionBackend(kernels=None)
    backend.plan(md)
    want = backend.run(step.q, step.k, step.v, cache, SCALE)  # also writes the new K/V
    rows = rows_of(md)
    got = attend(step.q, cache, rows, md)
    assert got.shape == step.q.shape and got.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    ref = invariant_attention_reference(step.q, cache, rows, md.kv_indptr, md.kv_indices, SCALE)
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chain_rows_are_bitwise_decode_rows(dtype):
    """Request 0 verifies a decode row + a chain of 6 (context 37, slots 37..43) beside a
    prefill chunk; each of its rows must equal, bitwise, a lone decode row at that position
    over the same pages, also when the chain row is given in the other form the kernel
    accepts (limit = the context, the chain's slots as tree bits)."""
    gen = torch.Generator().manual_seed(5)
    page, n, ctx = 4, 6, 37
    table = torch.randperm(32, generator=gen).tolist()
    chain_mask = step_mask(DraftTree.chain(torch.arange(n)), ctx - 1, ctx)
    md = build_metadata([table[:12], table[12:]], [ctx + n, 20], [1 + n, 9], page,
                        [chain_mask, None], DEVICE)
    q = torch.randn(1 + n + 9, 8, D, generator=gen).to(DEVICE, dtype)
    cache = random_cache(gen, 32, page, 2, D, DEVICE, dtype)
    together = attend(q, cache, rows_of(md), md)
    # the brief form of a chain row: everything before the chain, plus its ancestors and itself
    tree_form = make_rows([0] * (1 + n) + [1] * 9,
                          [ctx] + [ctx] * n + list(range(12, 21)),
                          [0] + [(1 << (i + 1)) - 1 for i in range(n)] + [0] * 9)
    assert torch.equal(attend(q, cache, tree_form, md), together)
    for i in range(1 + n):  # row i sits at slot ctx - 1 + i
        alone = build_metadata([table[:12]], [ctx + i], [1], page, None, DEVICE)
        got = attend(q[i:i + 1], cache, rows_of(alone), alone)
        assert torch.equal(got[0], together[i]), f"row {i}"


def test_split_kv_rows_are_bitwise_the_same_for_1_to_64_rows(monkeypatch):
    """KV splits of 32 slots (contexts of up to 72: 1-3 splits a row) merged in order: decode
    rows of 64 requests match the reference, and a row is bitwise itself alone, in calls of 2
    to 64 rows, under any split bound (the grid) and launched in chunks of 8 rows; a chain
    row is bitwise the decode row at its position. (fp32: the dtype changes only the loads;
    bf16 rows are checked bitwise by the tests above. Every program is interpreted here,
    ~25 ms each: the sizes are kept small.)"""
    from specdec.kernels import invariant_attention as kernel

    dtype = torch.float32
    gen = torch.Generator().manual_seed(11)
    page, n = 4, 64
    lens = torch.randint(1, 73, (n,), generator=gen).tolist()
    table = torch.randperm(n * 18, generator=gen).tolist()
    tables = [table[i * 18:(i + 1) * 18][:-(-k // page)] for i, k in enumerate(lens)]
    q = torch.randn(n, 4, D, generator=gen).to(DEVICE, dtype)
    cache = random_cache(gen, n * 18, page, 1, D, DEVICE, dtype)  # one KV head: fewer programs

    def run(picks, max_slots=None):
        md = build_metadata([tables[i] for i in picks], [lens[i] for i in picks],
                            [1] * len(picks), page, None, DEVICE)
        return invariant_attention(q[picks], cache, rows_of(md), md.kv_indptr, md.kv_indices,
                                   SCALE, max_slots=max_slots, split_slots=32)

    every = run(list(range(n)), max_slots=72)
    md = build_metadata(tables, lens, [1] * n, page, None, DEVICE)
    ref = invariant_attention_reference(q, cache, rows_of(md), md.kv_indptr, md.kv_indices,
                                        SCALE)
    torch.testing.assert_close(every.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype])
    monkeypatch.setattr(kernel, "ROW_CHUNK", 8)
    for m, bound in ((1, 72), (2, 96), (17, 128), (64, 73)):
        picks = torch.randperm(n, generator=gen)[:m].tolist()
        assert torch.equal(run(picks, bound), every[picks]), (m, bound)
    # a 4-node chain after the longest context, at the slots past it: each row = a decode row
    i = max(range(n), key=lens.__getitem__)
    ctx, extra = lens[i] - 4, 4
    chain = step_mask(DraftTree.chain(torch.arange(extra - 1)), ctx - 1, ctx)
    md = build_metadata([tables[i]], [ctx + extra - 1], [extra], page, [chain], DEVICE)
    rows = q[[i] * extra]
    together = invariant_attention(rows, cache, rows_of(md), md.kv_indptr, md.kv_indices,
                                   SCALE, split_slots=32)
    for r in range(extra):
        alone = build_metadata([tables[i]], [ctx + r], [1], page, None, DEVICE)
        got = invariant_attention(rows[r:r + 1], cache, rows_of(alone), alone.kv_indptr,
                                  alone.kv_indices, SCALE, split_slots=32)
        assert torch.equal(got[0], together[r]), r


def test_a_tree_row_is_bitwise_the_same_in_any_batch():
    """A branching tree's node rows, verified alone and behind other requests, with the
    request's pages listed at another place of kv_indices."""
    gen = torch.Generator().manual_seed(7)
    tree = DraftTree(torch.arange(7), torch.tensor([-1, -1, 0, 0, 1, 3, 2]))
    mask = step_mask(tree, 40, 41)
    table = torch.randperm(40, generator=gen).tolist()
    q = torch.randn(8, 4, D, generator=gen).to(DEVICE, torch.bfloat16)
    cache = random_cache(gen, 40, 4, 2, D, DEVICE, torch.bfloat16)
    alone = build_metadata([table[:12]], [48], [8], 4, [mask], DEVICE)
    other = torch.randn(5, 4, D, generator=gen).to(DEVICE, torch.bfloat16)
    batch = build_metadata([table[12:20], table[:12]], [30, 48], [5, 8], 4, [None, mask],
                           DEVICE)
    want = attend(q, cache, rows_of(alone), alone)
    got = attend(torch.cat([other, q]), cache, rows_of(batch), batch)
    assert torch.equal(got[5:], want)


def test_padding_rows_write_zeros_and_change_nothing():
    """Rows past the real ones (limit 0, tree 0; any request id, any query, NaN too), as a
    CUDA graph's padded batch has them; ``out`` is written in place."""
    gen = torch.Generator().manual_seed(3)
    step = random_step(gen, ["decode", "tree"], 32, 4, (4, 2, D), DEVICE, torch.float32)
    cache = random_cache(gen, 32, 4, 2, D, DEVICE, torch.float32)
    md, rows = step.md, rows_of(step.md)
    want = attend(step.q, cache, rows, md)
    pad = 3
    padded = RowMetadata(
        torch.cat([rows.row_request, torch.tensor([0, 7, 10**6], dtype=torch.int32,
                                                  device=DEVICE)]),
        torch.cat([rows.row_limit, rows.row_limit.new_zeros(pad)]),
        torch.cat([rows.row_tree, rows.row_tree.new_zeros(pad)]))
    q = torch.cat([step.q, torch.full((pad, 4, D), float("nan"), device=DEVICE)])
    out = torch.full_like(q, 5.0)
    got = attend(q, cache, padded, md, out=out)
    assert got is out
    assert torch.equal(got[:-pad], want)
    assert torch.equal(got[-pad:], torch.zeros(pad, 4, D, device=DEVICE))


def test_tree_bit_63_and_holes():
    """A row that sees slots 0..9, 11 and 73 (bits 1 and 63 of its tree), in one call with a
    row that sees only slot 40 (limit 0: no visible slot in its first block)."""
    gen = torch.Generator().manual_seed(11)
    md = build_metadata([torch.randperm(20, generator=gen).tolist()], [74], [1], 4, None,
                        DEVICE)
    q = torch.randn(2, 2, D, generator=gen).to(DEVICE)
    cache = random_cache(gen, 20, 4, 1, D, DEVICE, torch.float32)
    rows = make_rows([0, 0], [10, 0], [2 - 2**63, 1 << 40])
    got = attend(q, cache, rows, md)
    ref = invariant_attention_reference(q, cache, rows, md.kv_indptr, md.kv_indices, SCALE)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    page, offset = md.kv_indices[40 // 4].item(), 40 % 4
    assert torch.equal(got[1], cache[page, 1, offset].expand(2, D))  # softmax over one slot


def test_bad_inputs_are_value_errors():
    gen = torch.Generator().manual_seed(0)
    step = random_step(gen, ["decode"], 8, 4, (4, 2, D), DEVICE, torch.float32)
    md, rows = step.md, rows_of(step.md)
    cache = random_cache(gen, 8, 4, 2, D, DEVICE, torch.float32)
    with pytest.raises(ValueError, match="H must be a multiple of Hkv"):
        attend(step.q[:, :3], cache, rows, md)
    with pytest.raises(ValueError, match="one dtype of"):
        attend(step.q.to(torch.bfloat16), cache, rows, md)
    bad = RowMetadata(rows.row_request.float(), rows.row_limit, rows.row_tree)
    with pytest.raises(ValueError, match="rows.row_request must be torch.int32 or torch.int64"):
        attend(step.q, cache, bad, md)
    with pytest.raises(ValueError, match="kv_indices must be a 1-d int32 or int64 tensor"):
        invariant_attention(step.q, cache, rows, md.kv_indptr, md.kv_indices.float(), SCALE)
    # int64 index arrays (as the engine stages them) give the same result
    wide = RowMetadata(rows.row_request.long(), rows.row_limit.long(), rows.row_tree)
    assert torch.equal(attend(step.q, cache, wide, md), attend(step.q, cache, rows, md))
    with pytest.raises(ValueError, match="need q \\[T, H, D\\]"):
        attend(step.q[0], cache, rows, md)
    with pytest.raises(ValueError, match="out must be torch.float32 \\(1, 4, 64\\)"):
        attend(step.q, cache, rows, md, out=torch.empty(2, 4, D, device=DEVICE))
    none = RowMetadata(*(x[:0] for x in (rows.row_request, rows.row_limit, rows.row_tree)))
    assert attend(step.q[:0], cache, none, md).shape == (0, 4, D)
