"""What a controller hears: per step, the costs and, per request it was asked about, the budget
it asked for, the nodes proposed and the nodes accepted, kept apart (and whether the drafter had
no KV). A recording controller runs with the oracle drafter, whose trees (a wrong sibling plus
the true continuation) make asked, proposed and accepted three different numbers."""

from __future__ import annotations

from conftest import OracleTree, oracle_plugin

from specdec import LLM, SamplingParams
from specdec.controllers.base import DraftBudget, RequestOutcome, StepReport
from specdec.hookspecs import hookimpl
from specdec.tree import DraftTree

PROMPT = [5, 6, 7, 8, 5, 6]
ASK = DraftBudget(6)


class Recording:
    name = "recording"

    def __init__(self):
        self.views, self.batches, self.reports = [], [], []

    def budgets(self, requests, batch):
        self.views.append(requests)
        self.batches.append(batch)
        return [ASK] * len(requests)

    def observe(self, report):
        self.reports.append(report)


class NoKVForNines(OracleTree):
    """The oracle, except that requests whose prompt starts with 9 get no draft: no KV."""

    def propose(self, requests):
        trees = super().propose(requests)
        for i, r in enumerate(requests):
            if r.token_ids[0] == 9:
                r.mark_no_kv()
                trees[i] = DraftTree.empty()
        return trees


class Plugins:
    def __init__(self):
        self.controller, self.stats = Recording(), []

    @hookimpl
    def specdec_controllers(self):
        return {"recording": lambda: self.controller}

    @hookimpl
    def specdec_step_end(self, stats):
        self.stats.append(stats)


def test_observe_keeps_asked_proposed_and_accepted_apart(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    truth = PROMPT + LLM(model=str(tiny_llama), dtype="float64").generate(
        [PROMPT], params)[0].token_ids
    rec = Plugins()
    llm = LLM(model=str(tiny_llama), dtype="float64", drafter="oracle", controller="recording",
              plugins=(oracle_plugin(truth, depth=3, cls=NoKVForNines), rec))
    outs = llm.generate([PROMPT, [9, 1, 2]], params)
    ctl = rec.controller
    assert len(ctl.reports) == len(rec.stats) and all(isinstance(r, StepReport)
                                                      for r in ctl.reports)
    outcomes = [o for r in ctl.reports for o in r.outcomes]
    assert all(isinstance(o, RequestOutcome) and o.asked == ASK for o in outcomes)
    ids = [o.request_id for o in outs]
    mine = [o for o in outcomes if o.request_id == ids[0]]
    assert any(o.num_proposed > o.num_accepted > 0 and o.asked.max_nodes > o.num_proposed
               for o in mine), "some step must have asked != proposed != accepted"
    assert all(o.num_proposed <= o.asked.max_nodes and o.num_accepted <= o.num_proposed
               for o in outcomes)
    # the outcomes add up to the requests' own metrics
    m = outs[0].metrics
    assert sum(o.num_proposed for o in mine) == m.draft_tokens_proposed
    assert sum(o.num_accepted for o in mine) == sum(m.accepted_by_depth)
    nines = [o for o in outcomes if o.request_id == ids[1]]
    assert nines and all(o.num_proposed == 0 for o in nines)
    # the drafter marks no KV whenever it is asked to draft; in the last step the engine clips
    # the budget to 0 (one token left to emit), so it is not asked and nothing is marked
    assert all(o.no_kv for o in nines[:-1]) and not nines[-1].no_kv
    assert not any(o.no_kv for o in mine)
    for report, stats in zip(ctl.reports, rec.stats):  # the report matches the step's stats
        assert report.num_decode == stats.num_decode == len(report.outcomes)
        assert report.num_verified_rows == stats.num_verified_rows
        if not stats.num_prefill_tokens:  # (a prefill reaching its frontier verifies one row)
            assert stats.num_verified_rows == sum(1 + o.num_proposed for o in report.outcomes)
        assert stats.num_draft_no_kv == sum(o.no_kv for o in report.outcomes)
        assert stats.num_accepted == sum(o.num_accepted for o in report.outcomes)
        # the forward's own seconds (the device's on a GPU; its wall time here)
        assert report.forward_seconds == stats.forward_device_seconds >= 0
        assert report.num_prefill_tokens == stats.num_prefill_tokens
    first = rec.stats[0]  # both prompts prefilled at once: no decode row, nothing asked
    assert first.num_decode == 0 and first.num_prefill_tokens == 9
    assert first.num_verified_rows == 2 and ctl.reports[0].outcomes == ()
    assert llm.engine.totals.draft_no_kv == len(nines) - 1


def test_controller_sees_request_history(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    truth = PROMPT + LLM(model=str(tiny_llama), dtype="float64").generate(
        [PROMPT], params)[0].token_ids
    rec = Plugins()
    llm = LLM(model=str(tiny_llama), dtype="float64", drafter="oracle", controller="recording",
              plugins=(oracle_plugin(truth, depth=3), rec))
    llm.generate([PROMPT], params)
    ctl = rec.controller
    views = [v for step in ctl.views for v in step]
    outcomes = [o for r in ctl.reports for o in r.outcomes]
    assert len(views) == len(outcomes)
    for before, after, out in zip(views, views[1:], outcomes):
        # what the controller sees next is what it heard about the step before
        assert after.last_proposed == out.num_proposed and after.last_accepted == out.num_accepted
        assert after.num_verify_steps == before.num_verify_steps + 1
        assert after.draft_tokens_proposed == before.draft_tokens_proposed + out.num_proposed
        assert after.num_tokens == before.num_tokens + out.num_accepted + 1
    assert all(b.num_decode == 1 for b in ctl.batches)


def test_budgets_naming_unknown_sources_are_refused(tiny_llama):
    import pytest

    from specdec.plugins import PluginError

    class Plugin(Plugins):
        @hookimpl
        def specdec_controllers(self):
            class Asks(Recording):
                def budgets(self, requests, batch):
                    return [DraftBudget(2, 2, ("nope",))] * len(requests)
            return {"recording": Asks}

    llm = LLM(model=str(tiny_llama), dtype="float64", drafter="oracle", controller="recording",
              plugins=(oracle_plugin(PROMPT * 4, depth=3), Plugin()))
    with pytest.raises(PluginError, match=r"asked for drafts from \['nope'\]; this drafter's "
                                          "sources are none"):
        llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))


