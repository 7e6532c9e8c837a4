"""The goodput controller's decisions on synthetic acceptance and cost curves, its pruning against
a brute-force optimum, its cost-model fit, and the adaptive baseline's schedule."""

from __future__ import annotations

import itertools

import pytest
import torch

from specdec.controllers.adaptive import AdaptiveController
from specdec.controllers.base import (
    NO_DRAFT,
    BatchComposition,
    DraftBudget,
    RequestOutcome,
    RequestView,
    StepReport,
)
from specdec.controllers.costs import StepCosts
from specdec.controllers.exploration import MAX_BACKOFF
from specdec.controllers.goodput import GoodputController, _Line
from specdec.tree import DraftTree


def views(n: int) -> list[RequestView]:
    return [RequestView(f"r{i}", 50, 10, 5, 0, (), 0, 0) for i in range(n)]


def batch(decode: int, prefill: int = 0, rows: int = 512) -> BatchComposition:
    return BatchComposition(decode, 1 if prefill else 0, prefill, 0, rows)


def linear_costs(fixed: float, per_row: float, top: int = 512) -> StepCosts:
    grid = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512][: 1 + [1, 2, 4, 8, 16, 32, 64, 128, 256,
                                                             512].index(top)]
    return StepCosts(grid, [fixed + per_row * n for n in grid])


def test_no_draft_when_verification_costs_more_than_it_returns():
    # every row costs as much as a whole step, acceptance 0.3: drafting loses
    c = GoodputController(costs=linear_costs(0.0, 1.0), prior=0.3, explore_every=4)
    assert c.budgets(views(4), batch(4)) == [NO_DRAFT] * 4
    assert c.decision["depths"][:4] == [0, 0, 0, 0]
    # now and then a request explores one level, so its estimate can recover: each request
    # first within 2 x 4 x 4 steps, not all in the same step; an exploration after which it still
    # does not pay doubles its interval (16, then 32 steps, ... up to MAX_BACKOFF x 16)
    explored = [[b != NO_DRAFT for b in _drafted_step(c, 4)] for _ in range(64)]
    when = [[t for t, step in enumerate(explored) if step[i]] for i in range(4)]
    assert all(len(w) == 2 and w[0] < 32 and w[1] - w[0] == 32 for w in when), when
    assert max(sum(step) for step in explored) <= 2
    many = [sum(b != NO_DRAFT for b in _drafted_step(c, 4)) for _ in range(2000)]
    assert 4 * 2000 / (16 * MAX_BACKOFF) - 8 <= sum(many) <= 4 * 2000 / (16 * MAX_BACKOFF) + 8


def _drafted_step(c, n: int, drafted: bool = True) -> list[DraftBudget]:
    """One step of n requests: budgets, then (``drafted``) each budget drafted one node and
    none accepted, as the engine reports it."""
    out = c.budgets(views(n), batch(n))
    c.observe(_report([RequestOutcome(f"r{i}", b, 1 if drafted else 0, 0, False,
                                      DraftTree.chain([1], None) if drafted else None, ())
                       for i, b in enumerate(out) if b != NO_DRAFT]))
    return out


def test_a_plan_that_drafts_nothing_is_reused_until_what_it_reads_changes(monkeypatch):
    """Kept off: one plan per REPLAN steps for the same requests, not one a step; a drafted
    outcome (acceptance changed) or another batch plans again; budgets are unchanged by it."""
    from specdec.controllers.goodput import REPLAN

    c = GoodputController(costs=linear_costs(0.0, 1.0), prior=0.3, explore_every=0)
    calls = []
    plan = c._plan
    monkeypatch.setattr(c, "_plan", lambda *a: (calls.append(1), plan(*a))[1])
    for _ in range(3 * REPLAN):
        assert c.budgets(views(2), batch(2)) == [NO_DRAFT] * 2
    assert len(calls) == 3
    c.observe(_report([RequestOutcome("r0", DraftBudget(1), 1, 0, False,
                                      DraftTree.chain([1], None), ())]))
    c.budgets(views(2), batch(2))
    c.budgets(views(3), batch(3))
    assert len(calls) == 5


