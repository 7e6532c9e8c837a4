"""One request's logit processing (``SamplingParams``: logit_bias, repetition / frequency /
presence penalties, min_tokens, bad_words, structured_outputs), applied to its verification rows.

A request verifying a tree of n nodes has 1 + n logits rows: row 0 decides the token after its
output, row 1 + i the token after node i. Row 1 + i is processed as plain decoding would process
the row of that position had node i's path been emitted: the penalties count the output plus the
path, min_tokens counts the path's length, bad_words and the grammar read the path's tokens. The
counts are integers and every row applies the same float operations to the same counts, so the
processed row is bitwise what plain decoding computes. Order (as vLLM): bias, then penalties,
then bans (-inf).

Example, frequency_penalty 0.5 and an output [7, 7]: row 0 gets logits[7] -= 1.0; the row after a
node 7 (path [7]) gets logits[7] -= 1.5.
"""

from __future__ import annotations

from collections import Counter

import torch

from specdec.logits.grammar import Grammar
from specdec.sampling_params import SamplingParams


class RequestLogits:
    """What ``params`` do to one request's logits; ``commit`` keeps it at the request's output.

    bad_words: token-id sequences (the tokenizer's, with and without a leading space: LLM does
    that); ban_ids: EOS and stop token ids, banned while fewer than min_tokens are out."""

    def __init__(self, params: SamplingParams, prompt: list[int], ban_ids: tuple[int, ...],
                 bad_words: list[list[int]], grammar: Grammar | None) -> None:
        self.params = params
        self.grammar = grammar
        self.bad_words = [w for w in bad_words if w]
        self.ban_ids = sorted(set(ban_ids) | set(params.stop_token_ids))
        self.counts: Counter[int] = Counter()  # output token -> times emitted
        self.seen = set(prompt) if params.repetition_penalty != 1.0 else set()
        self.output: list[int] = []  # the output so far (bad_words read its end)
        bias = params.logit_bias or {}
        self._bias = (torch.tensor(list(bias), dtype=torch.int64),
                      torch.tensor([float(v) for v in bias.values()], dtype=torch.float64))

    def commit(self, tokens: list[int]) -> None:
        """The request emitted ``tokens``."""
        self.counts.update(tokens)
        self.output.extend(tokens)
        if self.params.repetition_penalty != 1.0:
            self.seen.update(tokens)
        if self.grammar is not None:
            self.grammar.commit(tokens)

    def until_complete(self, tokens: list[int]) -> int:
        """How many of ``tokens`` the request takes: up to the one completing its grammar."""
        return len(tokens) if self.grammar is None else self.grammar.until_complete(tokens)

    @property
    def stopped(self) -> bool:
        """The grammar is complete: nothing may follow."""
        return self.grammar is not None and self.grammar.stopped

    # ---- draft trees -------------------------------------------------------------------------

    def prune(self, tokens: list[int], parents: list[int], sequential: bool) -> list[int] | None:
        """The draft nodes worth verifying: those whose path the grammar allows (None: all)."""
        if self.grammar is None:
            return None
        return self.grammar.prune(tokens, parents, sequential)

    def process(self, rows: torch.Tensor, tokens: list[int], parents: list[int]) -> None:
        """Process ``rows`` [1 + n, V] in place: row 0 after the output, row 1 + i after the
        path to node i of the tree (``tokens``, ``parents``)."""
        paths: list[tuple[int, ...]] = [()]
        for t, p in zip(tokens, parents):
            paths.append((*paths[p + 1], t))
        for row, path in zip(rows, paths):
            self._row(row, path)

    def _row(self, row: torch.Tensor, path: tuple[int, ...]) -> None:
        p = self.params
        ids, values = self._bias
        if ids.numel():
            row[ids.to(row.device)] += values.to(row.device, row.dtype)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(self.seen.union(path)), dtype=torch.int64,
                                device=row.device)
            if seen.numel():
                x = row[seen]
                row[seen] = torch.where(x > 0, x / p.repetition_penalty,
                                        x * p.repetition_penalty)
        if p.frequency_penalty or p.presence_penalty:
            counts = self.counts + Counter(path) if path else self.counts
            if counts:
                out = torch.tensor(list(counts), dtype=torch.int64, device=row.device)
                penalty = torch.tensor([p.frequency_penalty * c + p.presence_penalty
                                        for c in counts.values()], dtype=torch.float64)
                row[out] -= penalty.to(row.device, row.dtype)
        banned = self._banned(path)
        if banned:
            row[torch.tensor(banned, dtype=torch.int64, device=row.device)] = float("-inf")
        if self.grammar is not None:
            row.masked_fill_(~self.grammar.allowed(path).to(row.device), float("-inf"))

    def _banned(self, path: tuple[int, ...]) -> list[int]:
        """Token ids banned after the output and ``path``."""
        out = []
        if len(self.output) + len(path) < self.params.min_tokens:
            out.extend(self.ban_ids)
        if self.bad_words:
            tail = None
            for word in self.bad_words:
                if len(word) == 1:
                    out.append(word[0])
                    continue
                if tail is None:  # the last tokens of output + path, as long as any word needs
                    need = max(len(w) for w in self.bad_words) - 1
                    tail = (self.output[-need:] + list(path))[-need:]
                prefix = word[:-1]
                if len(tail) >= len(prefix) and tail[len(tail) - len(prefix):] == prefix:
                    out.append(word[-1])
        return out
