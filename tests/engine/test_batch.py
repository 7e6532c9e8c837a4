"""build_forward_batch: one step's records (prefill chunks, decode rows, draft trees) packed into
the target's batch: rows, row_start / logits_start, positions, slots and masks."""

from __future__ import annotations

import torch

from specdec.engine.batch import build_forward_batch
from specdec.engine.sequence import Sequence
from specdec.engine.step import StepRequest
from specdec.kv.block_table import TableAllocator, slot_of
from specdec.kv.page_pool import PagePool
from specdec.sampling_params import SamplingParams
from specdec.tree import DraftTree, causal_mask

PAGE = 4


def record(kv: TableAllocator, tokens: list[int], computed: int, fed: int,
           tree: DraftTree | None = None) -> StepRequest:
    seq = Sequence(str(tokens[0]), tokens, SamplingParams(temperature=0), None)
    seq.num_computed = computed
    rec = StepRequest(seq, fed)
    rec.tree = tree
    kv.reserve(seq.block_table, computed + fed + rec.num_nodes)
    return rec


def oracle_mask(rec: StepRequest) -> torch.Tensor:
    """Row r (slot s_r) may see slot j iff j is a committed/fed slot <= its own (fed rows) or
    < the first node slot (node rows), or a node slot of an ancestor-or-self (node rows)."""
    c, end, n = rec.computed_before, rec.computed_before + rec.num_new_tokens, rec.num_nodes
    mask = torch.zeros(rec.num_rows, end + n, dtype=torch.bool)
    for r in range(rec.num_new_tokens):
        mask[r, : c + r + 1] = True
    for i in range(n):
        mask[rec.num_new_tokens + i, :end] = True
        cur = i
        while cur >= 0:
            mask[rec.num_new_tokens + i, end + cur] = True
            cur = int(rec.tree.parents[cur])
    return mask


def test_rows_offsets_positions_slots_and_masks():
    kv = TableAllocator(PagePool(32), PAGE)
    chunk = record(kv, list(range(100, 110)), 0, 5)  # a prefill chunk short of its frontier
    tree = DraftTree(torch.tensor([7, 8, 9]), torch.tensor([-1, -1, 0]))
    decode = record(kv, list(range(200, 210)), 9, 1, tree)
    chain = DraftTree.chain([5, 6])
    last_chunk = record(kv, list(range(300, 308)), 5, 3, chain)  # the last chunk, plus a tree
    plain = record(kv, list(range(400, 406)), 5, 1)
    records = [chunk, decode, last_chunk, plain]
    batch = build_forward_batch(records, PAGE, "cpu")

    assert [r.row_start for r in records] == [0, 5, 9, 14]
    assert [r.logits_start for r in records] == [-1, 0, 4, 7]
    assert batch.num_rows == 15
    # logits rows: each frontier request's last fed row, then its node rows
    assert batch.logits_indices.tolist() == [5, 6, 7, 8, 11, 12, 13, 14]
    assert batch.input_ids.tolist() == [100, 101, 102, 103, 104, 209, 7, 8, 9, 305, 306, 307,
                                        5, 6, 405]
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 9, 10, 10, 11, 5, 6, 7, 8, 9, 5]
    md = batch.metadata
    assert md.qo_lens() == [5, 4, 5, 1] and md.kv_lens() == [5, 13, 10, 6]
    slots = []  # node i of a request with n tokens goes to slot n + i
    for rec, (lo, hi) in zip(records, [(0, 5), (9, 13), (5, 10), (5, 6)]):
        slots += [slot_of(rec.seq.block_table.pages, s, PAGE) for s in range(lo, hi)]
    assert md.slot_mapping.tolist() == slots
    assert md.custom_masks[0] is None and md.custom_masks[3] is None
    assert torch.equal(md.custom_masks[1], oracle_mask(records[1]))
    # a chain's mask is the causal one: its rows go unmasked
    assert md.custom_masks[2] is None
    assert torch.equal(oracle_mask(records[2]), causal_mask(5, 10))


def test_frontier_rows_line_up_with_the_verifier_layout():
    """logits_start + 1 + i is node i's logits row; the records' rows tile the batch."""
    kv = TableAllocator(PagePool(32), PAGE)
    trees = [DraftTree.chain([1, 2, 3]), None, DraftTree(torch.tensor([4, 5]),
                                                         torch.tensor([-1, -1]))]
    records = [record(kv, [10 + i] * (6 + i), 5 + i, 1, t) for i, t in enumerate(trees)]
    batch = build_forward_batch(records, PAGE, "cpu")
    start = 0
    for rec in records:
        assert rec.row_start == start
        rows = batch.logits_indices[rec.logits_start: rec.logits_start + 1 + rec.num_nodes]
        assert rows.tolist() == list(range(start, start + 1 + rec.num_nodes))
        if rec.num_nodes:
            got = batch.input_ids[rows[1:]].tolist()
            assert got == rec.tree.tokens.tolist()
            depth = rec.tree.depths + rec.seq.num_tokens
            assert batch.positions[rows[1:]].tolist() == depth.tolist()
        start += rec.num_rows
    assert start == batch.num_rows


def test_a_batch_padded_on_its_lists_is_the_runner_padded_batch():
    """build_forward_batch with the runner's graphs pads to the graph shape while it builds the
    arrays (no pad_batch join): the same ids, positions, write slots and metadata as the
    unpadded batch padded by pad_batch, and only the real rows counted as the batch's rows."""
    from types import SimpleNamespace

    from specdec.engine.cuda_graphs import CudaGraphRunner, graph_shapes, pad_batch

    def records(kv):
        tree = DraftTree(torch.tensor([7, 8, 9]), torch.tensor([-1, -1, 0]))
        return [record(kv, list(range(200, 210)), 9, 1, tree),
                record(kv, list(range(300, 308)), 7, 1, DraftTree.chain([5, 6])),
                record(kv, list(range(400, 406)), 5, 1), record(kv, list(range(500, 504)), 3, 1)]

    graphs = SimpleNamespace(shapes=graph_shapes(4, 32), scratch=[30, 31], dummies={},
                             _padding={})
    graphs.padding = CudaGraphRunner.padding.__get__(graphs)
    padded = build_forward_batch(records(TableAllocator(PagePool(32), PAGE)), PAGE, "cpu",
                                 graphs)
    plain = build_forward_batch(records(TableAllocator(PagePool(32), PAGE)), PAGE, "cpu")
    assert padded.num_rows == plain.num_rows == 9
    assert padded.graph_shape.num_rows > 9 and padded.graph_shape.batch_size > 4  # dummies
    want = pad_batch(plain, padded.graph_shape, graphs.scratch)
    assert padded.input_ids.tolist() == want.input_ids.tolist()
    assert padded.positions.tolist() == want.positions.tolist()
    assert padded.logits_indices.tolist() == plain.logits_indices.tolist()
    a, b = padded.metadata, want.metadata
    assert (a.qo_lens(), a.kv_lens()) == (b.qo_lens(), b.kv_lens())
    assert a.slots.tolist() == b.slots.tolist()
    assert [m is None for m in a.custom_masks] == [m is None for m in b.custom_masks]
    for x, y in zip(a.custom_masks, b.custom_masks):
        assert x is None or torch.equal(x, y)
