"""The suffix drafter (SuffixDecoding, drafters/suffix.py): replay safety, its options, and end
to end: greedy float64 and bitwise float32 equality with plain decoding, sampling that follows
the target, tenant isolation and the history bound through the engine, prefix-cache restores
and composition with a learned drafter. Its speculation and history have their own tests
(test_suffix_speculate.py, test_suffix_history.py)."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch
from conftest import make_tiny_model
from drafter_helpers import (
    PROMPTS,
    assert_samples_follow_target,
    greedy,
    random_head,
    record_proposals,
    sampling_target,
)
from suffix_helpers import propose

from specdec import LLM, SamplingParams, native
from specdec.drafters.base import TokenView, VerifiedBatch, VerifiedRequest
from specdec.drafters.suffix import SuffixDrafter
from specdec.models.loader import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_repeated_calls_are_harmless():
    d = SuffixDrafter(None, max_spec_offset=0.0)
    d.history.add(None, "old", [7, 1, 2, 3, 9, 9])
    tokens = [4, 1, 2, 3, 5, 1, 2]
    state = d.init_state("r", tokens)
    first = propose(d, state, tokens)
    again = propose(d, state, tokens)
    assert d.replay_safe and first.tokens.tolist() == again.tokens.tolist() == [3, 5]
    verified = VerifiedBatch([VerifiedRequest("r", state, TokenView(tokens), 6, 1, 0, [], 0)])
    d.on_verified(verified)
    d.on_verified(verified)
    assert state.corpus.n == len(tokens)


@pytest.mark.parametrize("option, value", [
    ("max_history_tokens", 0), ("max_history_tokens", -3), ("max_history_tokens", 2.5),
    ("max_depth", 0), ("max_candidates", 0), ("min_token_prob", 1.5),
    ("min_token_prob", float("nan")), ("max_spec_factor", -1.0), ("tree", "yes")])
def test_bad_options_name_the_option(option, value):
    with pytest.raises(ValueError, match=f"drafter_args.{option}"):
        SuffixDrafter(None, **{option: value})


def test_bad_history_size_through_the_engine(tiny_llama):
    with pytest.raises(ValueError, match="max_history_tokens must be an int >= 1"):
        LLM(model=str(tiny_llama), drafter="suffix", drafter_args={"max_history_tokens": 0})


# ---- end to end -----------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_float64_equals_plain_and_the_history_helps(tiny_llama, batch):
    llm = LLM(model=str(tiny_llama), dtype="float64", drafter="suffix", controller="static",
              max_num_seqs=batch)
    want = [o.token_ids for o in greedy(tiny_llama, PROMPTS)]
    first = llm.generate(PROMPTS, GREEDY)  # the second round drafts from the first's text
    second = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in first] == want and [o.token_ids for o in second] == want
    accepted = [sum(sum(o.metrics.accepted_by_depth) for o in r) for r in (first, second)]
    assert accepted[1] > max(accepted[0], 15 * len(PROMPTS)), accepted
    stats = llm.engine.drafting.drafter.stats()
    assert stats["documents"] == 2 * len(PROMPTS) and stats["memory_bytes"] > 0


@pytest.mark.skipif(native.load() is None, reason="the compiled kernels are not built")
def test_float32_speculation_is_bitwise_plain(tmp_path):
    """On the row-invariant kernels, float32 greedy and seeded sampled tokens are exactly the
    plain ones (test_exact_precisions.py's wide model)."""
    wide = make_tiny_model(tmp_path / "wide", seed=7, hidden_size=256, vocab_size=16,
                           eos_token_id=15, intermediate_size=512, num_attention_heads=4,
                           num_key_value_heads=2, num_hidden_layers=3)
    sampled = [SamplingParams(temperature=0.8, seed=50 + i, max_tokens=20, ignore_eos=True)
               for i in range(len(PROMPTS))]
    prompts = [[t % 15 for t in p] for p in PROMPTS]
    plain = LLM(model=str(wide), dtype="float32", max_num_seqs=8)
    spec = LLM(model=str(wide), dtype="float32", max_num_seqs=8, drafter="suffix",
               controller="static", controller_args={"budget": 4})
    for params in (GREEDY, sampled, GREEDY, sampled):  # twice: from the history too
        want = [o.token_ids for o in plain.generate(prompts, params)]
        got = spec.generate(prompts, params)
        assert [o.token_ids for o in got] == want
        assert sum(sum(o.metrics.accepted_by_depth) for o in got) > 0


def test_sampling_follows_the_target(tmp_path):
    folder = sampling_target(tmp_path)[0]
    assert_samples_follow_target(folder, "suffix", {})


@pytest.mark.parametrize("first, second", [("a", "b"), (None, "a"), ("a", None)])
def test_a_salt_never_drafts_from_another_salts_text(tiny_llama, monkeypatch, first, second):
    """The second request's proposals after another salt's request are those of a fresh
    engine; after a request of its own salt (the control) it drafts from that one's text."""
    seen = record_proposals(monkeypatch, SuffixDrafter)
    prompt = list(range(10, 30))  # no token twice: nothing to draft from its own text at first

    def proposals(*salts):
        llm = LLM(model=str(tiny_llama), dtype="float64", drafter="suffix", controller="static")
        for salt in salts:
            seen.clear()
            out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16,
                                                        ignore_eos=True, cache_salt=salt))
        return [(t.tokens.tolist(), t.parents.tolist()) for _, _, t in seen], out[0]

    alone, out_alone = proposals(second)
    after_other, out_other = proposals(first, second)
    after_same, out_same = proposals(second, second)
    assert after_other == alone and out_other.token_ids == out_alone.token_ids
    assert alone[0][0] == [] and after_same[0][0] != []  # the control: shared within a salt
    assert out_same.token_ids == out_alone.token_ids


