"""On a mixture-of-experts target the goodput controller prices a step by the experts it is
expected to wake (``ExpertCosts``): its fit on synthetic reports, the expert growth learned from
routing, the controller drafting deeper where routing is correlated and holding back where a
tree wakes new experts, and, end to end on a tiny Qwen3-MoE, speculation equal to plain decoding
with the expert terms in the step stats."""

from __future__ import annotations

import random

import pytest

from specdec.controllers.base import (
    BatchComposition,
    RequestOutcome,
    RequestView,
    StepReport,
)
from specdec.controllers.costs import StepCosts
from specdec.controllers.expert_costs import ExpertCosts
from specdec.controllers.goodput import GoodputController
from specdec.tree import DraftTree

E, K, LAYERS = 64, 8, 16
A, B, C = 2e-3, 4e-4, 1e-4  # fixed seconds, seconds per expert per layer, seconds per row


def _model(growth: float, sequence_growth: float = 1.0) -> ExpertCosts:
    m = ExpertCosts(E, K)
    m.growth, m.sequence_growth = growth, sequence_growth
    return m


def _prior() -> list[tuple[float, float, float]]:
    """What ``profile_experts`` measures: each row count routing independently (random ids)
    and alike (one repeated id), priced by the true model."""
    out = []
    for rows in (1, 2, 4, 8, 16, 32):
        for growth in (1.0, 0.05):
            x = _model(growth).experts(1, rows)
            out.append((rows, x, A + B * x + C * rows))
    return out


def _woken(growth: float, sequences: int, rows: int, rng: random.Random,
           sequence_growth: float = 1.0) -> list[int]:
    x = _model(growth, sequence_growth).experts(sequences, rows)
    return [max(1, min(E, round(x + rng.gauss(0, 1)))) for _ in range(LAYERS)]


def test_the_prior_points_alone_give_the_cost_of_an_expert_and_of_a_row():
    m = ExpertCosts(E, K, _prior())
    assert m.b == pytest.approx(B, rel=1e-6)
    for rows in (1, 3, 8, 20):  # the rows' share, between the profiled points too
        for x in (8.0, 30.0):
            assert m.price(x, rows) == pytest.approx(A + B * x + C * rows, rel=1e-6)
    assert m.growth == 1.0  # nothing routed yet: independent routing, the cautious guess


def test_a_few_rows_are_priced_by_the_curve_not_a_line():
    """A forward memory-bound for a few rows and compute-bound beyond: the rows' share follows
    the profiled curve (a line over 1..32 rows would price a decode tree's few extra rows at
    the compute-bound slope)."""
    def true(x, rows):
        return A + B * x + (0.2 * C * rows if rows <= 4 else 0.2 * C * 4 + 3 * C * (rows - 4))

    prior = [(r, _model(g).experts(1, r), 0.0) for r in (1, 2, 4, 8, 16, 32) for g in (1.0, 0.05)]
    m = ExpertCosts(E, K, [(r, x, true(x, r)) for r, x, _ in prior])
    for rows in (1, 2, 3, 4, 12, 32):
        assert m.price(20.0, rows) == pytest.approx(true(20.0, rows), rel=1e-6)


def test_the_fit_follows_synthetic_reports():
    """Steps measured on a machine twice as slow as the prior and routing with growth 0.3:
    the fit finds the new seconds per expert and per row, and the growth."""
    rng = random.Random(0)
    m = ExpertCosts(E, K, _prior())
    for _ in range(400):
        s = rng.randint(1, 4)
        rows = s + rng.randint(0, 12)
        woken = _woken(0.3, s, rows, rng)
        x = sum(woken) / len(woken)
        m.observe(rows, s, woken, 2 * (A + B * x + C * rows) * (1 + rng.gauss(0, 0.01)))
    assert m.growth == pytest.approx(0.3, abs=0.02)
    assert m.base.scale == pytest.approx(2, rel=0.05)
    for rows, x in ((1, 8.0), (4, 12.0), (9, 20.0), (16, 30.0)):
        assert m.price(x, rows) == pytest.approx(2 * (A + B * x + C * rows), rel=0.05)
    # correlated routing: far fewer experts than independent routing predicts
    assert m.experts(1, 9) < 0.6 * _model(1.0).experts(1, 9)


