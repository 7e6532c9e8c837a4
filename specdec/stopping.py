"""When a request stops: EOS, stop token ids, stop strings, max_tokens, max_model_len."""

from __future__ import annotations

from specdec.sequence import Sequence


class StopChecker:
    def __init__(self, eos_token_ids: tuple[int, ...], max_model_len: int, tokenizer) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer

    def append_and_check(self, seq: Sequence, tokens: list[int]) -> int:
        """Append tokens one at a time until a stop condition fires.

        Returns how many were appended; sets seq.finish_reason when the request stops.
        """
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
