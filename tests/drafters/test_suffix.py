"""The suffix drafter (SuffixDecoding): its speculation against a brute-force suffix-tree oracle,
the history (tenant isolation, LRU bound, preemption), its options, and end to end: greedy
float64 and bitwise float32 equality with plain decoding, sampling that follows the target,
prefix-cache restores and composition with a learned drafter."""

from __future__ import annotations

import heapq
import logging
import math
import random
from collections import Counter

import numpy as np
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

from specdec import LLM, SamplingParams
from specdec.controllers.base import DraftBudget
from specdec.drafters.base import DraftRequest, TokenView, VerifiedBatch, VerifiedRequest
from specdec.drafters.suffix import SuffixDrafter
from specdec.drafters.suffix_corpus import TokenCorpus
from specdec.drafters.suffix_history import SuffixHistory
from specdec.drafters.suffix_speculate import SpeculateParams, count_trie, speculate
from specdec.models import native
from specdec.models.loader import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TREE = SpeculateParams(max_spec_factor=1.0, max_spec_offset=0.0, min_token_prob=0.1,
                       max_candidates=1 << 20, tree=True)


def _corpus(*docs: list[int]) -> TokenCorpus:
    c = TokenCorpus()
    for d in docs:
        c.append(d)
        c.end_document()
    return c


def _paths(draft) -> dict[tuple, float]:
    """{root-to-node token path: probability} of a draft."""
    out, paths = {}, []
    for tok, par, p in zip(draft.tokens.tolist(), draft.parents.tolist(), draft.probs.tolist()):
        paths.append((paths[par] if par >= 0 else ()) + (tok,))
        out[paths[-1]] = p
    return out


# ---- the oracle: a depth-unbounded suffix tree, ArcticInference's speculate by brute force ----

def oracle(docs, pattern, max_nodes, max_depth, p: SpeculateParams):
    """(score, match length, {path: prob}) as ArcticInference's SuffixTree::speculate would
    draft (heap expansion or top-child path), on the documents ``docs``."""
    best = (0.0, 0, {})
    for m in range(1, len(pattern) + 1):
        suffix = list(pattern[-m:])
        conts = [d[i + 1:i + 1 + max_depth] for d in docs for i in range(m - 1, len(d))
                 if d[i - m + 1:i + 1] == suffix]
        if not conts:
            break
        budget = min(max_nodes, int(m * p.max_spec_factor + p.max_spec_offset + 1e-6))
        count = Counter(tuple(c[:k]) for c in conts for k in range(1, len(c) + 1))
        count[()] = len(conts)
        kids: dict[tuple, list] = {}
        for path in count:
            if path:
                kids.setdefault(path[:-1], []).append(path)
        out = _heap(count, kids, budget, p.min_token_prob) if p.tree else \
            _path(count, kids, budget, p.min_token_prob)
        score = sum(out.values())
        if out and score >= best[0] - 1e-9:
            best = (score, m, out)
    return best


def _occurrences(docs, s: list[int]) -> int:
    return sum(d[i:i + len(s)] == s for d in docs for i in range(len(d) - len(s) + 1))


def _heap(count, kids, budget, min_prob) -> dict:
    out, heap, tick = {}, [(-1.0, 0, ())], 1
    while heap and len(out) < budget:
        q, _, path = heapq.heappop(heap)
        if path:
            out[path] = -q
        for child in kids.get(path, []):
            prob = -q * (count[child] / count[path])
            if prob >= min_prob:
                heapq.heappush(heap, (-prob, tick, child))
                tick += 1
    return out


def _path(count, kids, budget, min_prob) -> dict:
    out, path, prob = {}, (), 1.0
    while len(out) < budget and kids.get(path):
        child = max(sorted(kids[path]), key=lambda c: count[c])
        prob *= count[child] / count[path]
        if prob < min_prob:
            break
        out[child], path = prob, child
    return out


@pytest.mark.parametrize("tree", [True, False])
def test_speculation_matches_the_suffix_tree_oracle(tree):
    rng = random.Random(0)
    for case in range(300):
        docs = [[rng.randrange(4) for _ in range(rng.randrange(0, 30))]
                for _ in range(rng.randrange(1, 5))]
        pattern = [rng.randrange(4) for _ in range(rng.randrange(1, 8))]
        p = SpeculateParams(rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 1.0]),
                            rng.choice([0.0, 0.1, 0.3]), 1 << 20, tree)
        max_nodes, depth = rng.randrange(1, 10), rng.randrange(1, 8)
        score, m, want = oracle(docs, pattern, max_nodes, depth, p)
        got = speculate(_corpus(*docs), np.array(pattern), 1 << 30, max_nodes, depth, p)
        if not want:
            assert got is None, case
            continue
        assert got is not None and got.match_len == m and math.isclose(got.score, score), case
        have = _paths(got)
        assert len(have) == len(want), case
        if not tree:  # a path has no ties to break
            assert list(have) == list(want), case
        for path, prob in have.items():  # a tie at the budget's edge may pick another node
            want_p = _occurrences(docs, pattern[-m:] + list(path)) / _occurrences(
                docs, pattern[-m:])
            assert math.isclose(prob, want_p) and prob >= p.min_token_prob, case
        parents = got.parents.tolist()
        assert all(-1 <= q < i for i, q in enumerate(parents)), case


def test_count_trie_is_the_docstring_example():
    tokens, parents, counts, probs = count_trie(np.array([[7, 8], [7, 8], [7, 9], [4, -1]]), 0.0)
    assert tokens.tolist() == [4, 7, 8, 9] and parents.tolist() == [-1, -1, 1, 1]
    assert counts.tolist() == [1, 3, 2, 1] and probs.tolist() == [0.25, 0.75, 0.5, 0.25]


