"""A controller hears when a request ends (``release(request_id)``: finish, abort, error; not on
preemption), and the goodput and adaptive controllers drop that request's state there, so that a
request reusing the id starts from fresh estimates."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.controllers.adaptive import AdaptiveController
from specdec.controllers.base import (
    BatchComposition,
    DraftBudget,
    RequestOutcome,
    RequestView,
    StepReport,
)
from specdec.controllers.costs import StepCosts
from specdec.controllers.goodput import GoodputController
from specdec.hookspecs import hookimpl
from specdec.tree import DraftTree

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 5, 6, 7], [8, 9, 8, 9, 8], [3, 4, 3, 4, 3, 4, 3]]


def _report(outcomes) -> StepReport:
    return StepReport(0.002, 0.01, 0.001, 0.013, 5, len(outcomes), 0, tuple(outcomes))


def _outcome(rid: str, accepted: int) -> RequestOutcome:
    chain = DraftTree.chain([1, 2, 3, 4], None)
    return RequestOutcome(rid, DraftBudget(4), 4, accepted, False, chain,
                          tuple(range(accepted)))


def test_goodput_release_forgets_the_request_not_the_drafter():
    costs = StepCosts([1, 2, 4, 8], [1.0, 1.0, 1.0, 1.0])
    c = GoodputController(costs=costs, prior=0.5)
    for _ in range(100):  # r0 never accepted, r1 always accepted in full
        c.observe(_report([_outcome("r0", 0), _outcome("r1", 4)]))
    views = [RequestView(r, 20, 5, 5, 0, (), 0, 0) for r in ("r0", "r1")]
    c.budgets(views, BatchComposition(2, 0, 0, 0, 64))
    drafter_wide = c.depth.rate("never seen", 1)
    assert c.depth.rate("r0", 1) < drafter_wide - 0.2, "r0 has estimates of its own"
    assert "r0" in c.exploration.idle
    c.release("r0")
    assert c.depth.rate("r0", 1) == drafter_wide, "a reused id starts from the drafter's history"
    assert "r0" not in c.exploration.idle and "r0" not in c.depth.requests
    assert c.depth.rate("r1", 1) > drafter_wide, "other requests keep theirs"
    c.release("never seen")  # an id the controller never saw: nothing to drop


def test_adaptive_release_restarts_the_schedule():
    c = AdaptiveController(start=2, budget=16)
    view = [RequestView("r0", 20, 5, 5, 0, (), 0, 0)]
    batch = BatchComposition(1, 0, 0, 0, 64)
    c.budgets(view, batch)
    c.observe(_report([RequestOutcome("r0", DraftBudget(2), 2, 2, False, None, (0, 1))]))
    assert c.budgets(view, batch)[0].max_nodes == 4
    c.release("r0")
    assert c.budgets(view, batch)[0].max_nodes == 2


class Spy:
    """A static-like controller that records every release."""

    name = "spy"

    def __init__(self, budget: int = 2, fail: bool = False):
        self.budget, self.fail, self.released = budget, fail, []

    def budgets(self, requests, batch):
        return [DraftBudget(self.budget)] * len(requests)

    def observe(self, report):
        return None

    def release(self, request_id):
        self.released.append(request_id)
        if self.fail:
            raise RuntimeError("spy release bug")


class BoomOnEights:
    """ngram-like drafter that raises for requests whose prompt starts with 8."""

    name = "boom"
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, target):
        pass

    def init_state(self, request_id, prompt_token_ids):
        return None

    def propose(self, requests):
        if any(r.token_ids[0] == 8 for r in requests):
            raise RuntimeError("boom")
        return [DraftTree.chain(torch.tensor(r.token_ids[-1:])) for r in requests]

    def on_verified(self, batch):
        return None

    def release(self, state):
        return None


class SpyPlugin:
    def __init__(self, spy: Spy):
        self.spy = spy

    @hookimpl
    def specdec_controllers(self):
        return {"spy": lambda **kw: self.spy}

    @hookimpl
    def specdec_drafters(self):
        return {"boom": BoomOnEights}


def _llm(tiny_llama, spy: Spy, drafter: str = "ngram", **kw) -> LLM:
    return LLM(model=str(tiny_llama), dtype="float64", drafter=drafter, controller="spy",
               plugins=(SpyPlugin(spy),), **kw)


def test_release_on_finish(tiny_llama):
    spy = Spy()
    outs = _llm(tiny_llama, spy).generate(PROMPTS, GREEDY)
    assert all(o.finish_reason == "length" for o in outs)
    assert sorted(spy.released) == sorted(o.request_id for o in outs)


def test_release_on_abort_and_error(tiny_llama):
    spy = Spy()
    eng = _llm(tiny_llama, spy, drafter="boom").engine
    ids = [eng.add_request(p, GREEDY) for p in PROMPTS]
    eng.step()  # prefill
    eng.abort(ids[0])
    assert spy.released == [ids[0]]
    while eng.has_unfinished():
        eng.step()
    done = {i: eng.pop_finished(i) for i in ids}
    assert done[ids[1]].finish_reason == "error" and "boom" in done[ids[1]].error
    assert done[ids[2]].finish_reason == "length"
    assert sorted(spy.released) == sorted(ids), "each request released once, whatever its end"


def test_not_released_on_preemption(tiny_llama):
    spy = Spy(budget=4)
    eng = _llm(tiny_llama, spy, page_size=4, num_pages=12, max_model_len=40).engine
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ids = [eng.add_request(p, params) for p in PROMPTS]
    while eng.has_unfinished():
        eng.step()
    done = [eng.pop_finished(i) for i in ids]
    assert sum(s.num_preemptions for s in done) > 0, "12 pages of 4 must force preemption"
    assert sorted(spy.released) == sorted(ids)


def test_a_controller_failing_in_release_is_reported(tiny_llama):
    spy = Spy(fail=True)
    llm = _llm(tiny_llama, spy)
    with pytest.warns(RuntimeWarning, match="spy release bug"):
        outs = llm.generate(PROMPTS[:1], GREEDY)
    assert outs[0].finish_reason == "length"
    assert any("controller 'spy' failed in release" in e for e in llm.engine.plugin_errors)


def test_goodput_in_the_engine_forgets_a_request_that_ended(tiny_llama):
    """The release comes after the step's observe (which still reports the request's last
    outcome), so nothing of the request is left behind for a request reusing its id."""
    costs = StepCosts([1, 64], [1.0, 1.001], rate=0.0, local_rate=0.0)  # injected: rows all free
    llm = LLM(model=str(tiny_llama), dtype="float64", drafter="ngram",
              drafter_args={"min_ngram": 1}, controller="goodput",
              controller_args={"budget": 4, "costs": costs})
    eng, controller = llm.engine, llm.engine.controlling.controller
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for _ in range(2):  # the second request reuses the id
        eng.add_request(PROMPTS[0], params, request_id="x")
        seen = False
        while eng.has_unfinished():
            eng.step()
            seen |= "x" in controller.depth.requests
        eng.pop_finished("x")
        assert seen, "the request had estimates of its own while it ran"
        assert "x" not in controller.depth.requests and "x" not in controller.exploration.idle
    assert sum(controller.depth.trials) > 0, "the drafter-wide history stays"
