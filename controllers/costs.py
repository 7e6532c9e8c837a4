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
its own top-k experts, and the step streams every expert some row woke: ``ExpertCosts`` and
``profile_experts`` (``controllers/expert_costs.py``) price a step by both.
"""

from __future__ import annotations

import json
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
            times.append(time_forward(runner, ids, context, table, repeats, min_seconds)[0])
    finally:
        kv.release(table)
    return StepCosts(list(grid), times)


def time_forward(runner, ids: list[int], context: int, table, repeats: int,
                  min_seconds: float) -> tuple[float, tuple[int, ...] | None]:
    """(fastest seconds, experts woken per layer or None) of a forward feeding ``ids``."""
    batch = runner.pack([ids], [context], [table], logits="all")
    runner.forward(batch)  # warm-up (kernel choice, allocator)
    runs: list[float] = []
    woken = None
    while len(runs) < repeats or (sum(runs) < min_seconds and len(runs) < 25):
        out = runner.forward(batch)
        runs.append(out.seconds)  # (on CUDA: the device's time)
        woken = out.woken_counts()
    return min(runs), woken


def write_json_atomically(path: Path, data) -> None:
    """``data`` as JSON at ``path``, written to a temporary file and renamed: a torn write
    never looks like a table."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, path)
