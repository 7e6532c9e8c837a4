"""Finished requests' tokens for the suffix drafter, one corpus per ``cache_salt``, bounded.

Every finished request (prompt + output) is one document in the corpus of its salt (None is a
salt of its own): a request drafts only from its own salt's corpus, so tenants never see each
other's text. All salts together keep at most ``max_tokens`` tokens: above that the least
recently used documents go (used = added, or among the latest 32 occurrences a draft came
from).
A removed document is blanked at once and its memory is given back when blanks outnumber the
salt's live tokens (compaction), so memory stays within a small multiple of the bound
(``memory_bytes``: about 12 bytes per kept token, at most twice that before a compaction).
"""

from __future__ import annotations

import bisect
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from specdec.drafters.suffix_corpus import TokenCorpus
from specdec.drafters.suffix_speculate import Draft, SpeculateParams, speculate

logger = logging.getLogger("specdec")


@dataclass
class _Doc:
    salt: str | None
    start: int  # in its salt's corpus
    length: int
    request_id: str


@dataclass
class _Namespace:
    """One salt's corpus and its documents in corpus order (removed ones until compaction)."""

    corpus: TokenCorpus = field(default_factory=TokenCorpus)
    ids: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    tokens: int = 0  # live tokens

    def doc_ids_at(self, positions: np.ndarray) -> list[int]:
        """The documents holding ``positions`` (increasing), each once."""
        out, last = [], -1
        for p in positions.tolist():  # at most TOUCHED: bisect beats numpy's call overhead
            i = bisect.bisect_right(self.starts, p) - 1
            if i != last:
                out.append(self.ids[i])
                last = i
        return out


class SuffixHistory:
    """Documents per salt, at most ``max_tokens`` tokens in all, least recently used first out."""

    def __init__(self, max_tokens: int, speculate=speculate) -> None:
        assert max_tokens >= 1
        self.max_tokens = max_tokens
        self.speculate = speculate  # suffix_speculate.speculate or its compiled twin
        self.spaces: dict[str | None, _Namespace] = {}
        self.docs: OrderedDict[int, _Doc] = OrderedDict()  # least recently used first
        self.by_request: dict[str, int] = {}  # request id -> its document
        self.tokens = 0
        self.evicted = 0  # documents removed to keep the bound
        self._next_id = 0
        self._said_full = False

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the corpora and their indexes (the documents' bookkeeping aside)."""
        return sum(ns.corpus.nbytes + 8 * len(ns.starts) for ns in self.spaces.values())

    def stats(self) -> dict:
        return {"salts": len(self.spaces), "documents": len(self.docs), "tokens": self.tokens,
                "max_tokens": self.max_tokens, "evicted_documents": self.evicted,
                "memory_bytes": self.memory_bytes}

    def add(self, salt: str | None, request_id: str, tokens: list[int]) -> None:
        """File a finished request's tokens under ``salt`` (replacing the request's earlier
        document, if any); a document longer than the bound keeps its last ``max_tokens``."""
        self.forget(request_id)
        tokens = tokens[-self.max_tokens:]
        if not tokens:
            return
        self._make_room(len(tokens))
        ns = self.spaces.setdefault(salt, _Namespace())
        doc_id, self._next_id = self._next_id, self._next_id + 1
        self.docs[doc_id] = _Doc(salt, ns.corpus.n, len(tokens), request_id)
        self.by_request[request_id] = doc_id
        ns.ids.append(doc_id)
        ns.starts.append(ns.corpus.n)
        ns.corpus.append(tokens)
        ns.corpus.end_document()
        ns.tokens += len(tokens)
        self.tokens += len(tokens)

    def forget(self, request_id: str) -> None:
        """Drop the request's document (a preempted request restarting: its text comes back
        whole when it ends)."""
        doc_id = self.by_request.get(request_id)
        if doc_id is not None:
            self._remove(doc_id)

    def draft(self, salt: str | None, pattern: np.ndarray, max_nodes: int, max_depth: int,
              params: SpeculateParams) -> Draft | None:
        """The best draft from ``salt``'s documents alone; marks the documents it used."""
        ns = self.spaces.get(salt)
        if ns is None:
            return None
        draft = self.speculate(ns.corpus, pattern, ns.corpus.n, max_nodes, max_depth, params)
        if draft is not None:  # its latest occurrences' documents (suffix_speculate.TOUCHED)
            for doc_id in ns.doc_ids_at(draft.ends):
                if doc_id in self.docs:
                    self.docs.move_to_end(doc_id)
        return draft

    def _make_room(self, needed: int) -> None:
        if self.tokens + needed > self.max_tokens and not self._said_full:
            self._said_full = True
            logger.info("suffix drafter: history full (%d tokens kept, bound %d, %.1f MB); "
                        "evicting least recently used requests", self.tokens, self.max_tokens,
                        self.memory_bytes / 2**20)
        while self.docs and self.tokens + needed > self.max_tokens:
            self._remove(next(iter(self.docs)))
            self.evicted += 1

    def _remove(self, doc_id: int) -> None:
        doc = self.docs.pop(doc_id)
        if self.by_request.get(doc.request_id) == doc_id:
            del self.by_request[doc.request_id]
        ns = self.spaces[doc.salt]
        ns.corpus.remove(doc.start, doc.length)
        ns.tokens -= doc.length
        self.tokens -= doc.length
        if not ns.tokens:
            del self.spaces[doc.salt]
        elif ns.corpus.dead > ns.tokens:
            self._compact(ns)

    def _compact(self, ns: _Namespace) -> None:
        live = [i for i in ns.ids if i in self.docs]
        ns.corpus, starts = ns.corpus.compacted([(self.docs[i].start, self.docs[i].length)
                                                 for i in live])
        for i, start in zip(live, starts):
            self.docs[i].start = start
        ns.ids, ns.starts = live, starts
