"""Rank-path trees (MTP, block diffusion): the best nodes by calibrated path acceptance,
ancestor-closed and topological, against a brute force over every rank path."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from specdec.drafters.rank_tree import (
    default_rates,
    rank_paths,
    tree_from_ranks,
)


def _brute(rates, max_nodes, max_depth):
    paths = []
    for d in range(1, min(max_depth, len(rates)) + 1):
        paths += list(itertools.product(*[range(len(rates[j])) for j in range(d)]))
    score = {p: math.prod(rates[j][r] for j, r in enumerate(p)) for p in paths}
    return sorted(score.values(), reverse=True)[:max_nodes], score


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("max_nodes, max_depth", [(1, 4), (5, 2), (12, 3), (40, 4)])
def test_best_paths_by_product(seed, max_nodes, max_depth):
    g = torch.Generator().manual_seed(seed)
    rates = tuple(tuple(sorted(torch.rand(3, generator=g).tolist(), reverse=True))
                  for _ in range(4))
    paths = rank_paths(rates, max_nodes, max_depth)
    best, score = _brute(rates, max_nodes, max_depth)
    assert sorted((score[p] for p in paths), reverse=True) == pytest.approx(best)
    seen = set()
    for p in paths:  # parents first: ancestor-closed and topological
        assert len(p) == 1 or p[:-1] in seen
        seen.add(p)


def test_example_of_the_docstring_and_tree():
    rates = ((0.6, 0.2), (0.5, 0.1))
    paths = rank_paths(rates, 3, 4)
    assert paths == ((0,), (0, 0), (1,))
    tokens = torch.tensor([[11, 12], [21, 22]])
    probs = torch.tensor([[0.7, 0.2], [0.4, 0.3]])
    tree = tree_from_ranks(paths, tokens, probs)
    assert tree.tokens.tolist() == [11, 21, 12] and tree.parents.tolist() == [-1, 0, -1]
    assert tree.path_probs.tolist() == pytest.approx([0.7, 0.28, 0.2])


def test_confident_top1_gives_a_chain_and_zero_budget_nothing():
    rates = ((0.9, 0.05),) * 5
    assert rank_paths(rates, 4, 4) == ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))
    assert rank_paths(rates, 4, 2) == ((0,), (0, 0), (1,), (0, 1))
    assert rank_paths(rates, 0, 4) == () and rank_paths(rates, 3, 0) == ()
    # the uncalibrated default: falls with depth and rank
    d = default_rates(3, 2)
    assert d[0][0] > d[1][0] > d[2][0] and d[0][0] > d[0][1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_trees_are_tree_from_ranks_without_a_read(dtype):
    """DeviceTrees gathers the same tokens, parents and path probabilities (bitwise, the
    products taken as tree_from_ranks takes them), for shapes made anew and for shapes that
    are the first rows of one made before; the tree is marked as the device's."""
    from specdec.drafters.rank_tree import DeviceTrees

    gen = torch.Generator().manual_seed(1)
    rates = default_rates(4, 3)
    trees = DeviceTrees()
    for max_nodes, depth in [(9, 4), (4, 4), (1, 4), (6, 2), (12, 4), (9, 4)]:
        tokens = torch.randint(0, 50_000, (4, 3), generator=gen)
        probs = torch.rand(4, 3, generator=gen).to(dtype)
        paths = rank_paths(rates, max_nodes, depth)
        want = tree_from_ranks(paths, tokens, probs)
        got = trees.tree(paths, tokens, probs)
        assert not got.tokens_on_host and got.num_nodes == len(paths)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.parents, want.parents)
        assert got.parent_list == want.parents.tolist()
        assert torch.equal(got.path_probs, want.path_probs)
    assert len(trees._shapes[3]) == 3  # (9, 4) and (12, 4) made anew, (6, 2); the rest reused
