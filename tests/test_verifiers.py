"""Verifiers against exact oracles.

The sampling verifier is checked exactly: every random choice it makes (a coin or a draw) is
enumerated by replaying it with scripted choices, and the draft randomness is enumerated over all
token assignments weighted by q. Outputs shorter than K tokens are completed with the target's
own conditionals (what the next, lossless step would do), and the resulting distribution of the
first K tokens must equal the target's joint p(x1) p(x2 | x1) ... to 1e-9. A seeded empirical run
checks the real torch.Generator path, and deliberately broken verifiers show the checks have power.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.tree import DraftTree
from specdec.verifiers.base import Verifier
from specdec.verifiers.greedy import GreedyVerifier
from specdec.verifiers.rejection import RejectionVerifier

Dist = dict[tuple[int, ...], float]


class Toy:
    """A tiny 'language model': a fixed random distribution over V tokens per prefix."""

    def __init__(self, vocab: int, seed: int, zeros: bool = False):
        self.vocab, self.seed, self.zeros = vocab, seed, zeros
        self._cache: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, prefix: tuple[int, ...]) -> torch.Tensor:  # [V] float64
        if prefix not in self._cache:
            rng = np.random.default_rng([self.seed, len(prefix), *prefix])
            w = rng.gamma(0.8, size=self.vocab)
            if self.zeros:
                w[rng.random(self.vocab) < 0.35] = 0.0
                w[rng.integers(self.vocab)] += 0.1
            self._cache[prefix] = torch.tensor(w / w.sum())
        return self._cache[prefix]


def node_prefixes(tree: DraftTree) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    for tok, p in zip(tree.tokens.tolist(), tree.parents.tolist()):
        out.append((out[p] if p >= 0 else ()) + (tok,))
    return out


def target_rows(tree: DraftTree, target: Toy) -> torch.Tensor:  # [1 + n, V]
    return torch.stack([target(())] + [target(pre) for pre in node_prefixes(tree)])


class Scripted(RejectionVerifier):
    """Replays scripted random choices; past the script takes option 0 and queues the others."""

    def __init__(self, script: list[int]):
        self.script, self.taken, self.branches, self.prob = script, [], [], 1.0

    def _choose(self, options: list[tuple[object, float]]):
        k = self.script[len(self.taken)] if len(self.taken) < len(self.script) else 0
        if len(self.taken) >= len(self.script):
            self.branches += [self.taken + [alt] for alt in range(1, len(options))]
        self.taken.append(k)
        self.prob *= options[k][1]
        return options[k][0]

    def _coin(self, prob, generator):
        return self._choose([(v, w) for v, w in ((True, prob), (False, 1.0 - prob)) if w > 0])

    def _draw(self, dist, generator):
        dist = dist / dist.sum()
        return self._choose([(i, w) for i, w in enumerate(dist.tolist()) if w > 0])


class AlwaysAccept(Scripted):
    """Broken on purpose: accepts every drafted child."""

    def _coin(self, prob, generator):
        return True


def enumerate_verify(cls: type[Scripted], tree: DraftTree, probs: torch.Tensor) -> Dist:
    """Exact distribution of the emitted token tuple of one verification."""
    out: Dist = defaultdict(float)
    todo: list[list[int]] = [[]]
    while todo:
        v = cls(todo.pop())
        result = v.verify(tree, probs.log(), probs, None)
        todo += v.branches
        out[tuple(result.tokens)] += v.prob
    assert abs(sum(out.values()) - 1.0) < 1e-9
    return out


def extend(out: Dist, tokens: tuple[int, ...], w: float, target: Toy, k: int) -> None:
    """Add ``tokens`` (weight w) to ``out`` as K-token prefixes, completing short ones by p."""
    if len(tokens) >= k:
        out[tokens[:k]] += w
        return
    for x, px in enumerate(target(tokens).tolist()):
        if px > 0:
            extend(out, tokens + (x,), w * px, target, k)


def target_joint(target: Toy, k: int) -> Dist:
    out: Dist = defaultdict(float)
    extend(out, (), 1.0, target, k)
    return out


def exact_output(trees: Iterator[tuple[float, DraftTree]], target: Toy, k: int,
                 cls: type[Scripted] = Scripted) -> Dist:
    out: Dist = defaultdict(float)
    for weight, tree in trees:
        for tokens, pr in enumerate_verify(cls, tree, target_rows(tree, target)).items():
            extend(out, tokens, weight * pr, target, k)
    return out


def max_diff(a: Dist, b: Dist) -> float:
    return max(abs(a.get(key, 0.0) - b.get(key, 0.0)) for key in set(a) | set(b))


def sampled_trees(parents: list[int], draft: Toy, without_replacement: bool = False,
                  claimed: Toy | None = None) -> Iterator[tuple[float, DraftTree]]:
    """Every token assignment of a tree shape, each node drawn from draft(path to its parent).

    Siblings are i.i.d., or without replacement (q renormalised over the not-yet-drawn tokens).
    ``claimed`` reports a different q in draft_probs than the one sampled from (a drafter bug).
    """
    n = len(parents)
    for toks in itertools.product(range(draft.vocab), repeat=n):
        weight, rows, pres = 1.0, [], []
        for i, p in enumerate(parents):
            base = pres[p] if p >= 0 else ()
            q, said = draft(base).clone(), (claimed or draft)(base).clone()
            if without_replacement:
                taken = [toks[j] for j in range(i) if parents[j] == p]
                q[taken], said[taken] = 0.0, 0.0
                q, said = q / q.sum(), said / said.sum()
            weight *= float(q[toks[i]])
            rows.append(said)
            pres.append(base + (toks[i],))
        if weight > 0:
            probs = torch.stack(rows) if rows else torch.zeros(0, draft.vocab, dtype=torch.float64)
            yield weight, DraftTree(torch.tensor(toks, dtype=torch.int64),
                                    torch.tensor(parents, dtype=torch.int64), probs)


def topk_tree(shape: list[int], draft: Toy) -> DraftTree:
    """Deterministic tree: ``shape[d]`` = children per node at depth d, the draft's top tokens."""
    paths: list[tuple[int, ...]] = [()]
    seqs: list[tuple[int, ...]] = []
    for width in shape:
        paths = [pre + (int(t),) for pre in paths
                 for t in torch.topk(draft(pre), width).indices.tolist()]
        seqs += paths
    return DraftTree.from_paths(sorted(seqs, key=len))


