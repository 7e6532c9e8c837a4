"""A request's output text grown token by token, in O(new tokens) per update.

Decoding the whole output at every step costs O(n) a step, O(n²) a request. Instead, as HF's
``TextStreamer`` and vLLM's incremental detokenizer do, each update decodes only a window: the
tokens of the last emitted chunk (``prefix``) and the new ones after them, and appends what the
window adds beyond the chunk's own text::

    ids:    ... | prefix .. read | read .. end |
    text += decode(ids[prefix:end])[len(decode(ids[prefix:read])):]

A window whose text ends in U+FFFD is held back (a multi-byte character split across tokens,
whose next byte-level token completes it), until a token completes it or ``flush`` (the request
ended) emits it as is. For byte-level BPE tokenizers without space clean-up (SmolLM2, GPT-2,
Llama 3) the result is exactly ``decode(ids)`` (tests/engine/test_detokenizer.py checks it on random
token sequences); other tokenizers may differ from a full decode at window edges, as vLLM's does.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """The text of ``ids[offset:]`` for a token list ``ids`` that only grows (e.g. a request's
    prompt + output, ``offset`` the prompt's length: no slice of the whole list is made)."""

    def __init__(self, tokenizer, offset: int = 0, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self._prefix = offset  # first token of the last emitted chunk
        self._read = offset  # tokens whose text is in self.text

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, ids: list[int]) -> str:
        """The text the tokens appended to ``ids`` since the last call add; "" while a
        character is incomplete."""
        if len(ids) <= self._read:
            return ""
        new = self._decode(ids[self._prefix:])
        if new.endswith(REPLACEMENT):
            return ""
        return self._emit(ids, new)

    def flush(self, ids: list[int]) -> str:
        """Emit whatever is held back, incomplete characters as U+FFFD (the request ended)."""
        if len(ids) <= self._read:
            return ""
        return self._emit(ids, self._decode(ids[self._prefix:]))

    def _emit(self, ids: list[int], new: str) -> str:
        delta = new[len(self._decode(ids[self._prefix:self._read])):]
        self.text += delta
        self._prefix, self._read = self._read, len(ids)
        return delta