def test_draft_size_adapts_to_the_match_length():
    c = _corpus([1, 2, 3, 4, 5, 6, 7, 8])
    one = speculate(c, np.array([9, 3]), c.n, 16, 16, TREE)  # 1 token matched
    three = speculate(c, np.array([1, 2, 3]), c.n, 16, 16, TREE)
    assert one.tokens.tolist() == [4] and three.tokens.tolist() == [4, 5, 6]
    wide = SpeculateParams(2.0, 0.0, 0.1, 64, True)
    assert speculate(c, np.array([1, 2, 3]), c.n, 16, 16, wide).tokens.tolist() == [4, 5, 6, 7,
                                                                                    8]
    assert speculate(c, np.array([1, 2, 3]), c.n, 2, 16, wide).tokens.tolist() == [4, 5]


def test_min_token_prob_cuts_rare_continuations():
    c = _corpus(*([[5, 1]] * 9 + [[5, 2]]))  # after 5: 1 with p 0.9, 2 with p 0.1
    loose = SpeculateParams(1.0, 2.0, 0.1, 64, True)
    strict = SpeculateParams(1.0, 2.0, 0.2, 64, True)
    assert _paths(speculate(c, np.array([5]), c.n, 8, 4, loose)) == {(1,): 0.9, (2,): 0.1}
    assert _paths(speculate(c, np.array([5]), c.n, 8, 4, strict)) == {(1,): 0.9}


def test_the_request_itself_is_not_an_occurrence():
    c = TokenCorpus()
    c.append([3, 4, 5, 3])
    d = speculate(c, np.array([5, 3]), c.n - 1, 8, 8, TREE)  # 3 at position 0 only
    assert d.tokens.tolist() == [4] and d.match_len == 1


def test_lookup_after_the_sort_and_with_blanked_documents():
    rng = random.Random(1)
    docs = [[rng.randrange(50) for _ in range(rng.randrange(1, 400))] for _ in range(40)]
    c = _corpus(*docs)
    assert c.n_sorted > 0  # the index is sorted and has a tail
    flat = np.concatenate([np.array(d + [-1]) for d in docs])
    c.remove(0, len(docs[0]))
    flat[:len(docs[0])] = -2
    for tok in range(50):
        want = np.flatnonzero(flat == tok)
        assert c.positions(tok, 1 << 20).tolist() == want.tolist()
        assert c.positions(tok, 3).tolist() == want[-3:].tolist()


# ---- the history ----------------------------------------------------------------------------

def test_history_keeps_salts_apart():
    h = SuffixHistory(1000)
    h.add("a", "r1", [1, 2, 3, 4])
    assert h.draft("a", np.array([1, 2]), 8, 8, TREE).tokens.tolist() == [3, 4]
    assert h.draft("b", np.array([1, 2]), 8, 8, TREE) is None
    assert h.draft(None, np.array([1, 2]), 8, 8, TREE) is None


def test_history_evicts_the_least_recently_used_within_its_token_bound():
    h = SuffixHistory(90)
    for i, salt in enumerate(["a", "b", "a"]):  # 30 tokens each, each doc its own tokens
        h.add(salt, f"r{i}", list(range(100 * i, 100 * i + 30)))
    assert h.draft("a", np.array([5]), 4, 4, TREE) is not None  # r0 used: now the newest
    h.add("b", "r3", list(range(300, 330)))
    assert h.tokens == 90 and h.evicted == 1
    assert h.draft("b", np.array([105]), 4, 4, TREE) is None  # r1 went, not r0
    assert h.draft("a", np.array([5]), 4, 4, TREE) is not None
    h.add("c", "r4", list(range(1000, 1200)))  # longer than the bound: its last 90 tokens
    assert h.tokens == 90 and h.stats()["documents"] == 1 and set(h.spaces) == {"c"}


def test_history_memory_stays_bounded():
    h = SuffixHistory(3000)
    rng = np.random.default_rng(0)
    peak = 0
    for i in range(1500):
        h.add(str(i % 3), f"r{i}", rng.integers(0, 500, rng.integers(1, 60)).tolist())
        peak = max(peak, h.memory_bytes)
        assert h.tokens <= 3000
    assert h.evicted > 1000 and peak <= 40 * 3000, peak


def test_a_restarted_request_takes_its_partial_text_out():
    d = SuffixDrafter(None)
    state = d.init_state("r", [1, 2, 3])
    _propose(d, state, [1, 2, 3, 4, 5], salt="s")
    d.release(state)  # preempted: its text so far is filed
    assert d.stats()["documents"] == 1
    d.init_state("r", [1, 2, 3])  # it starts again
    assert d.stats()["documents"] == 0 and d.stats()["tokens"] == 0


def test_a_request_never_asked_to_draft_files_nothing():
    d = SuffixDrafter(None)
    d.release(d.init_state("r", [1, 2, 3]))  # its salt was never seen
    assert d.stats()["documents"] == 0


def _propose(d: SuffixDrafter, state, tokens, salt=None, budget=8):
    req = DraftRequest("r", TokenView(tokens), DraftBudget(budget), SamplingParams(
        temperature=0, cache_salt=salt), None, state)
    (tree,) = d.propose([req])
    tree.validate(max_nodes=budget)
    return tree


def test_repeated_calls_are_harmless():
    d = SuffixDrafter(None, max_spec_offset=0.0)
    d.history.add(None, "old", [7, 1, 2, 3, 9, 9])
    tokens = [4, 1, 2, 3, 5, 1, 2]
    state = d.init_state("r", tokens)
    first = _propose(d, state, tokens)
    again = _propose(d, state, tokens)
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
