"""The scheduler without a model: admission order, chunked prefill under the token budget, draft
slots for decode rows only (after admissions, within the tokens and pages left, never
preempting), the composition the budget function sees, and preemption of the newest request."""

from __future__ import annotations

import pytest

from specdec.controllers.base import BatchComposition, DraftBudget
from specdec.engine.scheduler import Scheduler
from specdec.engine.sequence import Sequence, SequenceStatus
from specdec.kv.block_table import TableAllocator
from specdec.kv.page_pool import PagePool
from specdec.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0)


def make(num_pages: int = 64, page_size: int = 4, max_num_seqs: int = 8,
         max_tokens: int = 64) -> Scheduler:
    return Scheduler(TableAllocator(PagePool(num_pages), page_size), max_num_seqs, max_tokens)


def add(sched: Scheduler, name: str, prompt_len: int) -> Sequence:
    seq = Sequence(name, list(range(1, prompt_len + 1)), GREEDY, None)
    sched.add(seq)
    return seq


class Budgets:
    """A budget function asking `ask` nodes per request and recording what it was asked."""

    def __init__(self, ask: int | list[int] = 0, max_depth: int | None = None):
        self.ask, self.max_depth, self.calls = ask, max_depth, []

    def __call__(self, records: list, batch: BatchComposition) -> list[DraftBudget]:
        self.calls.append(([r.seq.request_id for r in records], batch))
        asks = self.ask if isinstance(self.ask, list) else [self.ask] * len(records)
        return [DraftBudget(a, self.max_depth) for a in asks]


def advance(sched: Scheduler, out) -> None:
    """What the engine does after a step with no draft accepted: chunks advance; requests at
    their frontier get one token and keep KV for all but it (draft slots are given back)."""
    for rec in out.scheduled:
        seq = rec.seq
        if rec.at_frontier:
            seq.token_ids.append(7)
            seq.num_computed = seq.num_tokens - 1
            sched.kv.truncate(seq.block_table, seq.num_computed)
        else:
            seq.num_computed += rec.num_new_tokens


def step(sched: Scheduler, budgets=None):
    return sched.schedule(budgets or Budgets())


def rows(out) -> dict[str, int]:
    return {r.seq.request_id: r.num_new_tokens for r in out.scheduled}


def test_admission_is_first_come_first_served_and_limited_by_seats():
    sched = make(max_num_seqs=2)
    a, b, c = add(sched, "a", 3), add(sched, "b", 5), add(sched, "c", 2)
    out = step(sched)
    assert rows(out) == {"a": 3, "b": 5}
    assert list(sched.waiting) == [c] and sched.running == [a, b]
    assert a.status is b.status is SequenceStatus.RUNNING and c.status is SequenceStatus.WAITING
    advance(sched, out)
    out = step(sched)  # seats full: c still waits; running requests first, oldest first
    assert [r.seq for r in out.scheduled] == [a, b] and rows(out) == {"a": 1, "b": 1}


def test_admission_stops_at_the_first_request_that_does_not_fit_the_pages():
    sched = make(num_pages=3, page_size=4)
    add(sched, "a", 8)
    add(sched, "b", 8)  # needs 2 pages, 1 left: waits, and "c" does not jump the queue
    add(sched, "c", 2)
    out = step(sched)
    assert rows(out) == {"a": 8} and [s.request_id for s in sched.waiting] == ["b", "c"]


def test_chunked_prefill_under_the_token_budget():
    sched = make(max_tokens=8)
    long, short = add(sched, "long", 19), add(sched, "short", 3)
    chunks = []
    for _ in range(3):
        out = step(sched)
        assert out.num_rows <= 8 and sum(rows(out).values()) <= 8
        chunks.append(rows(out))
        advance(sched, out)
    # long: 8 + 8 + 3 (its last chunk reaches the frontier); short is admitted with what is left
    assert chunks == [{"long": 8}, {"long": 8}, {"long": 3, "short": 3}]
    assert long.num_output_tokens == 1 and short.num_output_tokens == 1
    recs = step(sched).scheduled
    assert all(r.num_new_tokens == 1 and r.at_frontier for r in recs)


