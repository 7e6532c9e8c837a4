"""The ngram (prompt lookup) drafter on hand-made token lists: matching, trees, index upkeep."""

from __future__ import annotations

import random

import pytest

from specdec.controllers.base import DraftBudget
from specdec.drafters.base import Drafter, DraftRequest, TokenView, VerifiedBatch, VerifiedRequest
from specdec.drafters.ngram import NgramDrafter, NgramState
from specdec.sampling_params import SamplingParams
from specdec.tree import DraftTree


def _drafter(**kw) -> NgramDrafter:
    # these unit tests were written for 1-grams and up to 4 matches; the defaults are tuned for speed
    return NgramDrafter(None, **{"min_ngram": 1, "max_matches": 4, **kw})  # target unused


def _match(tokens: list[int], budget: int = 64, **kw) -> list[list[int]]:
    d = _drafter(**kw)
    state = d.init_state("r", tokens)
    d.extend(state, tokens)
    return d.match(state, tokens, budget)


def _propose(d: NgramDrafter, tokens: list[int], budget: int, state=None,
             max_depth: int | None = None) -> DraftTree:
    state = d.init_state("r", tokens) if state is None else state
    req = DraftRequest("r", TokenView(tokens), DraftBudget(budget, max_depth),
                       SamplingParams(temperature=0), None, state)
    (tree,) = d.propose([req])
    tree.validate(max_nodes=budget, max_depth=max_depth)
    return tree


def _verified(d: NgramDrafter, state, tokens: list[int]) -> None:
    """The engine's feedback after a step that committed everything up to the last token."""
    n = len(tokens) - 1
    d.on_verified(VerifiedBatch([VerifiedRequest("r", state, TokenView(tokens), n, 1, 0, [], 0)]))


def _scratch_index(tokens: list[int], lo: int, hi: int) -> dict:
    index: dict = {}
    for n in range(lo, hi + 1):
        for end in range(n - 1, len(tokens)):
            index.setdefault(tuple(tokens[end - n + 1 : end + 1]), []).append(end)
    return {k: sorted(v) for k, v in index.items()}


def test_is_a_drafter():
    d = _drafter()
    assert isinstance(d, Drafter) and d.name == "ngram" and d.hidden_layers == ()


def test_longest_ngram_wins_over_a_more_recent_shorter_one():
    # suffix (1, 2, 3) occurred at 0..2 (-> 7 9 3); (3,) alone occurred more recently at 5 (-> 8)
    tokens = [1, 2, 3, 7, 9, 3, 8, 1, 2, 3]
    assert _match(tokens, max_matches=1, max_depth=3) == [[7, 9, 3]]
    assert _match(tokens, max_matches=1, max_depth=3, max_ngram=1) == [[8, 1, 2]]


def test_most_recent_occurrence_first():
    tokens = [1, 5, 1, 6, 1]
    assert _match(tokens, max_matches=2, max_depth=1) == [[6], [5]]
    tree = _propose(_drafter(max_matches=2, max_depth=1), tokens, budget=4)
    assert tree.tokens.tolist() == [6, 5] and tree.parents.tolist() == [-1, -1]


def test_continuation_stops_at_max_depth_and_at_the_sequence_end():
    tokens = [4, 1, 2, 3, 5, 6, 7, 8, 4]
    assert _match(tokens, max_depth=3) == [[1, 2, 3]]
    assert _match(tokens, max_depth=20) == [[1, 2, 3, 5, 6, 7, 8, 4]]  # not past the end
    assert _match([4, 4], max_depth=5) == [[4]]


def test_loop_is_drafted_to_full_depth():
    # older occurrences of a loop run further before the sequence end and replace the short ones
    assert _match([1, 2, 3] * 5, max_depth=8) == [[1, 2, 3, 1, 2, 3, 1, 2]]
    assert _match([7] * 6, max_depth=4) == [[7, 7, 7, 7]]


def test_repeated_continuations_are_one_match():
    tokens = [9, 1, 2, 9, 1, 2, 9, 1, 3, 9]
    assert _match(tokens, max_matches=3, max_depth=2, max_ngram=1) == [[1, 3], [1, 2]]


def test_multiple_matches_make_a_branching_tree():
    tokens = [1, 2, 3, 9, 1, 2, 4, 1, 2]
    assert _match(tokens, max_depth=2) == [[4, 1], [3, 9]]
    tree = _propose(_drafter(max_depth=2), tokens, budget=8)
    assert tree.tokens.tolist() == [4, 1, 3, 9]
    assert tree.parents.tolist() == [-1, 0, -1, 2]


def test_shared_prefixes_merge():
    tokens = [5, 1, 2, 8, 5, 1, 3, 5]
    tree = _propose(_drafter(max_depth=3), tokens, budget=8)
    assert tree.tokens.tolist() == [1, 3, 5, 2, 8]
    assert tree.parents.tolist() == [-1, 0, 1, 0, 3]


