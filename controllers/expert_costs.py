"""What a step costs on a mixture-of-experts target: rows and the experts they wake.

Each row of a step routes to its own top-k experts and the step streams every expert some row
woke, so ``ExpertCosts`` prices a step by both (T = a + b * experts woken + c * rows, the
experts a tree of extra rows wakes learned online from the routing of recent steps), and
``profile_experts`` measures its prior on the target itself. The rows-only curve and its
profile: ``controllers/costs.py``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from specdec.controllers.costs import (
    DEFAULT_CONTEXT,
    StepCosts,
    time_forward,
    write_json_atomically,
)


class ExpertCosts:
    """A mixture-of-experts target's forward seconds by rows and experts woken.

        seconds(s, rows) = a + b * x + c * rows,    x = experts(s, rows)
        experts(s, rows) = E * (1 - (1 - k / E) ** (s + g * (rows - s)))

    ``x``: the distinct experts a layer wakes, averaged over the layers (``StepReport.
    experts_woken``); E experts, top k per row; ``s`` the step's sequences (decode requests and
    prefill chunks: rows of different sequences route independently), ``rows - s`` its rows
    beyond one per sequence (draft nodes, a chunk's later tokens). A row routing independently
    and uniformly would bring ``s + (rows - s)`` independent rows' worth of experts (g = 1);
    neighbouring tokens of one text route alike (correlated routing), so each extra row brings
    only ``g`` < 1 of one: ``g``, the expert growth, is what makes a tree dear or cheap.

    * ``a, b, c``: least squares of relative errors over the prior points (profiled on the target,
      ``profile_experts``: rows routing as independently as random ids and as alike as one
      repeated id, so that rows and experts are told apart) and every step's measured
      (x, rows, forward seconds), exponentially weighted, ``b, c >= 0``. The prior's seconds
      follow a scale learned as ``StepCosts``' is (the measured over the prior's prediction,
      averaged geometrically at ``rate``): a machine busier than at profiling moves the prior
      with it rather than pulling against the steps.
    * ``g``: from every step with rows beyond its sequences, each layer's woken count turned
      into the independent rows it is worth (``log(1 - x / E) / log(1 - k / E)``; saturated
      layers, x = E, say nothing), least squares through the origin against the extra rows,
      exponentially weighted, starting from ``growth`` (1: independent routing, the cautious
      guess) worth one step of 4 extra rows.

    Nothing here drops or caps an expert: the model only prices what the routing will wake.
    """

    def __init__(self, num_experts: int, top_k: int,
                 points: list[tuple[float, float, float]] = (), growth: float = 1.0,
                 decay: float = 0.98, rate: float = 0.05) -> None:
        if not (isinstance(num_experts, int) and isinstance(top_k, int)
                and 1 <= top_k <= num_experts):
            raise ValueError(f"ExpertCosts needs 1 <= top_k <= num_experts, got {top_k}, "
                             f"{num_experts}")
        self.num_experts, self.top_k, self.decay, self.rate = num_experts, top_k, decay, rate
        # the prior (profiled points, kept at full weight) and the steps (decayed): the sums of
        # w f f^T and w f y for f = (1, x, rows)
        self.points = [tuple(map(float, p)) for p in points]
        self._prior = _robust(self.points)
        self._steps = _Normal()
        self._growth_prior = (16.0, 16.0 * float(growth))  # (sum w e e, sum w e (n - s)): e = 4
        self._growth = [0.0, 0.0]
        self.growth = float(growth)
        self._miss = math.log1p(-top_k / num_experts) if top_k < num_experts else None
        self.a = self.b = self.c = 0.0
        self.scale = 1.0
        self._fit()
        self._prior_fit = (self.a, self.b, self.c) if self._prior.n else None

    # ---- prediction --------------------------------------------------------------------------

    def experts(self, sequences: float, rows: float) -> float:
        """Expected distinct experts a layer wakes in a step of ``rows`` rows over ``sequences``
        sequences (rows >= sequences >= 1)."""
        if self._miss is None:
            return float(self.num_experts)
        s = max(float(sequences), 1.0)
        eff = s + self.growth * max(float(rows) - s, 0.0)
        return self.num_experts * -math.expm1(self._miss * eff)

    def seconds(self, sequences: float, rows: float) -> float:
        """Predicted forward seconds of a step of ``rows`` rows over ``sequences`` sequences."""
        return self.price(self.experts(sequences, rows), rows)

    def price(self, experts: float, rows: float) -> float:
        """Forward seconds of ``rows`` rows waking ``experts`` distinct experts per layer."""
        return max(self.a + self.b * experts + self.c * rows, 1e-9)

    def table(self, sequences: int, first: int, count: int) -> list[float]:
        """``[seconds(sequences, first + j) for j in range(count)]`` (a plan reads many)."""
        return [self.seconds(sequences, first + j) for j in range(count)]

    # ---- learning ----------------------------------------------------------------------------

    def observe(self, rows: int, sequences: int, woken: tuple[int, ...] | list[int],
                seconds: float) -> None:
        """A measured step: ``rows`` rows over ``sequences`` sequences woke ``woken[l]``
        distinct experts in layer l, and its forward took ``seconds``."""
        if rows < 1 or not woken:
            return
        x = sum(woken) / len(woken)
        if seconds > 0 and self._prior_fit is not None:
            a, b, c = self._prior_fit
            self.scale *= (seconds / (self.scale * max(a + b * x + c * rows, 1e-9))) ** self.rate
        if seconds > 0:
            # a step far off the prediction (another process took the cores) counts less
            off = abs(math.log(seconds / self.price(x, rows)))
            self._steps.scale(self.decay)
            self._steps.add(x, float(rows), float(seconds),
                            min(1.0, (OUTLIER / max(off, 1e-12)) ** 2) / seconds ** 2)
        extra = rows - max(sequences, 1)
        if extra > 0 and self._miss is not None:
            worth = [math.log1p(-w / self.num_experts) / self._miss for w in woken
                     if 0 < w < self.num_experts]
            if worth:
                gained = sum(worth) / len(worth) - max(sequences, 1)
                self._growth = [self._growth[0] * self.decay + extra * extra,
                                self._growth[1] * self.decay + extra * gained]
        if seconds > 0 or extra > 0:
            self._fit()

    def _fit(self) -> None:
        ee = self._growth_prior[0] + self._growth[0]
        en = self._growth_prior[1] + self._growth[1]
        self.growth = min(max(en / ee, 0.0), 2.0)
        prior = _Normal(self._prior.s[:6] + [v * self.scale for v in self._prior.s[6:]])
        m = prior.plus(self._steps)
        if m.n < 1e-9:
            self.a, self.b, self.c = 1e-3, 0.0, 0.0  # nothing measured: every step alike
            return
        self.a, self.b, self.c = m.solve()

    def describe(self) -> dict:
        """The model's figures (the controller's decision shows them)."""
        return {"fixed_seconds": self.a, "seconds_per_expert": self.b,
                "seconds_per_row": self.c, "expert_growth": round(self.growth, 4),
                "prior_scale": round(self.scale, 4)}

    # ---- the cached prior --------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {"num_experts": self.num_experts, "top_k": self.top_k,
                "points": [list(p) for p in self.points]}

    @classmethod
    def load(cls, path: Path) -> ExpertCosts | None:
        try:
            raw = json.loads(Path(path).read_text())
            return cls(int(raw["num_experts"]), int(raw["top_k"]),
                       [tuple(p) for p in raw["points"]])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save(self, path: Path) -> None:
        write_json_atomically(path, self.to_dict())

    @classmethod
    def from_step_costs(cls, costs: StepCosts, num_experts: int, top_k: int) -> ExpertCosts:
        """Without a profile of the experts (tests, a controller given its costs): the rows
        curve's points as if their rows had routed independently, a prior the steps reshape."""
        probe = cls(num_experts, top_k)
        return cls(num_experts, top_k, [(r, probe.experts(1, r), t)
                                        for r, t in zip(costs.rows, costs.to_dict()["seconds"])])