def test_an_exploration_that_drafted_nothing_backs_nothing_off():
    """A request without drafter state gets no draft when the controller explores it: that
    exploration says nothing about acceptance, and the interval stays."""
    c = GoodputController(costs=linear_costs(0.0, 1.0), prior=0.3, explore_every=4)
    for _ in range(200):
        _drafted_step(c, 1, drafted=False)
    assert c.exploration.backoff["r0"] == 1 and c.exploration.carried == 1
    for _ in range(200):
        _drafted_step(c, 1)
    assert c.exploration.backoff["r0"] == MAX_BACKOFF


def test_drafting_resets_the_exploration_backoff():
    c = GoodputController(costs=linear_costs(1.0, 0.01), prior=0.02, explore_every=1)
    for _ in range(40):  # rows nearly free but nothing accepted: explorations back off
        c.budgets(views(1), batch(1))
        c.observe(_report([RequestOutcome("r0", DraftBudget(1), 1, 0, False,
                                          DraftTree.chain([1], None), ())]))
    assert c.exploration.backoff["r0"] == MAX_BACKOFF
    chain = DraftTree.chain([1, 2], None)
    for _ in range(100):  # now its drafts are accepted: it drafts, at the base interval again
        c.observe(_report([RequestOutcome("r0", DraftBudget(2), 2, 2, False, chain, (0, 1))]))
    assert c.budgets(views(1), batch(1))[0].max_nodes > 0
    assert c.exploration.backoff["r0"] == 1


def _explorations(c, rid: str, steps: int) -> list[int]:
    """Steps at which request ``rid`` (alone in the batch, nothing ever accepted) explored."""
    seen = []
    for t in range(steps):
        b = c.budgets([RequestView(rid, 50, 10, 5, 0, (), 0, 0)], batch(1))[0]
        if b != NO_DRAFT:
            seen.append(t)
            c.observe(_report([RequestOutcome(rid, b, 1, 0, False, DraftTree.chain([1], None),
                                              ())]))
    return seen


def test_new_requests_start_from_the_backoff_explorations_reached():
    """Short requests one after another (a chat): explorations that never pay back off across
    requests, instead of each request starting again at the base interval; a request that
    drafts resets it."""
    c = GoodputController(costs=linear_costs(1.0, 0.01), prior=0.02, explore_every=4)
    first = _explorations(c, "a", 200)
    c.release("a")
    second = _explorations(c, "b", 200)
    assert len(first) >= 4 and len(second) < len(first) / 2, (first, second)
    assert c.exploration.backoff["b"] == MAX_BACKOFF
    c.release("b")
    chain = DraftTree.chain([1, 2], None)
    for _ in range(100):  # a request whose drafts are accepted drafts: the carry is reset
        c.observe(_report([RequestOutcome("c", DraftBudget(2), 2, 2, False, chain, (0, 1))]))
    assert c.budgets(views(1), batch(1))[0].max_nodes > 0
    assert c.exploration.carried == 1


def test_keep_drafting_keeps_an_idle_request_only_while_its_exploration_is_near():
    """A drafter the plan keeps off: an idle request keeps its drafter state (keep_drafting
    with nothing to recompute) only while budgets would explore it within EXPLORE_HORIZON
    steps, so what an exploration drafts from is there; never for a prefix hit to recompute."""
    from specdec.controllers.goodput import EXPLORE_HORIZON

    c = GoodputController(costs=linear_costs(0.0, 1.0), prior=0.3, explore_every=64)
    view = RequestView("r", 50, 10, 5, 0, (), 0, 0)
    answers, explored = [], []
    for _ in range(200):
        b = c.budgets([view], batch(1))[0]
        explored.append(b != NO_DRAFT)
        answers.append(c.keep_drafting(view, 0))
    first = explored.index(True)
    assert first > EXPLORE_HORIZON  # explorations every 64 steps, this one not at once
    assert answers[first - EXPLORE_HORIZON - 1] is False
    assert all(answers[first - EXPLORE_HORIZON:first])
    assert not c.keep_drafting(view, 16)  # recomputing a hit pays only where drafting does
    quiet = GoodputController(costs=linear_costs(0.0, 1.0), prior=0.3, explore_every=0)
    quiet.budgets([view], batch(1))
    assert not quiet.keep_drafting(view, 0)


