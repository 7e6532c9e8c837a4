"""Greedy verification, the Verifier protocol, and the padded batch form."""

from __future__ import annotations

import pytest
import torch

from specdec.tree import DraftTree
from specdec.verifiers.base import Verifier, VerifyResult, batch_form
from specdec.verifiers.greedy import GreedyVerifier
from specdec.verifiers.rejection import RejectionVerifier


def test_protocol():
    assert isinstance(GreedyVerifier(), Verifier) and isinstance(RejectionVerifier(), Verifier)
    assert GreedyVerifier.name == "greedy" and RejectionVerifier.name == "rejection"


# ---- greedy --------------------------------------------------------------------------------------

def argmax_logits(targets: list[int], vocab: int = 10) -> torch.Tensor:
    """[len(targets), vocab] logits whose row r has its argmax at targets[r]."""
    return torch.eye(vocab, dtype=torch.float64)[targets]


@pytest.mark.parametrize("targets, accepted, tokens", [
    ([7, 8, 9, 4], [0, 1, 2], [7, 8, 9, 4]),   # full accept + bonus
    ([7, 8, 4, 2], [0, 1], [7, 8, 4]),         # partial
    ([3, 8, 9, 4], [], [3]),                   # none
])
def test_greedy_chain(targets, accepted, tokens):
    result = GreedyVerifier().verify(DraftTree.chain([7, 8, 9]), argmax_logits(targets), None, None)
    assert result == VerifyResult(accepted, tokens)


def test_greedy_branching_second_sibling_matches():
    # root -> 0 (5), 1 (6); 1 -> 2 (7); 0 -> 3 (7)
    tree = DraftTree(torch.tensor([5, 6, 7, 7]), torch.tensor([-1, -1, 1, 0]))
    result = GreedyVerifier().verify(tree, argmax_logits([6, 0, 7, 1, 0]), None, None)
    assert result == VerifyResult([1, 2], [6, 7, 1])


def test_greedy_duplicate_siblings_take_first_and_empty_tree():
    tree = DraftTree(torch.tensor([5, 5]), torch.tensor([-1, -1]))
    assert GreedyVerifier().verify(tree, argmax_logits([5, 3, 4]), None, None).accepted == [0]
    empty = GreedyVerifier().verify(DraftTree.empty(), argmax_logits([9]), None, None)
    assert empty == VerifyResult([], [9])


# ---- batch form ----------------------------------------------------------------------------------

def test_batch_form_pads_with_minus_one():
    results = [VerifyResult([0, 2], [5, 6, 7]), VerifyResult([], [9]), VerifyResult([1], [3, 4])]
    accepted, tokens = batch_form(results)
    assert accepted.dtype == tokens.dtype == torch.int64
    assert accepted.tolist() == [[0, 2], [-1, -1], [1, -1]]
    assert tokens.tolist() == [[5, 6, 7], [9, -1, -1], [3, 4, -1]]
    acc0, tok0 = batch_form([])
    assert acc0.shape == (0, 0) and tok0.shape == (0, 1)
    acc1, tok1 = batch_form([VerifyResult([], [2])])
    assert acc1.shape == (1, 0) and tok1.tolist() == [[2]]
