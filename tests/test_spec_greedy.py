"""Greedy losslessness end to end: ngram speculation emits exactly the tokens plain decoding does.

Tiny random models run in float64 so that no argmax tie can flip between the batched tree
forward and the plain one. Their greedy outputs fall into loops within a few tokens, so prompt
lookup drafts get accepted; every test checks that some were, so none can pass vacuously.
"""

from __future__ import annotations

import random
import statistics

import pytest

from specdec.engine.llm import LLM
from specdec.sampling_params import SamplingParams

VOCAB = 96  # tests/conftest.py TINY_COMMON
LENGTHS = [5, 40, 1, 17, 64, 9, 28, 3]  # one batch mixes all of these


def _prompts() -> list[list[int]]:
    """Even indices repeat a motif (prompt lookup hits at once), odd ones never repeat a token."""
    rng = random.Random(0)
    out = []
    for i, n in enumerate(LENGTHS):
        if i % 2 == 0:
            motif = [rng.randrange(VOCAB) for _ in range(rng.randrange(2, 6))]
            out.append((motif * n)[:n])
        else:
            out.append(rng.sample(range(VOCAB), n))
    return out


PROMPTS = _prompts()


def _params(n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=28 + i % 5, ignore_eos=True) for i in range(n)]


def _num_accepted(outs) -> int:
    return sum(sum(o.metrics.accepted_by_depth) for o in outs)


def assert_lossless(plain: LLM, spec: LLM, prompts, params) -> list:
    """Same token ids and finish reasons, no errors, and some draft tokens accepted."""
    want = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert [o.error for o in got] == [None] * len(prompts)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    accepted = _num_accepted(got)
    assert accepted > 0, "no draft token was accepted: the test would pass vacuously"
    assert accepted <= sum(o.metrics.draft_tokens_proposed for o in got)
    assert sum(o.metrics.draft_tokens_proposed for o in want) == 0
    return got


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def plain(tiny_llama) -> LLM:
    return LLM(model=str(tiny_llama), dtype="float64")


@pytest.fixture(scope="module")
def spec_llm(tiny_llama):
    """spec_llm(max_matches, budget) -> a speculative LLM (static controller: what is drafted
    does not depend on the machine's speed), built once per module and config."""
    cache: dict[tuple[int, int], LLM] = {}

    def get(max_matches: int, budget: int) -> LLM:
        key = (max_matches, budget)
        if key not in cache:
            cache[key] = LLM(model=str(tiny_llama), dtype="float64", drafter="ngram",
                             drafter_args={"max_matches": max_matches, "max_depth": 8,
                                           "min_ngram": 1},
                             controller="static", controller_args={"budget": budget})
        return cache[key]

    return get


# (max_matches, budget): chains (max_matches 1) and trees at budgets 1, 4, 16
CONFIGS = [(1, 1), (1, 4), (1, 16), (4, 4), (4, 16)]


@pytest.mark.parametrize("batch", range(1, 9))
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"matches{c[0]}-budget{c[1]}")
def test_greedy_identical_to_plain(plain, spec_llm, config, batch):
    prompts = PROMPTS[:batch]
    assert_lossless(plain, spec_llm(*config), prompts, _params(batch))


def _record_trees(monkeypatch, llm: LLM) -> list:
    """Record every tree the drafter of `llm` proposes (until the test ends)."""
    drafter, trees = llm.engine.drafting.drafter, []
    propose = drafter.propose

    def recording(requests):
        out = propose(requests)
        trees.extend(zip((r.budget for r in requests), out))
        return out

    monkeypatch.setattr(drafter, "propose", recording)
    return trees


@pytest.mark.parametrize("max_matches", [1, 4])
def test_chains_and_branching_trees_deep_acceptance(plain, spec_llm, monkeypatch, max_matches):
    spec = spec_llm(max_matches, 16)
    trees = _record_trees(monkeypatch, spec)
    outs = assert_lossless(plain, spec, PROMPTS, _params(len(PROMPTS)))
    leaves = [len(t.paths()) for _, t in trees]
    assert all(t.num_nodes <= b.max_nodes for b, t in trees)
    assert max(leaves) == 1 if max_matches == 1 else max(leaves) > 1
    depth = max(len(o.metrics.accepted_by_depth) for o in outs)
    assert depth >= 4, f"drafts were never accepted 4 deep: {depth}"
    assert statistics.mean(o.metrics.tau for o in outs) > 1.3


def test_each_architecture(tiny_models):
    for arch, folder in tiny_models.items():
        plain = LLM(model=str(folder), dtype="float64")
        spec = LLM(model=str(folder), dtype="float64", drafter="ngram",
                   drafter_args={"max_matches": 2}, controller="static",
                   controller_args={"budget": 8})
        try:
            assert_lossless(plain, spec, PROMPTS[:4], _params(4))
        except AssertionError as e:
            raise AssertionError(f"{arch}: {e}") from e


def test_max_model_len_and_preemption(tiny_llama):
    """Drafts near max_model_len are clipped; preempted requests re-index from scratch."""
    kw = dict(model=str(tiny_llama), dtype="float64", max_model_len=64, num_pages=6,
              page_size=16)
    plain = LLM(**kw)
    spec = LLM(**kw, drafter="ngram", controller="static", controller_args={"budget": 16})
    prompts = PROMPTS[:4] + PROMPTS[5:]  # all shorter than max_model_len
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    outs = assert_lossless(plain, spec, prompts, params)
    assert {o.finish_reason for o in outs} == {"length"}
    assert all(len(o.prompt_token_ids) + len(o.token_ids) == 64 for o in outs)
    assert sum(o.metrics.num_preemptions for o in outs) > 0


