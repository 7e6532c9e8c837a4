"""Greedy verification: keep the longest path that matches the target argmax."""

from __future__ import annotations

import torch

from specdec.tree import DraftTree
from specdec.verifiers.base import VerifyResult, check_verify_inputs


class GreedyVerifier:
    """Walk from the root: while a child carries the target argmax, accept it; then emit argmax.

    Example: chain [7, 8, 9], target argmax per row [7, 8, 4, 2] -> accepted [0, 1],
    tokens [7, 8, 4]. ``probs`` and ``generator`` are ignored.
    """

    name = "greedy"

    def verify(self, tree: DraftTree, logits: torch.Tensor, probs: torch.Tensor | None = None,
               generator: torch.Generator | None = None) -> VerifyResult:
        check_verify_inputs(tree, logits, probs)
        return greedy_walk(tree, logits.argmax(dim=-1).tolist())


def greedy_walk(tree: DraftTree, targets: list[int]) -> VerifyResult:
    """Accept children equal to ``targets[row]`` (row = 1 + node, 0 = root); first match wins."""
    tokens = tree.tokens.tolist()
    accepted: list[int] = []
    cur = -1
    while True:
        want = targets[cur + 1]
        nxt = next((c for c in tree.children(cur) if tokens[c] == want), None)
        if nxt is None:
            return VerifyResult(accepted, [tokens[i] for i in accepted] + [want])
        accepted.append(nxt)
        cur = nxt
