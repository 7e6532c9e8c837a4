"""What a step costs: the target forward's time as a function of the rows it runs.

On a GPU a forward of 1 or 16 rows costs about the same (memory-bound); on a CPU, verification
rows stop being free after a handful (compute-bound: on a 2-core EPYC, 16 rows cost about 3x
one row). A controller that weighs accepted tokens against step time needs this curve for the
machine it runs on, so it is measured there:

* ``profile_forward(runner, grid)`` times target forwards of ``n`` rows for each ``n`` of the grid
  (one request feeding n tokens over a short context: the matmuls, which dominate, see n rows);
  a second or two for SmolLM2 on a CPU. The engine caches the table per model/device/dtype/threads
  (``StepCosts.load`` / ``save``).
* ``plan_profile(grid, free_slots, max_len)`` fits the profile into what the engine has: the KV
  slots free at start-up and the model's length bound both context + rows, so a small KV budget or
  a short ``max_model_len`` profiles fewer grid points over a shorter context (rows past the
  profiled ones extrapolate the last slope, and are refined online like the rest); where not even
  two points fit, ``StepCosts.flat`` stands in (rows cost alike, refined online).
* ``StepCosts`` interpolates the table (linear between grid points, the last slope beyond) and
  is refined online from every step's measured forward time: a scale on the whole curve moves
  towards the observed ratio (exponential average), and more slowly the two grid points around
  the step's row count, so the curve follows the machine's state (other load, longer contexts)
  without a new profile and without losing its profiled shape.

On a mixture-of-experts target a step's cost depends on more than its rows: each row routes to
its own top-k experts, and the step streams every expert some row woke. ``ExpertCosts`` prices
a step by both (module section below); ``profile_experts`` measures its prior on the target.
"""

from __future__ import annotations

import json
import math
import os
from bisect import bisect_left
from pathlib import Path

import torch

DEFAULT_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
DEFAULT_CONTEXT = 64  # cached slots each profiled forward attends over


