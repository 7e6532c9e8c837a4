"""Near-duplicate prompts (training/near_dup.py) and the held-out split that drops them from the
training side."""

from __future__ import annotations

import random

import pytest

from specdec.training.config import TrainConfig
from specdec.training.data import Conversation
from specdec.training.near_dup import (
    MinHasher,
    drop_near_duplicates,
    jaccard,
    near_duplicates,
    ngram_overlap,
    prompt_text,
    shingles,
    words,
)
from specdec.training.trainer import held_out_split

VOCAB = [f"w{i}" for i in range(500)]


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(n))


def test_normalisation_and_shingles():
    assert words("Héllo, WORLD! ｆｕｌｌ-width 42") == ["héllo", "world", "full", "width", "42"]
    assert shingles("a b c d") == shingles("A, b; C. d!")  # case and punctuation ignored
    assert len(shingles("a b c d")) == 2 and len(shingles("a b")) == 1 and not shingles(" ,. ")
    assert shingles("a b") != shingles("b a")
    a, b = shingles("one two three four five"), shingles("one two three four six")
    assert jaccard(a, b) == pytest.approx(2 / 4) and jaccard(a, a) == 1.0


def test_minhash_estimates_jaccard():
    rng = random.Random(0)
    base = _text(rng, 400).split()
    other = base[:200] + _text(rng, 200).split()  # about a third of the shingles shared
    a, b = shingles(" ".join(base)), shingles(" ".join(other))
    sig = MinHasher(512, seed=1).signatures([a, b, frozenset()])
    estimate = float((sig[0] == sig[1]).mean())
    assert abs(estimate - jaccard(a, b)) < 0.06
    assert (sig[2] == 2**32 - 1).all()


def test_near_duplicates_finds_exactly_the_pairs_above_threshold():
    rng = random.Random(1)
    corpus = [_text(rng, rng.randint(8, 60)) for _ in range(300)]
    queries = []
    for k in range(40):  # edited copies: a word changed every `gap` words, some far apart
        w = corpus[k].split()
        gap = 2 + k % 8
        queries.append(" ".join("zz" if i % gap == 1 else x for i, x in enumerate(w)))
    queries += [_text(rng, 30) for _ in range(20)]  # unrelated
    threshold = 0.5
    found = {(m.query, m.other): m.jaccard for m in near_duplicates(queries, corpus, threshold)}
    truth = {(i, j): jaccard(shingles(q), shingles(c)) for i, q in enumerate(queries)
             for j, c in enumerate(corpus)}
    expected = {k for k, v in truth.items() if v >= threshold}
    assert expected and set(found) <= expected  # exact check: nothing below the threshold
    assert len(expected - set(found)) <= 1  # LSH may miss a pair right at the threshold
    assert all(found[k] == pytest.approx(truth[k]) for k in found)
    assert any(truth[k] < threshold for k in truth if k[0] < 40)  # the test has close misses


def test_near_duplicates_within_one_list():
    texts = ["the cat sat on the mat today", "The cat sat on the mat, today!", "a different one",
             "the cat sat on the mat yesterday", ""]
    pairs = [(m.query, m.other) for m in near_duplicates(texts, None, 0.5)]
    assert pairs == [(0, 1), (0, 3), (1, 3)]
    assert near_duplicates(texts, None, 1.0)[0].jaccard == 1.0
    with pytest.raises(ValueError, match="threshold"):
        near_duplicates(texts, None, 0)


def test_containment_and_ngram_overlap():
    rng = random.Random(2)
    eval_prompt = _text(rng, 40)
    corpus = [_text(rng, 5) + " " + eval_prompt + " " + _text(rng, 5), _text(rng, 50)]
    (m,) = near_duplicates([eval_prompt], corpus, 0.5)
    assert m.other == 0 and m.containment == 1.0 and m.jaccard == pytest.approx(38 / 48)
    overlap = ngram_overlap([eval_prompt, _text(rng, 40), "short prompt"], corpus, n=13)
    assert overlap[0] == 1.0 and overlap[1] == 0.0 and overlap[2] == 0.0


def _conv(text: str, i: int) -> Conversation:
    return Conversation([{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}],
                        "data.json", i)


def test_split_drops_training_near_duplicates_of_held_out_prompts(tmp_path):
    rng = random.Random(3)
    texts = [_text(rng, 20) for _ in range(40)]
    config = TrainConfig(data=["x"], out=str(tmp_path), holdout=5, holdout_near_dup=0)
    plain = held_out_split([_conv(t, i) for i, t in enumerate(texts)], config)
    assert plain.near_duplicates_removed == 0 and len(plain.train) == 35
    held = [h[0]["content"] for h in plain.held_out]
    # two training conversations become copies of held-out prompts, one lightly edited (the
    # split's order depends on the number of conversations only)
    first, second = (c.index for c in plain.train[:2])
    texts[first] = held[0]
    texts[second] = held[1].replace(held[1].split()[3], "edited")
    convs = [_conv(t, i) for i, t in enumerate(texts)]
    off = held_out_split(convs, config)
    on = held_out_split(convs, TrainConfig(data=["x"], out=str(tmp_path), holdout=5))
    assert TrainConfig(data=["x"], out="o").holdout_near_dup == 0.5  # on by default
    assert on.held_out == off.held_out == plain.held_out  # the held-out prompts do not change
    assert off.near_duplicates_removed == 0 and len(off.train) == 35
    assert on.near_duplicates_removed == 2 and len(on.train) == 33
    assert [c.index for c in on.train] == [c.index for c in plain.train[2:]]


def test_drop_near_duplicates_edges():
    chat = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "answer"}, {"role": "user", "content": "more"}]
    assert prompt_text(chat) == "sys\nhi\nmore"
    assert drop_near_duplicates([], ["a b c"]) == [] and drop_near_duplicates(["a b c"], []) == []
    assert drop_near_duplicates(["x y z w", "a b c d e", "a b c d f"], ["a b c d e"]) == [1, 2]
    assert drop_near_duplicates(["x y z w", "a b c d e", "a b c d f"], ["a b c d e"], 0.9) == [1]


@pytest.mark.parametrize("value", [-0.1, 1.5, "0.5", True])
def test_config_checks_the_threshold(value, tmp_path):
    with pytest.raises(ValueError, match="holdout_near_dup"):
        TrainConfig(data=["x"], out=str(tmp_path), holdout_near_dup=value)