def test_bad_drafter_args_are_value_errors(tiny_llama):
    with pytest.raises(ValueError, match="max_depth"):
        LLM(model=str(tiny_llama), drafter="ngram", drafter_args={"max_depth": 0})
    with pytest.raises(ValueError, match="ngram"):
        LLM(model=str(tiny_llama), drafter="ngram", drafter_args={"depth": 3})


CHATS = ["List the numbers from 1 to 20, separated by commas.",
         "Write an HTML table with 3 rows and 3 columns."]


@pytest.mark.slow
def test_smollm2_greedy_identical_with_tau_above_1_2(smollm2_dir):
    plain = LLM(model=str(smollm2_dir), dtype="float32")
    spec = LLM(model=str(smollm2_dir), dtype="float32", controller="static", drafter="ngram",
               drafter_args={"max_matches": 4}, controller_args={"budget": 8})
    prompts = [[{"role": "user", "content": c}] for c in CHATS]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    # one run each: the speed ratio is the bench's to measure (`specdec bench`), not a test's
    want, got = plain.generate(prompts, params), spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    tau = sum(o.metrics.num_output_tokens for o in got) / sum(
        o.metrics.num_target_forwards for o in got)
    print(f"\nsmollm2 ngram: tau {tau:.2f} (per prompt {[round(o.metrics.tau, 2) for o in got]})")
    assert tau > 1.2


# the goodput controller on injected cost curves, fixed (not refined from measured times), so
# that what it drafts does not depend on this machine's speed: "flat", rows all but free (it
# drafts deep); "steep", every verified row costs a fifth of a step (pruning bites: only likely
# nodes are kept)
def _fixed_costs(shape: str):
    from specdec.controllers.costs import StepCosts

    rows = [1, 2, 4, 8, 16, 32, 64]
    per_row = {"flat": 1e-4, "steep": 0.2}[shape]
    return StepCosts(rows, [1.0 + per_row * n for n in rows], rate=0.0, local_rate=0.0)


CONTROLLERS = {
    "static": ("static", {"budget": 8}),
    "goodput": ("goodput", {"budget": 8, "costs": "flat"}),
    "goodput_pruning": ("goodput", {"budget": 8, "costs": "steep"}),
    "adaptive": ("adaptive", {"budget": 8}),
}


@pytest.mark.parametrize("name", sorted(CONTROLLERS))
def test_greedy_identical_under_every_controller(plain, tiny_llama, name):
    controller, args = CONTROLLERS[name]
    args = {**args, "costs": _fixed_costs(args["costs"])} if "costs" in args else args
    spec = LLM(model=str(tiny_llama), dtype="float64", drafter="ngram",
               drafter_args={"max_matches": 4, "max_depth": 8, "min_ngram": 1},
               controller=controller, controller_args=args)
    assert_lossless(plain, spec, PROMPTS, _params(len(PROMPTS)))


def test_pruned_trees_stay_lossless_and_drafters_hear_their_own_indices(tiny_llama, monkeypatch):
    """Pruning verifies part of a proposal; the drafter's on_verified still names nodes of the
    tree it proposed (their tokens are the committed ones)."""
    from specdec.controllers.static import StaticController
    from specdec.hookspecs import hookimpl

    class KeepFirstTwo(StaticController):
        """Static budgets; pruning keeps nodes 0 and 1 when they form a valid subtree."""

        name = "keep_first_two"

        def prune(self, requests, trees, batch):
            return [[0, 1] if t.num_nodes > 2 else None for t in trees]

    class Plugin:
        @hookimpl
        def specdec_controllers(self):
            return {"keep_first_two": KeepFirstTwo}

    plain = LLM(model=str(tiny_llama), dtype="float64")
    spec = LLM(model=str(tiny_llama), dtype="float64", drafter="ngram",
               drafter_args={"max_matches": 4, "max_depth": 8, "min_ngram": 1},
               controller="keep_first_two", controller_args={"budget": 8}, plugins=(Plugin(),))
    drafter = spec.engine.drafting.drafter
    proposed, heard, pruned_steps = {}, [], []
    stage_prune = spec.engine.controlling.prune

    def recording_prune(records, batch):
        stage_prune(records, batch)
        pruned_steps.extend(r for r in records if r.kept is not None)

    monkeypatch.setattr(spec.engine.controlling, "prune", recording_prune)
    propose, on_verified = drafter.propose, drafter.on_verified

    def recording_propose(requests):
        trees = propose(requests)
        for r, t in zip(requests, trees):
            proposed[r.request_id] = t
        return trees

    def recording_on_verified(batch):
        for r in batch.requests:
            if r.num_proposed:
                tree = proposed[r.request_id]
                assert r.num_proposed == tree.num_nodes
                toks = [int(tree.tokens[a]) for a in r.accepted]
                end = r.num_computed
                assert list(r.token_ids[end - len(toks):end]) == toks
                heard.append(len(r.accepted))
        return on_verified(batch)

    monkeypatch.setattr(drafter, "propose", recording_propose)
    monkeypatch.setattr(drafter, "on_verified", recording_on_verified)
    assert_lossless(plain, spec, PROMPTS, _params(len(PROMPTS)))
    assert sum(heard) > 0, "no accepted node was heard of"
    assert pruned_steps, "the controller was meant to prune"
