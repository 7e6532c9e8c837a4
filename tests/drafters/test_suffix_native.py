"""The suffix drafter's compiled speculation (specdec/native/suffix.c) against its oracle, the
numpy path (suffix_speculate.speculate): identical drafts on random corpora and on random
streams of requests through the drafter, history included; and the ``native`` option."""

from __future__ import annotations

import random

import numpy as np
import pytest

from specdec import SamplingParams
from specdec.controllers.base import DraftBudget
from specdec.drafters import suffix_native
from specdec.drafters.base import DraftRequest, TokenView
from specdec.drafters.suffix import SuffixDrafter
from specdec.drafters.suffix_corpus import TokenCorpus
from specdec.drafters.suffix_speculate import SpeculateParams, speculate

built = pytest.mark.skipif(suffix_native.load() is None,
                           reason="the compiled kernels are not built")


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return (a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
            and a.probs.tolist() == b.probs.tolist() and a.score == b.score
            and a.match_len == b.match_len and a.ends.tolist() == b.ends.tolist())


def _random_corpus(rng: random.Random, vocab: int) -> TokenCorpus:
    """Documents of a few tokens, some removed (blanked), often past the first sort."""
    c, spans = TokenCorpus(), []
    for _ in range(rng.randrange(1, 60)):
        doc = [rng.randrange(vocab) for _ in range(rng.randrange(0, 120))]
        spans.append((c.n, len(doc)))
        c.append(doc)
        c.end_document()
    for start, length in rng.sample(spans, min(len(spans), rng.randrange(0, 3))):
        c.remove(start, length)
    return c


@built
def test_the_compiled_speculation_equals_the_numpy_one_on_random_corpora():
    rng = random.Random(0)
    native = suffix_native.Speculate()
    drafted = 0
    for case in range(150):
        vocab = rng.choice([3, 8, 50])
        c = _random_corpus(rng, vocab)
        params = SpeculateParams(rng.choice([0.5, 1.0, 2.0, 40.0]), rng.choice([0.0, 1.0, -2.0]),
                                 rng.choice([0.0, 0.1, 0.3]), rng.choice([1, 7, 4096]),
                                 rng.random() < 0.7)
        pattern = np.array([rng.randrange(vocab) for _ in range(rng.randrange(1, 30))],
                           dtype=np.int32)
        before = rng.choice([c.n, rng.randrange(c.n + 1)])
        args = (c, pattern, before, rng.randrange(1, 80), rng.randrange(1, 30), params)
        want, got = speculate(*args), native(*args)
        assert _same(want, got), case
        drafted += want is not None
    assert drafted > 50  # many cases draft something: the comparison is not of Nones


def _stream(rng: random.Random, n: int) -> list[list[int]]:
    """Requests made of phrases from a small pool: repeats within and across requests."""
    phrases = [[rng.randrange(40) for _ in range(rng.randrange(2, 9))] for _ in range(12)]
    return [sum((rng.choice(phrases) for _ in range(rng.randrange(3, 25))), [])
            for _ in range(n)]


def _tree(t) -> tuple:
    probs = None if t.path_probs is None else t.path_probs.tolist()
    return t.tokens.tolist(), t.parents.tolist(), probs


@built
@pytest.mark.parametrize("args", [{}, {"tree": False, "max_spec_factor": 2.0},
                                  {"max_history_tokens": 300, "min_token_prob": 0.0}])
def test_the_drafter_proposes_the_same_trees_natively_on_random_streams(args):
    rng = random.Random(1)
    drafters = [SuffixDrafter(None, native=True, **args), SuffixDrafter(None, native=False,
                                                                        **args)]
    steps = 0
    for i, tokens in enumerate(_stream(rng, 20)):
        salt = rng.choice([None, "a"])
        states = [d.init_state(f"r{i}", tokens[:4]) for d in drafters]
        at = 4
        while at < len(tokens):
            budget = DraftBudget(rng.randrange(1, 20), rng.choice([None, 3]))
            trees = [d.propose([DraftRequest(f"r{i}", TokenView(tokens[:at]), budget,
                                             SamplingParams(cache_salt=salt), None, s)])[0]
                     for d, s in zip(drafters, states)]
            assert _tree(trees[0]) == _tree(trees[1]), (i, at)
            steps += trees[0].num_nodes > 0
            at += rng.randrange(1, 5)
        for d, s in zip(drafters, states):
            d.release(s)
    assert drafters[0].stats() == drafters[1].stats()
    assert steps > 50


def test_native_true_without_the_compiled_speculation_is_an_error(monkeypatch):
    monkeypatch.setattr(suffix_native, "load", lambda: None)
    with pytest.raises(ValueError, match="drafter_args.native is true"):
        SuffixDrafter(None, native=True)
    assert SuffixDrafter(None).speculate is speculate  # unset: the numpy path, quietly


def test_native_must_be_a_bool_or_none():
    with pytest.raises(ValueError, match="drafter_args.native must be a bool or None"):
        SuffixDrafter(None, native="yes")
