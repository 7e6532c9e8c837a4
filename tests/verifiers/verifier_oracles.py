"""Exact oracles for the sampling verifier: tiny "language models", every tree a drafter could
sample, and the exact output distribution of one verification.

How ``exact_verify`` gets the verifier's exact distribution. The rejection verifier draws, per
request, one coin per node (node c is accepted iff ``coins[b, c]`` is below its acceptance
probability) and one Exp(1) noise row for the final draw (``argmax r / E``, a draw from the walk's
final distribution r, at the position after the accepted path). Both are replaced
(``rejection._randomness``):

- the coins become a tensor whose comparison answers from a script, "accept exactly the nodes of
  the root path P", and records the probability each node was compared against (its threshold t);
- the noise is 1 except at one token x, so the final draw is x whenever r(x) > 0.

One batched call runs every (tree, P, x). The walk tries children in index order, so the
probability of P is the product, over the nodes the walk tried, of t (accepted) or 1 - t
(rejected); times r_P(x), the distribution the final draw is made from (recorded by wrapping
``final_draw``). The thresholds and r come from the verifier itself, so a wrong acceptance rule,
residual or final draw shows up in the distribution; the scripted outcomes are checked against
what the verifier emitted.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from unittest import mock

import numpy as np
import torch

from specdec.tree import DraftTree
from specdec.verifiers import rejection
from specdec.verifiers.base import VerifyBatch

Dist = dict[tuple[int, ...], float]
TINY = 1e-300  # noise of the scripted final token: r(x) / TINY beats every r(y) / 1 if r(x) > 0


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


def make_batch(trees: list[DraftTree], probs: list[torch.Tensor], seeds: list,
               greedy: list[bool] | None = None, positions: list[int] | None = None) -> VerifyBatch:
    """A VerifyBatch of requests with the given trees and [1 + n, V] target probs rows (every
    request at position 0 unless ``positions`` says otherwise)."""
    cu = [0]
    for t in trees:
        cu.append(cu[-1] + 1 + t.num_nodes)
    rows = torch.cat(probs)
    greedy = [False] * len(trees) if greedy is None else greedy
    positions = [0] * len(trees) if positions is None else positions
    return VerifyBatch(list(trees), cu, rows.log(), rows, greedy, list(seeds), list(positions))


# ---- exact distribution of one verification ----------------------------------------------------

@dataclass
class _Script:
    accept: list[int]  # the root path P (node indices in depth order) the coins accept
    token: int  # the token the noise picks for the final draw


_LESS = {torch.Tensor.__lt__, torch.Tensor.lt, torch.lt, torch.Tensor.__le__, torch.Tensor.le,
         torch.le}
_GREATER = {torch.Tensor.__gt__, torch.Tensor.gt, torch.gt, torch.Tensor.__ge__, torch.Tensor.ge,
            torch.ge}


def _coins_class(accept: torch.Tensor, thresholds: torch.Tensor, seen: torch.Tensor):
    """A tensor subclass for coins whose values are node indices: comparing a gathered coin row
    [B] with the acceptance probabilities [B] answers ``accept[b, node]`` and records each node's
    first probability (later comparisons of a node are the walk's inactive lanes)."""

    class Coins(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if (func in _LESS or func in _GREATER) and len(args) == 2:
                first = isinstance(args[0], Coins)
                coin, prob = args if first else args[::-1]
                with torch._C.DisableTorchFunctionSubclass():
                    nodes = torch.Tensor.as_subclass(coin, torch.Tensor).long()
                    prob = torch.Tensor.as_subclass(prob, torch.Tensor)
                    assert nodes.shape == prob.shape == (accept.shape[0],), (
                        "expected one coin per request compared with one probability each")
                    rows = torch.arange(accept.shape[0])
                    new = ~seen[rows, nodes]
                    thresholds[rows[new], nodes[new]] = prob[new].to(torch.float64)
                    seen[rows, nodes] = True
                    take = accept[rows, nodes]
                    # coin < prob accepts; coin > prob is the complement (and mirrored)
                    return take if first == (func in _LESS) else ~take
            return super().__torch_function__(func, types, args, kwargs)

    return Coins


@contextlib.contextmanager
def _scripted(record: dict):
    """Scripted coins and noise from the batch's seed slots (``_Script``s); records the
    thresholds and the distribution each final draw is made from in ``record``."""

    def randomness(batch, layout, vocab, device):
        b, n = batch.batch_size, max(layout.tokens.shape[1], 1)
        accept = torch.zeros(b, n, dtype=torch.bool)
        noise = torch.ones(b, vocab, dtype=torch.float64)
        for i, s in enumerate(batch.seeds):
            accept[i, s.accept] = True
            noise[i, s.token] = TINY
        record["thresholds"] = torch.full((b, n), float("nan"), dtype=torch.float64)
        record["seen"] = torch.zeros(b, n, dtype=torch.bool)
        coins = torch.arange(n, dtype=torch.float64).expand(b, n).clone()
        cls = _coins_class(accept, record["thresholds"], record["seen"])
        return coins.as_subclass(cls), lambda k: noise.to(device)

    def recording_draw(r, noise):
        # the distribution really drawn from (not the walk's r: a verifier that draws the last
        # token from anything else must show up in the distribution)
        record["r"] = torch.Tensor.as_subclass(r, torch.Tensor).detach().clone()
        return draw(r, noise)

    draw = rejection.final_draw
    with mock.patch.object(rejection, "_randomness", randomness), \
            mock.patch.object(rejection, "final_draw", recording_draw):
        yield


def root_path(tree: DraftTree, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = int(tree.parents[node])
    return path[::-1]


def tried(tree: DraftTree, path: list[int]) -> list[int]:
    """Nodes the walk tries to end with ``path`` accepted: at each level the children in index
    order up to the accepted one, and below the last accepted node all its children."""
    out, parent = [], -1
    for a in path:
        kids = tree.children(parent)
        out += kids[: kids.index(a) + 1]
        parent = a
    return out + tree.children(parent)


def exact_verify(trees: list[DraftTree], probs: list[torch.Tensor], verifier=None,
                 threshold: Callable[[float], float] | None = None) -> list[Dist]:
    """Per tree (with its [1 + n, V] target probs), the exact distribution of the emitted token
    tuple of one verification by ``verifier`` (default: RejectionVerifier). ``threshold`` maps
    each recorded acceptance probability (to model a broken acceptance rule)."""
    verifier = rejection.RejectionVerifier() if verifier is None else verifier
    reqs = []  # (tree index, path, token)
    for i, (tree, rows) in enumerate(zip(trees, probs)):
        paths = [[]] + [root_path(tree, v) for v in range(tree.num_nodes)]
        reqs += [(i, p, x) for p in paths for x in range(rows.shape[1])]
    record: dict = {}
    batch = make_batch([trees[i] for i, _, _ in reqs], [probs[i] for i, _, _ in reqs],
                       [_Script(p, x) for _, p, x in reqs])
    with _scripted(record):
        results = verifier.verify(batch).to_results()
    out: list[Dist] = [defaultdict(float) for _ in trees]
    for b, ((i, path, x), res) in enumerate(zip(reqs, results)):
        tree = trees[i]
        tokens = [int(tree.tokens[a]) for a in path]
        assert res.accepted == path, (res.accepted, path)
        weight = float(record["r"][b, x])
        for v in tried(tree, path):
            assert record["seen"][b, v], f"node {v} was tried but its coin never compared"
            t = float(record["thresholds"][b, v])
            t = threshold(t) if threshold is not None else t
            weight *= t if v in path else 1.0 - t
        if weight > 0:
            assert res.tokens == tokens + [x], (res.tokens, tokens, x)
            out[i][tuple(tokens + [x])] += weight
    for dist in out:
        assert abs(sum(dist.values()) - 1.0) < 1e-9, sum(dist.values())
    return out


# ---- target joints and draft trees -------------------------------------------------------------

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
                 threshold: Callable[[float], float] | None = None) -> Dist:
    """Distribution of the first k tokens: drafts weighted as drawn, one verification each, short
    outputs completed by the target (what the next, lossless step would do)."""
    weighted = list(trees)
    rows = [target_rows(t, target) for _, t in weighted]
    dists = exact_verify([t for _, t in weighted], rows, threshold=threshold)
    out: Dist = defaultdict(float)
    for (weight, _), dist in zip(weighted, dists):
        for tokens, pr in dist.items():
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


def sample_tree(parents: list[int], draft: Toy, g: torch.Generator) -> DraftTree:
    """One tree of the given shape, each node drawn from the draft with generator g."""
    toks, rows, pres = [], [], []
    for p in parents:
        q = draft(pres[p] if p >= 0 else ())
        toks.append(int(torch.multinomial(q, 1, generator=g)))
        rows.append(q)
        pres.append((pres[p] if p >= 0 else ()) + (toks[-1],))
    return DraftTree(torch.tensor(toks), torch.tensor(parents), torch.stack(rows))