def full_length(parents: list[int]) -> int:
    """Most tokens one verification can emit: the longest path + the bonus token."""
    shape = DraftTree(torch.zeros(len(parents), dtype=torch.int64), torch.tensor(parents))
    return shape.max_depth + 2


def one(tree: DraftTree) -> Iterator[tuple[float, DraftTree]]:
    yield 1.0, tree


# ---- exact losslessness ------------------------------------------------------------------------

V = 4


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
    for _, tree in sampled_trees([-1, 0], target):
        out = enumerate_verify(Scripted, tree, target_rows(tree, target))
        assert sum(pr for toks, pr in out.items() if len(toks) == 3) == pytest.approx(1.0)


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


# ---- the checks have power ---------------------------------------------------------------------

def test_always_accept_fails_the_exact_check():
    target, draft = Toy(V, 1), Toy(V, 2)
    got = exact_output(sampled_trees([-1, 0], draft), target, 3, cls=AlwaysAccept)
    assert max_diff(got, target_joint(target, 3)) > 0.02


def test_misreported_draft_probs_fail_the_exact_check():
    target, draft, claimed = Toy(V, 1), Toy(V, 2), Toy(V, 9)
    got = exact_output(sampled_trees([-1, -1], draft, claimed=claimed), target, 2)
    assert max_diff(got, target_joint(target, 2)) > 0.01


# ---- the real generator path -------------------------------------------------------------------

def sample_tree(parents: list[int], draft: Toy, g: torch.Generator) -> DraftTree:
    toks, rows, pres = [], [], []
    for p in parents:
        q = draft(pres[p] if p >= 0 else ())
        toks.append(int(torch.multinomial(q, 1, generator=g)))
        rows.append(q)
        pres.append((pres[p] if p >= 0 else ()) + (toks[-1],))
    return DraftTree(torch.tensor(toks), torch.tensor(parents), torch.stack(rows))


