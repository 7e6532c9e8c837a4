"""The output stage of a step: each frontier request's emitted tokens appended until a stop
condition fires (EOS, stop token ids, stop strings, max_tokens, max_model_len), and its
per-request figures. The text a stop string is searched in grows incrementally
(``specdec.engine.detokenizer``), O(new tokens) per step."""

from __future__ import annotations

import time

from specdec.engine.sequence import Sequence
from specdec.engine.step import StepRequest


class OutputStage:
    def __init__(self, eos_token_ids: tuple[int, ...], max_model_len: int, tokenizer) -> None:
        self.stopper = StopChecker(eos_token_ids, max_model_len, tokenizer)

    def append(self, records: list[StepRequest]) -> None:
        """Append the tokens each verified request emitted (``rec.appended``: how many, a
        stop condition may cut them), and count the verification."""
        now = time.perf_counter()
        for rec in records:
            if rec.result is not None:
                seq, tokens = rec.seq, rec.result.tokens
                if seq.logits is not None:  # a complete grammar ends the request at once
                    tokens = tokens[:seq.logits.until_complete(tokens)]
                rec.appended = self.stopper.append_and_check(seq, tokens)
                if rec.logprobs is not None:
                    seq.logprobs.extend(rec.logprobs[:rec.appended])
                if seq.logits is not None:
                    seq.logits.commit(tokens[:rec.appended])
                    if seq.logits.stopped and seq.finish_reason is None:
                        seq.finish_reason = "stop"
                _count(seq, rec, now)


def _count(seq: Sequence, rec: StepRequest, now: float) -> None:
    """Per-request metrics of one verification."""
    k = rec.num_accepted
    seq.num_steps_decoding += 1
    seq.draft_tokens_proposed += rec.num_nodes
    seq.last_proposed, seq.last_accepted = rec.num_nodes, k
    while len(seq.accepted_by_depth) < k:
        seq.accepted_by_depth.append(0)
    for d in range(k):
        seq.accepted_by_depth[d] += 1
    if seq.times.first_token is None:
        seq.times.first_token = now
    seq.times.emissions.append((now, rec.appended))


class StopChecker:
    def __init__(self, eos_token_ids: tuple[int, ...], max_model_len: int, tokenizer) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer

    def append_and_check(self, seq: Sequence, tokens: list[int]) -> int:
        """Append tokens one at a time until a stop condition fires.

        Returns how many were appended; sets seq.finish_reason when the request stops.
        """
        params = seq.params
        if not params.stop:  # (no text to search: the stops are per token, the length known)
            stops = params.stop_token_ids
            eos = () if params.ignore_eos else self.eos_token_ids
            n = len(seq.token_ids)
            room = min(params.max_tokens - (n - len(seq.prompt_token_ids)),
                       self.max_model_len - n)  # tokens until "length"
            for i, token in enumerate(tokens):
                if token in stops or token in eos or i + 1 >= room:
                    seq.token_ids.extend(tokens[:i + 1])
                    seq.finish_reason = "length" if token not in stops and token not in eos \
                        else "stop"
                    return i + 1
            seq.token_ids.extend(tokens)
            return len(tokens)
        for i, token in enumerate(tokens):
            seq.token_ids.append(token)
            reason = self._reason(seq, token)
            if reason is not None:
                seq.finish_reason = reason
                return i + 1
        return len(tokens)

    def _reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if token in params.stop_token_ids:
            return "stop"
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if params.stop and self._stop_string(seq):
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _stop_string(self, seq: Sequence) -> bool:
        """Did the text the last token added complete a stop string? Only the new text and the
        longest stop's length before it are searched (O(new tokens)): an earlier occurrence
        would have ended at an earlier token and stopped the request there."""
        if self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model was loaded without one")
        before = len(seq.detokenizer.text) if seq.detokenizer is not None else 0
        text = seq.text(self.tokenizer)
        start = max(0, before - max(len(s) for s in seq.params.stop) + 1)
        hits = [i for i in (text.find(s, start) for s in seq.params.stop) if i >= 0]
        if hits:
            seq.stop_text_len = min(hits)
        return bool(hits)