def test_sequences_that_route_alike_are_learned_apart_from_the_rows():
    """Batches whose sequences share most experts (h 0.2) and whose trees add few (g 0.1):
    both learned from steps mixing the two, and a batch of 8 then expects far fewer experts
    than 8 independent sequences would wake."""
    rng = random.Random(2)
    m = ExpertCosts(E, K, _prior())
    for _ in range(300):
        s = rng.randint(1, 8)
        rows = s + rng.randint(0, 16)
        m.observe(rows, s, _woken(0.1, s, rows, rng, 0.2), 0.05)
    assert m.growth == pytest.approx(0.1, abs=0.03)
    assert m.sequence_growth == pytest.approx(0.2, abs=0.05)
    assert m.experts(8, 8) < 0.5 * _model(1.0).experts(8, 8)


def test_growth_ignores_saturated_layers_and_steps_without_extra_rows():
    m = ExpertCosts(8, 2)
    m.observe(1, 1, [2] * 4, 0.01)  # one row: nothing beyond it
    m.observe(30, 1, [8] * 4, 0.01)  # every layer saturated: says nothing either
    assert m.growth == 1.0 and m.sequence_growth == 1.0
    assert ExpertCosts(4, 4).experts(1, 10) == 4  # top-k of all experts: always all


def test_the_prior_and_a_controllers_model_round_trip(tmp_path):
    m = ExpertCosts(E, K, _prior())
    m.save(tmp_path / "x.json")
    back = ExpertCosts.load(tmp_path / "x.json")
    assert back.b == m.b and back.table(1, 1, 40) == m.table(1, 1, 40)
    curve = StepCosts([1, 2, 4, 8], [1e-3, 1.1e-3, 1.3e-3, 1.7e-3])
    assert ExpertCosts.from_step_costs(curve, E, K).seconds(1, 4) == pytest.approx(1.3e-3,
                                                                                  rel=0.05)
    with pytest.raises(ValueError):
        ExpertCosts(4, 5)


# ---- the controller ---------------------------------------------------------------------------

def _views(n: int) -> list[RequestView]:
    return [RequestView(f"r{i}", 50, 10, 5, 0, (), 0, 0) for i in range(n)]


def _taught(growth: float, steps: int = 60) -> GoodputController:
    """A controller on an MoE whose routing grows by ``growth``: it hears prefill steps of
    one request's chunk of 16 rows (the routing of a text), with their true seconds."""
    rng = random.Random(1)
    c = GoodputController(costs=StepCosts([1, 32], [A, A + 32 * C]), prior=0.8,
                          explore_every=0, experts=ExpertCosts(E, K, _prior()))
    for _ in range(steps):
        woken = _woken(growth, 1, 16, rng)
        x = sum(woken) / len(woken)
        c.observe(StepReport(0.0, A + B * x + 16 * C, 0.0, A + B * x + 16 * C, 0, 0, 16, (),
                             experts_woken=tuple(woken), num_prefill_requests=1))
    return c


def test_correlated_routing_drafts_deeper_than_independent_routing():
    """Acceptance 0.8 a level; an expert costs 4x a row. Batch 1: where an extra row wakes few
    new experts (growth 0.1) the plan drafts deep; where each wakes a fresh row's worth (growth
    1) a node costs several rows' worth of experts and the plan holds back. Batch 4 with
    independent routing: the decode rows alone wake most experts and a few nodes wake the
    rest, after which a node costs only its row: deep again (the MoE's amortisation)."""
    low, high = _taught(0.1), _taught(1.0)
    assert low.experts.growth == pytest.approx(0.1, abs=0.03)
    assert high.experts.growth == pytest.approx(1.0, abs=0.05)
    one = BatchComposition(1, 0, 0, 0, 512)
    deep, shallow = low.budgets(_views(1), one), high.budgets(_views(1), one)
    assert deep[0].depth_limit > shallow[0].depth_limit >= 1, (deep, shallow)
    assert low.decision["expected_experts_per_layer"] < \
        high.decision["expected_experts_per_layer"]
    assert low.decision["expert_costs"]["expert_growth"] < 0.2
    four = high.budgets(_views(4), BatchComposition(4, 0, 0, 0, 512))
    assert min(b.depth_limit for b in four) > shallow[0].depth_limit
    assert high.decision["expected_experts_per_layer"] > 0.95 * E


