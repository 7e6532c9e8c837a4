"""Lossless verification for sampled decoding: (multi-draft) recursive rejection sampling.

At node ``cur`` (start: the root) the target is r = p(row of cur). Children are tried in index
order; for child c with token x:

- with draft probabilities q = draft_probs[c]: accept with prob min(1, r(x) / q(x)); on reject
  r <- norm(max(0, r - q)) (SpecInfer / recursive rejection sampling);
- without (deterministic drafts, the q = 1 rule): accept with prob r(x); on reject r(x) <- 0 and
  renormalise.

An accepted child becomes ``cur`` (fresh r from its row); if no child is accepted a token is drawn
from r and verification stops, so an accepted leaf is followed by a bonus token from its row.
A chain is the one-child case of the same walk.

Why it is lossless: each sibling step is a rejection sampler for the current r with proposal q,
so conditional on any earlier rejected siblings the output is distributed as r. That holds for any
q a sibling was really drawn from, including "without replacement" (q conditioned on the earlier
siblings), as long as ``draft_probs[c]`` is exactly that distribution. The q = 1 rule is lossless
for any draft tokens whatsoever; q only raises acceptance.
"""

from __future__ import annotations

import torch

from specdec.tree import DraftTree
from specdec.verifiers.base import VerifyResult, check_verify_inputs
from specdec.verifiers.greedy import greedy_walk


class RejectionVerifier:
    """Sampling verifier; with ``probs=None`` it falls back to greedy (the temperature-0 limit).

    All randomness goes through ``_coin`` and ``_draw`` with the given generator, so a seed
    reproduces the result. The work happens on the generator's device (probs are moved there).
    Example: chain [3] with q = p accepts node 0 and draws a bonus token from probs[1].
    """

    name = "rejection"

    def verify(self, tree: DraftTree, logits: torch.Tensor, probs: torch.Tensor | None,
               generator: torch.Generator | None = None) -> VerifyResult:
        check_verify_inputs(tree, logits, probs)
        if probs is None:
            return greedy_walk(tree, logits.argmax(dim=-1).tolist())
        device = generator.device if generator is not None else torch.device("cpu")
        p = _normalise_rows(probs.to(device, torch.float64), "probs")
        q = None
        if tree.draft_probs is not None:
            q = _normalise_rows(tree.draft_probs.to(device, torch.float64), "tree.draft_probs")
        tokens = tree.tokens.tolist()
        accepted: list[int] = []
        cur = -1
        while True:
            child, residual = self._pick_child(tree.children(cur), tokens, p[cur + 1], q, generator)
            if child is None:
                emitted = [tokens[i] for i in accepted] + [self._draw(residual, generator)]
                return VerifyResult(accepted, emitted)
            accepted.append(child)
            cur = child

    def _pick_child(self, children: list[int], tokens: list[int], target: torch.Tensor,
                    q: torch.Tensor | None, generator: torch.Generator | None,
                    ) -> tuple[int | None, torch.Tensor]:
        """Try siblings in order: (accepted child, target) or (None, residual [V] to draw from)."""
        residual = target
        for c in children:
            q_row = None if q is None else q[c]
            if self._coin(_accept_prob(residual, tokens[c], q_row, c), generator):
                return c, residual
            residual = _residual(residual, tokens[c], q_row)
        return None, residual

    def _coin(self, prob: float, generator: torch.Generator | None) -> bool:
        """True with probability ``prob`` (u < prob, u ~ U[0, 1), so prob 0 never and 1 always)."""
        device = generator.device if generator is not None else None
        u = torch.rand(1, generator=generator, dtype=torch.float64, device=device)
        return bool(u.item() < prob)

    def _draw(self, dist: torch.Tensor, generator: torch.Generator | None) -> int:
        """One token from ``dist`` [V] (non-negative, positive sum)."""
        return int(torch.multinomial(dist, 1, generator=generator).item())


def _accept_prob(r: torch.Tensor, x: int, q: torch.Tensor | None, node: int) -> float:
    """min(1, r(x) / q(x)); with q None (deterministic draft) just r(x)."""
    if q is None:
        return float(r[x])
    qx = float(q[x])
    if qx <= 0.0:
        raise ValueError(
            f"tree.draft_probs[{node}, {x}] = {qx} but node {node} drafted token {x}: a drafter "
            "can only propose tokens its own distribution gives mass to (drafter bug)")
    return min(1.0, float(r[x]) / qx)


def _residual(r: torch.Tensor, x: int, q: torch.Tensor | None) -> torch.Tensor:
    """Target after rejecting x: norm(max(0, r - q)), or r with x zeroed when q is None."""
    if q is None:
        nxt = r.clone()
        nxt[x] = 0.0
    else:
        nxt = (r - q).clamp_min(0.0)
    total = float(nxt.sum())
    if not total > 0.0:
        # r == q up to rounding, so the rejection was a float artifact and r is still the target
        return r
    return nxt / total


def _normalise_rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """Rows divided by their sums; ValueError naming ``name`` on negative, NaN or all-zero rows."""
    if not bool(torch.isfinite(x).all()) or bool((x < 0).any()):
        raise ValueError(f"{name} must be finite and non-negative")
    sums = x.sum(dim=-1, keepdim=True)
    bad = (sums <= 0).flatten().nonzero()
    if bad.numel():
        raise ValueError(f"{name} row {int(bad[0])} sums to 0; each row must be a distribution")
    return x / sums
