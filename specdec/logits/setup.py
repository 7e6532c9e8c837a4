"""An engine's logit processing set-up: checks a request's options against the model and makes
its ``RequestLogits`` (one per sample: each has its own output and grammar state)."""

from __future__ import annotations

from specdec.logits.grammar import GrammarCompiler
from specdec.logits.processors import RequestLogits
from specdec.sampling_params import RequestError, SamplingParams


class LogitsSetup:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.grammars = GrammarCompiler(tokenizer, vocab_size, self.eos_token_ids)

    def check(self, params: SamplingParams) -> None:
        """RequestError naming the field for options this model cannot honour (nothing is
        made)."""
        for token in params.logit_bias or {}:
            if token >= self.vocab_size:
                raise RequestError(f"logit_bias.{token}", f"logit_bias names token {token}; "
                                   f"this model's token ids are [0, {self.vocab_size})")
        if params.bad_words and self.tokenizer is None:
            raise RequestError("bad_words",
                               "bad_words needs a tokenizer; this model was loaded without one")
        if params.structured_outputs is not None:
            self.grammars.check(params.structured_outputs)

    def token_bytes(self, token_ids: list[int]) -> list[bytes]:
        """Each token's bytes (a byte-level token may hold part of a UTF-8 character)."""
        try:
            ll = self.grammars.tokenizer_ll()
        except ValueError:  # a tokenizer llguidance cannot read: its own decoding
            return [self.tokenizer.decode([t]).encode() for t in token_ids]
        return [ll.decode_bytes([t]) for t in token_ids]

    def make(self, params: SamplingParams, prompt: list[int]) -> RequestLogits | None:
        """The request's processing (None when its options change nothing); compiles its
        grammar (ValueError naming the field if it does not)."""
        if not params.processes_logits:
            return None
        grammar = (self.grammars.compile(params.structured_outputs)
                   if params.structured_outputs is not None else None)
        return RequestLogits(params, prompt, () if params.ignore_eos else self.eos_token_ids,
                             self._bad_words(params.bad_words), grammar)

    def _bad_words(self, words: list[str]) -> list[list[int]]:
        """Each word's token ids at the start of a text and after a space (as vLLM)."""
        out: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = list(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in out:
                    out.append(ids)
        return out
