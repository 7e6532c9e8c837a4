"""What every benchmarked system returns, and a batch-1 baseline's timing loop."""

from __future__ import annotations

import time
from dataclasses import dataclass

from specdec.outputs import RequestMetrics


@dataclass
class Out:
    token_ids: list[int]
    metrics: RequestMetrics | None  # None for HF systems


def one_by_one(generate, prompts: list[list[int]]) -> tuple[float, list[Out], list[float]]:
    """A batch-1 baseline's run: ``generate(ids) -> new ids`` timed prompt by prompt."""
    outs, secs = [], []
    for ids in prompts:
        t0 = time.perf_counter()
        outs.append(Out(generate(ids), None))
        secs.append(time.perf_counter() - t0)
    return sum(secs), outs, secs
