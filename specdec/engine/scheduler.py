"""Continuous batching: which requests run this step, with how many tokens and draft slots.

Running requests go first (oldest first), each getting its remaining prefill chunk or its decode
row; waiting requests are admitted while the token budget, `max_num_seqs` and free pages allow;
then the controller's draft budgets are asked for the decode requests, knowing that composition,
and draft slots are reserved within the tokens and pages left. When pages run out for a running
request, the newest running request is preempted by recompute: its pages are freed and it goes
back to the front of the queue, to be prefilled again over its prompt and everything it had
generated.

Prefix caching (``prefix_caching``): a request admitted with nothing computed first maps the
longest run of cached full pages of its tokens (``specdec.kv.prefix``), at most up to the page
before its last token (the last token is always computed: its logits are the first emission),
asks the drafter to restore its own state for them (``restore``: it may take fewer pages), and
computes only the rest. A preempted request's full pages stay cached (evictable), so its
re-admission usually finds them. A request whose next uncached page is being computed by a
running request (the same system prompt arriving in one batch, the samples of one prompt) waits
until that page is cached instead of computing it again; the requests behind it go first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specdec.controllers.base import BatchComposition, DraftBudget
from specdec.engine.sequence import Sequence, SequenceStatus
from specdec.engine.step import Failures, StepRequest
from specdec.kv.block_table import TableAllocator

# the records of the decode requests and the step's composition -> one budget each (the
# controller stage's `budgets`)
BudgetFn = Callable[[list[StepRequest], BatchComposition], list[DraftBudget]]
# a request and the keys of the cached pages it is about to reuse -> how many of those pages
# its drafter state now covers (the engine's, over the drafter and controller stages)
RestoreFn = Callable[[Sequence, list[bytes]], tuple[int, Failures]]
# a request that loses its KV (preemption, an undone hit) loses its drafter state
PreemptFn = Callable[[Sequence], Failures]


@dataclass
class SchedulerOutput:
    scheduled: list[StepRequest]
    preempted: list[Sequence] = field(default_factory=list)
    composition: BatchComposition | None = None  # the batch the draft budgets were asked for
    failures: Failures = field(default_factory=Failures)  # of the restore / preempt calls
    # prefix caching at this step's admissions: tokens / full pages looked up, and reused
    lookup_tokens: int = 0
    lookup_pages: int = 0
    cached_tokens: int = 0
    cached_pages: int = 0

    @property
    def num_rows(self) -> int:
        return sum(r.num_new_tokens + r.budget.max_nodes for r in self.scheduled)


class Scheduler:
    def __init__(self, kv: TableAllocator, max_num_seqs: int, max_num_batched_tokens: int,
                 prefix_caching: bool = False, restore: RestoreFn | None = None,
                 on_preempt: PreemptFn | None = None):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefix_caching = prefix_caching
        self.restore: RestoreFn = restore or (lambda seq, keys: (len(keys), Failures()))
        self.on_preempt: PreemptFn = on_preempt or (lambda seq: Failures())
        # content key of a full page some admitted request is computing -> (request, page index)
        self.in_flight: dict[bytes, tuple[Sequence, int]] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, draft_budgets: BudgetFn) -> SchedulerOutput:
        """Pick this step's work: running requests' rows, admissions, then draft slots.

        Drafts come last, so the controller is asked knowing the step's composition, and a draft
        never preempts anything: a budget that does not fit (tokens or pages) shrinks or is 0.
        """
        out = SchedulerOutput([])
        budget = self.max_num_batched_tokens
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or budget <= 0:
                continue
            n_new = min(seq.tokens_to_frontier(), budget)
            if self._reserve_running(seq, n_new, out):
                out.scheduled.append(StepRequest(seq, n_new))
                budget -= n_new
        budget = self._admit(out, budget)
        self._reserve_drafts(out, budget, draft_budgets)
        return out

    def _reserve_drafts(self, out: SchedulerOutput, budget: int, draft_budgets: BudgetFn) -> None:
        decode = [r for r in out.scheduled if r.at_frontier and r.num_new_tokens == 1]
        if not decode:
            return
        prefill = [r for r in out.scheduled if r not in decode]
        out.composition = BatchComposition(
            num_decode=len(decode), num_prefill_requests=len(prefill),
            num_prefill_tokens=sum(r.num_new_tokens for r in prefill),
            num_waiting=len(self.waiting), max_draft_rows=budget)
        kv = self.kv
        for req, asked in zip(decode, draft_budgets(decode, out.composition)):
            req.asked = asked
            table, start = req.seq.block_table, req.seq.num_computed + 1
            # slots its own pages and the free pages hold past the decode row (never preempts)
            room = kv.capacity(table) + kv.num_free_pages * kv.page_size - start
            n = min(asked.max_nodes, budget, room)
            if n > 0:
                kv.reserve(table, start + n)
                req.budget = asked.clip(n)
                budget -= n

    def trim_drafts(self, records: list[StepRequest]) -> None:
        """Give back the draft slots a request's tree does not use (a tree smaller than its
        budget, or none)."""
        for rec in records:
            end = rec.computed_before + rec.num_new_tokens + rec.num_nodes
            if rec.budget.max_nodes > 0 and end < rec.seq.block_table.num_slots:
                self.kv.truncate(rec.seq.block_table, end)

    def _reserve_running(self, seq: Sequence, n_new: int, out: SchedulerOutput) -> bool:
        """Reserve seq's rows, preempting the newest other running requests if pages run out.

        False if seq itself had to be preempted.
        """
        while not self.kv.can_reserve(seq.block_table, seq.num_computed + n_new):
            victim = self._newest_running(exclude=seq, scheduled=out.scheduled)
            if victim is None:
                self.preempt(seq, out)
                return False
            self.preempt(victim, out)
        self.kv.reserve(seq.block_table, seq.num_computed + n_new)
        return True

    def _newest_running(self, exclude, scheduled) -> Sequence | None:
        taken = {id(r.seq) for r in scheduled}
        for seq in reversed(self.running):
            if seq is not exclude and id(seq) not in taken:
                return seq
        return None

    def preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.kv.release(seq.block_table)
        out.failures.add(self.on_preempt(seq))
        seq.num_computed = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        """Admit waiting requests in order while tokens, seats and pages allow; returns the
        token budget left. A request whose next uncached page another running request is
        computing right now waits for it (and those behind it go first)."""
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            go = self._reuse_prefix(seq, budget, out)
            if go is _DEFER:
                continue
            if go is _WAIT:
                break
            n_new = min(seq.tokens_to_frontier(), budget)
            if not self.kv.can_reserve(seq.block_table, seq.num_computed + n_new):
                if seq.num_computed:  # undo the hit: the request waits as it was
                    self.kv.release(seq.block_table)
                    out.failures.add(self.on_preempt(seq))
                    seq.num_computed = 0
                break
            self.waiting.remove(seq)
            self._count_hit(seq, out)
            self._mark_in_flight(seq)
            self.kv.reserve(seq.block_table, seq.num_computed + n_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(StepRequest(seq, n_new))
            budget -= n_new
        return budget

    def _reuse_prefix(self, seq: Sequence, budget: int, out: SchedulerOutput):
        """Map the longest cached prefix of a request that has nothing computed: _GO (also
        when nothing is cached), _WAIT (not enough pages for the rest even with it), or _DEFER
        (the next page is being computed by a running request: it will be cached soon)."""
        if not self.prefix_caching or seq.num_computed or seq.block_table.pages \
                or seq.needs_prompt_rows:  # prompt logprobs need every prompt row computed
            return _GO
        kv, ps = self.kv, self.kv.page_size
        keys = seq.keys(ps, (seq.num_tokens - 1) // ps)  # the last token is always computed
        pages = kv.cached_prefix(keys)
        tier = kv.tier_prefix(keys[len(pages):])
        if len(pages) + tier < len(keys) and self._in_flight(keys[len(pages) + tier]):
            return _DEFER
        if not pages and not tier:
            return _GO
        n_new = min(seq.num_tokens - (len(pages) + tier) * ps, budget)
        evictable = sum(1 for p in pages if kv.pool.refcount(p) == 0)
        if -(-n_new // ps) + tier > kv.num_free_pages - evictable:
            return _WAIT
        kv.adopt(seq.block_table, pages)
        if tier:  # brought back from the second tier, or as far as it can serve
            kv.load_from_tier(seq.block_table, keys[len(pages):len(pages) + tier])
        hit = len(seq.block_table.pages)
        restored, failures = self.restore(seq, keys[:hit])
        out.failures.add(failures)
        restored = min(hit, restored)
        kv.truncate(seq.block_table, restored * ps)
        seq.num_computed = restored * ps
        return _GO

    def _mark_in_flight(self, seq: Sequence) -> None:
        """The full prompt pages an admitted request will compute (and then cache)."""
        if not self.prefix_caching:
            return
        if len(self.in_flight) > 4 * self.kv.num_free_pages + 1024:  # drop the stale ones
            # over a snapshot of the keys: _in_flight deletes the stale entry it finds
            self.in_flight = {k: self.in_flight[k] for k in list(self.in_flight)
                              if self._in_flight(k)}
        first = seq.num_computed // self.kv.page_size
        for p, key in enumerate(seq.page_keys[first:(seq.num_tokens - 1) // self.kv.page_size],
                                first):
            self.in_flight.setdefault(key, (seq, p))

    def _in_flight(self, key: bytes) -> bool:
        """A running request is computing the page named ``key`` (not cached yet)."""
        entry = self.in_flight.get(key)
        if entry is None:
            return False
        seq, p = entry
        if seq.status is SequenceStatus.RUNNING and seq.block_table.num_keyed <= p:
            return True
        del self.in_flight[key]
        return False

    def _count_hit(self, seq: Sequence, out: SchedulerOutput) -> None:
        if not self.prefix_caching:
            return
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed
        seq.num_reused_tokens += seq.num_computed
        out.lookup_tokens += seq.num_tokens
        out.lookup_pages += (seq.num_tokens - 1) // self.kv.page_size
        out.cached_tokens += seq.num_computed
        out.cached_pages += seq.num_computed // self.kv.page_size

    def finish(self, seq: Sequence) -> None:
        """Remove a request (finished, aborted or failed) and return its pages."""
        self.kv.release(seq.block_table)
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)


_GO, _WAIT, _DEFER = "go", "wait", "defer"  # what _reuse_prefix says of a waiting request
