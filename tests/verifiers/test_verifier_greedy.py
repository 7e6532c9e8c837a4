"""Greedy verification, the Verifier protocol, and the padded batch output."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.tree import DraftTree
from specdec.verifiers.base import (
    Verifier,
    VerifyBatch,
    VerifyOutput,
    VerifyResult,
    check_batch,
    single,
)
from specdec.verifiers.greedy import GreedyVerifier
from specdec.verifiers.rejection import RejectionVerifier


def test_protocol():
    assert isinstance(GreedyVerifier(), Verifier) and isinstance(RejectionVerifier(), Verifier)
    assert GreedyVerifier.name == "greedy" and RejectionVerifier.name == "rejection"
    assert GreedyVerifier.supports_sampling is False and RejectionVerifier.supports_sampling


# ---- greedy --------------------------------------------------------------------------------------

def argmax_logits(targets: list[int], vocab: int = 10) -> torch.Tensor:
    """[len(targets), vocab] logits whose row r has its argmax at targets[r]."""
    return torch.eye(vocab, dtype=torch.float64)[targets]


def greedy_one(tree: DraftTree, targets: list[int]) -> VerifyResult:
    (result,) = GreedyVerifier().verify(single(tree, argmax_logits(targets))).to_results()
    return result


@pytest.mark.parametrize("targets, accepted, tokens", [
    ([7, 8, 9, 4], [0, 1, 2], [7, 8, 9, 4]),   # full accept + bonus
    ([7, 8, 4, 2], [0, 1], [7, 8, 4]),         # partial
    ([3, 8, 9, 4], [], [3]),                   # none
])
def test_greedy_chain(targets, accepted, tokens):
    assert greedy_one(DraftTree.chain([7, 8, 9]), targets) == VerifyResult(accepted, tokens)


def test_greedy_branching_second_sibling_matches():
    # root -> 0 (5), 1 (6); 1 -> 2 (7); 0 -> 3 (7)
    tree = DraftTree(torch.tensor([5, 6, 7, 7]), torch.tensor([-1, -1, 1, 0]))
    assert greedy_one(tree, [6, 0, 7, 1, 0]) == VerifyResult([1, 2], [6, 7, 1])


def test_greedy_duplicate_siblings_take_first_and_empty_tree():
    tree = DraftTree(torch.tensor([5, 5]), torch.tensor([-1, -1]))
    assert greedy_one(tree, [5, 3, 4]).accepted == [0]
    assert greedy_one(DraftTree.empty(), [9]) == VerifyResult([], [9])


def test_greedy_refuses_sampled_requests():
    tree = DraftTree.chain([1])
    probs = torch.full((2, 4), 0.25)
    with pytest.raises(ValueError, match="greedy requests only"):
        GreedyVerifier().verify(single(tree, probs.log(), probs, seed=0))


# ---- batch output --------------------------------------------------------------------------------

def test_batch_output_pads_with_minus_one():
    trees = [DraftTree.chain([5, 6, 7]), DraftTree.empty(), DraftTree(torch.tensor([2, 3]),
                                                                       torch.tensor([-1, -1]))]
    # request 0 accepts [0, 1] then 4; request 1 plain 9; request 2 accepts node 1 then 8
    targets = [5, 6, 4, 0] + [9] + [3, 0, 8]
    batch = VerifyBatch(trees, [0, 4, 5, 8], argmax_logits(targets), None, [True] * 3, [None] * 3,
                        [0] * 3)
    check_batch(batch)
    out = GreedyVerifier().verify(batch)
    assert out.accepted.dtype == out.tokens.dtype == out.num_accepted.dtype == torch.int64
    # D = 3, the deepest tree's depth: accepted [B, D], tokens [B, D + 1]
    assert out.accepted.tolist() == [[0, 1, -1], [-1, -1, -1], [1, -1, -1]]
    assert out.tokens.tolist() == [[5, 6, 4, -1], [9, -1, -1, -1], [3, 8, -1, -1]]
    assert out.num_accepted.tolist() == [2, 0, 1]
    assert out.to_results() == [VerifyResult([0, 1], [5, 6, 4]), VerifyResult([], [9]),
                                VerifyResult([1], [3, 8])]


def test_merge_places_sub_batches_and_pads():
    a = VerifyOutput(torch.tensor([[0, 1]]), torch.tensor([[5, 6, 7]]), torch.tensor([2]))
    b = VerifyOutput(torch.zeros(2, 0, dtype=torch.int64), torch.tensor([[9], [8]]),
                     torch.tensor([0, 0]))
    out = VerifyOutput.merge([([1], a), ([2, 0], b)], 3)
    assert out.accepted.tolist() == [[-1, -1], [0, 1], [-1, -1]]
    assert out.tokens.tolist() == [[8, -1, -1], [5, 6, 7], [9, -1, -1]]
    assert out.to_results() == [VerifyResult([], [8]), VerifyResult([0, 1], [5, 6, 7]),
                                VerifyResult([], [9])]


def test_result_needs_one_more_token_than_accepted():
    with pytest.raises(AssertionError, match="len\\(tokens\\) == len\\(accepted\\) \\+ 1"):
        VerifyResult([0], [5])


def test_check_batch_errors():
    """Layout errors (the old per-request shape checks, now on the batch). Out-of-vocab draft
    tokens are the engine's tree validation (DraftTree.validate, tests/test_tree.py)."""
    tree = DraftTree.chain([1, 2])
    with pytest.raises(ValueError, match="1 \\+ n rows"):
        check_batch(VerifyBatch([tree], [0, 2], torch.zeros(2, 4), None, [True], [None], [0]))
    with pytest.raises(ValueError, match="probs must match"):
        check_batch(single(tree, torch.zeros(3, 4), torch.zeros(3, 5)))
    with pytest.raises(ValueError, match=r"logits must be \[3, V\]"):
        check_batch(VerifyBatch([tree], [0, 3], torch.zeros(4, 4), None, [True], [None], [0]))
    with pytest.raises(ValueError, match="probs are required"):
        check_batch(VerifyBatch([tree], [0, 3], torch.zeros(3, 4), None, [False], [None], [0]))
    with pytest.raises(ValueError, match="B \\+ 1"):
        check_batch(VerifyBatch([tree], [0, 3], torch.zeros(3, 4), None, [True, True], [None], [0]))
    with pytest.raises(ValueError, match="need an int seed"):
        check_batch(single(tree, torch.zeros(3, 4), torch.zeros(3, 4)))
    with pytest.raises(ValueError, match="seeds/positions"):
        check_batch(VerifyBatch([tree], [0, 3], torch.zeros(3, 4), None, [True], [None], []))
    check_batch(single(tree, torch.zeros(3, 4)))


