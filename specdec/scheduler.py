"""Continuous batching: which requests run this step, with how many tokens and draft slots.

Running requests go first (oldest first), each getting its remaining prefill chunk or its decode
row plus draft slots; waiting requests are admitted while the token budget, `max_num_seqs` and
free pages allow. When pages run out for a running request, the newest running request is
preempted by recompute: its pages are freed and it goes back to the front of the queue, to be
prefilled again over its prompt and everything it had generated.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specdec.kv.block_table import KVCacheManager
from specdec.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledRequest:
    seq: Sequence
    num_new_tokens: int  # tokens fed from token_ids[num_computed:]
    draft_budget: int = 0  # max draft-tree nodes this step (0 = no speculation)

    @property
    def at_frontier(self) -> bool:
        """This step ends at the last token, so the request emits tokens."""
        return self.seq.num_computed + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return sum(r.num_new_tokens + r.draft_budget for r in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, draft_budgets: Callable[[list[Sequence]], list[int]]) -> SchedulerOutput:
        """Pick this step's work. `draft_budgets` maps frontier requests to tree budgets."""
        out = SchedulerOutput([])
        budget = self.max_num_batched_tokens
        frontier = [s for s in self.running if s.tokens_to_frontier() == 1]
        wanted = dict(zip((id(s) for s in frontier), draft_budgets(frontier)))
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or budget <= 0:
                continue
            n_new = min(seq.tokens_to_frontier(), budget)
            draft = min(wanted.get(id(seq), 0), budget - n_new) if n_new == 1 else 0
            draft = self._reserve_running(seq, n_new, draft, out)
            if draft is None:
                continue
            out.scheduled.append(ScheduledRequest(seq, n_new, draft))
            budget -= n_new + draft
        self._admit(out, budget)
        return out

    def _reserve_running(self, seq, n_new, draft, out) -> int | None:
        """Reserve slots for seq (dropping the draft, then preempting others, if pages run out).

        Returns the draft budget that fit, or None if seq itself had to be preempted.
        """
        for d in (draft, 0):
            if self.kv.can_reserve(seq.block_table, seq.num_computed + n_new + d):
                self.kv.reserve(seq.block_table, seq.num_computed + n_new + d)
                return d
        while not self.kv.can_reserve(seq.block_table, seq.num_computed + n_new):
            victim = self._newest_running(exclude=seq, scheduled=out.scheduled)
            if victim is None:
                self.preempt(seq, out)
                return None
            self.preempt(victim, out)
        self.kv.reserve(seq.block_table, seq.num_computed + n_new)
        return 0

    def _newest_running(self, exclude, scheduled) -> Sequence | None:
        taken = {id(r.seq) for r in scheduled}
        for seq in reversed(self.running):
            if seq is not exclude and id(seq) not in taken:
                return seq
        return None

    def preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.kv.release(seq.block_table)
        seq.num_computed = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n_new = min(seq.tokens_to_frontier(), budget)
            if not self.kv.can_reserve(seq.block_table, seq.num_computed + n_new):
                break
            self.waiting.popleft()
            self.kv.reserve(seq.block_table, seq.num_computed + n_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledRequest(seq, n_new, 0))
            budget -= n_new

    def finish(self, seq: Sequence) -> None:
        """Remove a request (finished, aborted or failed) and return its pages."""
        self.kv.release(seq.block_table)
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
