"""Structured output with llguidance: a request's grammar, the tokens it allows at every node of a
draft tree, and the drafts it prunes.

``GrammarCompiler`` (one per engine) turns ``StructuredOutputs`` into an llguidance grammar,
checked when the request is added (a malformed schema, regex or grammar is a ValueError naming
the field), over an ``LLTokenizer`` built once from the model's tokenizer. ``Grammar`` (one per
request) holds the matcher, advanced by the tokens the request emits. Along a draft tree it is
advanced node by node and rolled back (depth first), so each node's allowed tokens are those
after its path; the masks found while pruning are kept for the verification of the same step.

A matcher is never fed a token it does not allow (llguidance leaves a matcher in an error state
then): every token is checked against the mask first.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import numpy as np
import torch

from specdec.sampling_params import RequestError, StructuredOutputs

try:  # optional: structured output needs it, nothing else does
    import llguidance
    import llguidance.hf
    import llguidance.numpy as llg_numpy
except ImportError:  # pragma: no cover - the dev extras install it
    llguidance = None


class GrammarCompiler:
    """Compiles ``StructuredOutputs`` for one model's tokenizer (its vocabulary size may exceed
    the tokenizer's: the extra ids are never allowed)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._ll = None  # the LLTokenizer, built on first use (~0.3 s)
        self._lock = threading.Lock()  # checked from a server's threads, compiled in the engine's
        self._valid: OrderedDict[str, None] = OrderedDict()  # grammars checked lately

    def tokenizer_ll(self):
        """llguidance's view of the tokenizer (token bytes, masks)."""
        if llguidance is None:
            raise RequestError("structured_outputs", "structured_outputs needs the llguidance "
                               "package (pip install llguidance)")
        if self.tokenizer is None:
            raise RequestError("structured_outputs", "structured_outputs needs a tokenizer; "
                               "this model was loaded without one")
        with self._lock:
            if self._ll is None:
                eos = list(self.eos_token_ids) or None
                try:
                    self._ll = llguidance.hf.from_tokenizer(
                        self.tokenizer, n_vocab=self.vocab_size, eos_token=eos)
                except Exception as e:  # e.g. a word-level tokenizer: no bytes to match
                    raise RequestError("structured_outputs", "structured_outputs needs a "
                                       "tokenizer llguidance can read (a fast, byte-level "
                                       f"one); this one is not: {e}") from None
            return self._ll

    def check(self, spec: StructuredOutputs) -> str:
        """The grammar text of ``spec``; ValueError naming the field if it does not compile
        (the last 256 grammars that did are remembered: a request is checked when the server
        takes it and again when the engine adds it)."""
        ll = self.tokenizer_ll()
        field, grammar = _grammar(spec)
        with self._lock:
            if grammar in self._valid:
                self._valid.move_to_end(grammar)
                return grammar
        error = llguidance.LLMatcher.validate_grammar(grammar, ll)
        if error:
            raise RequestError(f"structured_outputs.{field}",
                               f"structured_outputs.{field} does not compile: {error}")
        with self._lock:
            self._valid[grammar] = None
            while len(self._valid) > 256:
                self._valid.popitem(last=False)
        return grammar

    def compile(self, spec: StructuredOutputs) -> Grammar:
        grammar = self.check(spec)
        matcher = llguidance.LLMatcher(self.tokenizer_ll(), grammar)
        if matcher.is_error():
            raise RequestError("structured_outputs", "structured_outputs does not compile: "
                               f"{matcher.get_error()}")
        return Grammar(matcher, self.vocab_size)


def _grammar(spec: StructuredOutputs) -> tuple[str, str]:
    """(the field given, the llguidance grammar text)."""
    defaults = {"whitespace_flexible": spec.whitespace_flexible}
    if spec.json is not None:
        schema = spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError) as e:
                raise RequestError("structured_outputs.json",
                                   f"structured_outputs.json is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise RequestError("structured_outputs.json", "structured_outputs.json must be a "
                               f"JSON schema (an object), got {type(schema).__name__}")
        return "json", llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
    if spec.json_object:
        return "json_object", llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=defaults)
    if spec.regex is not None:
        return "regex", llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.grammar is not None:
        return "grammar", llguidance.LLMatcher.grammar_from_lark(spec.grammar)
    alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
    return "choice", llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")