def test_select_takes_rows_and_fields_in_order():
    trees = [DraftTree.chain([1]), DraftTree.empty(), DraftTree.chain([2, 3])]
    logits = torch.arange(6 * 4, dtype=torch.float64).view(6, 4)
    batch = VerifyBatch(trees, [0, 2, 3, 6], logits, logits.softmax(-1), [False, True, False],
                        [5, None, 7], [10, 20, 30])
    sub = batch.select([2, 0])
    check_batch(sub)
    assert sub.trees == [trees[2], trees[0]] and sub.cu_rows == [0, 3, 5]
    assert torch.equal(sub.logits, logits[[3, 4, 5, 0, 1]])
    assert torch.equal(sub.probs, logits.softmax(-1)[[3, 4, 5, 0, 1]])
    assert sub.greedy == [False, False] and sub.seeds == [7, 5] and sub.positions == [30, 10]
    assert sub.row_positions() == [30, 31, 32, 10, 11]


def test_plain_rows_take_the_argmax_without_a_tree_walk():
    """A batch of plain decode rows (every tree empty) skips the tree layout: same output as the
    layout walk gives."""
    from specdec.verifiers.base import VerifyBatch
    from specdec.verifiers.greedy import greedy_verify, verify_greedy
    from specdec.verifiers.layout import TreeLayout

    logits = torch.randn(4, 11, generator=torch.Generator().manual_seed(0))
    trees = [DraftTree.empty()] * 4
    batch = VerifyBatch(trees, [0, 1, 2, 3, 4], logits, None, [True] * 4, [None] * 4, [0] * 4)
    fast = verify_greedy(batch)
    walked = greedy_verify(logits.argmax(-1), TreeLayout.build(trees, batch.cu_rows, "cpu"))
    for name in ("accepted", "tokens", "num_accepted"):
        assert torch.equal(getattr(fast, name), getattr(walked, name)), name
    assert fast.tokens[:, 0].tolist() == logits.argmax(-1).tolist()


@st.composite
def _trees_and_targets(draw):
    """A batch of random trees (some empty) over a 3-token vocabulary (duplicate siblings and
    matches are common), and a random target per logits row."""
    trees = []
    for _ in range(draw(st.integers(1, 4))):
        n = draw(st.integers(0, 7))
        parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
        tokens = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
        trees.append(DraftTree(torch.tensor(tokens, dtype=torch.int64),
                               torch.tensor(parents, dtype=torch.int64)))
    cu = [0]
    for t in trees:
        cu.append(cu[-1] + 1 + t.num_nodes)
    targets = draw(st.lists(st.integers(0, 2), min_size=cu[-1], max_size=cu[-1]))
    return trees, cu, torch.tensor(targets, dtype=torch.int64)


@settings(max_examples=300)
@given(_trees_and_targets())
def test_host_walk_equals_the_layout_walk(case):
    """The CPU's host walk gives exactly the tensor path's output (the GPU's), padding included."""
    from specdec.verifiers.greedy import greedy_verify, host_walk
    from specdec.verifiers.layout import TreeLayout

    trees, cu, targets = case
    if all(t.num_nodes == 0 for t in trees):
        return
    host = host_walk(trees, cu, targets)
    walked = greedy_verify(targets, TreeLayout.build(trees, cu, "cpu"))
    for name in ("accepted", "tokens", "num_accepted"):
        assert torch.equal(getattr(host, name), getattr(walked, name)), name


def test_from_results_tensors_made_on_first_use():
    """``from_results`` (the host walk's output): the results are handed back as they are until
    a field is used; its fields are the padded tensors; a field set (or edited in place after
    a read) is what ``to_results`` reads from then on."""
    results = [VerifyResult([0, 1], [5, 6, 4]), VerifyResult([], [9])]
    out = VerifyOutput.from_results(results, 3)
    assert isinstance(out, VerifyOutput) and out._tensors is None
    got = out.to_results()
    assert got == results and got is not results and out._tensors is None
    assert torch.equal(out.accepted, torch.tensor([[0, 1, -1], [-1, -1, -1]]))
    assert torch.equal(out.tokens, torch.tensor([[5, 6, 4, -1], [9, -1, -1, -1]]))
    assert torch.equal(out.num_accepted, torch.tensor([2, 0]))
    out.tokens[1, 0] = 7  # an edit after the tensors were made is the output
    assert out.to_results() == [results[0], VerifyResult([], [7])]
    fresh = VerifyOutput.from_results(results, 3)
    fresh.num_accepted = torch.tensor([1, 0])  # a field set first makes the rest
    assert fresh.to_results() == [VerifyResult([0], [5, 6]), VerifyResult([], [9])]
