"""The suffix drafter's speculation (drafters/suffix_speculate.py, and its compiled twin) against
a brute-force suffix-tree oracle (ArcticInference's speculate), the count trie, draft sizes
adapting to the match length, min_token_prob, and the corpus' occurrence lookup."""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter

import numpy as np
import pytest
from suffix_helpers import TREE

from specdec.drafters.suffix_corpus import TokenCorpus
from specdec.drafters.suffix_speculate import SpeculateParams, count_trie, speculate

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _corpus(*docs: list[int]) -> TokenCorpus:
    c = TokenCorpus()
    for d in docs:
        c.append(d)
        c.end_document()
    return c


def _paths(draft) -> dict[tuple, float]:
    """{root-to-node token path: probability} of a draft."""
    out, paths = {}, []
    for tok, par, p in zip(draft.tokens.tolist(), draft.parents.tolist(), draft.probs.tolist()):
        paths.append((paths[par] if par >= 0 else ()) + (tok,))
        out[paths[-1]] = p
    return out


# ---- the oracle: a depth-unbounded suffix tree, ArcticInference's speculate by brute force ----

def oracle(docs, pattern, max_nodes, max_depth, p: SpeculateParams):
    """(score, match length, {path: prob}) as ArcticInference's SuffixTree::speculate would
    draft (heap expansion or top-child path), on the documents ``docs``."""
    best = (0.0, 0, {})
    for m in range(1, len(pattern) + 1):
        suffix = list(pattern[-m:])
        conts = [d[i + 1:i + 1 + max_depth] for d in docs for i in range(m - 1, len(d))
                 if d[i - m + 1:i + 1] == suffix]
        if not conts:
            break
        budget = min(max_nodes, int(m * p.max_spec_factor + p.max_spec_offset + 1e-6))
        count = Counter(tuple(c[:k]) for c in conts for k in range(1, len(c) + 1))
        count[()] = len(conts)
        kids: dict[tuple, list] = {}
        for path in count:
            if path:
                kids.setdefault(path[:-1], []).append(path)
        out = _heap(count, kids, budget, p.min_token_prob) if p.tree else \
            _path(count, kids, budget, p.min_token_prob)
        score = sum(out.values())
        if out and score >= best[0] - 1e-9:
            best = (score, m, out)
    return best


def _occurrences(docs, s: list[int]) -> int:
    return sum(d[i:i + len(s)] == s for d in docs for i in range(len(d) - len(s) + 1))


def _heap(count, kids, budget, min_prob) -> dict:
    out, heap, tick = {}, [(-1.0, 0, ())], 1
    while heap and len(out) < budget:
        q, _, path = heapq.heappop(heap)
        if path:
            out[path] = -q
        for child in kids.get(path, []):
            prob = -q * (count[child] / count[path])
            if prob >= min_prob:
                heapq.heappush(heap, (-prob, tick, child))
                tick += 1
    return out


def _path(count, kids, budget, min_prob) -> dict:
    out, path, prob = {}, (), 1.0
    while len(out) < budget and kids.get(path):
        child = max(sorted(kids[path]), key=lambda c: count[c])
        prob *= count[child] / count[path]
        if prob < min_prob:
            break
        out[child], path = prob, child
    return out


@pytest.mark.parametrize("tree", [True, False])
def test_speculation_matches_the_suffix_tree_oracle(tree):
    rng = random.Random(0)
    for case in range(300):
        docs = [[rng.randrange(4) for _ in range(rng.randrange(0, 30))]
                for _ in range(rng.randrange(1, 5))]
        pattern = [rng.randrange(4) for _ in range(rng.randrange(1, 8))]
        p = SpeculateParams(rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 1.0]),
                            rng.choice([0.0, 0.1, 0.3]), 1 << 20, tree)
        max_nodes, depth = rng.randrange(1, 10), rng.randrange(1, 8)
        score, m, want = oracle(docs, pattern, max_nodes, depth, p)
        got = speculate(_corpus(*docs), np.array(pattern), 1 << 30, max_nodes, depth, p)
        if not want:
            assert got is None, case
            continue
        assert got is not None and got.match_len == m and math.isclose(got.score, score), case
        have = _paths(got)
        assert len(have) == len(want), case
        if not tree:  # a path has no ties to break
            assert list(have) == list(want), case
        for path, prob in have.items():  # a tie at the budget's edge may pick another node
            want_p = _occurrences(docs, pattern[-m:] + list(path)) / _occurrences(
                docs, pattern[-m:])
            assert math.isclose(prob, want_p) and prob >= p.min_token_prob, case
        parents = got.parents.tolist()
        assert all(-1 <= q < i for i, q in enumerate(parents)), case


def test_count_trie_is_the_docstring_example():
    tokens, parents, counts, probs = count_trie(np.array([[7, 8], [7, 8], [7, 9], [4, -1]]), 0.0)
    assert tokens.tolist() == [4, 7, 8, 9] and parents.tolist() == [-1, -1, 1, 1]
    assert counts.tolist() == [1, 3, 2, 1] and probs.tolist() == [0.25, 0.75, 0.5, 0.25]


def test_draft_size_adapts_to_the_match_length():
    c = _corpus([1, 2, 3, 4, 5, 6, 7, 8])
    one = speculate(c, np.array([9, 3]), c.n, 16, 16, TREE)  # 1 token matched
    three = speculate(c, np.array([1, 2, 3]), c.n, 16, 16, TREE)
    assert one.tokens.tolist() == [4] and three.tokens.tolist() == [4, 5, 6]
    wide = SpeculateParams(2.0, 0.0, 0.1, 64, True)
    assert speculate(c, np.array([1, 2, 3]), c.n, 16, 16, wide).tokens.tolist() == [4, 5, 6, 7,
                                                                                    8]
    assert speculate(c, np.array([1, 2, 3]), c.n, 2, 16, wide).tokens.tolist() == [4, 5]


def test_min_token_prob_cuts_rare_continuations():
    c = _corpus(*([[5, 1]] * 9 + [[5, 2]]))  # after 5: 1 with p 0.9, 2 with p 0.1
    loose = SpeculateParams(1.0, 2.0, 0.1, 64, True)
    strict = SpeculateParams(1.0, 2.0, 0.2, 64, True)
    assert _paths(speculate(c, np.array([5]), c.n, 8, 4, loose)) == {(1,): 0.9, (2,): 0.1}
    assert _paths(speculate(c, np.array([5]), c.n, 8, 4, strict)) == {(1,): 0.9}


def test_the_request_itself_is_not_an_occurrence():
    c = TokenCorpus()
    c.append([3, 4, 5, 3])
    d = speculate(c, np.array([5, 3]), c.n - 1, 8, 8, TREE)  # 3 at position 0 only
    assert d.tokens.tolist() == [4] and d.match_len == 1


def test_lookup_after_the_sort_and_with_blanked_documents():
    rng = random.Random(1)
    docs = [[rng.randrange(50) for _ in range(rng.randrange(1, 400))] for _ in range(40)]
    c = _corpus(*docs)
    assert c.n_sorted > 0  # the index is sorted and has a tail
    flat = np.concatenate([np.array(d + [-1]) for d in docs])
    c.remove(0, len(docs[0]))
    flat[:len(docs[0])] = -2
    for tok in range(50):
        want = np.flatnonzero(flat == tok)
        assert c.positions(tok, 1 << 20).tolist() == want.tolist()
        assert c.positions(tok, 3).tolist() == want[-3:].tolist()
