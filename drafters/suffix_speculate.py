"""SuffixDecoding's speculation (arXiv 2411.04975; ArcticInference ``SuffixTree::speculate``) over
a ``TokenCorpus``, vectorised with numpy.

The occurrences of the context's last token are extended backwards to their match length (how
many of the context's last tokens end there). For a match length m, the continuations of the
occurrences matching at least m tokens form a trie whose node counts are the suffix tree's: a
node's probability is the running product of child count / parent count, so the probability of
a continuation given the matched suffix (a row that stops at a document's end counts in its
parent's total; the product telescopes to the node's count / the number of occurrences).
Example, continuations [[7, 8], [7, 8], [7, 9], [4, -1]]::

    7 (p = 3/4) ─┬─ 8 (p = 3/4 * 2/3 = 1/2)
                 └─ 9 (p = 1/4)
    4 (p = 1/4)

Tree mode keeps the ``budget`` most probable nodes with p >= ``min_token_prob`` (ArcticInference's
heap expansion: p never grows along a path, so the set is closed under parents); path mode
follows the most frequent child. Budget = min(max_nodes, floor(m * max_spec_factor +
max_spec_offset)), so a longer match may draft more (the paper's adaptive MAX_SPEC = alpha * p).
Score = sum of the drafted nodes' p (the expected number accepted if the corpus is the model),
added left to right in draft order; the best-scoring m wins, ties to the longer match.

This module is the oracle of the compiled hot path (specdec/native/suffix.c, through
``suffix_native``), which follows it step by step: both give identical drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdec.drafters.suffix_corpus import TokenCorpus

_STRIDE = 1 << 32  # trie keys: (parent node + 1) * _STRIDE + token
_TIE = 1e-9  # scores this close are equal (sums of products, rounded): the longer match wins
TOUCHED = 32  # a draft reports the latest this many occurrences it came from (Draft.ends)


@dataclass(frozen=True)
class SpeculateParams:
    max_spec_factor: float
    max_spec_offset: float
    min_token_prob: float
    max_candidates: int  # latest occurrences of the last token looked at
    tree: bool  # tree mode (True) or path mode


@dataclass
class Draft:
    """A drafted tree in DraftTree order (parents[i] < i, -1 = below the last token)."""

    tokens: np.ndarray  # [n] int64
    parents: np.ndarray  # [n] int64
    probs: np.ndarray  # [n] float64: the corpus probability of the path to node i
    score: float  # probs.sum()
    match_len: int
    ends: np.ndarray  # [<= TOUCHED] int64: the latest corpus positions it was drafted from


def speculate(corpus: TokenCorpus, pattern: np.ndarray, before: int, max_nodes: int,
              max_depth: int, params: SpeculateParams) -> Draft | None:
    """The best draft after ``pattern`` (the context's last tokens, int64) from the occurrences
    ending before position ``before``; None when there is none or it would be empty."""
    if not len(pattern) or max_nodes <= 0:
        return None
    ends = corpus.positions(int(pattern[-1]), params.max_candidates)
    ends = ends[ends < before]
    if not len(ends):
        return None
    lengths = corpus.match_lengths(ends, pattern)
    best = None
    for m in np.flatnonzero(np.bincount(lengths))[::-1].tolist():
        budget = min(max_nodes, int(m * params.max_spec_factor + params.max_spec_offset + 1e-6))
        if budget <= 0 or (best is not None and best.score >= budget):
            break  # budgets only shrink with m: nothing shorter can score higher
        rows = ends[lengths >= m]
        got = _draft(corpus.continuations(rows, min(max_depth, budget)), budget, params)
        if got is not None and (best is None or got[3] > best.score + _TIE):
            best = Draft(*got, match_len=m, ends=rows[-TOUCHED:])
    return best


def _draft(conts: np.ndarray, budget: int, params: SpeculateParams):
    """(tokens, parents, probs, score) of the draft from continuation rows [k, depth], or None."""
    if conts.shape[0] == 1:  # one occurrence (the usual long match): its continuation, p = 1
        tokens = conts[0, :budget]
        tokens = tokens[: int(np.argmin(tokens >= 0)) if tokens.min() < 0 else len(tokens)]
        if not len(tokens):
            return None
        return tokens, np.arange(-1, len(tokens) - 1), np.ones(len(tokens)), float(len(tokens))
    tokens, parents, counts, probs = count_trie(conts, params.min_token_prob)
    if not len(tokens):
        return None
    keep = _best_nodes(probs, budget) if params.tree else _best_path(parents, counts, budget)
    keep.sort()  # node order is depth-major, hence topological
    remap = np.full(len(tokens) + 1, -1, dtype=np.int64)  # slot 0: the root
    remap[keep + 1] = np.arange(len(keep))
    picked = probs[keep]
    # left to right, as the C path adds (numpy's pairwise sum rounds otherwise past 8 terms)
    return tokens[keep], remap[parents[keep] + 1], picked, float(sum(picked.tolist()))


def count_trie(conts: np.ndarray, min_prob: float):
    """The trie of the rows of ``conts`` ([k, depth] int64, -1 padded), nodes depth by depth,
    those below ``min_prob`` left out: (tokens, parents (-1 = root), counts, probs), each [n].

    A node's probability is its count / k (the product of child / parent counts telescopes).
    The rows are sorted once; at each depth a node starts at a row that continues there and
    differs from the row above in some column up to that depth (rows that stop sort first)."""
    k, depth = conts.shape
    rows = conts[np.lexsort(conts.T[::-1])] if k > 1 else conts
    live = rows >= 0  # [k, depth]
    differs = np.ones((k, depth), dtype=bool)
    differs[1:] = np.logical_or.accumulate(rows[1:] != rows[:-1], axis=1)
    start = (live & differs).T  # [depth, k]: depth-major, hence topological
    node = np.cumsum(start.ravel()).reshape(depth, k) - 1  # each row's node at each depth
    counts = np.bincount(node.ravel()[live.T.ravel()], minlength=int(node[-1, -1]) + 1)
    d, i = np.nonzero(start)
    parents = np.where(d > 0, node[np.maximum(d - 1, 0), i], -1)
    probs = counts / k
    keep = probs >= min_prob  # closed under parents: a child never counts more
    remap = np.cumsum(keep) - 1
    parents = np.where(parents >= 0, remap[np.maximum(parents, 0)], -1)
    return rows.T[start][keep], parents[keep], counts[keep], probs[keep]


def _best_nodes(probs: np.ndarray, budget: int) -> np.ndarray:
    """The ``budget`` most probable nodes; on a tie the earlier (shallower) node first, so a
    parent always comes before its child."""
    return np.lexsort((np.arange(len(probs)), -probs))[:budget]


def _best_path(parents: np.ndarray, counts: np.ndarray, budget: int) -> np.ndarray:
    """From the root down, the child with the highest count (the first of equals)."""
    path, cur = [], -1
    while len(path) < budget:
        children = np.flatnonzero(parents == cur)
        if not len(children):
            break
        cur = int(children[np.argmax(counts[children])])
        path.append(cur)
    return np.array(path, dtype=np.int64)
