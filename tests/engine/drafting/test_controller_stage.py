"""The controller stage: budgets (checked, clipped, asked only of requests that may draft),
idle requests and keep_drafting, pruning, release; what fails in it is reported or stops the
step with a PluginError naming the controller."""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams
from specdec.controllers.adapter import as_controller
from specdec.controllers.base import BaseController, BatchComposition, DraftBudget
from specdec.controllers.static import StaticController
from specdec.engine.drafting.controller_stage import IDLE_CHECK, ControllerStage
from specdec.engine.sequence import Sequence
from specdec.engine.step import StepRequest
from specdec.hookspecs import hookimpl
from specdec.plugins import PluginError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
COMPOSITION = BatchComposition(num_decode=2, num_prefill_requests=0, num_prefill_tokens=0,
                               num_waiting=0, max_draft_rows=64)


def seq(n_prompt: int, n_out: int = 0, rid: str = "r") -> Sequence:
    s = Sequence(rid, list(range(1, n_prompt + 1)), GREEDY, None)
    s.token_ids += [5] * n_out
    s.num_computed = s.num_tokens - 1  # at its decode frontier
    return s


def records(*seqs: Sequence) -> list[StepRequest]:
    return [StepRequest(s, 1) for s in seqs]


def stage(controller, max_model_len: int = 64, with_drafter: bool = True) -> ControllerStage:
    return ControllerStage(as_controller(controller), with_drafter, (), max_model_len)


# ---- budgets ---------------------------------------------------------------------------------

def test_budgets_are_clipped_by_max_model_len_and_max_tokens():
    recs = records(seq(10), seq(17), seq(5, n_out=9), seq(16, n_out=3), seq(19))
    # max_tokens 12: 12 - outputs - 1 (the bonus token comes on top); max_model_len 20 - tokens
    got = stage(StaticController(8, max_depth=3), max_model_len=20).budgets(recs, COMPOSITION)
    assert got == [DraftBudget(8, 3), DraftBudget(3, 3), DraftBudget(2, 3), DraftBudget(1, 3),
                   DraftBudget(1, 3)]
    # the controller's own answer, before the clipping, is what it hears back as ``asked``
    assert all(r.controller_asked == DraftBudget(8, 3) for r in recs)


def test_no_drafter_means_no_budget_and_no_question():
    recs = records(seq(3), seq(4))
    got = stage(StaticController(8), with_drafter=False).budgets(recs, COMPOSITION)
    assert got == [DraftBudget(0), DraftBudget(0)]
    assert all(r.controller_asked is None for r in recs)


class Counting(BaseController):
    name = "counting"

    def __init__(self):
        self.asked = []

    def budgets(self, requests, batch):
        self.asked.append([r.request_id for r in requests])
        return [DraftBudget(4)] * len(requests)

    def observe(self, report):
        pass


def test_a_request_decoding_without_drafter_state_is_not_asked():
    a, b = seq(3, rid="a"), seq(4, rid="b")
    b.drafting.undrafted = True
    controller = Counting()
    got = stage(controller).budgets(records(a, b), COMPOSITION)
    assert got == [DraftBudget(4), DraftBudget(0)] and controller.asked == [["a"]]


class WrongController:
    name = "wrong"

    def __init__(self, reply):
        self.reply = reply

    def budgets(self, requests, batch):
        return self.reply(requests)

    def observe(self, report):
        pass


@pytest.mark.parametrize("reply", [
    lambda reqs: [4] * len(reqs),  # the old API: ints
    lambda reqs: [DraftBudget(4)] * (len(reqs) + 1),
    lambda reqs: [DraftBudget(4)][:0],
    lambda reqs: None,
], ids=["ints", "too-many", "too-few", "none"])
def test_controller_returning_the_wrong_count_or_type_is_a_plugin_error(reply):
    with pytest.raises(PluginError, match="controller 'wrong' must return 2 DraftBudget"):
        stage(WrongController(reply)).budgets(records(seq(3), seq(4)), COMPOSITION)


def test_budget_naming_a_source_the_drafter_lacks_is_a_plugin_error():
    ask = WrongController(lambda reqs: [DraftBudget(2, sources=("eagle3",))] * len(reqs))
    s = ControllerStage(as_controller(ask), True, ("ngram", "suffix"), 64)
    with pytest.raises(PluginError, match=r"drafts from \['eagle3'\]"):
        s.budgets(records(seq(3)), COMPOSITION)


def test_a_wrong_controller_stops_generate_with_a_plugin_error(tiny_llama):
    class Plugin:
        @hookimpl
        def specdec_controllers(self):
            return {"wrong": lambda: WrongController(lambda reqs: [3] * len(reqs))}

    llm = LLM(model=str(tiny_llama), dtype="float32", drafter="ngram", controller="wrong",
              plugins=(Plugin(),))
    with pytest.raises(PluginError, match="controller 'wrong'"):
        llm.generate([[1, 2, 1, 2, 1]], GREEDY)
    pool = llm.engine.kv.pool
    assert pool.num_free == pool.num_pages and not llm.engine.has_unfinished()


# ---- idle requests and keep_drafting -----------------------------------------------------------

class KeepOff(StaticController):
    def __init__(self, answer):
        super().__init__(budget=0)
        self.answer, self.asked = answer, []

    def keep_drafting(self, request, recompute_tokens):
        self.asked.append((request.request_id, recompute_tokens))
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def idle_steps(s: ControllerStage, a: Sequence, steps: int) -> list[list[Sequence]]:
    stopped = []
    for _ in range(steps):
        recs = records(a)
        for r, budget in zip(recs, s.budgets(recs, COMPOSITION)):
            r.asked = budget
        stopped.append(s.idle(recs)[0])
    return stopped


def test_keep_drafting_is_asked_at_the_first_idle_step_and_every_idle_check_after():
    a = seq(3, rid="a")
    a.drafting.ready = True
    controller = KeepOff(True)
    stopped = idle_steps(stage(controller), a, 2 * IDLE_CHECK)
    assert not any(stopped)
    assert [n for _, n in controller.asked] == [0, 0, 0]  # steps 1, 32, 64
    assert a.drafting.idle_steps == 2 * IDLE_CHECK


def test_no_from_keep_drafting_stops_the_request_and_a_failure_there_keeps_it():
    a = seq(3, rid="a")
    a.drafting.ready = True
    assert idle_steps(stage(KeepOff(False)), a, 1) == [[a]]
    with pytest.warns(RuntimeWarning, match="failed in keep_drafting"):
        keep, failures = stage(KeepOff(RuntimeError("bug"))).keep_drafting(a, 8)
    assert keep is True and "bug" in failures.reports[0] and not failures.requests
    with pytest.warns(RuntimeWarning, match="keep_drafting must return a bool"):
        assert stage(KeepOff("yes")).keep_drafting(a, 8)[0] is True


def test_a_request_without_drafter_state_is_never_idle():
    a = seq(3, rid="a")  # not ready: init_state has not run
    controller = KeepOff(False)
    assert idle_steps(stage(controller), a, 3) == [[], [], []] and controller.asked == []


# ---- release ---------------------------------------------------------------------------------

class FailsInRelease(StaticController):
    def release(self, request_id):
        raise RuntimeError("cannot forget")


def test_release_failures_are_reported_not_raised():
    with pytest.warns(RuntimeWarning, match="controller 'static' failed in release"):
        failures = stage(FailsInRelease()).release([seq(3, rid="a"), seq(3, rid="b")])
    assert len(failures.reports) == 2 and not failures.requests
