"""The oracle drafter: controlled acceptance, lossless output, tau as predicted, argument checks.

Engine runs use the tiny random llama in float64 (no argmax tie can flip between the tree forward
and the plain one), greedy, against continuations from one plain greedy run of the same model.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from drafter_helpers import PROMPTS

from specdec import LLM, SamplingParams
from specdec.controllers.base import DraftBudget
from specdec.drafters.base import Drafter, DraftRequest, TokenView
from specdec.drafters.oracle import (
    OracleDrafter,
    error_rate_for_tau,
    expected_tau,
    oracle_plugin,
)

VOCAB = 96  # tests/conftest.py TINY_COMMON
TRUTH_TOKENS = 160  # continuation length (the statistics test generates all of it)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def truth(tiny_llama) -> dict[tuple[int, ...], list[int]]:
    """{prompt: plain greedy continuation of TRUTH_TOKENS tokens} for every PROMPTS prompt."""
    outs = LLM(model=str(tiny_llama), dtype="float64").generate(PROMPTS, _params(TRUTH_TOKENS))
    assert [o.error for o in outs] == [None] * len(PROMPTS)
    return {tuple(p): o.token_ids for p, o in zip(PROMPTS, outs)}


def _spec(folder, truth, error_rate: float, depth: int, budget: int, max_depth=None,
          seed: int = 0) -> LLM:
    return LLM(model=str(folder), dtype="float64", drafter="oracle", controller="static",
               controller_args={"budget": budget, "max_depth": max_depth},
               plugins=(oracle_plugin(truth, error_rate, depth, seed),))


def _record(llm: LLM) -> list[tuple[str, int, int]]:
    """(request id, nodes proposed, nodes accepted) of every verify step with a draft, as the
    controller hears them (the drafter's on_verified does not hear a request's final step)."""
    controller, seen = llm.engine.controlling.controller, []
    observe = controller.observe

    def recording(report):
        seen.extend((o.request_id, o.num_proposed, o.num_accepted)
                    for o in report.outcomes if o.num_proposed)
        return observe(report)

    controller.observe = recording
    return seen


# ---- the drafter alone ------------------------------------------------------------------------


def _drafter(truth, error_rate=0.0, depth=4, seed=0) -> OracleDrafter:
    return OracleDrafter(SimpleNamespace(vocab_size=VOCAB), truth, error_rate, depth, seed)


def _propose(d: OracleDrafter, state, tokens, budget: DraftBudget) -> list[int]:
    req = DraftRequest("r", TokenView(tokens), budget, SamplingParams(temperature=0), None, state)
    (tree,) = d.propose([req])
    tree.validate(max_nodes=budget.max_nodes, vocab_size=VOCAB, max_depth=budget.max_depth)
    assert tree.parents.tolist() == list(range(-1, tree.num_nodes - 1))  # a chain
    return tree.tokens.tolist()


def test_chain_of_the_next_true_tokens_within_depth_and_budget():
    prompt, cont = [1, 2, 3], [10, 11, 12, 13, 14, 15]
    d = _drafter({tuple(prompt): cont}, depth=4)
    assert isinstance(d, Drafter) and d.name == "oracle" and d.hidden_layers == ()
    s = d.init_state("r", prompt)
    assert _propose(d, s, prompt, DraftBudget(8)) == [10, 11, 12, 13]  # depth
    assert _propose(d, s, prompt + [10], DraftBudget(2)) == [11, 12]  # max_nodes
    assert _propose(d, s, prompt + [10], DraftBudget(8, 3)) == [11, 12, 13]  # max_depth
    assert _propose(d, s, prompt + cont[:4], DraftBudget(8)) == [14, 15]  # runs out
    assert _propose(d, s, prompt + cont, DraftBudget(8)) == []  # nothing left
    unknown = d.init_state("u", [1, 2])
    assert _propose(d, unknown, [1, 2, 10], DraftBudget(8)) == []


def test_error_rate_one_replaces_every_token_and_divergence_stops_drafting():
    prompt, cont = (7,), [94, 95, 3]
    d = _drafter({prompt: cont}, 1.0)
    assert _propose(d, d.init_state("r", [7]), [7], DraftBudget(8)) == [95, 0, 4]
    d = _drafter({prompt: cont}, 0.0)
    s = d.init_state("r", [7])
    assert _propose(d, s, [7, 50], DraftBudget(8)) == []  # output left the continuation
    assert _propose(d, s, [7, 94], DraftBudget(8)) == []  # and it stays off for the request


def test_draws_are_reproducible_per_seed_and_request():
    prompt, cont = (1,), list(range(2, 82))
    steps = [[1, *cont[:i]] for i in range(0, 80, 8)]

    def drafts(seed, rid):
        d = _drafter({prompt: cont}, 0.5, depth=8, seed=seed)
        s = d.init_state(rid, [1])
        return [_propose(d, s, t, DraftBudget(8)) for t in steps]

    assert drafts(0, "0") == drafts(0, "0")
    assert drafts(0, "0") != drafts(0, "1")
    assert drafts(0, "0") != drafts(1, "0")


# ---- end to end ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spec_llm(tiny_llama, truth):
    """spec_llm(error_rate) -> an oracle LLM (depth 4, static budget 6), built once per rate."""
    cache: dict[float, LLM] = {}

    def get(error_rate: float) -> LLM:
        if error_rate not in cache:
            cache[error_rate] = _spec(tiny_llama, truth, error_rate, depth=4, budget=6)
        return cache[error_rate]

    return get


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("error_rate", [0.0, 0.3, 1.0])
def test_greedy_output_identical_to_plain(spec_llm, truth, error_rate, batch):
    prompts = PROMPTS[:batch]
    outs = spec_llm(error_rate).generate(prompts, _params(40))
    assert [o.error for o in outs] == [None] * batch
    assert [o.token_ids for o in outs] == [truth[tuple(p)][:40] for p in prompts]
    proposed = sum(o.metrics.draft_tokens_proposed for o in outs)
    accepted = sum(sum(o.metrics.accepted_by_depth) for o in outs)
    assert proposed > 0
    assert (accepted > 0) == (error_rate < 1.0)


def test_unknown_prompt_and_short_continuation_draft_nothing_past_the_known(tiny_llama, truth):
    known, short, unknown = PROMPTS[0], PROMPTS[1], [33, 34, 35]
    partial = {tuple(known): truth[tuple(known)], tuple(short): truth[tuple(short)][:10]}
    llm = _spec(tiny_llama, partial, 0.0, depth=4, budget=4)
    seen = _record(llm)
    plain = LLM(model=str(tiny_llama), dtype="float64").generate([unknown], _params(24))
    outs = llm.generate([known, short, unknown], _params(24))
    assert [o.token_ids for o in outs] == [truth[tuple(known)][:24], truth[tuple(short)][:24],
                                          plain[0].token_ids]
    assert {rid for rid, _, _ in seen} == {outs[0].request_id, outs[1].request_id}
    # of the 10 known tokens prefill emits the 1st, two full drafts 2-5 and 7-10, bonus tokens
    # the 6th and the 11th; after that the drafter has nothing to propose
    assert [(n, a) for rid, n, a in seen if rid == outs[1].request_id] == [(4, 4), (4, 4)]
    assert outs[2].metrics.draft_tokens_proposed == 0


def test_error_rate_zero_accepts_every_draft_full_depth(tiny_llama, truth):
    """Static budget 8 nodes at most 3 deep, drafter depth 5: chains of 3, all accepted, so every
    step emits depth + 1 = 4 tokens but the last, clipped at max_tokens."""
    llm = _spec(tiny_llama, truth, 0.0, depth=5, budget=8, max_depth=3)
    seen = _record(llm)
    outs = llm.generate(PROMPTS[:3], _params(32))
    assert [o.token_ids for o in outs] == [truth[tuple(p)][:32] for p in PROMPTS[:3]]
    for o in outs:
        steps = [(n, a) for rid, n, a in seen if rid == o.request_id]
        # prefill emits 1; 7 steps of 3 + 1 make 29; the last may draft 32 - 29 - 1 = 2
        assert steps == [(3, 3)] * 7 + [(2, 2)]
        assert o.metrics.accepted_by_depth == [8, 8, 7]


def test_error_rate_one_accepts_nothing(tiny_llama, truth):
    llm = _spec(tiny_llama, truth, 1.0, depth=4, budget=4)
    seen = _record(llm)
    outs = llm.generate(PROMPTS[:3], _params(20))
    assert [o.token_ids for o in outs] == [truth[tuple(p)][:20] for p in PROMPTS[:3]]
    for o in outs:  # every decode step drafted 4, but the last ones (budget clipped at 20 - 1)
        assert [(n, a) for rid, n, a in seen if rid == o.request_id] == \
            [(4, 0)] * 15 + [(3, 0), (2, 0), (1, 0)]
    assert all(o.metrics.tau == 1.0 for o in outs)


def test_mean_acceptance_matches_expected_tau(tiny_llama, truth):
    """error_rate 0.3, 4-node chains: a step accepts A >= d nodes with probability 0.7 ** d, so
    E[1 + A] = expected_tau(0.3, 4) = 2.7731 and Var A = sum (2d - 1) 0.7 ** d - E[A] ** 2.
    Over the full-depth steps of 8 requests x 160 tokens (~440 steps, sd of A ~1.56, standard
    error ~0.075) the mean must lie within 4 standard errors, and so must the fraction of steps
    accepting >= d nodes, for each d (binomial). The seed is fixed: the test is deterministic."""
    rate, depth = 0.3, 4
    llm = _spec(tiny_llama, truth, rate, depth=depth, budget=depth, seed=0)
    seen = _record(llm)
    outs = llm.generate(PROMPTS, _params(TRUTH_TOKENS))
    assert [o.token_ids for o in outs] == [truth[tuple(p)] for p in PROMPTS]

    full = [a for _, n, a in seen if n == depth]  # a step's depth is fixed before the draws
    n = len(full)
    assert n >= 350, n
    p = 1.0 - rate
    mean_a = expected_tau(rate, depth) - 1.0
    var_a = sum((2 * d - 1) * p**d for d in range(1, depth + 1)) - mean_a**2
    se = math.sqrt(var_a / n)
    measured = 1.0 + sum(full) / n
    assert abs(measured - expected_tau(rate, depth)) < 4 * se, (measured, se, n)
    for d in range(1, depth + 1):
        frac, q = sum(a >= d for a in full) / n, p**d
        assert abs(frac - q) < 4 * math.sqrt(q * (1 - q) / n), (d, frac, q, n)

    # the same engine config and request ids draw the same: the record repeats exactly
    again = _spec(tiny_llama, truth, rate, depth=depth, budget=depth, seed=0)
    seen_again = _record(again)
    again.generate(PROMPTS[:2], _params(TRUTH_TOKENS))
    assert seen_again == [s for s in seen if s[0] in {"0", "1"}]


# ---- expected_tau / error_rate_for_tau ----------------------------------------------------------


def test_expected_tau_edges_and_formula():
    assert expected_tau(0.0, 4) == 5.0
    assert expected_tau(1.0, 4) == 1.0
    assert expected_tau(0.5, 1) == 1.5
    assert math.isclose(expected_tau(0.3, 4), 1 + 0.7 + 0.49 + 0.343 + 0.2401)
    assert expected_tau(0, 3) == 4.0  # ints are fine


@pytest.mark.parametrize("depth", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("rate", [0.0, 1e-6, 0.1, 0.3, 0.5, 0.9, 1.0])
def test_round_trip(rate, depth):
    tau = expected_tau(rate, depth)
    back = error_rate_for_tau(tau, depth)
    assert math.isclose(expected_tau(back, depth), tau, rel_tol=1e-12, abs_tol=1e-12)
    assert math.isclose(back, rate, abs_tol=1e-9)


def test_error_rate_for_tau_edges():
    assert error_rate_for_tau(1.0, 4) == 1.0
    assert error_rate_for_tau(5.0, 4) == 0.0
    assert error_rate_for_tau(2, 1) == 0.0
    r = error_rate_for_tau(3.0, 4)
    assert 0 < r < 1 and math.isclose(expected_tau(r, 4), 3.0, rel_tol=1e-12)


# ---- argument checks ----------------------------------------------------------------------------


@pytest.mark.parametrize("call, exc, match", [
    (lambda: expected_tau(-0.1, 4), ValueError, r"error_rate must be in \[0, 1\]"),
    (lambda: expected_tau(1.5, 4), ValueError, r"error_rate must be in \[0, 1\]"),
    (lambda: expected_tau(float("nan"), 4), ValueError, r"error_rate must be in \[0, 1\]"),
    (lambda: expected_tau("0.3", 4), TypeError, "error_rate must be a real number"),
    (lambda: expected_tau(True, 4), TypeError, "error_rate must be a real number"),
    (lambda: expected_tau(0.3, 0), ValueError, "depth must be an int >= 1"),
    (lambda: expected_tau(0.3, 2.0), TypeError, "depth must be an int >= 1"),
    (lambda: error_rate_for_tau(0.9, 4), ValueError, r"tau must be in \[1, depth \+ 1\] = \[1, 5\]"),
    (lambda: error_rate_for_tau(5.01, 4), ValueError, r"tau must be in \[1, depth \+ 1\]"),
    (lambda: error_rate_for_tau(None, 4), TypeError, "tau must be a real number"),
    (lambda: error_rate_for_tau(2.0, -1), ValueError, "depth must be an int >= 1"),
])
def test_tau_functions_reject_bad_args(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


GOOD = {(1, 2): [3, 4]}


@pytest.mark.parametrize("args, exc, match", [
    ((GOOD, -0.5, 4), ValueError, r"error_rate must be in \[0, 1\]"),
    ((GOOD, None, 4), TypeError, "error_rate must be a real number"),
    ((GOOD, 0.1, 0), ValueError, "depth must be an int >= 1"),
    ((GOOD, 0.1, "4"), TypeError, "depth must be an int >= 1"),
    ((GOOD, 0.1, 4, 1.5), TypeError, "seed must be an int"),
    (([((1, 2), [3])], 0.1, 4), TypeError, "continuations must be a mapping"),
    (({(1, 2.0): [3]}, 0.1, 4), TypeError, "continuations keys must be non-empty tuples of ints"),
    (({(): [3]}, 0.1, 4), TypeError, "continuations keys must be non-empty tuples of ints"),
    (({(1, 2): 3}, 0.1, 4), TypeError, "continuations values must be lists of ints"),
    (({(1, 2): [3, "4"]}, 0.1, 4), TypeError, "continuations values must be lists of ints"),
])
def test_drafter_and_plugin_reject_bad_args(args, exc, match):
    with pytest.raises(exc, match=match):
        oracle_plugin(*args)
    with pytest.raises(exc, match=match):
        OracleDrafter(SimpleNamespace(vocab_size=VOCAB), *args)


def test_tokens_outside_the_vocab_and_unknown_drafter_args_fail_at_engine_start(tiny_llama):
    with pytest.raises(ValueError, match=r"outside the target's vocab \[0, 96\): \[96\]"):
        LLM(model=str(tiny_llama), dtype="float64", drafter="oracle",
            plugins=(oracle_plugin({(1, 2): [3, 96]}, 0.1, 4),))
    with pytest.raises(ValueError, match="oracle drafter_args may set depth, error_rate, seed; "
                                         "got unknown tau"):
        LLM(model=str(tiny_llama), dtype="float64", drafter="oracle", drafter_args={"tau": 2.0},
            plugins=(oracle_plugin(GOOD, 0.1, 4),))
    with pytest.raises(ValueError, match="error_rate must be in"):
        LLM(model=str(tiny_llama), dtype="float64", drafter="oracle",
            drafter_args={"error_rate": 2.0}, plugins=(oracle_plugin(GOOD, 0.1, 4),))


def test_drafter_args_override_the_plugin_defaults(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float64", drafter="oracle",
              drafter_args={"error_rate": 0.25, "depth": 2, "seed": 7},
              plugins=(oracle_plugin(GOOD, 0.1, 4),))
    d = llm.engine.drafting.drafter
    assert (d.error_rate, d.depth, d.seed) == (0.25, 2, 7)
