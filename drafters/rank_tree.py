"""Trees from per-depth candidate lists (MTP heads, block diffusion): one shape rule for both.

A drafter that proposes, for each depth d, its top-k tokens independently of the tokens above
(MTP head d, block position d) builds its tree from rank paths: a node is a tuple of ranks
(r_0, ..., r_d) and carries depth d's rank-r_d token. A node's score is the product over its
path of a per-(depth, rank) acceptance rate — measured when the drafter was calibrated (Medusa's
tree construction) — and the tree is the ``max_nodes`` best nodes, best first. Rates are <= 1,
so a node never outscores its parent: the chosen set is ancestor-closed, in topological order.

Example, rates [[0.6, 0.2], [0.5, 0.1]], 3 nodes: (0,) 0.6, (0, 0) 0.3, (1,) 0.2.
"""

from __future__ import annotations

import heapq
from functools import lru_cache

import torch

from specdec.tree import DraftTree


@lru_cache(maxsize=256)
def rank_paths(rates: tuple[tuple[float, ...], ...], max_nodes: int,
               max_depth: int) -> tuple[tuple[int, ...], ...]:
    """The ``max_nodes`` best rank paths at most ``max_depth`` deep (see the module docstring);
    ties go to the shallower, then lower-ranked node. ``rates``: [depth][rank] in [0, 1]."""
    depth = min(max_depth, len(rates))
    if depth < 1 or max_nodes < 1:
        return ()
    heap = [(-rates[0][r], 1, (r,)) for r in range(len(rates[0]))]
    heapq.heapify(heap)
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < max_nodes:
        neg, d, path = heapq.heappop(heap)
        chosen.append(path)
        if d < depth:
            for r, rate in enumerate(rates[d]):
                heapq.heappush(heap, (neg * rate, d + 1, path + (r,)))
    return tuple(chosen)


def tree_from_ranks(paths: tuple[tuple[int, ...], ...], tokens: torch.Tensor,
                    probs: torch.Tensor) -> DraftTree:
    """The tree of ``paths`` (topological, from ``rank_paths``) for one request.

    tokens [D, k] int64: depth d's rank-r target token; probs [D, k]: the drafter's probability
    of it. ``path_probs`` (the controller's confidence) is the product along the path."""
    index = {p: i for i, p in enumerate(paths)}
    tok, prob = tokens.tolist(), probs.tolist()
    ids, parents, conf = [], [], []
    for p in paths:
        d, r = len(p) - 1, p[-1]
        ids.append(tok[d][r])
        parent = index[p[:-1]] if d else -1
        parents.append(parent)
        conf.append(prob[d][r] * (conf[parent] if d else 1.0))
    return DraftTree(torch.tensor(ids, dtype=torch.int64),
                     torch.tensor(parents, dtype=torch.int64), None,
                     torch.tensor(conf, dtype=torch.float32))


def default_rates(depth: int, ranks: int) -> tuple[tuple[float, ...], ...]:
    """Rates for an uncalibrated drafter: falling with depth and rank."""
    return tuple(tuple(0.6 * 0.8**d / (1 + 2 * r) for r in range(ranks)) for d in range(depth))


def candidates_to_host(tokens: torch.Tensor, probs: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens`` and ``probs`` (a batch's candidates, [R, D, k] each) on the host in one
    device -> host read, not two: both go as one float64 tensor (token ids below 2**53 and
    float32 / 16-bit values are exact in float64, so each comes back bitwise, in its dtype)."""
    k = tokens.shape[-1]
    both = torch.cat([tokens.double(), probs.double()], dim=-1).cpu()
    return both[..., :k].to(tokens.dtype), both[..., k:].to(probs.dtype)
