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


class DeviceTrees:
    """Trees of rank paths whose tokens and path probabilities stay on the device: each
    request's nodes are gathered there from its candidates by an index made once per tree shape
    (device tensors cached, as a CUDA graph is made once per shape; a shape whose paths begin
    another's uses the first rows of that one's), so a step reads nothing (the engine's
    verification read brings the tokens along: ``DraftTree.on_device``). Same trees as
    ``tree_from_ranks``, path probabilities multiplied in the same order, in float64."""

    MAX_SHAPES = 64

    def __init__(self) -> None:
        # k -> [(paths, token index [n], path index [n, depth], parents [n] host, as ints)]
        self._shapes: dict[int, list] = {}

    def tree(self, paths: tuple[tuple[int, ...], ...], tokens: torch.Tensor,
             probs: torch.Tensor) -> DraftTree:
        """``tokens`` [D, k] int64 and ``probs`` [D, k] of one request, on the device."""
        n = len(paths)
        token_index, path_index, parents, parent_list = self._shape(paths, tokens.shape[-1],
                                                                    tokens.device)
        ids = tokens.reshape(-1).index_select(0, token_index[:n])
        # each node's path entries from the root (entry 0 is 1.0: the padding past its depth)
        flat = torch.cat([probs.new_ones(1), probs.reshape(-1)]).double()  # (as host floats)
        along = flat.index_select(0, path_index[:n].reshape(-1)).view(n, -1)
        conf = along[:, 0]
        for d in range(1, along.shape[1]):
            conf = along[:, d] * conf
        tree = DraftTree.on_device(ids, parents[:n], conf.float())
        tree.__dict__["_parent_list"] = parent_list[:n]
        return tree

    def _shape(self, paths, k: int, device):
        shapes = self._shapes.setdefault(k, [])
        n = len(paths)
        for got in shapes:
            if len(got[0]) >= n and got[0][:n] == paths:
                return got[1:]
        if len(shapes) >= self.MAX_SHAPES:
            shapes.clear()
        depth = max(len(p) for p in paths)
        node = {p: i for i, p in enumerate(paths)}
        parent_list = [node[p[:-1]] if len(p) > 1 else -1 for p in paths]
        flat = [(len(p) - 1) * k + p[-1] for p in paths]
        along = [[1 + d * k + r for d, r in enumerate(p)] + [0] * (depth - len(p))
                 for p in paths]
        both = torch.tensor(flat + [a for row in along for a in row], dtype=torch.int64)
        both = both.to(device)
        got = (paths, both[:n], both[n:].view(n, depth),
               torch.tensor(parent_list, dtype=torch.int64), parent_list)
        shapes.append(got)
        return got[1:]


def default_rates(depth: int, ranks: int) -> tuple[tuple[float, ...], ...]:
    """Rates for an uncalibrated drafter: falling with depth and rank."""
    return tuple(tuple(0.6 * 0.8**d / (1 + 2 * r) for r in range(ranks)) for d in range(depth))