OUTLIER = math.log(1.5)  # a step within 1.5x of the prediction counts fully; beyond, less


def _robust(points: list[tuple[float, float, float]]) -> _Normal:
    """The prior's sums: relative squares (each (rows, x, seconds) point weighted by
    1 / seconds^2: a forward another process slowed weighs little), and a point far off the
    fit of the others (over three times the median relative residual) weighted down further,
    iteratively."""
    weights = [1.0] * len(points)
    for _ in range(4):
        sums = _Normal()
        for (rows, x, seconds), w in zip(points, weights):
            sums.add(x, rows, seconds, w / seconds ** 2)
        if len(points) < 4:
            return sums
        a, b, c = sums.solve()
        off = [abs(math.log(t / max(a + b * x + c * r, 1e-12))) for r, x, t in points]
        cut = 3 * max(sorted(off)[len(off) // 2], 0.02)
        weights = [min(1.0, (cut / max(o, 1e-12)) ** 2) for o in off]
    return sums


class _Normal:
    """Weighted sums for least squares of y on (1, x, r): n, x, r, xx, xr, rr, y, xy, ry."""

    def __init__(self, sums: list[float] | None = None) -> None:
        self.s = sums or [0.0] * 9

    @property
    def n(self) -> float:
        return self.s[0]

    def add(self, x: float, r: float, y: float, w: float = 1.0) -> None:
        for i, v in enumerate((1.0, x, r, x * x, x * r, r * r, y, x * y, r * y)):
            self.s[i] += w * v

    def scale(self, f: float) -> None:
        self.s = [v * f for v in self.s]

    def plus(self, other: _Normal) -> _Normal:
        return _Normal([p + q for p, q in zip(self.s, other.s)])

    def solve(self) -> tuple[float, float, float]:
        """(a, b, c) minimising the weighted squares with a, b, c >= 0 (a tiny ridge keeps an
        unidentified slope at 0): of the fits with each subset of the three held at 0, the best
        one that is feasible (three unknowns: the exact non-negative least squares)."""
        n, x, r, xx, xr, rr, y, xy, ry = self.s
        ridge = 1e-9 * (xx + rr + 1.0)
        m = [[n, x, r], [x, xx + ridge, xr], [r, xr, rr + ridge]]
        v = [y, xy, ry]
        fits = [(0.0, 0.0, 0.0)]
        for free in ((0, 1, 2), (0, 1), (0, 2), (1, 2), (0,), (1,), (2,)):
            sol = _solve([[m[i][j] for j in free] for i in free], [v[i] for i in free])
            if sol is not None and all(u >= 0 for u in sol):
                fit = [0.0, 0.0, 0.0]
                for i, u in zip(free, sol):
                    fit[i] = u
                fits.append(tuple(fit))
        return min(fits, key=self._residual)

    def _residual(self, f: tuple[float, float, float]) -> float:
        a, b, c = f
        n, x, r, xx, xr, rr, y, xy, ry = self.s
        # sum w (y - a - b x - c r)^2 without its sum w y y (the same for every fit)
        return (a * a * n + b * b * xx + c * c * rr + 2 * a * b * x + 2 * a * c * r
                + 2 * b * c * xr - 2 * a * y - 2 * b * xy - 2 * c * ry)


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """m^-1 v for a small system (Gaussian elimination with partial pivoting); None if
    singular."""
    k = len(v)
    a = [row[:] + [b] for row, b in zip(m, v)]
    for i in range(k):
        p = max(range(i, k), key=lambda j: abs(a[j][i]))
        if abs(a[p][i]) < 1e-300:
            return None
        a[i], a[p] = a[p], a[i]
        for j in range(i + 1, k):
            f = a[j][i] / a[i][i]
            a[j] = [u - f * w for u, w in zip(a[j], a[i])]
    out = [0.0] * k
    for i in reversed(range(k)):
        out[i] = (a[i][k] - sum(a[i][j] * out[j] for j in range(i + 1, k))) / a[i][i]
    return out


def profile_experts(runner, grid: tuple[int, ...], context: int = DEFAULT_CONTEXT,
                    repeats: int = 3, min_seconds: float = 0.03,
                    max_positions: int | None = None) -> ExpertCosts:
    """``ExpertCosts``' prior for a mixture-of-experts ``runner``: for each n of ``grid``, the
    forward of n rows over ``context`` slots (as ``profile_forward``) twice, with the experts
    each layer woke: n random ids (rows routing about as independently as they can: more
    experts than real text wakes) and one random id repeated n times (rows routing as alike as
    they can: the fewest). Real text routes between the two; where, each step's routing tells
    (``ExpertCosts.observe``). The two patterns give each row count two expert counts, so the
    fit tells the seconds of an expert from those of a row."""
    from specdec.kv.block_table import BlockTable

    cfg, kv = runner.cfg, runner.kv
    grid = tuple(sorted(set(int(n) for n in grid)))
    total = context + grid[-1]
    if max_positions is not None and total > max_positions:
        raise ValueError(f"profiling {grid[-1]} rows over a context of {context} reaches "
                         f"position {total - 1}, past max_positions={max_positions}")
    table = BlockTable()
    if not kv.try_reserve(table, total):
        raise ValueError(f"profiling needs {total} free KV slots")
    gen = torch.Generator().manual_seed(0)
    points = []
    try:
        for n in grid:
            spread = torch.randint(cfg.vocab_size, (n,), generator=gen).tolist()
            alike = [int(torch.randint(cfg.vocab_size, (1,), generator=gen))] * n
            for ids in (spread, alike):
                seconds, woken = time_forward(runner, ids, context, table, repeats,
                                               min_seconds)
                if not woken:
                    raise ValueError(f"runner {runner.name!r}: not a mixture of experts")
                points.append((n, sum(woken) / len(woken), seconds))
    finally:
        kv.release(table)
    return ExpertCosts(cfg.num_experts, cfg.num_experts_per_tok, points)