def test_requests_in_flight_do_not_draft_from_each_other(tiny_llama, monkeypatch):
    seen = record_proposals(monkeypatch, SuffixDrafter)
    prompt = list(range(40, 60))
    LLM(model=str(tiny_llama), dtype="float64", drafter="suffix", controller="static",
        max_num_seqs=1).generate([prompt], GREEDY)
    alone = Counter((tuple(ids), tuple(t.tokens.tolist())) for ids, _, t in seen)
    seen.clear()
    LLM(model=str(tiny_llama), dtype="float64", drafter="suffix", controller="static",
        max_num_seqs=2).generate([prompt, prompt], GREEDY)
    together = Counter((tuple(ids), tuple(t.tokens.tolist())) for ids, _, t in seen)
    assert together == alone + alone and sum(alone.values()) > 1


def test_the_engine_keeps_the_history_within_its_bound(tiny_llama, caplog):
    caplog.set_level(logging.INFO, logger="specdec")
    llm = LLM(model=str(tiny_llama), dtype="float64", drafter="suffix", controller="static",
              drafter_args={"max_history_tokens": 50})
    for p in PROMPTS:
        llm.generate([p], GREEDY)
    stats = llm.engine.drafting.drafter.stats()
    assert stats["tokens"] <= 50 and stats["evicted_documents"] >= len(PROMPTS) - 2, stats
    said = [r.getMessage() for r in caplog.records if "suffix drafter" in r.getMessage()]
    assert len(said) == 2 and "at most 50 tokens" in said[0] and "history full" in said[1]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("suffix"), seed=4, num_hidden_layers=4)
    model, cfg, hf = load_model(folder, torch.float64, "cpu", 512)
    return folder, model, cfg, hf


@pytest.mark.parametrize("batch", [1, 4])
def test_same_tokens_and_drafts_with_and_without_the_prefix_cache(target, batch):
    from test_prefix_caching import _run

    folder = target[0]
    want = _run(folder, "suffix", {}, batch, caching=False)
    got = _run(folder, "suffix", {}, batch, caching=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.metrics.accepted_by_depth for o in got] == [o.metrics.accepted_by_depth
                                                          for o in want]
    assert [o.metrics.draft_tokens_proposed for o in got] == [
        o.metrics.draft_tokens_proposed for o in want]
    assert sum(o.metrics.num_cached_tokens for o in got) > 0
    assert sum(o.metrics.draft_tokens_proposed for o in got) > 0


def test_composes_with_a_learned_drafter(target, monkeypatch):
    folder, model, cfg, hf = target
    seen = record_proposals(monkeypatch, SuffixDrafter)
    args = {"eagle3": {"head": random_head(model, cfg, hf), "depth": 3, "topk": 2},
            "suffix": {}}
    want = [o.token_ids for o in greedy(folder, PROMPTS)]
    llm = LLM(model=str(folder), dtype="float64", drafter="eagle3+suffix", drafter_args=args,
              controller="static", controller_args={"budget": 8})
    for _ in range(2):
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.error for o in outs] == [None] * len(outs)
        assert [o.token_ids for o in outs] == want
    assert any(t.num_nodes for _, _, t in seen)
    assert sum(sum(o.metrics.accepted_by_depth) for o in outs) > 0
