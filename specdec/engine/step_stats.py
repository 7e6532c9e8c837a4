"""A step's figures: ``StepStats`` from the step's records and stage times, the prefix cache's
and the tier's counters since the last step, and the engine's running totals."""

from __future__ import annotations

import time
from dataclasses import dataclass

from specdec.engine.scheduler import SchedulerOutput
from specdec.engine.sequence import Sequence
from specdec.engine.step import StepRequest
from specdec.kv.block_table import TableAllocator
from specdec.metrics import EngineTotals, StepStats, forward_seconds


@dataclass
class StepTimes:
    """perf_counter() when a step started and when each of its stages ended (a stage that did
    not run ends when the one before it did)."""

    start: float
    scheduled: float = 0.0
    drafted: float = 0.0
    forwarded: float = 0.0
    verified: float = 0.0
    committed: float = 0.0
    fed_back: float = 0.0

    def skip_forward(self) -> None:
        """Until a forward runs: the forward, verify, commit and feedback stages take no time."""
        self.forwarded = self.verified = self.committed = self.fed_back = self.drafted


class StepRecorder:
    def __init__(self, kv: TableAllocator, tier, tp=None) -> None:
        self.kv = kv
        self.tier = tier
        self.tp = tp  # rank 0's TensorParallel (tensor_parallel_size > 1), else None
        self.totals = EngineTotals()
        self._evicted = 0  # the pool's evictions counted into step stats so far
        self._tier_seen = (0, 0, 0.0)  # the tier's (hits, stores, seconds) counted so far
        self._tp_start = None  # the collectives' counts when the step began

    def begin(self) -> None:
        """A step begins: what tensor parallelism's collectives counted so far (a forward
        outside the steps, e.g. the step profile, is no step's)."""
        if self.tp is not None:
            self._tp_start = self.tp.counts()

    def record(self, records: list[StepRequest], sched: SchedulerOutput, failed: list[Sequence],
               times: StepTimes, graphed: bool | None = None,
               transfers: tuple[int, int] = (0, 0),
               forward_device_seconds: float | None = None,
               experts_woken: list[int] | None = None) -> StepStats:
        """The step's stats (``times``: when each stage ended; ``graphed``: whether the
        forward replayed a CUDA graph, None without one; ``transfers``: host -> device copies
        and device -> host reads it made; the forward's device seconds; on a mixture of
        experts, the distinct experts per layer it woke), added to the totals."""
        stats = self._stats(records, sched.preempted, failed, times)
        stats.graphed = graphed
        stats.h2d_copies, stats.d2h_reads = transfers
        stats.forward_device_seconds = forward_device_seconds
        stats.experts_woken = None if experts_woken is None else list(experts_woken)
        self._prefix(stats, sched)
        self._tensor_parallel(stats)
        self.totals.add(stats)
        return stats

    def _stats(self, records, preempted, failed, times: StepTimes) -> StepStats:
        t0, t1, t2, t3 = times.start, times.drafted, times.forwarded, times.committed
        frontier = [r for r in records if r.result is not None]
        return StepStats(
            step=self.totals.steps, num_requests=len(records),
            num_decode=sum(1 for r in records if r.at_frontier and r.num_new_tokens == 1),
            num_prefill_tokens=sum(r.num_new_tokens for r in records if r.num_new_tokens > 1),
            num_draft_nodes=sum(r.num_nodes for r in records),
            num_verified_rows=sum(1 + r.num_nodes for r in frontier),
            num_accepted=sum(r.num_accepted for r in frontier),
            num_emitted=sum(r.appended for r in frontier),
            num_draft_no_kv=sum(1 for r in records if r.no_kv),
            draft_seconds=t1 - t0, forward_seconds=t2 - t1, verify_seconds=t3 - t2,
            step_seconds=time.perf_counter() - t0, num_preempted=len(preempted),
            failed_requests=[s.request_id for s in dict.fromkeys(failed)],
            schedule_seconds=times.scheduled - t0, commit_seconds=t3 - times.verified,
            feedback_seconds=times.fed_back - t3,
        )

    def _prefix(self, stats: StepStats, sched: SchedulerOutput) -> None:
        stats.num_lookup_tokens, stats.num_lookup_pages = sched.lookup_tokens, sched.lookup_pages
        stats.num_cached_tokens, stats.num_cached_pages = sched.cached_tokens, sched.cached_pages
        pool = self.kv.pool
        stats.num_evicted_pages, self._evicted = pool.num_evicted - self._evicted, pool.num_evicted
        if self.tier is not None:
            now = (self.tier.hits, self.tier.stores, self.tier.seconds)
            stats.tier_hits, stats.tier_stores, stats.tier_seconds = (
                a - b for a, b in zip(now, self._tier_seen))
            self._tier_seen = now
        self.kv.observe_prefill(forward_seconds(stats), stats.num_prefill_tokens,
                                stats.num_prefill_tokens + stats.num_decode)

    def _tensor_parallel(self, stats: StepStats) -> None:
        """The step's collectives on rank 0 (``StepStats.tp_*``), since ``begin``."""
        if self.tp is None:
            return
        now = self.tp.counts()
        start = self._tp_start or now
        reductions = now["reductions"].minus(start["reductions"])
        messages = now["messages"].minus(start["messages"])
        stats.tp_reductions = reductions.calls
        stats.tp_reduce_seconds = reductions.seconds
        stats.tp_reduce_bytes = reductions.bytes
        stats.tp_messages = messages.calls
        stats.tp_message_seconds = messages.seconds
        self._tp_start = None
