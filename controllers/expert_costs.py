"""What a step costs on a mixture-of-experts target: rows and the experts they wake.

Each row of a step routes to its own top-k experts and the step streams every expert some row
woke, so ``ExpertCosts`` prices a step by both (T = B(rows) + b * experts woken, the experts
a tree of extra rows wakes learned online from the routing of recent steps), and
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

        seconds(s, rows) = B(rows) + b * x,    x = experts(s, rows)
        experts(s, rows) = E * (1 - (1 - k / E) ** (1 + h * (s - 1) + g * (rows - s)))

    ``x``: the distinct experts a layer wakes, averaged over the layers (``StepReport.
    experts_woken``); E experts, top k per row; ``s`` the step's sequences (decode requests and
    prefill chunks), ``rows - s`` its rows beyond one per sequence (draft nodes, a chunk's later
    tokens). Rows routing independently and uniformly would each bring one independent row's
    worth of experts (g = h = 1); neighbouring tokens of one text route alike (correlated
    routing), so each extra row of a sequence brings only ``g`` < 1 of one: ``g``, the expert
    growth, is what makes a tree dear or cheap. Other sequences' rows, ``h`` of one each: texts
    share the experts routers favour, so h < 1 too (measured on an OLMoE shape: 8 sequences'
    decode rows woke ~15 experts a layer, where independent rows would wake ~41), and
    overrating them adds to every plan at a batch the same experts' cost, which a deeper tree
    then seems to amortise.

    * ``b``, the seconds of an expert: from the prior (profiled on the target,
      ``profile_experts``): at each row count, rows routing as independently as random ids and
      as alike as one repeated id wake different experts at the same rows, so the difference
      of their seconds over the difference of their experts is an expert's; least squares over
      the row counts (relative: each pair weighed by 1 / seconds^2), ``b >= 0``.
    * ``B(rows)``, the rest of a step by rows: the prior's seconds less ``b * x``, a curve
      through the profiled row counts (``StepCosts``: linear between them, never decreasing).
      A curve, not a line: a few rows cost little beyond one (memory-bound), many rows a lot
      (compute-bound), and a line fitted over both overprices the few a decode tree adds
      (measured: 2 ms a row where a verify row cost 0.6 ms on an OLMoE shape). Every step
      refines it as ``StepCosts`` is refined: its measured seconds less ``b * x`` move the
      curve's scale (``rate``) and, more slowly, its points around the step's rows; ``b`` moves
      with the scale (a busier machine makes experts and rows dearer alike).
    * ``g`` and ``h``: from every step of more than one row, each layer's woken count turned
      into the independent rows it is worth (``log(1 - x / E) / log(1 - k / E)``; saturated
      layers, x = E, say nothing), least squares through the origin of that worth less one
      against the extra rows and the extra sequences, exponentially weighted (``decay``),
      starting from ``growth`` and ``sequence_growth`` (1: independent routing, the cautious
      guess) each worth one step of 4 extra rows or sequences.

    Nothing here drops or caps an expert: the model only prices what the routing will wake.
    """

    def __init__(self, num_experts: int, top_k: int,
                 points: list[tuple[float, float, float]] = (), growth: float = 1.0,
                 decay: float = 0.98, rate: float = 0.05, sequence_growth: float = 1.0) -> None:
        if not (isinstance(num_experts, int) and isinstance(top_k, int)
                and 1 <= top_k <= num_experts):
            raise ValueError(f"ExpertCosts needs 1 <= top_k <= num_experts, got {top_k}, "
                             f"{num_experts}")
        self.num_experts, self.top_k, self.decay = num_experts, top_k, decay
        self.points = [tuple(map(float, p)) for p in points]  # (rows, experts, seconds)
        self.b, self.base = _fit_prior(self.points, rate)
        # the sums of the (g, h) least squares: rr, rs, ss, ry, sy over (extra rows r, extra
        # sequences s, worth - 1 y); the priors: one step of 4 extra rows worth 4 g0, one of 4
        # extra sequences worth 4 h0
        self._prior_sums = [16.0, 0.0, 16.0, 16.0 * float(growth), 16.0 * float(sequence_growth)]
        self._sums = [0.0] * 5
        self.growth, self.sequence_growth = float(growth), float(sequence_growth)
        self._miss = math.log1p(-top_k / num_experts) if top_k < num_experts else None

    # ---- prediction --------------------------------------------------------------------------

    def experts(self, sequences: float, rows: float) -> float:
        """Expected distinct experts a layer wakes in a step of ``rows`` rows over ``sequences``
        sequences (rows >= sequences >= 1)."""
        if self._miss is None:
            return float(self.num_experts)
        s = max(float(sequences), 1.0)
        eff = 1.0 + self.sequence_growth * (s - 1.0) + self.growth * max(float(rows) - s, 0.0)
        return self.num_experts * -math.expm1(self._miss * eff)

    def seconds(self, sequences: float, rows: float) -> float:
        """Predicted forward seconds of a step of ``rows`` rows over ``sequences`` sequences."""
        return self.price(self.experts(sequences, rows), rows)

    def price(self, experts: float, rows: float) -> float:
        """Forward seconds of ``rows`` rows waking ``experts`` distinct experts per layer."""
        return max(self.base.seconds(rows) + self.b * self.base.scale * experts, 1e-9)

    def table(self, sequences: int, first: int, count: int) -> list[float]:
        """``[seconds(sequences, first + j) for j in range(count)]`` (a plan reads many)."""
        base = self.base.table(first, count)
        per = self.b * self.base.scale
        return [max(t + per * self.experts(sequences, first + j), 1e-9)
                for j, t in enumerate(base)]

    # ---- learning ----------------------------------------------------------------------------

    def observe(self, rows: int, sequences: int, woken: tuple[int, ...] | list[int],
                seconds: float) -> None:
        """A measured step: ``rows`` rows over ``sequences`` sequences woke ``woken[l]``
        distinct experts in layer l, and its forward took ``seconds``."""
        if rows < 1 or not woken:
            return
        x = sum(woken) / len(woken)
        if seconds > 0:
            # the rows' share: what is left after the experts' (at least a tenth of the step)
            rest = max(seconds - self.b * self.base.scale * x, 0.1 * seconds)
            self.base.observe(rows, rest)
        seqs = max(sequences, 1)
        r, q = rows - seqs, seqs - 1  # extra rows, extra sequences
        if (r > 0 or q > 0) and self._miss is not None:
            worth = [math.log1p(-w / self.num_experts) / self._miss for w in woken
                     if 0 < w < self.num_experts]
            if worth:
                y = sum(worth) / len(worth) - 1.0
                self._sums = [v * self.decay + d for v, d in
                              zip(self._sums, (r * r, r * q, q * q, r * y, q * y))]
                self._fit_growth()

    def _fit_growth(self) -> None:
        """(g, h): the 2 x 2 least squares of the sums, each within [0, 2]."""
        rr, rq, qq, ry, qy = (p + v for p, v in zip(self._prior_sums, self._sums))
        det = rr * qq - rq * rq  # > 0: the priors alone make it 256
        self.growth = min(max((ry * qq - qy * rq) / det, 0.0), 2.0)
        self.sequence_growth = min(max((qy * rr - ry * rq) / det, 0.0), 2.0)

    def describe(self) -> dict:
        """The model's figures (the controller's decision shows them)."""
        return {"seconds_per_expert": self.b * self.base.scale,
                "rows_seconds": {r: round(self.base.seconds(r), 6)
                                 for r in self.base.rows[:6]},
                "expert_growth": round(self.growth, 4),
                "sequence_growth": round(self.sequence_growth, 4),
                "prior_scale": round(self.base.scale, 4)}

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
        curve as the rows' share and no price on an expert (one pattern of routing per row
        count cannot tell an expert's seconds from a row's), reshaped by the steps."""
        return cls(num_experts, top_k, [(r, 0.0, t) for r, t in
                                        zip(costs.rows, costs.to_dict()["seconds"])])


def _fit_prior(points: list[tuple[float, float, float]], rate: float
               ) -> tuple[float, StepCosts]:
    """(b, B) of the prior points (see ``ExpertCosts``); with none, no price on an expert and
    every row count 1 ms (refined by the steps)."""
    by_rows: dict[float, list[tuple[float, float]]] = {}
    for rows, x, t in points:
        if t > 0:
            by_rows.setdefault(rows, []).append((x, t))
    if not by_rows:
        return 0.0, StepCosts.flat([1, 2], 1e-3)
    num = den = 0.0
    for pts in by_rows.values():
        (x0, t0), (x1, t1) = min(pts), max(pts)
        w = 1.0 / ((t0 + t1) / 2) ** 2
        num += w * (t1 - t0) * (x1 - x0)
        den += w * (x1 - x0) ** 2
    b = max(num / den, 0.0) if den > 0 else 0.0
    grid = sorted(by_rows)
    base = [max(sum(t - b * x for x, t in by_rows[r]) / len(by_rows[r]),
                0.1 * min(t for _, t in by_rows[r])) for r in grid]
    if grid[0] > 1:  # (a curve from one row: the first point's seconds, as StepCosts would)
        grid, base = [1, *grid], [base[0], *base]
    return b, StepCosts([int(r) for r in grid], base, rate=rate)


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