def test_deep_trees_when_acceptance_is_high_and_rows_are_nearly_free():
    c = GoodputController(budget=16, max_depth=8, costs=linear_costs(1.0, 1e-4), prior=0.95)
    budgets = c.budgets(views(2), batch(2))
    assert budgets == [DraftBudget(16, 8)] * 2
    assert c.decision["expected_tokens"] > 2 + 2 * 5


def test_batch_size_turns_speculation_down():
    """Same acceptance, a cost curve flat up to 8 rows and steep after (a GPU's shape): a
    small batch drafts deep, a large one less, per request."""
    grid = [1, 8, 16, 64, 256]
    costs = StepCosts(grid, [1.0, 1.0, 1.8, 6.0, 24.0])
    small = GoodputController(costs=costs, prior=0.7).budgets(views(1), batch(1))
    large = GoodputController(costs=StepCosts(grid, [1.0, 1.0, 1.8, 6.0, 24.0]),
                              prior=0.7).budgets(views(32), batch(32))
    assert small[0].max_depth >= 5
    assert max(b.depth_limit for b in large) <= 1


def test_requests_decoding_without_a_drafter_count_in_the_plan():
    """The engine does not ask about requests decoding without their drafter state, but their
    rows and tokens are the step's: one request asked among 32 decoding plans as in a batch of
    32 (the costs' steep part), not as a lone request."""
    grid = [1, 8, 16, 64, 256]
    costs = [1.0, 1.0, 1.8, 6.0, 24.0]
    lone = GoodputController(costs=StepCosts(grid, costs), prior=0.7).budgets(views(1), batch(1))
    among = GoodputController(costs=StepCosts(grid, costs), prior=0.7).budgets(views(1),
                                                                               batch(32))
    assert lone[0].max_depth >= 5 and among[0].depth_limit <= 1


def test_budget_respects_the_rows_left():
    c = GoodputController(costs=linear_costs(1.0, 1e-4), prior=0.95)
    budgets = c.budgets(views(3), batch(3, rows=4))
    assert sum(b.depth_limit for b in budgets) == 4


def _best_subtree(tree: DraftTree, est: list[float], base_rows: int, tokens: float, costs,
                  overhead: float) -> float:
    """Brute force: the best goodput over every parent-closed node set."""
    n, parents = tree.num_nodes, tree.parents.tolist()
    best = tokens / (costs.seconds(base_rows) + overhead)
    for r in range(1, n + 1):
        for keep in itertools.combinations(range(n), r):
            s = set(keep)
            if any(parents[i] >= 0 and parents[i] not in s for i in keep):
                continue
            g = (tokens + sum(est[i] for i in keep)) / (costs.seconds(base_rows + r) + overhead)
            best = max(best, g)
    return best


@pytest.mark.parametrize("fixed,per_row", [(1, 0.01), (1, 0.1), (1, 0.3), (1, 1.0), (0, 1.0)])
def test_prune_keeps_exactly_the_nodes_that_pay(fixed, per_row):
    probs = torch.tensor([0.9, 0.05, 0.8, 0.6, 0.02, 0.4, 0.3])
    tree = DraftTree(torch.arange(7), torch.tensor([-1, -1, 0, 2, 2, 3, 5]), path_probs=probs)
    costs = linear_costs(fixed, per_row)
    c = GoodputController(costs=costs)
    (kept,) = c.prune(views(1), [tree], batch(1))
    kept = list(range(7)) if kept is None else kept
    est = c._node_estimates("r0", tree)
    assert est == pytest.approx(probs.tolist(), abs=1e-6)  # no evidence: the drafter's numbers
    got = (1 + sum(est[i] for i in kept)) / costs.seconds(1 + len(kept))
    assert got == pytest.approx(_best_subtree(tree, est, 1, 1.0, costs, 0.0), rel=1e-9)
    # what it keeps is a valid subtree, the most probable nodes first
    tree.select(kept)
    if fixed == 0:  # a row costs a whole step: no node returns that
        assert kept == []
    if per_row == 0.01:  # nearly free rows: all but the 2 % node
        assert kept == [0, 1, 2, 3, 5, 6]


