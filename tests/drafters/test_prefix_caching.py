"""Prefix caching end to end: the same greedy tokens and the same speculation with and without
the cache, for plain decoding and every drafter, while the cache really is hit.

A workload of three rounds: round 1 runs prompts that share a system-prompt-like head; round 2
runs each round-1 prompt + its output + a new question (a chat's second turn); round 3 shares
exactly two pages with round 1. Page size 4, so that a
short prompt spans several pages. Per request the accepted draft tokens by depth must equal the
uncached run's: a drafter whose state was restored, not computed, drafts exactly the same.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_tiny_model
from drafter_helpers import random_block_diffusion, random_head
from test_mtp import random_heads

from specdec import LLM, SamplingParams
from specdec.controllers.base import DraftBudget
from specdec.controllers.static import StaticController
from specdec.drafters.base import BaseDrafter
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.hookspecs import hookimpl
from specdec.models.loader import load_model
from specdec.tree import DraftTree

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PAGE = 4


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("prefix"), seed=4, num_hidden_layers=4)
    model, cfg, hf = load_model(folder, torch.float64, "cpu", 512)
    return folder, model, cfg, hf


def _drafters(model, cfg, hf) -> dict[str, tuple[str | None, dict]]:
    return {
        "plain": (None, {}),
        "ngram": ("ngram", {"min_ngram": 1}),
        "draft_model": ("draft_model", {"early_exit_layers": 1, "max_depth": 3}),
        "eagle3": ("eagle3", {"head": random_head(model, cfg, hf), "depth": 3, "topk": 2}),
        "mtp": ("mtp", {"heads": random_heads(model, cfg)}),
        "block_diffusion": ("block_diffusion", {"model": random_block_diffusion(model, cfg, hf)}),
        "eagle3+ngram": ("eagle3+ngram", {"eagle3": {"head": random_head(model, cfg, hf),
                                                     "depth": 3, "topk": 2},
                                          "ngram": {"min_ngram": 1}}),
    }


def _rounds(batch: int, seed: int = 0):
    rng = random.Random(seed)
    head = [rng.randrange(90) for _ in range(11)]  # shared by every prompt: 2 full pages + 3
    return [head + [rng.randrange(90) for _ in range(rng.randrange(1, 9))] for _ in range(batch)]


def _run(folder, drafter, args, batch: int, caching: bool, plugins=(), params=None, **engine):
    llm = LLM(model=str(folder), dtype="float64", drafter=drafter, drafter_args=args,
              controller="static", controller_args={"budget": 4}, page_size=PAGE,
              enable_prefix_caching=caching, plugins=plugins, **engine)
    params = params or SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    first = _rounds(batch)
    outs1 = llm.generate(first, params)
    rng = random.Random(1)
    second = [p + o.token_ids + [rng.randrange(90) for _ in range(3)]
              for p, o in zip(first, outs1)]
    outs2 = llm.generate(second, params)
    # third: the shared head's first 2 full pages, then new tokens (a hit that ends exactly at
    # a page boundary, where the next token differs)
    third = [first[0][:2 * PAGE] + [rng.randrange(90) for _ in range(5)] for _ in range(2)]
    outs3 = llm.generate(third, params)
    assert llm.engine.kv.num_free_pages == llm.engine.kv.num_pages, "pages leaked"
    for r in llm.engine.parts.drafter_runners:
        assert r.kv.num_free_pages == r.kv.num_pages, f"drafter {r.name} leaked pages"
    outs = outs1 + outs2 + outs3
    if llm.engine.parts.tier is not None:
        assert llm.engine.parts.tier.hits > 0, "nothing came back from the tier"
    assert [o.error for o in outs] == [None] * len(outs)
    return outs


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("name", ["plain", "ngram", "draft_model", "eagle3", "mtp",
                                  "block_diffusion", "eagle3+ngram"])
def test_same_tokens_and_drafts_with_and_without_the_cache(target, name, batch):
    folder, model, cfg, hf = target
    drafter, args = _drafters(model, cfg, hf)[name]
    want = _run(folder, drafter, args, batch, caching=False)
    got = _run(folder, drafter, args, batch, caching=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.metrics.accepted_by_depth for o in got] == [o.metrics.accepted_by_depth
                                                          for o in want]
    assert [o.metrics.draft_tokens_proposed for o in got] == [
        o.metrics.draft_tokens_proposed for o in want]
    assert all(o.metrics.num_cached_tokens == 0 for o in want)
    second = got[batch:2 * batch]
    # every second turn reuses at least its first turn's prompt pages (the drafter's too)
    assert all(o.metrics.num_cached_tokens >= PAGE * (len(p) // PAGE) - PAGE
               for o, p in zip(second, _rounds(batch))), [o.metrics.num_cached_tokens
                                                          for o in second]
    # the head's page 1 (slots 4..7) depends on token 8 for an EAGLE head: not reusable there
    assert [o.metrics.num_cached_tokens for o in got[-2:]] == [PAGE if "eagle3" in name
                                                              else 2 * PAGE] * 2
    if drafter is not None and name != "ngram":
        assert sum(o.metrics.draft_tokens_proposed for o in got) > 0


class _Restorer(DraftModelDrafter):
    """draft_model (early exit) whose restore hook is replaced by ``how``."""

    name = "restorer"
    how = "raise"

    def restore(self, state, token_ids, page_keys):
        if self.how == "raise":
            raise RuntimeError("restore bug")
        if self.how == "bad":
            return len(page_keys) + 1
        if self.how == "half":  # restores the first half of what it is offered
            return super().restore(state, token_ids, page_keys[:len(page_keys) // 2])
        return super().restore(state, token_ids, page_keys)


class _NoHook:
    """A drafter without the hook (not a BaseDrafter): it gets no reuse, and loses nothing."""

    def __init__(self, target, **kw):
        self.inner = DraftModelDrafter(target, **kw)
        self.name, self.hidden_layers, self.replay_safe = "nohook", (), False

    def __getattr__(self, name):
        if name == "restore":
            raise AttributeError(name)
        return getattr(self.inner, name)


class _Plugin:
    @hookimpl
    def specdec_drafters(self):
        return {"restorer": _Restorer, "nohook": _NoHook}


@pytest.mark.parametrize("how,reused", [("raise", False), ("bad", False), ("half", True),
                                        ("nohook", False)])
def test_restore_failures_and_partial_restores_keep_outputs(target, monkeypatch, how, reused):
    """A restore that raises or answers out of range is reported and the prefix computed; one
    restoring part of the hit gets that part reused; a drafter without the hook gets none."""
    folder = target[0]
    monkeypatch.setattr(_Restorer, "how", how)
    name = "nohook" if how == "nohook" else "restorer"
    args = {"early_exit_layers": 1, "max_depth": 3}
    want = _run(folder, "draft_model", args, 2, caching=False)
    if how in ("raise", "bad"):
        with pytest.warns(RuntimeWarning, match="failed in restore"):
            got = _run(folder, name, args, 2, caching=True, plugins=(_Plugin(),))
    else:
        got = _run(folder, name, args, 2, caching=True, plugins=(_Plugin(),))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.metrics.accepted_by_depth for o in got] == [o.metrics.accepted_by_depth
                                                          for o in want]
    assert (sum(o.metrics.num_cached_tokens for o in got) > 0) == reused


@pytest.mark.parametrize("name", ["plain", "ngram", "draft_model", "eagle3", "mtp",
                                  "block_diffusion"])
def test_same_tokens_with_the_disk_tier_under_page_pressure(target, tmp_path, name):
    """24 pages of 4 slots for batches of 8: preemptions, evictions to the tier and reads back
    (the drafters' own pages are only in memory: they restore what is left there)."""
    folder, model, cfg, hf = target
    drafter, args = _drafters(model, cfg, hf)[name]
    small = dict(num_pages=24, max_model_len=64)
    want = _run(folder, drafter, args, 8, caching=False, **small)
    llm_args = dict(kv_tier_path=str(tmp_path / "kv.tier"), **small)
    got = _run(folder, drafter, args, 8, caching=True, **llm_args)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(o.metrics.num_cached_tokens for o in got) > 0


@pytest.mark.parametrize("name", ["plain", "ngram", "draft_model", "eagle3", "mtp",
                                  "block_diffusion"])
def test_seeded_sampling_is_the_same_with_and_without_the_cache(target, name):
    """Sampled requests (the gumbel verifier's per-position noise): with the cache's KV bitwise
    the computed one, a seeded request emits exactly the tokens it emits without the cache —
    the strongest form of "follows the target distribution" (the uncached engine's sampling
    is tested against exact distributions in tests/test_spec_sampling.py)."""
    folder, model, cfg, hf = target
    drafter, args = _drafters(model, cfg, hf)[name]
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    want = _run(folder, drafter, args, 4, caching=False, params=params)
    got = _run(folder, drafter, args, 4, caching=True, params=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(o.metrics.num_cached_tokens for o in got) > 0


class _Stateless(BaseDrafter):
    """Proposes the request's last token once: nothing per position."""

    name = "stateless"
    declared = True

    @property
    def prefix_cache_safe(self):
        return self.declared

    def __init__(self, target):
        pass

    def propose(self, requests):
        return [DraftTree.chain(torch.tensor([r.token_ids[-1]])) for r in requests]


class _BadLayers(_Stateless):
    name = "badlayers"
    layers = (-1,)

    @property
    def hidden_layers(self):
        return self.layers


class _StatelessPlugin:
    @hookimpl
    def specdec_drafters(self):
        return {"stateless": _Stateless, "badlayers": _BadLayers}


@pytest.mark.parametrize("declared", [True, False])
def test_a_plugin_declaring_prefix_cache_safe_gets_hits_and_one_without_is_told(
        target, monkeypatch, caplog, declared):
    monkeypatch.setattr(_Stateless, "declared", declared)
    with caplog.at_level("WARNING", logger="specdec"):
        got = _run(target[0], "stateless", {}, 2, caching=True, plugins=(_StatelessPlugin(),))
    warned = [r for r in caplog.records if "prefix_cache_safe" in r.getMessage()]
    assert len(warned) == (0 if declared else 1)
    assert not warned or "'stateless'" in warned[0].getMessage()
    assert (sum(o.metrics.num_cached_tokens for o in got) > 0) == declared


@pytest.mark.parametrize("layers", [(-1,), (4,), (0, 99), ("1",), (True,), 2])
def test_hidden_layers_are_checked_at_start_up(target, monkeypatch, layers):
    """The target has 4 layers: every layer a drafter asks for must be one of them (a bad one
    used to give no hidden states without a word)."""
    monkeypatch.setattr(_BadLayers, "layers", layers)
    with pytest.raises(ValueError, match=r"'badlayers'.*hidden_layers must be a tuple of ints "
                                         r"in \[0, 4\)"):
        LLM(model=str(target[0]), dtype="float64", drafter="badlayers",
            plugins=(_StatelessPlugin(),))
    with pytest.raises(ValueError, match=r"'badlayers'.*hidden_layers"):  # in a composition too
        LLM(model=str(target[0]), dtype="float64", drafter="ngram+badlayers",
            plugins=(_StatelessPlugin(),))


class _KeepOff(StaticController):
    """Static budgets; ``keep`` answers keep_drafting (None: BaseController's default, as a
    controller that does not write the method)."""

    name = "keepoff"
    keep: bool | None = False
    asked: list = []

    def keep_drafting(self, request, recompute_tokens):
        if type(self).keep is None:
            return super().keep_drafting(request, recompute_tokens)
        type(self).asked.append((request.request_id, recompute_tokens))
        return type(self).keep


class _KeepOffPlugin:
    @hookimpl
    def specdec_controllers(self):
        return {"keepoff": _KeepOff}


@pytest.mark.parametrize("keep", [False, True, None])
def test_a_hit_the_drafter_cannot_restore_is_reused_when_the_controller_keeps_it_off(
        target, monkeypatch, keep):
    """A drafter restoring half of a hit: the controller's keep_drafting decides whether the
    target recomputes the other half for it (True, or no such method) or reuses it all and the
    request decodes without drafts (False); the tokens are the uncached run's either way."""
    monkeypatch.setattr(_Restorer, "how", "half")
    monkeypatch.setattr(_KeepOff, "keep", keep)
    monkeypatch.setattr(_KeepOff, "asked", [])
    folder = target[0]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    first = _rounds(2)
    runs = {}
    for caching in (False, True):
        llm = LLM(model=str(folder), dtype="float64", drafter="restorer",
                  drafter_args={"early_exit_layers": 1, "max_depth": 3}, controller="keepoff",
                  controller_args={"budget": 3}, page_size=PAGE, enable_prefix_caching=caching,
                  plugins=(_Plugin(), _KeepOffPlugin()))
        llm.generate(first, params)
        runs[caching] = llm.generate([p + [7, 8, 9, 10, 11] for p in first], params)
        assert llm.engine.kv.num_free_pages == llm.engine.kv.num_pages
    assert [o.token_ids for o in runs[True]] == [o.token_ids for o in runs[False]]
    cached = [o.metrics.num_cached_tokens for o in runs[True]]
    proposed = [o.metrics.draft_tokens_proposed for o in runs[True]]
    plain = LLM(model=str(folder), dtype="float64", page_size=PAGE)  # the hits without drafter
    plain.generate(first, params)
    full = [o.metrics.num_cached_tokens for o in plain.generate([p + [7, 8, 9, 10, 11]
                                                                 for p in first], params)]
    assert all(full)
    if keep is False:
        assert cached == full and proposed == [0, 0]
        # asked for the hits (tokens to recompute), and at each request's first idle step (0)
        assert any(n > 0 for _, n in _KeepOff.asked)
    else:
        assert all(0 < c < f for c, f in zip(cached, full)) and all(proposed)
        assert bool(_KeepOff.asked) == (keep is True)


def test_goodput_keeps_drafting_while_drafting_pays():
    from specdec.controllers.base import RequestOutcome, RequestView, StepReport
    from specdec.controllers.costs import StepCosts
    from specdec.controllers.goodput import GoodputController

    costs = StepCosts([1, 2, 4, 8, 16], [0.004, 0.0045, 0.0055, 0.0075, 0.0115])
    view = RequestView("new", 50, 0, 0, 0, (), 0, 0)
    c = GoodputController(prior=0.9, costs=costs)
    assert c.keep_drafting(view, 64)  # nothing known: the prior says drafting pays
    chain = DraftTree.chain([1, 2, 3], None)
    for _ in range(200):  # nothing it drafts is accepted: drafting is off
        c.observe(StepReport(0.001, 0.004, 0.0, 0.005, 4, 1, 0, (RequestOutcome(
            "r", DraftBudget(3, 3), 3, 0, False, chain, ()),), {}))
    assert not c.keep_drafting(view, 64)


@pytest.mark.parametrize("keep", [False, True])
def test_a_request_kept_idle_drops_its_drafter_state_when_the_controller_says_so(
        target, monkeypatch, keep):
    """Budget 0 at a decode step: keep_drafting is asked (nothing to recompute), and every 32
    idle steps after; False drops the request's drafter state (its pages back, no layers
    captured, no on_verified), True keeps it; the tokens are the same either way."""
    from specdec.engine.drafting.controller_stage import IDLE_CHECK

    monkeypatch.setattr(_KeepOff, "keep", keep)
    monkeypatch.setattr(_KeepOff, "asked", [])
    captured = []
    folder = target[0]
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    llm = LLM(model=str(folder), dtype="float64", drafter="eagle3",
              drafter_args={"head": random_head(target[1], target[2], target[3]), "depth": 2},
              controller="keepoff", controller_args={"budget": 0}, page_size=PAGE,
              plugins=(_KeepOffPlugin(),))
    original = llm.engine.parts.runner.forward
    monkeypatch.setattr(llm.engine.parts.runner, "forward", lambda batch, layers=(): (
        captured.append(layers), original(batch, layers))[1])
    out = llm.generate([[3, 1, 4, 1, 5, 9, 2, 6]], params)[0]
    plain = LLM(model=str(folder), dtype="float64").generate([[3, 1, 4, 1, 5, 9, 2, 6]], params)[0]
    assert out.token_ids == plain.token_ids
    # asked at the first idle decode step, then every IDLE_CHECK while kept (79 idle steps)
    assert [n for _, n in _KeepOff.asked] == ([0] if not keep else
                                              [0] * (1 + 79 // IDLE_CHECK))
    steps_with_layers = sum(1 for layers in captured if layers)
    if keep:
        assert steps_with_layers == len(captured)
    else:  # the prefill step only: the first decode step asks before its forward
        assert steps_with_layers == 1 < len(captured)
    assert llm.engine.kv.num_free_pages == llm.engine.kv.num_pages
    for r in llm.engine.parts.drafter_runners:
        assert r.kv.num_free_pages == r.kv.num_pages


class _DraftThenStop(StaticController):
    """Budget 3 for the first 10 steps, then 0; keep_drafting answers no: the request drafts,
    then (at its first idle step) drops its drafter state mid-request."""

    name = "draftthenstop"

    def __init__(self, **kw):
        super().__init__(budget=3)
        self.calls = 0

    def budgets(self, requests, batch):
        self.calls += 1
        out = super().budgets(requests, batch)
        return out if self.calls <= 10 else [DraftBudget(0)] * len(requests)

    def keep_drafting(self, request, recompute_tokens):
        return False


class _DraftThenStopPlugin:
    @hookimpl
    def specdec_controllers(self):
        return {"draftthenstop": _DraftThenStop}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_request_that_drafted_then_drops_its_state_stays_lossless(target, temperature):
    """Drafting, then idle, then decoding without drafter state: greedy tokens (float64) and
    seeded sampled tokens (per-position noise) are plain decoding's, no page is left."""
    folder, model, cfg, hf = target
    params = SamplingParams(temperature=temperature, seed=5, max_tokens=70, ignore_eos=True)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
    llm = LLM(model=str(folder), dtype="float64", drafter="eagle3",
              drafter_args={"head": random_head(model, cfg, hf), "depth": 3, "topk": 2},
              controller="draftthenstop", page_size=PAGE, plugins=(_DraftThenStopPlugin(),))
    got = llm.generate(prompts, params)
    want = LLM(model=str(folder), dtype="float64").generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(o.metrics.draft_tokens_proposed > 0 for o in got)
    assert llm.engine.kv.num_free_pages == llm.engine.kv.num_pages
    for r in llm.engine.parts.drafter_runners:
        assert r.kv.num_free_pages == r.kv.num_pages


@pytest.mark.parametrize("answer", ["yes", RuntimeError("controller bug")])
def test_a_controller_failing_in_keep_drafting_is_reported_and_the_prefix_recomputed(
        target, monkeypatch, answer):
    monkeypatch.setattr(_Restorer, "how", "half")

    def keep_drafting(self, request, recompute_tokens):
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(_KeepOff, "keep_drafting", keep_drafting)
    monkeypatch.setattr(_KeepOff, "keep", True)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(model=str(target[0]), dtype="float64", drafter="restorer",
              drafter_args={"early_exit_layers": 1, "max_depth": 3}, controller="keepoff",
              controller_args={"budget": 3}, page_size=PAGE, plugins=(_Plugin(), _KeepOffPlugin()))
    first = _rounds(2)
    with pytest.warns(RuntimeWarning, match="failed in keep_drafting"):
        llm.generate(first, params)  # the second prompt hits the first's head already
        outs = llm.generate([p + [7, 8, 9, 10, 11] for p in first], params)
    assert [o.error for o in outs] == [None, None]
    assert all(o.metrics.draft_tokens_proposed > 0 for o in outs)  # still drafting
    assert any("keep_drafting must return a bool" in e or "controller bug" in e
               for e in llm.engine.plugin_errors)