class Grammar:
    """One request's matcher, at the request's output so far."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self._bits = llg_numpy.allocate_token_bitmask(1, vocab_size)
        # allowed-token masks by path (token tuple after the output), found by ``prune`` for
        # this step's tree; ``allowed`` reads them; ``commit`` drops them
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}

    # ---- the request's own state ------------------------------------------------------------

    def commit(self, tokens: list[int]) -> None:
        """The request emitted ``tokens`` (each allowed: verification masked its rows)."""
        self._masks = {}
        self._advance(tokens)

    def until_complete(self, tokens: list[int]) -> int:
        """How many of ``tokens`` come up to (and with) the one after which the grammar is
        complete (all of them if it never is); the matcher is left as it was."""
        taken, complete = self._advance(tokens)
        if taken:
            self.matcher.rollback(taken)
        return taken if complete else len(tokens)

    def _advance(self, tokens: list[int]) -> tuple[int, bool]:
        """Feed ``tokens`` until the grammar is complete: (tokens fed, complete)."""
        taken = 0
        for t in tokens:
            if self.matcher.is_stopped():
                return taken, True
            if not self.matcher.consume_token(t):  # verification masked it: cannot happen
                raise RuntimeError(f"the grammar refused emitted token {t}: "
                                   f"{self.matcher.get_error()}")
            taken += 1
        return taken, self.matcher.is_stopped()

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing more (the request stops)."""
        return self.matcher.is_stopped()

    # ---- along a draft tree ------------------------------------------------------------------

    def _mask(self) -> torch.Tensor:
        """[V] bool: the tokens the matcher allows now."""
        llg_numpy.fill_next_token_bitmask(self.matcher, self._bits)
        bits = np.unpackbits(self._bits[0].view(np.uint8), bitorder="little")
        return torch.from_numpy(bits[:self.vocab_size].astype(bool))

    def prune(self, tokens: list[int], parents: list[int], sequential: bool) -> list[int]:
        """The nodes whose path the grammar allows (ascending, closed under parents), and the
        masks along them kept for ``allowed``. ``sequential``: siblings were drawn one after
        another (sampled drafts): a forbidden node drops its later siblings too."""
        self._masks = {}
        children: list[list[int]] = [[] for _ in range(len(tokens) + 1)]
        for i, p in enumerate(parents):
            children[p + 1].append(i)
        kept: list[int] = []

        def visit(node: int, path: tuple[int, ...]) -> None:
            mask = self._masks[path] = self._mask()
            for child in children[node + 1]:
                token = tokens[child]
                if not mask[token]:
                    if sequential:
                        break
                    continue
                kept.append(child)
                if not self.matcher.consume_token(token):  # allowed by the mask: cannot fail
                    raise RuntimeError(f"the grammar refused allowed token {token}: "
                                       f"{self.matcher.get_error()}")
                visit(child, (*path, token))
                self.matcher.rollback(1)

        visit(-1, ())
        return sorted(kept)

    def allowed(self, path: tuple[int, ...]) -> torch.Tensor:
        """[V] bool: the tokens allowed after the output and ``path`` (every token of it
        allowed in turn; those ``prune`` saw are read back)."""
        mask = self._masks.get(path)
        if mask is not None:
            return mask
        for n, token in enumerate(path):
            if not self.matcher.consume_token(token):
                self.matcher.rollback(n)
                raise RuntimeError(f"the grammar refused draft token {token}: "
                                   f"{self.matcher.get_error()}")
        mask = self._masks[path] = self._mask()
        if path:
            self.matcher.rollback(len(path))
        return mask