def test_prune_keeps_earlier_siblings_of_sampled_drafts():
    q = torch.full((3, 8), 1 / 8)
    probs = torch.tensor([0.2, 0.9, 0.8])  # the later sibling looks better
    tree = DraftTree(torch.tensor([1, 2, 3]), torch.tensor([-1, -1, 1]), q, probs)
    c = GoodputController(costs=linear_costs(1.0, 0.05))
    (kept,) = c.prune(views(1), [tree], batch(1))
    assert kept is None or 0 in kept, "node 1 kept without its earlier sibling 0"


def test_acceptance_is_learned_per_depth_and_calibrated():
    c = GoodputController(costs=linear_costs(1.0, 0.01), prior=0.5)
    chain = DraftTree.chain([1, 2, 3, 4], None)
    chain.path_probs = torch.tensor([0.5, 0.25, 0.12, 0.06])
    for _ in range(200):  # depth 1 and 2 always accepted, 3 never
        c.observe(_report([RequestOutcome("r0", DraftBudget(4), 4, 2, False, chain, (0, 1))]))
    assert c.depth.rate("r0", 1) > 0.95 and c.depth.rate("r0", 3) < 0.1
    assert c.confidence.probability(0.5) > 0.9 and c.confidence.probability(0.12) < 0.1
    # a new request starts from the drafter's history
    assert c.depth.rate("new", 1) > 0.9


def _report(outcomes, rows=5, forward=0.01, draft=0.002, step=0.013) -> StepReport:
    return StepReport(draft, forward, 0.001, step, rows, len(outcomes), 0, tuple(outcomes))


def test_cost_model_follows_measured_times():
    costs = StepCosts([1, 4, 16], [1.0, 1.2, 2.0])
    truth = StepCosts([1, 4, 16], [2.0, 2.4, 4.0])  # the machine got twice as slow
    for _ in range(200):
        for n in (1, 3, 4, 9, 16):
            costs.observe(n, truth.seconds(n))
    for n in (1, 2, 4, 8, 16, 24):
        assert costs.seconds(n) == pytest.approx(truth.seconds(n), rel=0.05)


def test_step_costs_interpolate_extrapolate_and_persist(tmp_path):
    costs = StepCosts([1, 4, 8], [1.0, 2.5, 3.0])
    assert costs.seconds(1) == 1.0 and costs.seconds(2) == pytest.approx(1.5)
    assert costs.seconds(12) == pytest.approx(3.5)  # the last slope beyond the grid
    # never cheaper with more rows; one noisy point is averaged, not carried up the curve
    assert StepCosts([1, 2], [2.0, 1.0]).times == [1.5, 1.5]
    assert StepCosts([1, 2, 4, 8], [1.0, 3.0, 1.0, 4.0]).times == [1.0, 2.0, 2.0, 4.0]
    costs.scale = 1.3
    for grid in ([1, 4, 8], [3, 5], [2]):  # a table is bitwise the seconds it lists
        c = StepCosts(grid, [1.0, 2.5, 3.0][:len(grid)])
        c.scale = 0.7
        assert c.table(1, 14) == [c.seconds(n) for n in range(1, 15)]
    assert costs.table(5, 10) == [costs.seconds(n) for n in range(5, 15)]
    path = tmp_path / "c.json"
    costs.save(path)
    assert StepCosts.load(path).to_dict() == costs.to_dict()
    path.write_text('{"rows": [1, 2')  # torn
    assert StepCosts.load(path) is None
    with pytest.raises(ValueError, match="increasing"):
        StepCosts([2, 1], [1.0, 1.0])


def test_draft_cost_line_fit():
    line = _Line()
    for _ in range(50):
        for d in (0, 2, 4, 6):
            line.add(d, 0.001 + 0.003 * d)
    assert line(5) == pytest.approx(0.016, rel=1e-3) and line(0) == pytest.approx(0.001, rel=1e-2)


def test_bad_arguments_are_value_errors():
    for kw in ({"budget": 0}, {"width": 0}, {"max_depth": 0}, {"prior": 1.5}):
        with pytest.raises(ValueError, match="controller_args"):
            GoodputController(**kw)


