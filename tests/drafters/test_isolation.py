"""Drafter failures without replays (drafters/base.py, "Failures"): a drafter that is not
replay_safe is never called twice for a request in one step, whatever it raised; the requests it
did not fail keep their plain outputs, and their drafter state stays right (the self-drafting
draft_model below has every draft accepted, which a state left half-advanced would break)."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.drafters.base import BaseDrafter
from specdec.drafters.compose import ComposedDrafter
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.hookspecs import hookimpl
from specdec.tree import DraftTree

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [42] * 9, [3, 1, 4, 1, 5], [60, 61, 62, 63]]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
BAD = "1"  # the engine's request ids count up from "0": the second prompt
FROM_STEP = 3  # the bad request fails from this step on (after some drafting went right)


class Faulty(DraftModelDrafter):
    """draft_model that fails for request BAD from FROM_STEP on: ``where`` (propose or
    on_verified), ``how`` ("raise": after part of the batch has been processed; "mark":
    ``request.fail`` and the others handled). Records every call as (step, method, request id).
    """

    name = "faulty"

    def __init__(self, target, where: str = "propose", how: str = "raise", **kwargs):
        super().__init__(target, **kwargs)
        self.where, self.how = where, how
        self.calls: list[tuple[int, str, str]] = []
        self.clock = lambda: 0  # the engine's step count (set by the test)
        self.forwards, self.armed = 0, False
        forward = self.runner.forward

        def counted(*args, **kw):
            self.forwards += 1
            if self.armed and self.forwards == 3:
                # every request's num_cached and KV reservation have moved on by now
                raise RuntimeError("draft bug")
            return forward(*args, **kw)

        self.runner.forward = counted

    def _fails(self, ids) -> bool:
        return BAD in ids and self.clock() >= FROM_STEP

    def propose(self, requests):
        step = self.clock()
        self.calls += [(step, "propose", r.request_id) for r in requests]
        ids = [r.request_id for r in requests]
        if not (self.where == "propose" and self._fails(ids)):
            return super().propose(requests)
        if self.how == "mark":
            good = [r for r in requests if r.request_id != BAD]
            trees = iter(super().propose(good))
            requests[ids.index(BAD)].fail("no draft for this one")
            return [DraftTree.empty() if r.request_id == BAD else next(trees) for r in requests]
        self.forwards, self.armed = 0, True
        try:
            return super().propose(requests)
        finally:
            self.armed = False

    def on_verified(self, batch):
        step = self.clock()
        ids = [r.request_id for r in batch.requests]
        self.calls += [(step, "on_verified", i) for i in ids]
        if not (self.where == "on_verified" and self._fails(ids)):
            return super().on_verified(batch)
        bad = ids.index(BAD)
        if self.how == "mark":
            super().on_verified(batch.select([i for i in range(len(ids)) if i != bad]))
            batch.requests[bad].fail("bookkeeping bug")
            return None
        super().on_verified(batch.select(list(range(bad))))  # the requests before it: done
        raise RuntimeError("bookkeeping bug")


class FaultyPlugin:
    @hookimpl
    def specdec_drafters(self):
        return {"faulty": Faulty}


@pytest.fixture(scope="module")
def plain(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float64")
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


class Steps:
    def __init__(self):
        self.stats = []

    @hookimpl
    def specdec_step_end(self, stats):
        self.stats.append(stats)


def run(tiny_llama, where: str, how: str):
    steps = Steps()
    llm = LLM(model=str(tiny_llama), dtype="float64", drafter="faulty",
              drafter_args={"model": str(tiny_llama), "where": where, "how": how},
              controller="static", controller_args={"budget": 4},
              plugins=(FaultyPlugin(), steps))
    drafter = llm.engine.drafting.drafter
    drafter.clock = lambda: llm.engine.totals.steps
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.request_id for o in outs][1] == BAD
    return llm, drafter, outs, steps.stats


def all_pages_free(llm: LLM) -> bool:
    pools = [llm.engine.kv.pool, llm.engine.drafting.drafter.runner.kv.pool]
    return all(p.num_free == p.num_pages for p in pools)


def no_replays(calls) -> bool:
    return len(calls) == len(set(calls))


def failed_step(stats) -> int:
    return next(s.step for s in stats if BAD in s.failed_requests)


def assert_others_exact_and_fully_accepted(outs, plain):
    for i, o in enumerate(outs):
        if o.request_id == BAD:
            continue
        assert o.finish_reason == "length" and o.token_ids == plain[i]
        # the target drafting for itself: a right draft state means every draft is accepted
        assert o.metrics.draft_tokens_proposed > 0
        assert o.metrics.draft_tokens_proposed == sum(o.metrics.accepted_by_depth), o.request_id


def assert_bad_failed(outs, needle: str):
    bad = outs[1]
    assert bad.finish_reason == "error"
    assert "drafter 'faulty' (plugin 'FaultyPlugin')" in bad.error and needle in bad.error


@pytest.mark.parametrize("how", ["raise", "mark"])
def test_propose_failing_for_one_request_fails_only_it_without_replays(tiny_llama, plain, how):
    if how == "raise":
        with pytest.warns(RuntimeWarning, match="failed in propose for 5 requests at once"):
            llm, drafter, outs, stats = run(tiny_llama, "propose", how)
    else:
        llm, drafter, outs, stats = run(tiny_llama, "propose", how)
    assert_bad_failed(outs, "draft bug" if how == "raise" else "no draft for this one")
    assert_others_exact_and_fully_accepted(outs, plain)
    assert no_replays(drafter.calls)
    step = failed_step(stats)
    if how == "raise":
        # step FROM_STEP: nobody could be blamed, nobody drafted; the next step each of them
        # proposed in a call of its own, and only the bad request's call raised
        assert step == FROM_STEP + 1 and stats[FROM_STEP].num_draft_nodes == 0
        alone = [c for c in drafter.calls if c[0] == step and c[1] == "propose"]
        assert len(alone) == len(PROMPTS)
        assert any("failed in propose for 5 requests" in e for e in llm.engine.plugin_errors)
    else:
        assert step == FROM_STEP and stats[step].num_draft_nodes > 0  # the others drafted
    assert all_pages_free(llm)


def test_on_verified_marking_one_request_fails_only_it(tiny_llama, plain):
    llm, drafter, outs, stats = run(tiny_llama, "on_verified", "mark")
    assert_bad_failed(outs, "failed in on_verified: bookkeeping bug")
    assert_others_exact_and_fully_accepted(outs, plain)
    assert no_replays(drafter.calls)
    assert failed_step(stats) == FROM_STEP
    assert all_pages_free(llm)


def test_on_verified_raising_for_a_batch_stops_drafting_for_it_but_fails_nobody(tiny_llama,
                                                                                plain):
    """The step's update cannot be replayed (it may be half done) nor redone later (its hidden
    states are gone): the requests of that call decode on without drafts, outputs unchanged."""
    with pytest.warns(RuntimeWarning, match="failed in on_verified for 5 requests at once"):
        llm, drafter, outs, stats = run(tiny_llama, "on_verified", "raise")
    assert [o.token_ids for o in outs] == plain
    assert all(o.finish_reason == "length" for o in outs)
    assert no_replays(drafter.calls)
    assert not [c for c in drafter.calls if c[0] > FROM_STEP]  # no drafter calls any more
    assert all(s.num_draft_nodes == 0 for s in stats[FROM_STEP + 1:])
    assert all(o.metrics.draft_tokens_proposed == sum(o.metrics.accepted_by_depth) > 0
               for o in outs)
    assert any("failed in on_verified for 5" in e for e in llm.engine.plugin_errors)
    assert all_pages_free(llm)


# ---- a replay-safe drafter is still retried request by request -------------------------------

class Repeater(BaseDrafter):
    """Proposes the last token repeated; raises for request BAD from FROM_STEP on. Pure, so
    replay_safe."""

    name = "repeater"
    replay_safe = True

    def __init__(self, target, **kwargs):
        self.calls: list[tuple[int, str]] = []
        self.clock = lambda: 0

    def propose(self, requests):
        self.calls += [(self.clock(), r.request_id) for r in requests]
        if any(r.request_id == BAD for r in requests) and self.clock() >= FROM_STEP:
            raise RuntimeError("repeater bug")
        return [DraftTree.chain(torch.tensor(r.token_ids[-1:] * r.budget.depth_limit))
                for r in requests]


class RepeaterPlugin:
    @hookimpl
    def specdec_drafters(self):
        return {"repeater": Repeater}


def test_replay_safe_drafter_is_retried_per_request_and_the_others_draft_that_step(tiny_llama,
                                                                                   plain):
    steps = Steps()
    llm = LLM(model=str(tiny_llama), dtype="float64", drafter="repeater",
              controller="static", controller_args={"budget": 4},
              plugins=(RepeaterPlugin(), steps))
    drafter = llm.engine.drafting.drafter
    drafter.clock = lambda: llm.engine.totals.steps
    outs = llm.generate(PROMPTS, GREEDY)
    assert outs[1].finish_reason == "error" and "repeater bug" in outs[1].error
    assert "plugin 'RepeaterPlugin'" in outs[1].error
    assert [o.token_ids for i, o in enumerate(outs) if i != 1] == plain[:1] + plain[2:]
    step = failed_step(steps.stats)
    assert step == FROM_STEP and steps.stats[step].num_draft_nodes > 0
    # the batch call, then one call per request: each of the others twice in that step
    at = [rid for s, rid in drafter.calls if s == step]
    assert sorted(at) == sorted([o.request_id for o in outs] * 2)
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_pages


# ---- declarations ------------------------------------------------------------------------------

def test_builtin_declarations():
    """True only where a repeat call is harmless: ngram (its index skips what it has), mtp
    (propose reads, on_verified overwrites). draft_model, eagle3 and block_diffusion advance
    their caches and append features; oracle draws coins per call."""
    from specdec.drafters.block_diffusion import BlockDiffusionDrafter
    from specdec.drafters.eagle3 import Eagle3Drafter
    from specdec.drafters.mtp import MTPDrafter
    from specdec.drafters.ngram import NgramDrafter
    from specdec.drafters.oracle import OracleDrafter

    assert NgramDrafter.replay_safe and MTPDrafter.replay_safe
    assert not any(d.replay_safe for d in (DraftModelDrafter, Eagle3Drafter,
                                           BlockDiffusionDrafter, OracleDrafter, BaseDrafter))


class Member:
    """A composable stub: a one-node chain, or ``fail`` for request "x"."""

    hidden_layers = ()

    def __init__(self, name, replay_safe=None, fails=False):
        self.name, self.fails = name, fails
        if replay_safe is not None:
            self.replay_safe = replay_safe

    def init_state(self, request_id, prompt_token_ids):
        return None

    def propose(self, requests):
        for r in requests:
            if self.fails and r.request_id == "x":
                r.fail("bad member")
        return [DraftTree.chain(torch.tensor([1])) for _ in requests]

    def on_verified(self, batch):
        for r in batch.requests:
            if self.fails and r.request_id == "x":
                r.fail("bad feedback")


@pytest.mark.parametrize("flags, safe", [((True, True), True), ((True, False), False),
                                         ((True, None), False)])
def test_composed_is_replay_safe_only_when_every_member_is(flags, safe):
    composed = ComposedDrafter([Member(f"m{i}", f) for i, f in enumerate(flags)])
    assert composed.replay_safe is safe


def test_composed_passes_a_member_marking_a_request_failed_on():
    from specdec.controllers.base import DraftBudget
    from specdec.drafters.base import DraftRequest, TokenView, VerifiedBatch, VerifiedRequest

    composed = ComposedDrafter([Member("a"), Member("b", fails=True)])
    reqs = [DraftRequest(rid, TokenView([1, 2]), DraftBudget(2), GREEDY, None,
                         composed.init_state(rid, [1, 2])) for rid in ("x", "y")]
    composed.propose(reqs)
    assert reqs[0].error == "b: bad member" and reqs[1].error is None
    batch = VerifiedBatch([VerifiedRequest(r.request_id, r.state, r.token_ids, 2, 1, 1, [], 0)
                           for r in reqs])
    composed.on_verified(batch)
    assert [r.error for r in batch.requests] == ["b: bad feedback", None]
