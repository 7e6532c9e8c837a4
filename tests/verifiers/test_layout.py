"""TreeLayout: a batch of trees as padded tensors (the docstring example, and random trees
against the tree's own derived structure)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.tree import DraftTree
from specdec.verifiers.layout import TreeLayout


def test_docstring_example():
    trees = [DraftTree(torch.tensor([4, 5, 6]), torch.tensor([-1, -1, 0])), DraftTree.empty()]
    lay = TreeLayout.build(trees, [0, 4, 5], "cpu")
    assert lay.tokens.tolist() == [[4, 5, 6], [0, 0, 0]]
    assert lay.valid.tolist() == [[True] * 3, [False] * 3]
    assert lay.depth[0].tolist() == [0, 0, 1]
    assert lay.children[0].tolist() == [[0, 1], [2, -1], [-1, -1], [-1, -1]]
    assert (lay.children[1] == -1).all()
    assert lay.node_row.tolist() == [[0, 1, 2, 3], [4, 4, 4, 4]]
    assert lay.parent_row[0].tolist() == [0, 0, 1]
    assert lay.ancestors[0].int().tolist() == [[1, 0, 0], [0, 1, 0], [1, 0, 1]]
    assert not lay.ancestors[1].any()
    assert lay.max_depth == 2 and lay.max_children == 2


def test_first_marks_earlier_duplicate_siblings_only():
    # root children 7, 7, 8; node 0's children 7, 7; node 1's child 7 (a cousin, not a duplicate)
    tree = DraftTree(torch.tensor([7, 7, 8, 7, 7, 7]), torch.tensor([-1, -1, -1, 0, 0, 1]))
    lay = TreeLayout.build([tree], [0, 7], "cpu")
    assert lay.first[0].tolist() == [True, False, True, True, False, True]


@st.composite
def trees(draw, max_nodes: int = 7) -> DraftTree:
    n = draw(st.integers(0, max_nodes))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    return DraftTree(torch.tensor(tokens, dtype=torch.int64),
                     torch.tensor(parents, dtype=torch.int64))


@settings(max_examples=60, deadline=None)
@given(batch=st.lists(trees(), min_size=1, max_size=5))
def test_random_batches_match_each_tree(batch):
    cu = [0]
    for t in batch:
        cu.append(cu[-1] + 1 + t.num_nodes)
    lay = TreeLayout.build(batch, cu, "cpu")
    n = max(t.num_nodes for t in batch)
    assert lay.tokens.shape == (len(batch), n) and lay.node_row.shape == (len(batch), n + 1)
    assert lay.max_depth == max(t.max_depth + 1 for t in batch)
    for b, t in enumerate(batch):
        m = t.num_nodes
        assert lay.valid[b].tolist() == [True] * m + [False] * (n - m)
        assert lay.tokens[b, :m].tolist() == t.tokens.tolist()
        assert lay.depth[b, :m].tolist() == t.depths.tolist()
        assert torch.equal(lay.ancestors[b, :m, :m], t.ancestor_mask)
        assert lay.node_row[b, : m + 1].tolist() == list(range(cu[b], cu[b + 1]))
        for i in range(-1, m):
            kids = [c for c in lay.children[b, i + 1].tolist() if c >= 0]
            assert kids == t.children(i)
        for i, p in enumerate(t.parents.tolist()):
            assert int(lay.parent_row[b, i]) == cu[b] + 1 + p
        pairs = list(zip(t.parents.tolist(), t.tokens.tolist()))
        assert lay.first[b, :m].tolist() == [pairs.index(pt) == i for i, pt in enumerate(pairs)]
    assert not lay.first[~lay.valid].any() and not lay.ancestors[~lay.valid].any()
    assert lay.max_children == max(len(t.children(i)) for t in batch
                                   for i in range(-1, t.num_nodes))
