"""Incremental detokenization equals a full decode, token by token and at the end, on random
token sequences of the real tokenizer (multi-byte characters split across tokens, special
tokens, whitespace), and its cost per token does not grow with the output."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from specdec.models.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_dir)


def _check(tok, ids: list[int]) -> None:
    d = IncrementalDetokenizer(tok)
    for i in range(1, len(ids) + 1):
        d.update(ids[:i])
        full = tok.decode(ids[:i], skip_special_tokens=True)
        assert full.startswith(d.text), (ids[:i], d.text, full)
        assert len(full) - len(d.text) <= 8  # only an incomplete character is held back
    d.flush(ids)
    assert d.text == tok.decode(ids, skip_special_tokens=True)
    prompt = [5, 6, 7]  # an offset: the text of what follows the prompt
    d = IncrementalDetokenizer(tok, offset=len(prompt))
    d.update(prompt + ids)
    d.flush(prompt + ids)
    assert d.text == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_known_multibyte_and_special_cases(tok):
    text = "héllo wörld 😀 ok . , ! 日本語のテキスト\n\n  spaces\t"
    ids = tok(text).input_ids
    _check(tok, ids)
    _check(tok, [1, *ids, 2, 0, *ids])  # special tokens skipped
    emoji = tok("😀").input_ids
    d = IncrementalDetokenizer(tok)
    assert d.update(emoji[:1]) == "" and d.update(emoji) == "😀"  # held back, then whole


@pytest.mark.slow
@settings(max_examples=60)
@given(data=st.data())
def test_random_token_sequences_equal_a_full_decode(tok, data):
    # ids below 300 are mostly single bytes and byte pairs: many split characters
    ids = data.draw(st.lists(st.one_of(st.integers(0, 300), st.integers(0, len(tok) - 1)),
                             max_size=40))
    _check(tok, ids)


@pytest.mark.slow
def test_cost_per_token_is_flat_in_the_output_length(tok):
    ids = tok("The quick brown fox jumps over the lazy dog. " * 300).input_ids[:2000]

    def per_token(n: int) -> float:
        d, grown = IncrementalDetokenizer(tok), ids[:n - 52]
        d.update(grown)
        for t in ids[n - 52:n - 50]:  # the first windows after a long first chunk hold it
            grown.append(t)
            d.update(grown)
        t0 = time.perf_counter()
        for t in ids[n - 50:n]:
            grown.append(t)
            d.update(grown)
        return (time.perf_counter() - t0) / 50

    short, long = min(per_token(100) for _ in range(3)), min(per_token(2000) for _ in range(3))
    assert long < 3 * short, (short, long)  # a full decode would be ~20x
