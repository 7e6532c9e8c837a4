"""What a stream sends of a request at each step: the tokens and text it has not sent yet.

Text only grows and nothing is sent twice: while a stop string could still cut the tail, the
tail that could begin one is held back: the longest end of the text that is a proper prefix of
a stop string (at most ``len(longest stop) - 1`` characters, and none when the text ends in no
stop's beginning). A stop completing later cuts the text at its start, which is never before
what was sent. Shared by ``LLM.stream`` and the engine loop
behind the server (specdec.serving.engine_loop).
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.engine.sequence import Sequence


def changed(result) -> list[Sequence]:
    """The sequences a step result touched (emitted or finished), each once, in order."""
    seen = {id(s): s for s, _ in result.emitted}
    for s in result.finished:
        seen.setdefault(id(s), s)
    return list(seen.values())


def stop_prefix_len(text: str, stops: list[str]) -> int:
    """The length of the longest end of ``text`` that is a proper prefix of a stop string: what
    a later token could complete into a stop (e.g. "say ab" with stop "abc": 2; with stop "xyz":
    0). Only prefixes ending in the text's last character are tried, longest first."""
    if not text:
        return 0
    last, best = text[-1], 0
    for stop in stops:
        i = stop.rfind(last, 0, len(stop) - 1)  # stop[:i + 1] ends as the text does
        while i + 1 > best:
            if text.endswith(stop[:i + 1]):
                best = i + 1
                break
            i = stop.rfind(last, 0, i)
    return best


@dataclass
class Delta:
    token_ids: list[int]
    text: str


class DeltaTracker:
    """Per sequence id: tokens and text sent so far."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._tokens: dict[str, int] = {}
        self._text: dict[str, int] = {}

    def text(self, seq: Sequence) -> str:
        return "" if self.tokenizer is None else seq.text(self.tokenizer)

    def started(self, seq: Sequence) -> bool:
        """Whether a delta of this sequence was taken before."""
        return seq.request_id in self._tokens

    def delta(self, seq: Sequence) -> Delta:
        rid = seq.request_id
        sent_tokens, sent_text = self._tokens.get(rid, 0), self._text.get(rid, 0)
        text = self.text(seq)
        if seq.params.stop and not seq.is_finished:  # a stop string may still cut this tail
            text = text[:max(sent_text, len(text) - stop_prefix_len(text, seq.params.stop))]
        out = seq.token_ids[seq.num_prompt_tokens + sent_tokens:]
        self._tokens[rid], self._text[rid] = sent_tokens + len(out), len(text)
        return Delta(out, text[sent_text:])

    def forget(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)
        self._text.pop(request_id, None)