def test_adaptive_grows_on_full_acceptance_and_shrinks_on_rejection():
    c = AdaptiveController(start=4, budget=8)
    assert c.budgets(views(1), batch(1)) == [DraftBudget(4)]
    chain = DraftTree.chain([1, 2, 3, 4])
    c.observe(_report([RequestOutcome("r0", DraftBudget(4), 4, 4, False, chain, (0, 1, 2, 3))]))
    assert c.budgets(views(1), batch(1)) == [DraftBudget(6)]
    c.observe(_report([RequestOutcome("r0", DraftBudget(6), 6, 1, False,
                                      DraftTree.chain([1] * 6), (0,))]))
    assert c.budgets(views(1), batch(1)) == [DraftBudget(5)]
    for _ in range(10):
        c.observe(_report([RequestOutcome("r0", DraftBudget(5), 5, 0, False,
                                          DraftTree.chain([1] * 5), ())]))
    assert c.budgets(views(1), batch(1)) == [DraftBudget(1)]


def test_drafts_that_pruning_drops_count_against_drafting():
    """Phase 1 learns what asking for a depth yields after pruning: drafts whose nodes were all
    pruned count as unaccepted, so budgets stop paying for drafts nobody verifies."""
    c = GoodputController(costs=linear_costs(1.0, 0.01), prior=0.6, explore_every=0)
    for _ in range(100):
        c.observe(_report([RequestOutcome("r0", DraftBudget(4, 2), 4, 0, False, None, ())]))
    assert c.depth.rate("r0", 1) < 0.1
    assert c.budgets(views(1)[:1], batch(1)) == [NO_DRAFT]


def _arm_outcome(rid: str, arm: tuple[str, ...], accepted: int, depth: int = 2):
    tree = DraftTree.chain(list(range(1, depth + 1)), None)
    return RequestOutcome(rid, DraftBudget(depth, depth, arm), depth, accepted, False, tree,
                          tuple(range(accepted)))


@pytest.mark.parametrize("good", ["a", "b"])
def test_composed_drafter_members_are_measured_apart(good):
    """Synthetic acceptance: member ``good`` alone accepts both nodes, the other none, and the
    composition what its first member gives. Budgets name the good member alone, however
    cheap or dear the other is to run: a composition is never worse than its better member."""
    c = GoodputController(budget=4, max_depth=2, width=1, costs=linear_costs(1.0, 0.05),
                          explore_every=0)
    c.set_sources(("a", "b"))
    assert c.arms == [("a",), ("b",), ("a", "b")]
    bad = "b" if good == "a" else "a"
    for _ in range(60):
        outs = [_arm_outcome("r0", (good,), 2), _arm_outcome("r1", (bad,), 0),
                _arm_outcome("r2", ("a", "b"), 2 if good == "a" else 0)]
        seconds = {good: 0.5, bad: 0.001}  # the good member is also the dear one
        c.observe(StepReport(0.5, 1.3, 0.0, 1.9, 6, 3, 0, tuple(outs), source_seconds=seconds))
    assert c.depths[(good,)].rate("new", 1) > 0.9 > 0.1 > c.depths[(bad,)].rate("new", 1)
    assert c.member_draft[good](2) == pytest.approx(0.5, rel=0.05)
    budgets = c.budgets(views(2), batch(2))
    assert budgets == [DraftBudget(2, 2, (good,))] * 2
    assert c.decision["sources"] == [good]
    # once the good member's drafting costs more than its tokens are worth: no draft at all
    for _ in range(200):
        c.observe(StepReport(5.0, 1.3, 0.0, 6.4, 6, 3, 0,
                             (_arm_outcome("r0", (good,), 2),), source_seconds={good: 5.0}))
    assert c.budgets(views(2), batch(2)) == [NO_DRAFT] * 2


def test_exploration_takes_the_arms_in_turn():
    c = GoodputController(costs=linear_costs(0.0, 1.0), prior=0.3, explore_every=1)
    c.set_sources(("x", "y"))
    seen = {b.sources for _ in range(30) for b in c.budgets(views(2), batch(2)) if b.max_nodes}
    assert seen == {("x",), ("y",), ("x", "y")}


def test_sources_must_name_drafters():
    with pytest.raises(ValueError, match="DraftBudget.sources must be None or a non-empty tuple"):
        DraftBudget(2, 2, ())
    with pytest.raises(ValueError, match="DraftBudget.sources"):
        DraftBudget(2, 2, ["ngram"])