def test_pruning_keeps_more_of_a_tree_where_routing_is_correlated():
    low, high = _taught(0.1), _taught(1.0)
    tree = DraftTree.chain(list(range(1, 9)), None)
    batch = BatchComposition(1, 0, 0, 0, 512)
    for c in (low, high):
        c.budgets(_views(1), batch)
        c.prune(_views(1), [tree], batch)
    assert low.decision["kept_nodes"] > high.decision["kept_nodes"]
    assert "expected_experts_per_layer_kept" in low.decision


def test_a_dense_controller_ignores_expert_terms():
    """No ExpertCosts (a dense target): the rows curve prices steps, no expert figures."""
    c = GoodputController(costs=StepCosts([1, 32], [A, A + 32 * C]), prior=0.8,
                          explore_every=0)
    c.budgets(_views(2), BatchComposition(2, 0, 0, 0, 512))
    c.observe(StepReport(0.0, 1e-3, 0.0, 1e-3, 2, 2, 0,
                         (RequestOutcome("r0", c.budgets(_views(1),
                                                         BatchComposition(1, 0, 0, 0, 9))[0],
                                         0, 0),)))
    assert not any("expert" in k for k in c.decision)


# ---- end to end on a tiny MoE -----------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from conftest import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe", seed=0,
                           hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, num_hidden_layers=4, initializer_range=0.1,
                           num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                           norm_topk_prob=True)


def test_goodput_on_an_moe_equals_plain_decoding_and_shows_the_expert_terms(tiny_moe):
    from specdec import LLM, SamplingParams
    from specdec.hookspecs import hookimpl

    class Observer:
        def __init__(self):
            self.stats = []

        @hookimpl
        def specdec_step_end(self, stats):
            self.stats.append(stats)

    prompts = [[5, 6, 7, 8, 5, 6, 9, 5, 6], [3, 4, 3, 4, 3], [7, 7, 7, 7], [40, 41, 42, 40]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    obs = Observer()
    spec = LLM(model=str(tiny_moe), dtype="float32", max_model_len=64, drafter="ngram",
               drafter_args={"min_ngram": 1}, controller="goodput", plugins=(obs,))
    experts = spec.engine.controlling.controller.experts
    assert experts is not None and experts.num_experts == 8 and experts.top_k == 2
    # the prior was profiled on the MoE itself: both routing patterns at each row count
    assert len(experts.points) >= 4 and experts.b >= 0
    got = [o.token_ids for o in spec.generate(prompts, params)]
    want = [o.token_ids for o in LLM(model=str(tiny_moe), dtype="float32",
                                     max_model_len=64).generate(prompts, params)]
    assert got == want
    woken = [s.experts_woken for s in obs.stats if s.experts_woken]
    assert woken and all(len(w) == 4 and all(1 <= x <= 8 for x in w) for w in woken)
    assert any(max(w) > 2 for w in woken)  # steps of several rows woke more than one row's 2
    figures = [s.controller for s in obs.stats if s.controller]
    assert figures and "expected_experts_per_layer" in figures[-1]
    assert "measured_experts_per_layer" in figures[-1]
    assert set(figures[-1]["expert_costs"]) == {"seconds_per_expert", "rows_seconds",
                                                "expert_growth", "sequence_growth",
                                                "prior_scale"}


def test_a_dense_target_has_no_expert_pricing(tiny_llama):
    """A dense target: no expert profile, no routing in the stats, the rows curve prices."""
    from specdec import LLM, SamplingParams

    llm = LLM(model=str(tiny_llama), dtype="float32", drafter="ngram",
              drafter_args={"min_ngram": 1})
    assert llm.engine.controlling.controller.experts is None
    llm.generate([[5, 6, 7, 5, 6, 7]], SamplingParams(temperature=0, max_tokens=8,
                                                     ignore_eos=True))
    assert llm.engine.controlling.controller.costs is not None
