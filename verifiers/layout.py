"""A batch of draft trees as padded tensors, built once on the host and moved to the device, so
that verification runs as a few tensor ops per tree level with no host sync.

For B trees of at most N nodes and S children per node (example: request 0 parents
[-1, -1, 0], request 1 a plain row)::

    tokens    [B, N]     node tokens, 0 where padded
    parents   [B, N]     -1 for the root's children
    valid     [B, N]     a real node
    first     [B, N]     no earlier sibling carries the same token (greedy: first match wins)
    depth     [B, N]     0-based
    ancestors [B, N, N]  ancestors-or-self
    children  [B, N + 1, S]  children[b, 1 + i, s]: s-th child of node i (slot 0: the root), -1 pad
    node_row  [B, N + 1] row of logits/probs for "the token after" root (col 0) or node i (1 + i)
    parent_row [B, N]    node_row of each node's parent (the row its token is checked against)

    request 0: children[0] = [[0, 1], [2, -1], [-1, -1], [-1, -1]]; node_row[0] = [0, 1, 2, 3]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.tree import DraftTree


@dataclass
class TreeLayout:
    tokens: torch.Tensor  # [B, N] int64
    valid: torch.Tensor  # [B, N] bool
    first: torch.Tensor  # [B, N] bool
    depth: torch.Tensor  # [B, N] int64
    ancestors: torch.Tensor  # [B, N, N] bool
    children: torch.Tensor  # [B, N + 1, S] int64, -1 padded
    node_row: torch.Tensor  # [B, N + 1] int64
    parent_row: torch.Tensor  # [B, N] int64
    max_depth: int  # deepest node depth + 1 (0 when no tree has nodes)
    max_children: int  # S

    @classmethod
    def build(cls, trees: list[DraftTree], cu_rows: list[int], device) -> TreeLayout:
        b = len(trees)
        n = max((t.num_nodes for t in trees), default=0)
        kids = [[t.children(i) for i in range(-1, t.num_nodes)] for t in trees]
        s = max((len(c) for k in kids for c in k), default=0)
        tokens = torch.zeros(b, n, dtype=torch.int64)
        depth = torch.zeros(b, n, dtype=torch.int64)
        valid = torch.zeros(b, n, dtype=torch.bool)
        first = torch.zeros(b, n, dtype=torch.bool)
        anc = torch.zeros(b, n, n, dtype=torch.bool)
        children = torch.full((b, n + 1, max(s, 1)), -1, dtype=torch.int64)
        last = cu_rows[-1] - 1  # padded entries point at a real row; they are never used
        node_row = torch.tensor([[min(cu_rows[i] + j, last) for j in range(n + 1)]
                                 for i in range(b)], dtype=torch.int64)
        parents = torch.full((b, n), -1, dtype=torch.int64)
        for i, (tree, k) in enumerate(zip(trees, kids)):
            m = tree.num_nodes
            if not m:
                continue
            tokens[i, :m] = tree.tokens.cpu()
            parents[i, :m] = tree.parents.cpu()
            depth[i, :m] = tree.depths.cpu()
            valid[i, :m] = True
            anc[i, :m, :m] = tree.ancestor_mask.cpu()
            for slot, cs in enumerate(k):
                children[i, slot, :len(cs)] = torch.tensor(cs, dtype=torch.int64)
            first[i, :m] = torch.tensor(_first_of_token(tree), dtype=torch.bool)
        max_depth = max((t.max_depth + 1 for t in trees), default=0)
        parent_row = node_row.gather(1, parents + 1)
        to = dict(device=device)
        return cls(tokens.to(**to), valid.to(**to), first.to(**to), depth.to(**to),
                   anc.to(**to), children.to(**to), node_row.to(**to), parent_row.to(**to),
                   max_depth, s)


def _first_of_token(tree: DraftTree) -> list[bool]:
    """Per node: no earlier sibling has the same token (later duplicates can never be taken)."""
    seen: set[tuple[int, int]] = set()
    out = []
    for p, t in zip(tree.parents.tolist(), tree.tokens.tolist()):
        out.append((p, t) not in seen)
        seen.add((p, t))
    return out
