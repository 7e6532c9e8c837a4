"""The sampling (rejection) verifier against exact oracles.

Every random choice it makes (a node's coin, the final draw) is enumerated by scripting them
(``verifier_oracles.exact_verify``), and the draft randomness is enumerated over all token
assignments weighted by q. Outputs shorter than K tokens are completed with the target's own
conditionals (what the next, lossless step would do), and the resulting distribution of the first
K tokens must equal the target's joint p(x1) p(x2 | x1) ... to 1e-9. A seeded empirical run
checks the real per-position randomness, and deliberately broken verifiers show the checks have
power.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from verifier_oracles import (
    Dist,
    Toy,
    exact_output,
    exact_verify,
    full_length,
    make_batch,
    max_diff,
    one,
    sample_tree,
    sampled_trees,
    target_joint,
    target_rows,
    topk_tree,
)

from specdec.tree import DraftTree
from specdec.verifiers import rejection
from specdec.verifiers.base import single
from specdec.verifiers.greedy import GreedyVerifier
from specdec.verifiers.rejection import RejectionVerifier

V = 4


# ---- exact losslessness ------------------------------------------------------------------------

@pytest.mark.parametrize("parents", [[-1], [-1, 0], [-1, 0, 1]])
@pytest.mark.parametrize("zeros", [False, True])
def test_chain_with_q_is_lossless(parents, zeros):
    target, draft = Toy(V, 1, zeros), Toy(V, 2)
    k = len(parents) + 1
    got = exact_output(sampled_trees(parents, draft), target, k)
    assert max_diff(got, target_joint(target, k)) < 1e-9


@pytest.mark.parametrize("tokens", [[0], [2, 0], [3, 3, 1]])
@pytest.mark.parametrize("zeros", [False, True])
def test_chain_without_q_is_lossless(tokens, zeros):
    target = Toy(V, 3, zeros)
    k = len(tokens) + 1
    got = exact_output(one(DraftTree.chain(tokens)), target, k)
    assert max_diff(got, target_joint(target, k)) < 1e-9


@pytest.mark.parametrize("parents", [[-1, -1], [-1, -1, -1], [-1, -1, 0, 1], [-1, -1, 0, 0]])
@pytest.mark.parametrize("without_replacement", [False, True])
def test_tree_with_q_is_lossless(parents, without_replacement):
    target, draft = Toy(V, 4, zeros=True), Toy(V, 5)
    k = full_length(parents)
    trees = sampled_trees(parents, draft, without_replacement)
    got = exact_output(trees, target, k)
    assert max_diff(got, target_joint(target, k)) < 1e-9


@pytest.mark.parametrize("shape", [[2], [3], [2, 1], [2, 2]])
def test_topk_tree_without_q_is_lossless(shape):
    target, draft = Toy(5, 6), Toy(5, 7)
    tree = topk_tree(shape, draft)
    k = tree.max_depth + 2
    got = exact_output(one(tree), target, k)
    assert max_diff(got, target_joint(target, k)) < 1e-9


def test_draft_equal_to_target_accepts_everything():
    target = Toy(V, 8)
    weighted = list(sampled_trees([-1, 0], target))
    dists = exact_verify([t for _, t in weighted], [target_rows(t, target) for _, t in weighted])
    for dist in dists:
        assert sum(pr for toks, pr in dist.items() if len(toks) == 3) == pytest.approx(1.0)


@settings(max_examples=100, deadline=None)
@given(data=st.data(), seed=st.integers(0, 10_000), use_q=st.booleans(), zeros=st.booleans())
def test_random_trees_are_lossless(data, seed, use_q, zeros):
    n = data.draw(st.integers(0, 5 if use_q else 7))
    parents = [data.draw(st.integers(-1, i - 1)) for i in range(n)]
    target, draft = Toy(3, seed, zeros), Toy(3, seed + 1, zeros)
    if use_q:
        trees = sampled_trees(parents, draft)
    else:
        tokens = data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
        trees = one(DraftTree(torch.tensor(tokens, dtype=torch.int64),
                              torch.tensor(parents, dtype=torch.int64)))
    k = full_length(parents)
    got = exact_output(trees, target, k)
    assert max_diff(got, target_joint(target, k)) < 1e-9


def test_trees_in_one_batch_are_verified_independently():
    """The exact distribution of each tree is the same alone and batched with others (one
    verifier call covers different shapes, with and without q)."""
    target, draft = Toy(V, 21), Toy(V, 22)
    trees = [DraftTree.empty(), DraftTree.chain([1, 2]), topk_tree([2, 1], draft),
             next(iter(sampled_trees([-1, -1, 0], draft)))[1]]
    rows = [target_rows(t, target) for t in trees]
    together = exact_verify(trees, rows)
    for tree, row, dist in zip(trees, rows, together):
        (alone,) = exact_verify([tree], [row])
        assert max_diff(alone, dist) < 1e-12


# ---- the checks have power ---------------------------------------------------------------------

def test_always_accept_fails_the_exact_check():
    target, draft = Toy(V, 1), Toy(V, 2)
    got = exact_output(sampled_trees([-1, 0], draft), target, 3, threshold=lambda t: 1.0)
    assert max_diff(got, target_joint(target, 3)) > 0.02


def test_misreported_draft_probs_fail_the_exact_check():
    target, draft, claimed = Toy(V, 1), Toy(V, 2), Toy(V, 9)
    got = exact_output(sampled_trees([-1, -1], draft, claimed=claimed), target, 2)
    assert max_diff(got, target_joint(target, 2)) > 0.01


def test_q1_residual_keeping_the_rejected_token_fails_the_exact_check(monkeypatch):
    monkeypatch.setattr(rejection, "residual_without", lambda r, x: r.clone())
    target, draft = Toy(5, 6), Toy(5, 7)
    got = exact_output(one(topk_tree([2, 1], draft)), target, 3)
    assert max_diff(got, target_joint(target, 3)) > 0.01


def test_correction_drawn_from_p_instead_of_the_residual_fails_the_exact_check(monkeypatch):
    """After rejecting a draft drawn from q, the correction must come from norm(max(0, p - q)):
    drawing it from p (the residual left as r) over-weights the tokens q favours."""
    monkeypatch.setattr(rejection, "residual_with_q", lambda r, q: r.clone())
    target, draft = Toy(V, 1), Toy(V, 2)
    got = exact_output(sampled_trees([-1], draft), target, 2)
    assert max_diff(got, target_joint(target, 2)) > 0.01


# ---- the real randomness ----------------------------------------------------------------------

def empirical_tv(trials: int, seed: int) -> float:
    """TV distance between sampled (x1, x2) and the target joint, depth-2 tree with q; every
    trial is one request (its own seed) of one batched verifier call."""
    target, draft, g = Toy(V, 11), Toy(V, 12), torch.Generator().manual_seed(seed)
    trees = [sample_tree([-1, -1, 0, 1], draft, g) for _ in range(trials)]
    seeds = [seed * trials + i for i in range(trials)]
    batch = make_batch(trees, [target_rows(t, target) for t in trees], seeds)
    counts: Dist = defaultdict(float)
    for res in RejectionVerifier().verify(batch).to_results():
        toks = res.tokens
        if len(toks) < 2:
            toks = toks + [int(torch.multinomial(target(tuple(toks)), 1, generator=g))]
        counts[tuple(toks[:2])] += 1.0 / trials
    return 0.5 * sum(abs(counts.get(key, 0.0) - pr)
                     for key, pr in target_joint(target, 2).items())


def test_empirical_distribution_matches_target():
    assert empirical_tv(20_000, seed=0) < 0.02


def test_empirical_check_catches_naive_accept(monkeypatch):
    draw = rejection._randomness

    def zero_coins(*args):  # every coin 0: a child is accepted whenever its probability is > 0
        coins, noise = draw(*args)
        return coins.zero_(), noise

    monkeypatch.setattr(rejection, "_randomness", zero_coins)
    assert empirical_tv(5_000, seed=0) > 0.02


SHAPES = [[], [-1], [-1, -1, 0], [-1, 0, 1, 2], [-1, -1, -1, 0, 1]]


def _seeded_requests(seeds: list[int], target: Toy, draft: Toy):
    """One sampled tree per seed (its shape and tokens fixed by the seed, shapes of 0 to 5
    nodes), their target rows and the seeds."""
    trees = [sample_tree(SHAPES[s % len(SHAPES)], draft, torch.Generator().manual_seed(1000 + s))
             if s % len(SHAPES) else DraftTree.empty() for s in seeds]
    rows = [target_rows(t, target) for t in trees]
    return trees, rows, list(seeds)


def test_seed_reproduces_result_whatever_the_batch():
    target, draft = Toy(V, 13), Toy(V, 14)
    seeds = list(range(40))

    def run(order: list[int]) -> dict[int, list[int]]:
        trees, rows, gens = _seeded_requests(order, target, draft)
        out = RejectionVerifier().verify(make_batch(trees, rows, gens)).to_results()
        return {s: r.tokens for s, r in zip(order, out)}

    first = run(seeds)
    assert run(seeds) == first  # same seeds, same tokens
    assert run(seeds[::-1]) == first  # other positions and neighbours
    assert {s: run([s])[s] for s in seeds[:8]} == {s: first[s] for s in seeds[:8]}  # alone
    shifted = run([s + 100 for s in seeds])
    assert [shifted[s + 100] for s in seeds] != [first[s] for s in seeds]


def test_seeded_request_is_unaffected_by_greedy_neighbours():
    target, draft = Toy(V, 15), Toy(V, 16)
    trees, rows, gens = _seeded_requests([7, 8], target, draft)
    alone = RejectionVerifier().verify(make_batch(trees, rows, gens)).to_results()
    plain = DraftTree.chain([1, 2])
    mixed_trees = [plain, trees[0], plain, trees[1]]
    mixed_rows = [target_rows(plain, target), rows[0], target_rows(plain, target), rows[1]]
    batch = make_batch(mixed_trees, mixed_rows, [None, 7, None, 8],
                       greedy=[True, False, True, False])
    mixed = RejectionVerifier().verify(batch).to_results()
    assert [mixed[1], mixed[3]] == alone


# ---- errors and edge cases ---------------------------------------------------------------------

def test_zero_draft_prob_for_drafted_token_is_an_error():
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    tree = DraftTree.chain([2], draft_probs=q)
    probs = torch.full((2, 4), 0.25)
    with pytest.raises(ValueError, match="draft probability 0"):
        RejectionVerifier().verify(single(tree, probs.log(), probs, seed=0))
    with pytest.raises(ValueError, match=r"draft_probs\[0, 2\]"):  # the engine's check first
        tree.validate(check_probs=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype):
    q = torch.softmax(torch.randn(2, 6), -1).to(dtype)
    tree = DraftTree.chain([1, 4], draft_probs=q)
    probs = torch.softmax(torch.randn(3, 6), -1).to(dtype)
    batch = single(tree, probs.log(), probs, seed=0)
    (result,) = RejectionVerifier().verify(batch).to_results()
    assert len(result.tokens) == len(result.accepted) + 1 and all(0 <= t < 6 for t in result.tokens)


def test_rejection_without_probs_is_greedy():
    tree = DraftTree(torch.tensor([1, 2, 3]), torch.tensor([-1, -1, 1]))
    logits = torch.eye(4)[[2, 3, 0, 1]]
    got = RejectionVerifier().verify(single(tree, logits)).to_results()
    assert got == GreedyVerifier().verify(single(tree, logits)).to_results()
    assert got[0].accepted == [1] and got[0].tokens == [2, 0]
