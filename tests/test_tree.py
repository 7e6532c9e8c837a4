"""DraftTree: derived structure against simple oracles (causal mask, parent walks), validation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.tree import (
    DraftTree,
    causal_mask,
    from_paths,
    nodes_mask,
    step_mask,
    verify_mask,
)

VOCAB = 8


@st.composite
def trees(draw, max_nodes: int = 14) -> DraftTree:
    n = draw(st.integers(0, max_nodes))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
    return DraftTree(torch.tensor(tokens, dtype=torch.int64),
                     torch.tensor(parents, dtype=torch.int64))


def _ancestors_or_self(tree: DraftTree, i: int) -> set[int]:
    out, cur = set(), i
    while cur >= 0:
        out.add(cur)
        cur = int(tree.parents[cur])
    return out


def _causal(length: int) -> torch.Tensor:
    return torch.ones(length, length, dtype=torch.bool).tril()


def test_docstring_example():
    tree = DraftTree(torch.tensor([11, 12, 13, 14, 15]), torch.tensor([-1, -1, 0, 1, 2]))
    tree.validate(max_nodes=5, vocab_size=16)
    assert tree.depths.tolist() == [0, 0, 1, 1, 2]
    assert tree.positions(7).tolist() == [7, 7, 8, 8, 9]
    assert tree.children(-1) == [0, 1] and tree.children(4) == []
    assert tree.paths() == [[0, 2, 4], [1, 3]]
    assert tree.max_depth == 2


def test_verify_mask_docstring_example():
    tree = DraftTree(torch.tensor([1, 2, 3]), torch.tensor([-1, -1, 0]))
    expected = torch.tensor([[1, 1, 1, 0, 0, 0],
                             [1, 1, 1, 1, 0, 0],
                             [1, 1, 1, 0, 1, 0],
                             [1, 1, 1, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(verify_mask(tree, 3), expected)


def test_empty_tree():
    tree = DraftTree.empty()
    tree.validate(max_nodes=0, vocab_size=4)
    assert tree.num_nodes == 0 and tree.max_depth == -1 and tree.paths() == []
    assert tree.children(-1) == [] and tree.ancestor_mask.shape == (0, 0)
    assert torch.equal(verify_mask(tree, 4), torch.ones(1, 4, dtype=torch.bool))


@given(n=st.integers(0, 20), prefix_len=st.integers(1, 9))
def test_chain_masks_are_causal(n, prefix_len):
    tree = DraftTree.chain(list(range(n)))
    tree.validate()
    assert torch.equal(tree.ancestor_mask, _causal(n))
    full = _causal(prefix_len + n)[prefix_len - 1:]
    assert torch.equal(verify_mask(tree, prefix_len), full)
    assert tree.paths() == ([list(range(n))] if n else [])


@given(tree=trees(), offset=st.integers(0, 1000))
def test_depths_positions_and_ancestor_mask(tree, offset):
    tree.validate(vocab_size=VOCAB)
    for i in range(tree.num_nodes):
        anc = _ancestors_or_self(tree, i)
        assert int(tree.depths[i]) == len(anc) - 1
        assert set(tree.ancestor_mask[i].nonzero().flatten().tolist()) == anc
    assert torch.equal(tree.positions(offset), tree.depths + offset)
    assert tree.max_depth == (int(tree.depths.max()) if tree.num_nodes else -1)


@given(tree=trees(), prefix_len=st.integers(1, 6))
def test_verify_mask_rows(tree, prefix_len):
    mask = verify_mask(tree, prefix_len)
    n = tree.num_nodes
    assert mask.shape == (1 + n, prefix_len + n) and mask.dtype == torch.bool
    assert mask[:, :prefix_len].all() and not mask[0, prefix_len:].any()
    assert torch.equal(mask[1:, prefix_len:], tree.ancestor_mask)


@given(tree=trees())
def test_children_and_paths_cover_every_leaf_once(tree):
    n = tree.num_nodes
    for i in range(-1, n):
        assert tree.children(i) == [j for j in range(n) if int(tree.parents[j]) == i]
    leaves = [i for i in range(n) if not tree.children(i)]
    paths = tree.paths()
    assert sorted(p[-1] for p in paths) == leaves
    for path in paths:
        assert int(tree.parents[path[0]]) == -1
        assert all(int(tree.parents[b]) == a for a, b in zip(path, path[1:]))
    assert {i for p in paths for i in p} == set(range(n))


def test_children_rejects_bad_index():
    with pytest.raises(ValueError, match="node index"):
        DraftTree.chain([1, 2]).children(2)


token_lists = st.lists(st.lists(st.integers(0, 5), max_size=6), max_size=8)


@given(seqs=token_lists)
def test_from_paths_roundtrip(seqs):
    tree = from_paths(seqs)
    tree.validate()
    tokens = tree.tokens.tolist()
    for seq in seqs:
        cur = -1
        for tok in seq:
            match = [c for c in tree.children(cur) if tokens[c] == tok]
            assert len(match) == 1
            cur = match[0]
    prefixes = {tuple(s[:k]) for s in seqs for k in range(1, len(s) + 1)}
    assert tree.num_nodes == len(prefixes)


@given(seqs=token_lists, budget=st.integers(0, 12))
def test_from_paths_budget(seqs, budget):
    tree = DraftTree.from_paths(seqs, max_nodes=budget)
    tree.validate(max_nodes=budget)
    prefixes = {tuple(s[:k]) for s in seqs for k in range(1, len(s) + 1)}
    assert tree.num_nodes == min(budget, len(prefixes))
    tokens = tree.tokens.tolist()
    for path in tree.paths():
        assert tuple(tokens[i] for i in path) in prefixes


def test_from_paths_example_and_errors():
    tree = from_paths([[5, 6], [5, 7], [8]])
    assert tree.tokens.tolist() == [5, 6, 7, 8] and tree.parents.tolist() == [-1, 0, 0, -1]
    with pytest.raises(ValueError, match="max_nodes"):
        from_paths([[1]], max_nodes=-1)
    with pytest.raises(ValueError, match="tokens"):
        from_paths([[1, -2]])


def _tree(tokens, parents, **kw) -> DraftTree:
    return DraftTree(torch.tensor(tokens, dtype=torch.int64),
                     torch.tensor(parents, dtype=torch.int64), **kw)


@pytest.mark.parametrize("tree, kwargs, match", [
    (_tree([1, 2], [-1, 5]), {}, r"parents\[1\] = 5"),
    (_tree([1, 2], [-1, -2]), {}, r"parents\[1\] = -2"),
    (_tree([1, 2], [0, -1]), {}, r"parents\[0\] = 0.*cycle"),
    (_tree([1, 2], [1, 0]), {}, r"parents\[0\] = 1.*forward"),
    (_tree([1, 2, 3], [-1, 2, 1]), {}, r"parents\[1\] = 2"),
    (_tree([1, 2, 3], [-1, 0, 1]), {"max_nodes": 2}, "budget max_nodes=2"),
    (_tree([1, 9], [-1, 0]), {"vocab_size": 8}, r"tokens\[1\] = 9.*\[0, 7\]"),
    (_tree([-1, 2], [-1, 0]), {}, r"tokens\[0\] = -1"),
    (_tree([1, 2], [-1]), {}, "parents has 1 entries"),
    (DraftTree(torch.tensor([1, 2], dtype=torch.int32), torch.tensor([-1, 0])), {}, "int64"),
    (DraftTree(torch.tensor([[1, 2]]), torch.tensor([-1, 0])), {}, "1-D"),
    (DraftTree([1, 2], torch.tensor([-1, 0])), {}, "torch.Tensor"),
    (_tree([1, 2], [-1, 0], draft_probs=torch.ones(3, 8)), {}, r"shape \[n=2, V\]"),
    (_tree([1, 2], [-1, 0], draft_probs=torch.ones(2, 8)), {"vocab_size": 9}, "9"),
    (_tree([1, 2], [-1, 0], draft_probs=torch.ones(2, 8, dtype=torch.int64)), {}, "float"),
])
def test_validate_errors(tree, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tree.validate(**kwargs)


@settings(max_examples=50)
@given(tree=trees(max_nodes=6), data=st.data())
def test_corrupting_one_parent_is_caught(tree, data):
    if tree.num_nodes == 0:
        return
    i = data.draw(st.integers(0, tree.num_nodes - 1))
    bad = data.draw(st.one_of(st.integers(i, i + 5), st.integers(-5, -2)))
    parents = tree.parents.clone()
    parents[i] = bad
    with pytest.raises(ValueError, match=rf"parents\[{i}\]"):
        DraftTree(tree.tokens, parents).validate()


# ---- masks: causal, nodes, step ----------------------------------------------------------------

def test_causal_mask_docstring_example():
    assert causal_mask(2, 4).int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert torch.equal(causal_mask(5, 5), _causal(5))


@given(kv_len=st.integers(1, 12), data=st.data())
def test_causal_mask_is_the_last_rows_of_the_square_one(kv_len, data):
    q_len = data.draw(st.integers(1, kv_len))
    assert torch.equal(causal_mask(q_len, kv_len), _causal(kv_len)[kv_len - q_len:])


def test_nodes_mask_docstring_example_and_row_selection():
    tree = DraftTree(torch.tensor([1, 2, 3]), torch.tensor([-1, -1, 0]))
    assert nodes_mask(tree, 2, torch.tensor([2])).int().tolist() == [[1, 1, 1, 0, 1]]
    full = nodes_mask(tree, 2)
    assert torch.equal(full[:, 2:], tree.ancestor_mask) and full[:, :2].all()
    assert torch.equal(nodes_mask(tree, 2, torch.tensor([2, 0])), full[[2, 0]])


@given(tree=trees(), computed=st.integers(0, 8), fed=st.integers(1, 6))
def test_step_mask_rows(tree, computed, fed):
    """Fed rows are causal over the committed and fed slots; node rows are verify_mask rows."""
    end = computed + fed
    mask = step_mask(tree, computed, end)
    n = tree.num_nodes
    assert mask.shape == (fed + n, end + n)
    for r in range(fed - 1):  # token at slot computed + r sees slots 0 .. computed + r
        assert mask[r].tolist() == [j <= computed + r for j in range(end + n)]
    assert torch.equal(mask[fed - 1:], verify_mask(tree, end))


@given(n=st.integers(0, 6), computed=st.integers(0, 5), fed=st.integers(1, 5))
def test_chain_step_mask_is_causal(n, computed, fed):
    end = computed + fed
    assert torch.equal(step_mask(DraftTree.chain(list(range(n))), computed, end),
                       causal_mask(fed + n, end + n))


# ---- validation of depth and draft probabilities -----------------------------------------------

def test_validate_max_depth():
    tree = _tree([1, 2, 3, 4], [-1, 0, 1, -1])  # 3 levels
    tree.validate(max_depth=3)
    with pytest.raises(ValueError, match="3 levels deep.*max_depth=2"):
        tree.validate(max_depth=2)


@pytest.mark.parametrize("q, match", [
    (torch.tensor([[0.5, float("nan"), 0.5]]), "finite and non-negative"),
    (torch.tensor([[0.5, float("inf"), 0.5]]), "finite and non-negative"),
    (torch.tensor([[0.6, 0.6, -0.2]]), "finite and non-negative"),
    (torch.tensor([[0.0, 0.0, 0.0]]), "row 0 sums to 0"),
    (torch.tensor([[0.5, 0.0, 0.5]]), r"draft_probs\[0, 1\] is 0"),
])
def test_validate_draft_prob_values(q, match):
    tree = _tree([1], [-1], draft_probs=q)
    tree.validate(vocab_size=3)  # the values are only checked for sampled requests
    with pytest.raises(ValueError, match=match):
        tree.validate(vocab_size=3, check_probs=True)
    _tree([1], [-1], draft_probs=torch.tensor([[0.2, 0.3, 0.5]])).validate(check_probs=True)


def test_packed_masks_are_every_mask_row_major_packed_per_request():
    from specdec.tree import causal_mask, packed_masks

    tree = DraftTree(torch.tensor([5, 6]), torch.tensor([-1, 0]))
    m0 = verify_mask(tree, 2)  # [3, 4]: 12 bits, 2 bytes
    packed, offsets = packed_masks([m0, None], [3, 2], [4, 5])
    assert packed.dtype == torch.uint8 and offsets.tolist() == [0, 2, 4]
    bits = [(int(b) >> i) & 1 for b in packed for i in range(8)]  # little-endian per byte
    assert bits[:12] == m0.reshape(-1).int().tolist() and bits[12:16] == [0] * 4
    assert bits[16:26] == causal_mask(2, 5).reshape(-1).int().tolist()
    assert packed_masks([], [], [])[0].shape == (0,)
    example = packed_masks([torch.tensor([[1, 0], [1, 1]], dtype=torch.bool), None], [2, 1],
                           [2, 2])
    assert example[0].tolist() == [0b1101, 0b11] and example[1].tolist() == [0, 1, 2]
    with pytest.raises(AssertionError):
        packed_masks([m0], [2], [4])  # a mask of the wrong shape