class KeepsNinesOff(Recording):
    """Drafts for every request but those whose prompt starts with 9, which it keeps off."""

    def __init__(self):
        super().__init__()
        self.nines, self.kept = set(), []

    def budgets(self, requests, batch):
        self.views.append(requests)
        self.batches.append(batch)
        return [DraftBudget(0) if r.request_id in self.nines else ASK for r in requests]

    def keep_drafting(self, request, recompute_tokens):
        self.kept.append(request.request_id)
        return request.request_id not in self.nines


def test_a_request_kept_off_is_not_asked_again_and_a_step_of_only_such_is_not_reported(
        tiny_llama):
    """Once keep_drafting said no, the request decodes without its drafter and the controller
    is not asked about it (a drafter kept off costs no planning per step); the batch still
    counts it; a step whose decode requests are all such, with no prefill, is not reported."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    truth = PROMPT + LLM(model=str(tiny_llama), dtype="float64").generate(
        [PROMPT], short)[0].token_ids
    rec = Plugins()
    ctl = rec.controller = KeepsNinesOff()
    llm = LLM(model=str(tiny_llama), dtype="float64", drafter="oracle", controller="recording",
              plugins=(oracle_plugin(truth, depth=3), rec))
    ids = [llm.engine.add_request(p, q) for p, q in ((PROMPT, short), ([9, 1, 2], params))]
    ctl.nines.add(ids[1])
    while llm.engine.has_unfinished():
        llm.engine.step()
    asked_nine = [v for step in ctl.views for v in step if v.request_id == ids[1]]
    assert len(asked_nine) == 1 and ctl.kept.count(ids[1]) == 1  # asked once, then kept off
    both = [b for b, v in zip(ctl.batches, ctl.views) if len(v) == 1 and v[0].request_id == ids[0]]
    assert both and all(b.num_decode == 2 for b in both)  # the batch counts the unasked one
    # after the short request ended the nines request decoded alone for ~13 steps, unreported
    assert len(rec.stats) - len(ctl.reports) >= 10
    assert all(s.num_draft_nodes == 0 for s in rec.stats[len(ctl.reports):])
    assert [o.request_id for r in ctl.reports for o in r.outcomes].count(ids[1]) == 1
