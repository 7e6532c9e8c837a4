"""What a stream holds back while a stop string could still cut its tail: only the end of the
text that could begin a stop, however long the stop strings are."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specdec.engine.streaming import DeltaTracker, stop_prefix_len


@pytest.mark.parametrize("text,stops,held", [
    ("say ab", ["abc"], 2),
    ("say ab", ["xyz"], 0),
    ("say a", ["b" * 500, "ax"], 1),
    ("aaaa", ["aaab"], 3),
    ("abab", ["ababc", "bx"], 4),
    ("", ["abc"], 0),
    ("abc", ["abc"], 0),  # a whole stop is the engine's to cut, not a prefix to wait on
])
def test_stop_prefix_len_is_the_longest_end_that_begins_a_stop(text, stops, held):
    assert stop_prefix_len(text, stops) == held
    brute = max([k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])],
                default=0)
    assert held == brute


class _Seq:
    """What DeltaTracker reads of a running sequence whose text is given."""

    def __init__(self, text: str, stops: list[str]) -> None:
        self.request_id, self._text = "r", text
        self.params = SimpleNamespace(stop=stops)
        self.is_finished, self.num_prompt_tokens, self.token_ids = False, 0, [1]

    def text(self, tokenizer) -> str:
        return self._text


def test_a_long_stop_string_does_not_hold_back_the_stream():
    sent = DeltaTracker(tokenizer=object())
    seq = _Seq("hello world, the sea", ["the end" + "x" * 200])
    assert sent.delta(seq).text == "hello world, the sea"  # could begin no stop: all of it
    seq._text += " and the en"
    assert sent.delta(seq).text == " and "  # "the en" could still become "the end"...
    seq._text += "ding"
    assert sent.delta(seq).text == "the ending"  # ...and did not