def test_a_chunk_short_of_the_frontier_is_not_at_the_frontier():
    sched = make(max_tokens=4)
    seq = add(sched, "a", 10)
    (rec,) = step(sched).scheduled
    assert rec.num_new_tokens == 4 and rec.computed_before == 0 and not rec.at_frontier
    assert seq.block_table.num_slots == 4


def test_drafts_only_for_decode_rows_after_admissions_with_the_composition():
    sched = make(max_tokens=20)
    add(sched, "a", 4), add(sched, "b", 6)
    advance(sched, step(sched))  # both prefilled: now at their decode frontier
    c, d = add(sched, "c", 9), add(sched, "d", 30)
    budgets = Budgets(ask=3)
    out = step(sched, budgets)
    # a, b decode (1 row each); c prefills 9; d gets the 9 tokens left: a chunk, no draft
    assert rows(out) == {"a": 1, "b": 1, "c": 9, "d": 9}
    (asked_for, batch), = budgets.calls
    assert asked_for == ["a", "b"]
    assert batch == BatchComposition(num_decode=2, num_prefill_requests=2,
                                     num_prefill_tokens=18, num_waiting=0, max_draft_rows=0)
    # the token budget is spent by the admissions: the drafts shrink to 0, nothing is preempted
    assert [r.budget.max_nodes for r in out.scheduled] == [0, 0, 0, 0]
    assert [r.asked for r in out.scheduled] == [DraftBudget(3), DraftBudget(3), None, None]
    assert not out.preempted and c.status is d.status is SequenceStatus.RUNNING


def test_draft_budget_shrinks_to_the_tokens_left_in_request_order():
    sched = make(max_tokens=9)
    seqs = [add(sched, n, 3) for n in "abc"]
    advance(sched, step(sched))
    budgets = Budgets(ask=[4, 4, 2], max_depth=2)
    out = step(sched, budgets)
    assert budgets.calls[0][1].max_draft_rows == 6
    got = [r.budget for r in out.scheduled]
    assert got == [DraftBudget(4, 2), DraftBudget(2, 2), DraftBudget(0)]  # the depth cap stays
    assert out.num_rows == 9
    for seq, budget in zip(seqs, got):  # slots reserved for the decode row and the drafts
        assert seq.block_table.num_slots == seq.num_computed + 1 + budget.max_nodes


def test_num_waiting_counts_requests_left_in_the_queue():
    sched = make(max_tokens=8, max_num_seqs=2)
    add(sched, "a", 3)
    advance(sched, step(sched))
    add(sched, "b", 2)
    add(sched, "c", 2)  # no seat left for c
    budgets = Budgets(ask=1)
    step(sched, budgets)
    assert budgets.calls[0][1].num_waiting == 1 and budgets.calls[0][1].num_prefill_tokens == 2


def test_draft_shrinks_to_the_free_pages_and_never_preempts():
    sched = make(num_pages=4, page_size=4, max_tokens=64)
    a, b = add(sched, "a", 6), add(sched, "b", 5)
    advance(sched, step(sched))  # a: 7 tokens, 6 computed (2 pages); b: 6 tokens, 5 computed (2 pages)
    assert sched.kv.pool.num_free == 0
    budgets = Budgets(ask=8)
    out = step(sched, budgets)
    # a's decode row is slot 6; its second page holds slot 7 too: 1 node fits, b's slot 6: 2
    assert [r.budget.max_nodes for r in out.scheduled] == [1, 2]
    assert not out.preempted and sched.running == [a, b]
    assert a.block_table.num_slots == 8 and b.block_table.num_slots == 8
    assert len(a.block_table.pages) == len(b.block_table.pages) == 2