class StepCosts:
    """Forward seconds by rows: ``seconds(n)``; ``observe(n, seconds)`` refines it."""

    def __init__(self, rows: list[int], seconds: list[float], rate: float = 0.05,
                 local_rate: float = 0.02) -> None:
        if len(rows) != len(seconds) or not rows:
            raise ValueError("StepCosts needs one time per grid point")
        if list(rows) != sorted(set(rows)) or rows[0] < 1:
            raise ValueError(f"grid rows must be increasing ints >= 1, got {rows}")
        if not all(s > 0 for s in seconds):
            raise ValueError(f"forward times must be > 0, got {seconds}")
        self.rows = [int(r) for r in rows]
        self.times = [float(s) for s in seconds]
        self.rate, self.local_rate = rate, local_rate
        self.scale = 1.0  # the whole curve's correction, learned online
        self._monotone()

    def seconds(self, n: float) -> float:
        """Predicted forward seconds for ``n`` rows (n >= 1)."""
        return self.scale * self._curve(n)

    def table(self, first: int, count: int) -> list[float]:
        """``[seconds(first + j) for j in range(count)]`` (first >= 1), in one walk of the
        curve (a controller's planning reads hundreds of row counts a step)."""
        rows, times, out = self.rows, self.times, []
        if len(rows) == 1:
            return [self.scale * times[0] * max(first + j, 1) / rows[0] for j in range(count)]
        i = 1
        for n in range(max(first, 1), max(first, 1) + count):
            while i < len(rows) - 1 and rows[i] < n:
                i += 1
            out.append(self.scale * self._segment(i, n))
        return out

    def _curve(self, n: float) -> float:
        rows, times = self.rows, self.times
        n = max(float(n), 1.0)
        if len(rows) == 1:
            return times[0] * n / rows[0]
        return self._segment(min(max(bisect_left(rows, n), 1), len(rows) - 1), n)

    def _segment(self, i: int, n: float) -> float:
        """The curve at ``n`` on the line through grid points i - 1 and i."""
        r0, r1, t0, t1 = self.rows[i - 1], self.rows[i], self.times[i - 1], self.times[i]
        return max(t0 + (t1 - t0) * (n - r0) / (r1 - r0), 1e-9)

    def observe(self, n: int, seconds: float) -> None:
        """A measured forward of ``n`` rows: the whole curve's scale moves towards it (``rate``,
        so the shape stays the profiled one when the machine gets busier or the contexts longer)
        and, more slowly (``local_rate``), the grid points around ``n``."""
        if n < 1 or not seconds > 0:
            return
        ratio = seconds / self.seconds(n)
        self.scale *= ratio ** self.rate
        ratio = seconds / self.seconds(n)
        rows = self.rows
        i = bisect_left(rows, n)
        if i < len(rows) and rows[i] == n:
            near = [(i, 1.0)]
        elif i == 0:
            near = [(0, 1.0)]
        elif i == len(rows):
            near = [(len(rows) - 1, 1.0)]
        else:
            w = (n - rows[i - 1]) / (rows[i] - rows[i - 1])
            near = [(i - 1, 1 - w), (i, w)]
        for j, w in near:
            self.times[j] *= ratio ** (self.local_rate * w)
        self._monotone()

    def _monotone(self) -> None:
        """More rows never cost less: the closest non-decreasing curve (pool-adjacent-violators
        averaging), so that one noisy point is averaged with its neighbours, not carried up the
        whole curve."""
        blocks: list[list[float]] = []  # [sum, count]
        for t in self.times:
            blocks.append([t, 1.0])
            while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
                s, c = blocks.pop()
                blocks[-1][0] += s
                blocks[-1][1] += c
        self.times = [s / c for s, c in blocks for _ in range(int(c))]

    @classmethod
    def flat(cls, rows: list[int], seconds: float) -> StepCosts:
        """Every row count costs ``seconds`` (the memory-bound guess, where nothing better could
        be measured); ``observe`` then shapes it from the steps the engine runs."""
        return cls(list(rows), [float(seconds)] * len(rows))

    def to_dict(self) -> dict:
        return {"rows": self.rows, "seconds": [self.scale * t for t in self.times]}

    def describe(self) -> str:
        return ", ".join(f"{r}: {1e3 * t:.1f} ms" for r, t in zip(self.rows, self.times))

    @classmethod
    def load(cls, path: Path) -> StepCosts | None:
        try:
            raw = json.loads(Path(path).read_text())
            return cls(raw["rows"], raw["seconds"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save(self, path: Path) -> None:
        """Written to a temporary file and renamed: a torn write never looks like a table."""
        write_json_atomically(path, self.to_dict())


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


def plan_profile(grid: tuple[int, ...], free_slots: int, max_len: int,
                 context: int = DEFAULT_CONTEXT) -> tuple[int, tuple[int, ...]]:
    """(context, grid points) of a profile that fits: context + n <= min(free_slots, max_len)
    for every point n (the KV slots it reserves, and positions 0 .. context + n - 1 the model
    has). The full ``context`` when the largest point fits beside it; otherwise an eighth of the
    room is context and the points that fit after it stay (possibly none).

    Example: grid (1, 2, 4, ..., 256), 96 free slots, max_len 80 -> (10, (1, 2, 4, ..., 64)).
    """
    grid = tuple(sorted(set(int(n) for n in grid)))
    if not grid or grid[0] < 1 or context < 0:
        raise ValueError(f"plan_profile needs grid points >= 1 and context >= 0, got {grid}, "
                         f"{context}")
    room = max(min(int(free_slots), int(max_len)), 0)
    if context + grid[-1] > room:
        context = min(context, room // 8)
    return context, tuple(n for n in grid if context + n <= room)


def profile_forward(runner, grid: tuple[int, ...], context: int = DEFAULT_CONTEXT,
                    repeats: int = 3, min_seconds: float = 0.03, vocab_size: int | None = None,
                    max_positions: int | None = None) -> StepCosts:
    """Time ``runner``'s forward of n new rows (over ``context`` cached slots) for n in ``grid``:
    after a warm-up, at least ``repeats`` runs and ``min_seconds`` per point (at most 25 runs),
    keeping the fastest (interference only ever adds time). Needs free KV pages for
    context + max(grid) slots (returned afterwards) and, where ``max_positions`` is given, that
    many positions (``plan_profile`` picks a grid that fits both). Logits are computed for every
    row, as verification does.
    """
    from specdec.kv.block_table import BlockTable

    kv = runner.kv
    grid = tuple(sorted(set(int(n) for n in grid)))
    table = BlockTable()
    total = context + grid[-1]
    if max_positions is not None and total > max_positions:
        raise ValueError(f"profiling {grid[-1]} rows over a context of {context} reaches "
                         f"position {total - 1}, past max_positions={max_positions}")
    if not kv.try_reserve(table, total):
        raise ValueError(f"profiling needs {total} free KV slots")
    vocab = vocab_size or runner.cfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    times = []
    try:
        for n in grid:
            ids = torch.randint(vocab, (n,), generator=gen).tolist()
            times.append(_time_forward(runner, ids, context, table, repeats, min_seconds)[0])
    finally:
        kv.release(table)
    return StepCosts(list(grid), times)


def _time_forward(runner, ids: list[int], context: int, table, repeats: int,
                  min_seconds: float) -> tuple[float, tuple[int, ...] | None]:
    """(fastest seconds, experts woken per layer or None) of a forward feeding ``ids``."""
    batch = runner.pack([ids], [context], [table], logits="all")
    runner.forward(batch)  # warm-up (kernel choice, allocator)
    runs: list[float] = []
    woken = None
    while len(runs) < repeats or (sum(runs) < min_seconds and len(runs) < 25):
        out = runner.forward(batch)
        runs.append(out.seconds)  # (on CUDA: the device's time)
        woken = out.experts_woken
    return min(runs), woken


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
                seconds, woken = _time_forward(runner, ids, context, table, repeats,
                                               min_seconds)
                if not woken:
                    raise ValueError(f"runner {runner.name!r}: not a mixture of experts")
                points.append((n, sum(woken) / len(woken), seconds))
    finally:
        kv.release(table)
    return ExpertCosts(cfg.num_experts, cfg.num_experts_per_tok, points)


def write_json_atomically(path: Path, data) -> None:
    """``data`` as JSON at ``path``, written to a temporary file and renamed: a torn write
    never looks like a table."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, path)
