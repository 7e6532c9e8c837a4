"""What prefix caching means for requests: salts isolate, a preempted request finds its own pages
again, n samples share the prompt's pages with seed streams of their own, the figures add up,
and bad parameters are clear errors."""

from __future__ import annotations

import random

import pytest

from specdec import LLM, SamplingParams
from specdec.sampling_params import MAX_SAMPLES

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(90) for _ in range(n)]


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(model=str(tiny_llama), dtype="float64", page_size=4)


def _cached(llm, prompt, params=GREEDY) -> int:
    return llm.generate(prompt, params)[0].metrics.num_cached_tokens


def test_salts_isolate_and_the_same_salt_shares(llm):
    p = _prompt(23, seed=1)
    salted = lambda s: SamplingParams(temperature=0, max_tokens=4, cache_salt=s)  # noqa: E731
    assert _cached(llm, p, salted("tenant-a")) == 0
    assert _cached(llm, p, salted("tenant-b")) == 0
    assert _cached(llm, p, salted(None)) == 0
    assert _cached(llm, p, salted("tenant-a")) == 20  # 5 full pages before the last token
    assert _cached(llm, p, salted(None)) == 20
    assert llm.engine.kv.num_free_pages == llm.engine.kv.num_pages


def test_figures_in_step_stats_totals_and_request_metrics(llm):
    p = _prompt(30, seed=2)
    before = llm.engine.totals.cached_tokens, llm.engine.totals.lookup_tokens
    llm.generate(p, GREEDY)
    out = llm.generate(p + [5, 6], GREEDY)[0]
    t = llm.engine.totals
    assert out.metrics.num_cached_tokens == 28  # 7 full pages of the 32 tokens, last one computed
    assert t.cached_tokens - before[0] == 28 and t.lookup_tokens - before[1] == 30 + 32
    rate = t.prefix_hit_rate
    assert 0 < rate["tokens"] < 1 and 0 < rate["pages"] <= 1
    assert t.prefix_summary()["cached_pages"] == t.cached_pages


def test_a_preempted_request_reuses_its_own_pages(tiny_llama):
    """20 pages of 4 slots for 4 requests growing to 46 tokens each: some are preempted, and
    their re-admission finds their pages; the tokens are those of a run without the cache."""
    prompts = [_prompt(30, seed=s) for s in range(4)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    common = dict(model=str(tiny_llama), dtype="float64", page_size=4, num_pages=20,
                  max_model_len=64)
    want = LLM(enable_prefix_caching=False, **common).generate(prompts, params)
    llm = LLM(**common)
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in prompts]
    seqs = [engine.requests[i] for i in ids]
    while engine.has_unfinished():
        engine.step()
    assert [s.output_token_ids for s in seqs] == [o.token_ids for o in want]
    again = [s for s in seqs if s.num_preemptions]
    assert again, "nothing was preempted: the test would pass vacuously"
    assert all(s.num_reused_tokens > s.num_cached_tokens for s in again)
    assert engine.kv.num_free_pages == 20


def test_n_samples_share_the_prompt_and_each_has_its_own_seed_stream(llm):
    p = _prompt(26, seed=3)
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=7, n=4, ignore_eos=True)
    out = llm.generate(p, params)[0]
    assert [s.index for s in out.outputs] == [0, 1, 2, 3]
    assert out.token_ids == out.outputs[0].token_ids and out.text == out.outputs[0].text
    one = llm.generate(p, SamplingParams(temperature=1.0, max_tokens=12, seed=7,
                                          ignore_eos=True))[0]
    assert out.outputs[0].token_ids == one.token_ids  # sample 0 is the n=1 request's
    assert len({tuple(s.token_ids) for s in out.outputs}) > 1
    again = llm.generate(p, params)[0]  # a seeded request is reproducible as a whole
    assert [s.token_ids for s in again.outputs] == [s.token_ids for s in out.outputs]
    fresh = _prompt(26, seed=4)  # nothing cached yet: sample 0 computes it, the others reuse it
    samples = llm.generate(fresh, params)[0].outputs
    assert samples[0].metrics.num_cached_tokens == 0
    assert [s.metrics.num_cached_tokens for s in samples[1:]] == [24] * 3
    assert llm.engine.kv.num_free_pages == llm.engine.kv.num_pages
    assert not llm.engine.requests and not llm.engine.samples


def test_n_greedy_samples_are_identical_and_streams_carry_their_index(llm):
    p = _prompt(9, seed=5)
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=6, n=3, ignore_eos=True))[0]
    assert len(out.outputs) == 3 and len({tuple(s.token_ids) for s in out.outputs}) == 1
    params = SamplingParams(temperature=1.0, max_tokens=6, n=2, seed=11, ignore_eos=True)
    whole = llm.generate(p, params)[0]
    got: dict[int, list[int]] = {0: [], 1: []}
    for delta in llm.stream(p, params):
        (sample,) = delta.outputs
        assert delta.request_id and delta.token_ids == sample.token_ids
        got[sample.index] += sample.token_ids
    assert [got[0], got[1]] == [s.token_ids for s in whole.outputs]
    assert not llm.engine.requests


@pytest.mark.parametrize("field,value,match", [
    ("n", 0, r"n must be an int in \[1, 64\]"), ("n", MAX_SAMPLES + 1, "n must be"),
    ("n", True, r"\(a bool\)"), ("n", 2.0, "n must be"),
    ("cache_salt", 5, "cache_salt must be None or a string, got int 5"),
    ("cache_salt", b"x", "cache_salt must be None or a string"),
])
def test_bad_parameters_are_clear_errors(field, value, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{field: value})


def test_abort_ends_every_sample(llm):
    engine = llm.engine
    rid = engine.add_request(_prompt(10, seed=6), SamplingParams(temperature=1.0, n=3,
                                                                  max_tokens=50))
    engine.step()
    engine.abort(rid)
    sids = engine.samples_of(rid)
    assert len(sids) == 3 and all(engine.requests[s].finish_reason == "abort" for s in sids)
    for s in sids:
        engine.pop_finished(s)
    assert engine.kv.num_free_pages == engine.kv.num_pages and not engine.samples


def test_requests_arriving_together_compute_a_shared_prefix_once(tiny_llama):
    """Four prompts with a common 3-page head in one batch: the first computes the head, the
    others wait one step for it and reuse it (a prompt without the head goes first)."""
    head = _prompt(12, seed=8)
    prompts = [head + _prompt(5, seed=20 + i) for i in range(4)]
    prompts.insert(2, _prompt(9, seed=30))
    llm = LLM(model=str(tiny_llama), dtype="float64", page_size=4)
    outs = llm.generate(prompts, GREEDY)
    assert [o.metrics.num_cached_tokens for o in outs] == [0, 12, 0, 12, 12]
    want = LLM(model=str(tiny_llama), dtype="float64", page_size=4,
               enable_prefix_caching=False).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    first_token = [o.metrics.ttft for o in outs]
    assert first_token[2] < first_token[1]  # the unrelated prompt was not held up
