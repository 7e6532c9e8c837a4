"""One verifier call per step: batched results equal per-request references.

- greedy, batched, equals a plain per-request walk (first matching child wins) on random trees
  with duplicate sibling tokens, for both built-in verifiers;
- a mixed batch (greedy and sampled requests) equals verifying each subset, and each request,
  alone with the same seeds (both sampling verifiers).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from verifier_oracles import Toy, make_batch, sample_tree, target_rows

from specdec.tree import DraftTree
from specdec.verifiers.base import VerifyBatch, VerifyResult, check_batch, single
from specdec.verifiers.greedy import GreedyVerifier
from specdec.verifiers.gumbel import GumbelVerifier
from specdec.verifiers.rejection import RejectionVerifier

VOCAB = 3  # small, so that siblings often carry the same token and argmaxes often match


def reference_greedy(tree: DraftTree, logits: torch.Tensor) -> VerifyResult:
    """logits [1 + n, V]: walk from the root, taking the first child carrying the argmax."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    accepted, cur = [], -1
    while True:
        want = int(logits[cur + 1].argmax())
        match = [i for i in range(len(tokens)) if parents[i] == cur and tokens[i] == want]
        if not match:
            return VerifyResult(accepted, [tokens[a] for a in accepted] + [want])
        cur = match[0]
        accepted.append(cur)


@st.composite
def trees(draw, max_nodes: int = 8) -> DraftTree:
    n = draw(st.integers(0, max_nodes))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
    return DraftTree(torch.tensor(tokens, dtype=torch.int64),
                     torch.tensor(parents, dtype=torch.int64))


@settings(max_examples=150, deadline=None)
@given(batch=st.lists(trees(), min_size=1, max_size=6), seed=st.integers(0, 2**31))
def test_batched_greedy_equals_reference_walk(batch, seed):
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(1 + t.num_nodes, VOCAB, generator=g, dtype=torch.float64)
            for t in batch]
    cu = [0]
    for t in batch:
        cu.append(cu[-1] + 1 + t.num_nodes)
    vb = VerifyBatch(batch, cu, torch.cat(rows), None, [True] * len(batch), [None] * len(batch),
                     [0] * len(batch))
    check_batch(vb)
    want = [reference_greedy(t, r) for t, r in zip(batch, rows)]
    assert GreedyVerifier().verify(vb).to_results() == want
    assert RejectionVerifier().verify(vb).to_results() == want
    for t, r, w in zip(batch, rows, want):  # and alone
        assert GreedyVerifier().verify(single(t, r)).to_results() == [w]


def _mixed_requests(seed: int):
    """Eight requests: greedy and sampled, chains/trees with and without draft probs, plain rows."""
    target, draft = Toy(5, seed), Toy(5, seed + 1)
    g = torch.Generator().manual_seed(seed)
    shapes = [[-1, 0], [], [-1, -1, 0], [-1, -1, 0, 1], [-1], [-1, -1], [], [-1, 0, 1]]
    trees = []
    for i, parents in enumerate(shapes):
        tree = sample_tree(parents, draft, g) if parents else DraftTree.empty()
        if i % 3 == 1 and tree.num_nodes:  # deterministic drafts: the q = 1 rule
            tree = DraftTree(tree.tokens, tree.parents)
        trees.append(tree)
    rows = [target_rows(t, target) for t in trees]
    greedy = [i % 2 == 0 for i in range(len(trees))]
    return trees, rows, greedy


def _seeds(greedy: list[bool], index: list[int]) -> list:
    return [None if greedy[i] else 100 + i for i in index]


@pytest.mark.parametrize("verifier", [RejectionVerifier(), GumbelVerifier()],
                         ids=lambda v: v.name)
def test_mixed_batch_equals_each_subset_and_each_request_alone(verifier):
    for seed in range(5):
        trees, rows, greedy = _mixed_requests(seed)
        everyone = list(range(len(trees)))
        mixed = verifier.verify(
            make_batch(trees, rows, _seeds(greedy, everyone), greedy)).to_results()
        for subset in ([i for i in everyone if greedy[i]], [i for i in everyone if not greedy[i]]):
            alone = verifier.verify(make_batch(
                [trees[i] for i in subset], [rows[i] for i in subset], _seeds(greedy, subset),
                [greedy[i] for i in subset])).to_results()
            assert alone == [mixed[i] for i in subset]
        for i in everyone:
            (one,) = verifier.verify(make_batch(
                [trees[i]], [rows[i]], _seeds(greedy, [i]), [greedy[i]])).to_results()
            assert one == mixed[i]
        greedy_rows = [i for i in everyone if greedy[i]]
        assert [mixed[i] for i in greedy_rows] == [
            reference_greedy(trees[i], rows[i].log()) for i in greedy_rows]
