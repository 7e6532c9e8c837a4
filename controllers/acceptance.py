"""Acceptance estimates for a controller, learned online from what was verified.

Two views of the same evidence (every verified tree and its accepted path):

* **By depth** (`DepthAcceptance`): the conditional rate ``a(d)`` = P(depth d accepted | depth
  d - 1 accepted and the tree reached depth d), for the drafter as a whole and per request; a
  request's estimate is its own counts shrunk towards the drafter's (``prior_weight`` pseudo
  steps), so a new request starts from the drafter's recent history. The expected accepted
  length of a chain of k nodes is ``sum_{d<=k} prod_{i<=d} a(i)``.
* **By draft confidence** (`ConfidenceCalibration`): where a tree carries each node's cumulative
  draft probability (``DraftTree.path_probs``), P(node on the accepted path) is read from bins
  of that probability, counted online; a bin with little evidence leans on the drafter's own
  number (``prior_weight`` pseudo nodes at the bin's probability).

Counts decay (``decay`` per observation), so the estimates follow a drafter whose acceptance
drifts with the text.
"""

from __future__ import annotations

import math

from specdec.tree import DraftTree


class DepthAcceptance:
    """Conditional acceptance by depth, drafter-wide and per request."""

    def __init__(self, max_depth: int = 32, prior: float = 0.5, prior_weight: float = 4.0,
                 decay: float = 0.995) -> None:
        self.max_depth = max_depth
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        self.hits = [0.0] * max_depth  # drafter-wide, depth d at index d - 1
        self.trials = [0.0] * max_depth
        self.requests: dict[str, tuple[list[float], list[float]]] = {}
        self._rates: list[float] | None = None  # global_rate by depth, until the next observe

    def observe(self, request_id: str, depth: int, accepted: int) -> None:
        """A tree reaching ``depth`` was verified and ``accepted`` nodes (a path) were kept."""
        if depth <= 0:
            return
        self._rates = None
        own = self.requests.setdefault(request_id, ([0.0] * self.max_depth,
                                                     [0.0] * self.max_depth))
        for hits, trials in ((self.hits, self.trials), own):
            for d in range(self.max_depth):
                hits[d] *= self.decay
                trials[d] *= self.decay
            for d in range(1, min(depth, accepted + 1, self.max_depth) + 1):
                trials[d - 1] += 1.0
                hits[d - 1] += 1.0 if d <= accepted else 0.0

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def global_rate(self, d: int) -> float:
        """a(d) for the drafter: its counts, leaning on the previous depth's rate (or the
        prior at depth 1) while they are few."""
        if self._rates is None:  # once per observation, not per request and depth
            rates, prior = [], self.prior
            for h, t in zip(self.hits, self.trials):
                prior = (h + self.prior_weight * prior) / (t + self.prior_weight)
                rates.append(prior)
            self._rates = rates
        return self._rates[min(d, self.max_depth) - 1]

    def rate(self, request_id: str, d: int) -> float:
        """a(d) for one request: its counts shrunk towards the drafter's rate."""
        base = self.global_rate(d)
        own = self.requests.get(request_id)
        if own is None:
            return base
        d = min(d, self.max_depth)
        h, t = own[0][d - 1], own[1][d - 1]
        return (h + self.prior_weight * base) / (t + self.prior_weight)

    def chain_gains(self, request_id: str, k: int, floor: float = 0.0) -> list[float]:
        """P(depth d accepted) for d = 1..k: the expected gain of each node of a k-chain,
        stopping after the first gain below ``floor`` (deeper ones are smaller still)."""
        out, p = [], 1.0
        for d in range(1, k + 1):
            p *= self.rate(request_id, d)
            out.append(p)
            if p < floor:
                break
        return out

    def summary(self, depths: int = 6) -> list[float]:
        return [round(self.global_rate(d), 3) for d in range(1, depths + 1)]


class ConfidenceCalibration:
    """P(node accepted) from the drafter's cumulative path probability, binned in log space."""

    def __init__(self, bins: int = 16, floor: float = 1e-4, prior_weight: float = 2.0,
                 decay: float = 0.999) -> None:
        self.bins, self.floor = bins, floor
        self.prior_weight, self.decay = prior_weight, decay
        self.hits = [0.0] * bins
        self.trials = [0.0] * bins

    def _bin(self, q: float) -> int:
        q = min(max(q, self.floor), 1.0)
        frac = math.log(q) / math.log(self.floor)  # 0 at q = 1, 1 at the floor
        return min(int(frac * self.bins), self.bins - 1)

    def _center(self, b: int) -> float:
        return self.floor ** ((b + 0.5) / self.bins)

    def observe(self, tree: DraftTree, accepted: list[int]) -> None:
        if tree.path_probs is None or tree.num_nodes == 0:
            return
        for b in range(self.bins):
            self.hits[b] *= self.decay ** tree.num_nodes
            self.trials[b] *= self.decay ** tree.num_nodes
        kept = set(accepted)
        for i, q in enumerate(tree.path_probs.tolist()):
            b = self._bin(q)
            self.trials[b] += 1.0
            self.hits[b] += 1.0 if i in kept else 0.0

    def probability(self, q: float) -> float:
        b = self._bin(q)
        prior = min(max(q, self.floor), 1.0)
        return (self.hits[b] + self.prior_weight * prior) / (self.trials[b] + self.prior_weight)

    def summary(self) -> list[tuple[float, float, int]]:
        """(bin centre, estimated acceptance, evidence) for bins with evidence."""
        return [(round(self._center(b), 4), round(self.probability(self._center(b)), 3),
                 round(self.trials[b])) for b in range(self.bins) if self.trials[b] >= 1]
