"""Lossless verification for sampled decoding: (multi-draft) recursive rejection sampling, batched.

At node ``cur`` (start: the root) the target is r = p(row of cur). Children are tried in index
order; for child c with token x:

- with draft probabilities q = draft_probs[c]: accept with prob min(1, r(x) / q(x)); on reject
  r <- norm(max(0, r - q)) (SpecInfer / recursive rejection sampling);
- without (deterministic drafts, the q = 1 rule): accept with prob r(x); on reject r(x) <- 0 and
  renormalise.

An accepted child becomes ``cur`` (fresh r from its row); if no child is accepted a token is drawn
from r and verification stops, so an accepted leaf is followed by a bonus token from its row.
A chain is the one-child case of the same walk, a plain row the no-child case.

Why it is lossless: each sibling step is a rejection sampler for the current r with proposal q,
so conditional on any earlier rejected siblings the output is distributed as r. That holds for any
q a sibling was really drawn from, including "without replacement" (q conditioned on the earlier
siblings), as long as ``draft_probs[c]`` is exactly that distribution. The q = 1 rule is lossless
for any draft tokens whatsoever; q only raises acceptance.

Batched: every request walks its tree at once, one tree level and one sibling rank per round of
tensor ops (rounds = deepest tree x widest node, both known on the host). Randomness is per
position (``specdec.randomness``): the coin of the child of rank s tried at position n is the
uniform of (seed, n, COIN + s), the final draw at position n is argmax r / E with E the noise of
(seed, n, RESIDUAL) — streams no drafter sees, so they are independent of the drafts even when a
drafter sampled its drafts with the SAMPLE noise (coupled drafts). A seed reproduces a request's
tokens for the same drafts whatever batch it runs in; unlike the ``gumbel`` verifier, the text
depends on the drafts (its distribution does not). One host sync reads the accepted depths (the
final draw's position), and with it the check that no accepted coin divided by a zero draft
probability.
"""

from __future__ import annotations

import torch

from specdec import randomness
from specdec.sampling import greedy
from specdec.verifiers.base import VerifyBatch, VerifyOutput
from specdec.verifiers.greedy import assemble, verify_greedy
from specdec.verifiers.layout import TreeLayout


class RejectionVerifier:
    """Greedy requests get the greedy rule, sampled ones recursive rejection sampling."""

    name = "rejection"
    supports_sampling = True

    def verify(self, batch: VerifyBatch) -> VerifyOutput:
        greedy = [b for b, g in enumerate(batch.greedy) if g]
        sampled = [b for b, g in enumerate(batch.greedy) if not g]
        if not sampled:
            return verify_greedy(batch)
        if not greedy:
            return _sample(batch)
        return VerifyOutput.merge([(greedy, verify_greedy(batch.select(greedy))),
                                   (sampled, _sample(batch.select(sampled)))], batch.batch_size)


def _sample(batch: VerifyBatch) -> VerifyOutput:
    device = batch.probs.device
    layout = TreeLayout.build(batch.trees, batch.cu_rows, device)
    p = batch.probs.to(torch.float64)
    p = p / p.sum(-1, keepdim=True)
    q_rows, q_index = _draft_probs(batch, layout, device)
    coins, final_noise = _randomness(batch, layout, p.shape[1], device)
    ok, r = _walk(p, q_rows, q_index, coins, layout)
    return assemble(ok, layout, final_draw(r, final_noise(ok.sum(-1))))