def test_draft_takes_free_pages_first_come():
    sched = make(num_pages=5, page_size=4, max_tokens=64)
    add(sched, "a", 4), add(sched, "b", 4)
    advance(sched, step(sched))  # 5 tokens, 4 computed each: one full page each, 3 pages free
    out = step(sched, Budgets(ask=9))
    # the decode rows (slot 4) take a page each; a's drafts fill slots 5..7 and the last free
    # page (7 nodes), b's the rest of its own page (3)
    assert [r.budget.max_nodes for r in out.scheduled] == [7, 3]
    assert sched.kv.pool.num_free == 0 and not out.preempted


def test_preemption_picks_the_newest_running_request():
    sched = make(num_pages=4, page_size=4, max_tokens=64)
    a, b, c = add(sched, "a", 4), add(sched, "b", 4), add(sched, "c", 4)
    out = step(sched)
    assert sched.kv.pool.num_free == 1
    advance(sched, out)  # each has 5 tokens, 4 computed: a decode row needs a second page each
    out = step(sched)
    # a takes the free page; b needs one: the newest running request (c) is preempted
    assert out.preempted == [c] and rows(out) == {"a": 1, "b": 1}
    assert c.status is SequenceStatus.WAITING and c.num_computed == 0 and c.num_preemptions == 1
    assert list(sched.waiting) == [c] and sched.running == [a, b]
    assert c.block_table.pages == [] and c.block_table.num_slots == 0
    advance(sched, out)
    sched.finish(a)
    out = step(sched)  # a's pages are back: c is readmitted with its prompt and output so far
    assert rows(out) == {"b": 1, "c": 5} and sched.running == [b, c]


def test_a_request_that_cannot_fit_preempts_itself_last():
    sched = make(num_pages=2, page_size=4, max_tokens=64)
    a = add(sched, "a", 8)
    out = step(sched)
    advance(sched, out)  # 9 tokens, 8 computed: the decode row needs a third page; nobody to preempt
    out = step(sched)
    assert out.preempted == [a] and out.scheduled == [] and list(sched.waiting) == [a]


def test_finish_returns_pages_from_any_queue():
    sched = make(num_pages=8, page_size=4, max_num_seqs=1)
    a, b = add(sched, "a", 5), add(sched, "b", 5)
    step(sched)
    sched.finish(b)  # waiting
    sched.finish(a)  # running
    assert not sched.has_work() and sched.kv.pool.num_free == 8
    assert a.status is b.status is SequenceStatus.FINISHED


@pytest.mark.parametrize("ask", [0, 5])
def test_zero_and_unused_budgets_reserve_nothing_extra(ask):
    sched = make()
    a = add(sched, "a", 3)
    advance(sched, step(sched))
    out = step(sched, Budgets(ask=ask))
    assert out.scheduled[0].budget == DraftBudget(ask)
    assert a.block_table.num_slots == a.num_computed + 1 + ask


def test_stale_in_flight_pages_are_dropped_without_breaking_the_walk():
    """Past 4 x free pages + 1024 entries, admitting a request drops the in-flight pages of
    requests no longer running (regression: the walk deleted entries of the dict it walked,
    RuntimeError mid-regeneration after ~8,000 requests)."""
    sched = Scheduler(TableAllocator(PagePool(8), 4), 8, 64, prefix_caching=True)
    gone = Sequence("gone", [1, 2, 3], GREEDY, None)
    gone.status = SequenceStatus.FINISHED
    live = Sequence("live", [1, 2, 3], GREEDY, None)
    live.status = SequenceStatus.RUNNING
    sched.in_flight = {bytes([i % 256, i // 256]): (gone, 0) for i in range(2000)}
    sched.in_flight[b"live"] = (live, 0)
    new = Sequence("new", list(range(1, 10)), GREEDY, None)
    new.page_keys = [b"k0", b"k1"]
    sched._mark_in_flight(new)
    assert set(sched.in_flight) == {b"live", b"k0", b"k1"}