def empirical_tv(verifier: Verifier, trials: int, seed: int) -> float:
    """TV distance between sampled (x1, x2) and the target joint, depth-2 tree with q."""
    target, draft, g = Toy(V, 11), Toy(V, 12), torch.Generator().manual_seed(seed)
    counts: Dist = defaultdict(float)
    for _ in range(trials):
        tree = sample_tree([-1, -1, 0, 1], draft, g)
        probs = target_rows(tree, target)
        toks = verifier.verify(tree, probs.log(), probs, g).tokens
        if len(toks) < 2:
            toks = toks + [int(torch.multinomial(target(tuple(toks)), 1, generator=g))]
        counts[tuple(toks[:2])] += 1.0 / trials
    return 0.5 * sum(abs(counts.get(key, 0.0) - pr)
                     for key, pr in target_joint(target, 2).items())


class NaiveAccept(RejectionVerifier):
    def _coin(self, prob, generator):
        return True


def test_empirical_distribution_matches_target():
    assert empirical_tv(RejectionVerifier(), 20_000, seed=0) < 0.02


def test_empirical_check_catches_naive_accept():
    assert empirical_tv(NaiveAccept(), 5_000, seed=0) > 0.02


def test_seed_reproduces_result():
    target, draft = Toy(V, 13), Toy(V, 14)

    def run(seed: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(50):
            tree = sample_tree([-1, -1, 0], draft, g)
            probs = target_rows(tree, target)
            out.append(RejectionVerifier().verify(tree, probs.log(), probs, g).tokens)
        return out

    assert run(3) == run(3)
    assert run(3) != run(4)


# ---- errors and edge cases ---------------------------------------------------------------------

def test_zero_draft_prob_for_drafted_token_is_an_error():
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    tree = DraftTree.chain([2], draft_probs=q)
    probs = torch.full((2, 4), 0.25)
    with pytest.raises(ValueError, match=r"draft_probs\[0, 2\]"):
        RejectionVerifier().verify(tree, probs.log(), probs, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("verifier", [GreedyVerifier(), RejectionVerifier()])
def test_shape_errors(verifier):
    tree = DraftTree.chain([1, 2])
    with pytest.raises(ValueError, match="1 \\+ n rows"):
        verifier.verify(tree, torch.zeros(2, 4), None, None)
    with pytest.raises(ValueError, match="probs must match"):
        verifier.verify(tree, torch.zeros(3, 4), torch.zeros(3, 5), None)
    with pytest.raises(ValueError, match=r"tokens\[1\] = 2"):
        verifier.verify(tree, torch.zeros(3, 2), None, None)


def test_bad_probs_rows_are_errors():
    tree = DraftTree.chain([1])
    probs = torch.tensor([[0.5, 0.5], [0.0, 0.0]])
    with pytest.raises(ValueError, match="probs row 1"):
        RejectionVerifier().verify(tree, torch.zeros(2, 2), probs, None)
    with pytest.raises(ValueError, match="non-negative"):
        RejectionVerifier().verify(tree, torch.zeros(2, 2), -probs, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype):
    q = torch.softmax(torch.randn(2, 6), -1).to(dtype)
    tree = DraftTree.chain([1, 4], draft_probs=q)
    probs = torch.softmax(torch.randn(3, 6), -1).to(dtype)
    result = RejectionVerifier().verify(tree, probs.log(), probs, torch.Generator().manual_seed(0))
    assert len(result.tokens) == len(result.accepted) + 1 and all(0 <= t < 6 for t in result.tokens)


def test_rejection_without_probs_is_greedy():
    tree = DraftTree(torch.tensor([1, 2, 3]), torch.tensor([-1, -1, 1]))
    logits = torch.eye(4)[[2, 3, 0, 1]]
    assert RejectionVerifier().verify(tree, logits, None, None) == \
        GreedyVerifier().verify(tree, logits, None, None)
