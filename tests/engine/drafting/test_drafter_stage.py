"""The drafter stage: proposals checked per request, and drafter failures (init_state, propose,
release, on_verified) confined to the request concerned, returned as Failures; a request's
drafting bookkeeping lives on the request."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.drafters.base import BaseDrafter
from specdec.engine.drafting.drafter_stage import DrafterStage
from specdec.engine.sequence import RequestDrafting, Sequence
from specdec.hookspecs import hookimpl
from specdec.tree import DraftTree

VOCAB = 96  # tests/conftest.py TINY_COMMON
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)


# ---- proposals checked per request -----------------------------------------------------------

def _chain(r, n: int, probs=None) -> DraftTree:
    return DraftTree.chain(torch.tensor([r.token_ids[-1]] * n), probs)


def _uniform(n: int) -> torch.Tensor:
    return torch.full((n, VOCAB), 1.0 / VOCAB)


def _bad_probs(kind: str, tree_tokens: list[int]) -> torch.Tensor:
    q = _uniform(len(tree_tokens))
    if kind == "nan":
        q[0, 3] = float("nan")
    elif kind == "negative":
        q[1, 4] = -0.5
    elif kind == "zero-row":
        q[1] = 0.0
    elif kind == "zero-at-token":
        q[0, tree_tokens[0]] = 0.0
    return q


class Scripted(BaseDrafter):
    """Behaviour chosen by the prompt's first token: 11 a chain too deep for the budget's
    max_depth, 12..15 bad draft_probs, 16 raises in release, 17 in on_verified; otherwise a valid
    chain (with uniform draft_probs). Records the request ids it heard in on_verified."""

    name = "scripted"
    BAD = {12: "nan", 13: "negative", 14: "zero-row", 15: "zero-at-token"}
    # propose is pure and on_verified raises before it records anything: calling either twice is
    # harmless, so the engine may retry a raising call request by request (drafters/base.py)
    replay_safe = True

    def __init__(self, target, **kwargs):
        self.heard: list[str] = []

    def init_state(self, request_id, prompt_token_ids):
        return prompt_token_ids[0]

    def propose(self, requests):
        out = []
        for r in requests:
            n = r.budget.depth_limit
            if r.state == 11:
                out.append(_chain(r, r.budget.max_nodes))  # max_nodes 3 > max_depth 2
            elif r.state in self.BAD:
                tokens = [r.token_ids[-1]] * n
                out.append(_chain(r, n, _bad_probs(self.BAD[r.state], tokens)))
            else:
                out.append(_chain(r, n, _uniform(n)))
        return out

    def on_verified(self, batch):
        if any(r.state == 17 for r in batch.requests):
            raise RuntimeError("bookkeeping bug")
        self.heard += [r.request_id for r in batch.requests]

    def release(self, state):
        if state == 16:
            raise RuntimeError("cannot free")


class ScriptedPlugin:
    @hookimpl
    def specdec_drafters(self):
        return {"scripted": Scripted}


def scripted_llm(tiny_llama, **kw) -> LLM:
    return LLM(model=str(tiny_llama), dtype="float64", drafter="scripted",
               plugins=(ScriptedPlugin(),), controller="static",
               controller_args={"budget": 3, "max_depth": 2}, **kw)


@pytest.fixture(scope="module")
def plain(tiny_llama):
    return LLM(model=str(tiny_llama), dtype="float64")


def all_free(llm: LLM) -> bool:
    pool = llm.engine.kv.pool
    return pool.num_free == pool.num_pages


def test_bad_trees_fail_only_their_request_naming_the_plugin(tiny_llama, plain):
    llm = scripted_llm(tiny_llama)
    prompts = [[1, 2, 3], [11, 2, 3], [12, 2], [13, 2], [14, 2], [15, 2], [4, 5], [12, 3]]
    params = [GREEDY, GREEDY, SAMPLED, SAMPLED, SAMPLED, SAMPLED, SAMPLED, GREEDY]
    outs = llm.generate(prompts, params)
    assert [o.finish_reason for o in outs] == ["length"] + ["error"] * 5 + ["length"] * 2
    assert "3 levels deep, more than the budget max_depth=2" in outs[1].error
    for o, needle in zip(outs[2:6], ["finite", "finite", "sums to 0", "is 0 but node 0"]):
        assert "drafter 'scripted' (plugin 'ScriptedPlugin')" in o.error and needle in o.error
    # greedy requests: exact, even with the draft_probs a sampled request may not use
    ref = plain.generate([prompts[0], prompts[7]], GREEDY)
    assert [outs[0].token_ids, outs[7].token_ids] == [r.token_ids for r in ref]
    assert outs[0].metrics.draft_tokens_proposed > 0 and outs[7].metrics.draft_tokens_proposed > 0
    assert all(len(o.token_ids) == 12 for o in (outs[0], outs[6], outs[7]))
    assert all_free(llm)


def test_release_raising_at_finish_is_reported_and_generate_completes(tiny_llama, plain):
    llm = scripted_llm(tiny_llama)
    with pytest.warns(RuntimeWarning, match="failed in release"):
        outs = llm.generate([[16, 2, 3], [1, 2, 3]], GREEDY)
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert [o.token_ids for o in outs] == [
        o.token_ids for o in plain.generate([[16, 2, 3], [1, 2, 3]], GREEDY)]
    errors = llm.engine.plugin_errors
    assert len(errors) == 1 and "drafter 'scripted'" in errors[0] and "cannot free" in errors[0]
    assert all_free(llm)


def test_release_raising_at_preemption_fails_only_that_request(tiny_llama, plain):
    llm = scripted_llm(tiny_llama, page_size=4, num_pages=8, max_model_len=32)
    prompts = [[1, 2, 3, 4], [5, 6, 7], [16, 8, 9]]  # the newest is preempted first
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert outs[2].finish_reason == "error" and "failed in release" in outs[2].error
    assert "cannot free" in outs[2].error
    assert [o.token_ids for o in outs[:2]] == [
        o.token_ids for o in plain.generate(prompts[:2], params)]
    assert all_free(llm)


def test_on_verified_failure_is_isolated_to_the_request_that_raised(tiny_llama, plain):
    llm = scripted_llm(tiny_llama)
    prompts = [[1, 2, 3], [17, 2, 3], [4, 5, 6]]
    outs = llm.generate(prompts, GREEDY)
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert "failed in on_verified" in outs[1].error and "bookkeeping bug" in outs[1].error
    assert "plugin 'ScriptedPlugin'" in outs[1].error
    ref = plain.generate([prompts[0], prompts[2]], GREEDY)
    assert [outs[0].token_ids, outs[2].token_ids] == [r.token_ids for r in ref]
    heard = llm.engine.drafting.drafter.heard
    ids = [o.request_id for o in outs]
    assert ids[1] not in heard and heard.count(ids[0]) == heard.count(ids[2]) >= 5
    assert all_free(llm)


# ---- the stage alone -------------------------------------------------------------------------

class InitFails(BaseDrafter):
    name = "initfails"

    def init_state(self, request_id, prompt_token_ids):
        if request_id == "bad":
            raise RuntimeError("no state")
        return request_id

    def release(self, state):
        if state == "sticky":
            raise RuntimeError("cannot free")


def test_failures_are_values_per_request_and_the_others_get_state():
    stage = DrafterStage(InitFails(), VOCAB)
    good, bad = (Sequence(rid, [1, 2], GREEDY, None) for rid in ("good", "bad"))
    failures = stage._ensure_states([good, bad])
    assert list(failures.requests) == [bad] and "no state" in failures.requests[bad]
    assert bad.finish_reason is None  # the engine ends it, not the stage
    assert good.drafting.ready and good.drafting.state == "good"


def test_release_resets_the_bookkeeping_and_a_failing_release_fails_a_running_request():
    stage = DrafterStage(InitFails(), VOCAB)
    s = Sequence("r", [1, 2], GREEDY, None)
    s.drafting = RequestDrafting(state="sticky", ready=True, suspect=True, undrafted=True,
                                 idle_steps=5)
    failures = stage.release(s)
    assert s.drafting == RequestDrafting() and "cannot free" in failures.requests[s]
    s.drafting, s.finish_reason = RequestDrafting(state="sticky", ready=True), "stop"
    with pytest.warns(RuntimeWarning, match="failed in release"):
        failures = stage.release(s)  # finished already: reported
    assert not failures.requests and "cannot free" in failures.reports[0]


def test_stop_drops_the_state_and_marks_the_request_undrafted():
    stage = DrafterStage(InitFails(), VOCAB)
    s = Sequence("r", [1, 2], GREEDY, None)
    s.drafting = RequestDrafting(state="r", ready=True, idle_steps=3)
    assert not stage.stop([s]).requests
    assert s.drafting == RequestDrafting(undrafted=True)
    assert stage._ensure_states([s]).requests == {} and not s.drafting.ready


# ---- every plugin exception is reported, once, even when a retry saved the step --------------

class BatchBug(BaseDrafter):
    """Correct alone; raises whenever it is asked for several requests at once."""

    name = "batchbug"
    replay_safe = True  # propose only reads: the engine retries it request by request
    prefix_cache_safe = True

    def __init__(self, target, **kwargs):
        pass

    def propose(self, requests):
        if len(requests) > 1:
            raise IndexError("batched path bug")
        return [_chain(r, r.budget.depth_limit) for r in requests]


class BatchBugPlugin:
    @hookimpl
    def specdec_drafters(self):
        return {"batchbug": BatchBug}


class Steps:
    def __init__(self):
        self.stats = []

    @hookimpl
    def specdec_step_end(self, stats):
        self.stats.append(stats)


def test_a_batched_propose_saved_by_the_retry_is_reported_once(tiny_llama, plain, caplog):
    steps = Steps()
    llm = LLM(model=str(tiny_llama), dtype="float64", drafter="batchbug", controller="static",
              plugins=(BatchBugPlugin(), steps), controller_args={"budget": 2})
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8]]
    with caplog.at_level("ERROR", logger="specdec"), \
            pytest.warns(RuntimeWarning, match="'batchbug'.*batched path bug.*not for any of them"):
        outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, GREEDY)]
    assert all(o.metrics.draft_tokens_proposed > 0 for o in outs)  # the retry drafted them
    raised = [s for s in steps.stats if s.plugin_errors]
    assert len(raised) >= 5  # every step it ran batched: in the step's stats
    assert "plugin 'BatchBugPlugin' raised in drafter 'batchbug' propose: IndexError(" \
        in raised[0].plugin_errors[0]
    engine = llm.engine
    assert engine.faults.counts == {"BatchBugPlugin": len(raised)}
    assert any("batched path bug" in e for e in engine.plugin_errors)
    # logged once, with the traceback; the other steps' are counted
    logged = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(logged) == 1 and logged[0].exc_info[0] is IndexError
    assert sum(engine.faults.repeats.values()) == len(raised) - 1


# ---- a composition's failing member is named, with its plugin --------------------------------

class Toy(BaseDrafter):
    """Raises in propose for a prompt starting with 5; else a one-token chain."""

    name = "toy"
    prefix_cache_safe = True

    def __init__(self, target, **kwargs):
        pass

    def propose(self, requests):
        if any(r.token_ids[0] == 5 for r in requests):
            raise RuntimeError("toy bug")
        return [_chain(r, 1) for r in requests]


class ToyPlugin:
    @hookimpl
    def specdec_drafters(self):
        return {"toy": Toy}


def test_a_failing_member_of_a_composition_is_named_with_its_plugin(tiny_llama, plain):
    llm = LLM(model=str(tiny_llama), dtype="float64", drafter="toy+ngram", controller="static",
              plugins=(ToyPlugin(),), controller_args={"budget": 2})
    assert llm.engine.drafting.drafter.plugin_name == "ToyPlugin+specdec.builtins"
    with pytest.warns(RuntimeWarning, match="failed in propose for 2 requests at once"):
        outs = llm.generate([[1, 2, 3], [5, 6, 7]], GREEDY)
    assert outs[0].token_ids == plain.generate([[1, 2, 3]], GREEDY)[0].token_ids
    assert outs[1].finish_reason == "error" and "'?'" not in outs[1].error
    assert "member 'toy' (plugin 'ToyPlugin') failed in propose: RuntimeError('toy bug')" \
        in outs[1].error
    assert set(llm.engine.faults.counts) == {"ToyPlugin"}  # counted against the member's plugin