def test_budget_is_respected_most_recent_first():
    tokens = [1, 2, 3, 9, 1, 2, 4, 1, 2]
    d = _drafter(max_depth=2)
    assert _propose(d, tokens, budget=1).tokens.tolist() == [4]
    assert _propose(d, tokens, budget=3).tokens.tolist() == [4, 1, 3]
    long = [0] + list(range(10, 40)) + [0]
    assert _propose(_drafter(max_depth=30), long, budget=5).tokens.tolist() == [10, 11, 12, 13, 14]


def test_budget_max_depth_limits_every_path():
    tokens = [1, 2, 3, 9, 8, 1, 2, 4, 5, 1, 2]
    d = _drafter(max_depth=4)
    assert _propose(d, tokens, budget=8).max_depth == 3  # [4, 5, 1, 2] and [3, 9, 8, 1]
    tree = _propose(d, tokens, budget=8, max_depth=2)
    assert tree.max_depth == 1 and tree.tokens.tolist() == [4, 5, 3, 9]


def test_falls_back_to_shorter_ngrams_while_budget_is_left():
    # (1, 2, 3) -> [4, 9, 3]; (2, 3) adds nothing new; (3,) at 5 -> [5, 1, 2]
    tokens = [1, 2, 3, 4, 9, 3, 5, 1, 2, 3]
    assert _match(tokens, max_depth=3) == [[4, 9, 3], [5, 1, 2]]
    assert _match(tokens, budget=3, max_depth=3) == [[4, 9, 3]]  # budget already used up
    assert _match(tokens, max_depth=3, max_matches=1) == [[4, 9, 3]]
    assert _match(tokens, max_depth=3, min_ngram=2) == [[4, 9, 3]]


def test_empty_when_nothing_matches():
    d = _drafter()
    for tokens in ([7], [1, 2, 3, 4, 5], [2, 1, 2, 3]):
        assert _match(tokens) == []
        assert _propose(d, tokens, budget=8).num_nodes == 0
    assert _match([1, 2, 1], min_ngram=2) == []  # only a 1-gram repeats


def test_ngram_longer_than_the_sequence_is_skipped():
    assert _match([6, 6], max_ngram=4, max_depth=2) == [[6]]


def test_incremental_index_equals_a_from_scratch_index():
    rng = random.Random(0)
    d = _drafter(min_ngram=2, max_ngram=5, max_depth=6)
    tokens = [rng.randrange(5) for _ in range(40)]
    state = d.init_state("r", tokens)
    for _ in range(60):
        _propose(d, tokens, budget=rng.randrange(1, 12), state=state)
        tokens += [rng.randrange(5) for _ in range(rng.randrange(0, 5))]
        _verified(d, state, tokens)
        assert state.num_indexed == len(tokens)
        assert state.index == _scratch_index(tokens, 2, 5)
        fresh = NgramState()
        d.extend(fresh, tokens)
        assert d.match(state, tokens, 12) == d.match(fresh, tokens, 12)


class _CountingList(list):
    """A token list that counts element and slice reads, to measure the work per step."""

    reads = 0

    def __getitem__(self, i):
        type(self).reads += 1
        return super().__getitem__(i)


@pytest.mark.parametrize("prompt_len", [100, 2000])
def test_a_step_costs_new_tokens_not_sequence_length(prompt_len):
    rng = random.Random(1)
    d = _drafter()
    tokens = _CountingList(rng.randrange(50) for _ in range(prompt_len))
    state = d.init_state("r", list(tokens))
    _propose(d, tokens, 8, state)
    reads = []
    for _ in range(5):
        tokens.append(rng.randrange(50))
        _CountingList.reads = 0
        _verified(d, state, tokens)
        _propose(d, tokens, 8, state)
        reads.append(_CountingList.reads)
    # 4 n-gram keys per new token, 4 suffix lookups, <= 4 * max_scan continuation slices
    assert max(reads) <= 4 + 4 + 4 * d.max_scan


def test_states_are_per_request_and_release_clears():
    d = _drafter(max_depth=2)
    a, b = [1, 2, 1], [3, 4, 3]
    sa, sb = d.init_state("a", a), d.init_state("b", b)
    reqs = [DraftRequest(r, TokenView(t), DraftBudget(4), SamplingParams(temperature=0), None, s)
            for r, t, s in (("a", a, sa), ("b", b, sb))]
    trees = d.propose(reqs)
    assert [t.tokens.tolist() for t in trees] == [[2, 1], [4, 3]]
    assert (1,) in sa.index and (1,) not in sb.index
    d.release(sa)
    assert sa.index == {} and sa.num_indexed == 0


@pytest.mark.parametrize("kw, name", [
    ({"min_ngram": 0}, "min_ngram"),
    ({"max_ngram": 2, "min_ngram": 3}, "max_ngram"),
    ({"max_ngram": 0}, "max_ngram"),
    ({"max_depth": 0}, "max_depth"),
    ({"max_depth": 2.5}, "max_depth"),
    ({"max_matches": 0}, "max_matches"),
    ({"max_matches": True}, "max_matches"),
    ({"max_ngram": "4"}, "max_ngram"),
])
def test_bad_args_name_the_arg(kw, name):
    with pytest.raises(ValueError, match=rf"drafter_args\.{name} must be an int"):
        _drafter(**kw)