def _walk(p, q_rows, q_index, coins, layout: TreeLayout):
    """Run every request's walk; returns (accepted flags [B, N], final target r [B, V])."""
    b, n = layout.tokens.shape
    rows = torch.arange(b, device=p.device)
    cur = torch.full((b,), -1, dtype=torch.int64, device=p.device)
    alive = torch.ones(b, dtype=torch.bool, device=p.device)
    ok = torch.zeros(b, n, dtype=torch.bool, device=p.device)
    bad = torch.zeros(b, dtype=torch.bool, device=p.device)
    r = p.index_select(0, layout.node_row[:, 0])
    for _ in range(layout.max_depth):
        kids = layout.children[rows, cur + 1]  # [B, S]
        moved = torch.zeros_like(alive)
        nxt = cur
        for s in range(layout.max_children):
            child = kids[:, s]
            act = alive & ~moved & (child >= 0)
            c = child.clamp(min=0)
            x = layout.tokens[rows, c][:, None]  # [B, 1]
            rx = r.gather(1, x)[:, 0]
            prob, residual = rx, residual_without(r, x)
            if q_rows is not None:
                qi = q_index[rows, c]
                has_q = qi >= 0
                q = q_rows.index_select(0, qi.clamp(min=0))
                qx = q.gather(1, x)[:, 0]
                bad |= act & has_q & ~(qx > 0)
                prob = torch.where(has_q, (rx / qx).clamp(max=1.0), rx)
                residual = torch.where(has_q[:, None], residual_with_q(r, q), residual)
            take = act & (coins[rows, c] < prob)
            total = residual.sum(-1, keepdim=True)
            # total 0: r == q up to rounding, so the rejection was a float artifact; keep r
            residual = torch.where(total > 0, residual / total, r)
            r = torch.where((act & ~take)[:, None], residual, r)
            moved = moved | take
            nxt = torch.where(take, c, nxt)
        cur, alive = nxt, moved
        ok |= moved[:, None] & (torch.arange(n, device=p.device)[None, :] == cur[:, None])
        fresh = p.index_select(0, layout.node_row.gather(1, (cur + 1)[:, None])[:, 0])
        r = torch.where(moved[:, None], fresh, r)
    if bool(bad.any()):
        raise ValueError("a drafted token has draft probability 0 in its own draft_probs row: a "
                         "drafter can only propose tokens its distribution gives mass to")
    return ok, r


def residual_with_q(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The residual after rejecting a draft drawn from q: max(0, r - q) ([B, V]); the caller
    renormalises."""
    return (r - q).clamp(min=0.0)


def final_draw(r: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The token after the accepted path: argmax r / E, an exact draw from the walk's final
    distribution r [B, V] with Exp(1) noise [B, V] -> [B] int64."""
    return greedy(r / noise)


def residual_without(r: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The q = 1 rule's residual after rejecting token x: r [B, V] with r(x) zeroed (x [B, 1]);
    the caller renormalises."""
    return r.scatter(1, x, 0.0)


def _draft_probs(batch: VerifyBatch, layout: TreeLayout, device):
    """(q rows [Q, V] float64 normalised, q_index [B, N] int64 row of each node or -1), or
    (None, None) when no tree carries draft probabilities."""
    with_q = [t for t in batch.trees if t.draft_probs is not None and t.num_nodes]
    if not with_q:
        return None, None
    q = torch.cat([t.draft_probs.to(device, torch.float64) for t in with_q])
    q = q / q.sum(-1, keepdim=True)
    index = torch.full(layout.tokens.shape, -1, dtype=torch.int64)
    start = 0
    for b, t in enumerate(batch.trees):
        if t.draft_probs is not None and t.num_nodes:
            index[b, :t.num_nodes] = torch.arange(start, start + t.num_nodes)
            start += t.num_nodes
    return q, index.to(device)


def _randomness(batch: VerifyBatch, layout: TreeLayout, vocab: int, device):
    """(coins [B, max(N, 1)] U(0, 1), final_noise) from each request's (seed, position) keys.

    Node c's coin is the uniform of (seed, position of c, COIN + its rank among its siblings);
    padding coins are 1 (never accepted, never read). ``final_noise(k)`` with k [B] the accepted
    depths gives the Exp(1) rows [B, V] of (seed, position after the accepted path, RESIDUAL)."""
    n = max(layout.tokens.shape[1], 1)
    coins = torch.ones(batch.batch_size * n, dtype=torch.float64)
    keys, slots = [], []  # every node's key, hashed in one call for the batch
    for b, (seed, start, tree) in enumerate(zip(batch.seeds, batch.positions, batch.trees)):
        if tree.num_nodes:
            keys += [randomness.key(seed, start + d, randomness.COIN + s)
                     for d, s in zip(tree.depths.tolist(), _sibling_ranks(tree))]
            slots += range(b * n, b * n + tree.num_nodes)
    if keys:
        coins[slots] = randomness.coins(keys)
    coins = coins.view(batch.batch_size, n)

    def final_noise(k: torch.Tensor) -> torch.Tensor:
        keys = [randomness.key(seed, start + d, randomness.RESIDUAL)
                for seed, start, d in zip(batch.seeds, batch.positions, k.tolist())]
        return randomness.noise(keys, vocab, device)

    return coins.to(device), final_noise


def _sibling_ranks(tree) -> list[int]:
    """[n] each node's index among its parent's children (nodes are in topological order)."""
    seen: dict[int, int] = {}
    ranks = []
    for p in tree.parents.tolist():
        ranks.append(seen.get(p, 0))
        seen[p] = ranks[-1] + 1
    return ranks
