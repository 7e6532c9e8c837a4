"""The gumbel verifier: it emits exactly what plain sampling with the same seed emits.

The oracle is plain sampling itself, written out: at position n the token is
``randomness.draw(p(prefix), key(seed, n))`` (an exact draw, tests/test_randomness.py). For random
trees (with duplicates, deterministic or with draft probabilities), seeds and start positions, the
verifier's tokens must be a prefix of that sequence, its accepted nodes the longest tree path
carrying it; so the output distribution is the target's, and does not depend on the drafts.
Acceptance at a node is then Σ p(children), which an empirical check confirms.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from verifier_oracles import Toy, make_batch, node_prefixes, sample_tree, target_rows

from specdec import randomness
from specdec.tree import DraftTree
from specdec.verifiers.greedy import GreedyVerifier
from specdec.verifiers.gumbel import GumbelVerifier

V = 4


def plain_sampling(target: Toy, seed: int, start: int, k: int) -> list[int]:
    """The first k tokens plain sampling emits from position ``start`` on (prefix () there)."""
    out: list[int] = []
    for i in range(k):
        p = target(tuple(out))[None]
        out.append(int(randomness.draw(p, [randomness.key(seed, start + i)])[0]))
    return out


def longest_path(tree: DraftTree, tokens: list[int]) -> list[int]:
    """Node indices of the longest root path whose tokens are a prefix of ``tokens`` (the first
    matching child wins among duplicates)."""
    path, parent = [], -1
    for t in tokens:
        kids = [c for c in tree.children(parent) if int(tree.tokens[c]) == t]
        if not kids:
            break
        path.append(kids[0])
        parent = kids[0]
    return path


@st.composite
def trees(draw):
    n = draw(st.integers(0, 6))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = draw(st.lists(st.integers(0, V - 1), min_size=n, max_size=n))
    return DraftTree(torch.tensor(tokens, dtype=torch.int64), torch.tensor(parents,
                                                                           dtype=torch.int64))


@settings(max_examples=60, deadline=None)
@given(batch=st.lists(st.tuples(trees(), st.integers(0, 2**62), st.integers(0, 5000)),
                      min_size=1, max_size=5), zeros=st.booleans())
def test_emits_the_plain_sampling_tokens_of_the_seed(batch, zeros):
    target = Toy(V, 31, zeros)
    ts, seeds, starts = zip(*batch)
    vb = make_batch(list(ts), [target_rows(t, target) for t in ts], list(seeds),
                    positions=list(starts))
    results = GumbelVerifier().verify(vb).to_results()
    for tree, seed, start, res in zip(ts, seeds, starts, results):
        want = plain_sampling(target, seed, start, tree.max_depth + 2)
        assert res.tokens == want[:len(res.tokens)]
        assert res.accepted == longest_path(tree, want)


def test_draft_probs_are_not_read_and_sampled_drafts_are_coupled():
    """Drafts sampled from q with the noise of their own position are accepted exactly when q
    and p race to the same token; whatever q says, the output is plain sampling's."""
    target, draft = Toy(V, 41), Toy(V, 42)
    seeds = list(range(400))
    ts = []
    for s in seeds:  # a 3-deep chain drawn from the draft with the SAMPLE noise
        toks: list[int] = []
        for d in range(3):
            q = draft(tuple(toks))[None]
            toks.append(int(randomness.draw(q, [randomness.key(s, 7 + d)])[0]))
        ts.append(DraftTree.chain(toks, torch.stack([draft(tuple(toks[:d])) for d in range(3)])))
    vb = make_batch(ts, [target_rows(t, target) for t in ts], seeds, positions=[7] * len(seeds))
    results = GumbelVerifier().verify(vb).to_results()
    bare = [DraftTree(t.tokens, t.parents) for t in ts]
    vb2 = make_batch(bare, [target_rows(t, target) for t in bare], seeds, positions=[7] * 400)
    assert GumbelVerifier().verify(vb2).to_results() == results
    for s, res in zip(seeds, results):
        assert res.tokens == plain_sampling(target, s, 7, 4)[:len(res.tokens)]
    assert sum(len(r.accepted) for r in results) > 300  # similar draft and target: accepted


def test_acceptance_is_the_children_mass():
    """One level of siblings: accepted with probability Σ p(children) (the q = 1 rule's)."""
    target = Toy(6, 51)
    p = target(())
    tree = DraftTree(torch.tensor([2, 4, 5]), torch.tensor([-1, -1, -1]))
    n = 6000
    rows = [target_rows(tree, target)] * n
    results = GumbelVerifier().verify(make_batch([tree] * n, rows, list(range(n)))).to_results()
    rate = sum(bool(r.accepted) for r in results) / n
    want = float(p[[2, 4, 5]].sum())
    assert abs(rate - want) < 4 * (want * (1 - want) / n) ** 0.5


def test_greedy_requests_take_the_greedy_rule():
    target = Toy(V, 61)
    ts = [sample_tree([-1, 0, -1], Toy(V, 62), torch.Generator().manual_seed(i))
          for i in range(6)]
    rows = [target_rows(t, target) for t in ts]
    mixed = make_batch(ts, rows, [None, 3, None, 4, None, 5], greedy=[True, False] * 3)
    got = GumbelVerifier().verify(mixed).to_results()
    greedy_only = make_batch(ts[::2], rows[::2], [None] * 3, greedy=[True] * 3)
    assert got[::2] == GreedyVerifier().verify(greedy_only).to_results()
    for i, seed in ((1, 3), (3, 4), (5, 5)):
        want = plain_sampling(target, seed, 0, 4)
        assert got[i].tokens == want[:len(got[i].tokens)]
    assert node_prefixes(ts[0])  # the trees are real
