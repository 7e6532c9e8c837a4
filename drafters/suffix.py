"""Suffix decoding (SuffixDecoding, arXiv 2411.04975; vLLM's ``suffix`` method): draft the most
frequent continuations of the longest matching suffix, from the request's own tokens and from
earlier requests' prompts and responses.

Two corpora are searched each step and the better-scoring draft wins (the request's own on a
tie), as ArcticInference's ``SuffixDecodingCache.speculate`` does with its local and global
trees: the request's prompt + output (``TokenCorpus`` on its state), and the history of finished
requests of the same ``cache_salt`` (``SuffixHistory``, shared by the engine's requests,
bounded by ``max_history_tokens`` and evicted least recently used first). A request's text
joins the history when it ends (``release``), so a request never drafts from another request
still in flight, and never from another salt's text. Drafts are trees of the corpus'
most probable continuations (``suffix_speculate``); they are deterministic (no draft_probs:
the sampling verifier's q = 1 rule, lossless), their path probabilities go in ``path_probs``.

Options (``drafter_args``), defaults as vLLM's ``suffix_decoding_*`` where it has them:

- ``max_depth`` (24): the longest suffix matched, and the deepest draft. (In a suffix tree cut
  at depth D, a match of m tokens leaves D - m for the draft; here the two are apart.)
- ``max_spec_factor`` (1.0), ``max_spec_offset`` (-1.0; vLLM: 0): at most
  floor(m * factor + offset) nodes after an m-token match, within the controller's budget. The
  offset -1 drafts nothing after a 1-token match: on MT-Bench such drafts were accepted so
  rarely that the goodput controller kept the drafter off (tau 1.09 against 1.27 with -1, q8,
  docs/benchmarks.md), as ngram's ``min_ngram`` 2 does.
- ``min_token_prob`` (0.1): no node whose corpus probability given the match is below it.
- ``max_history_tokens`` (1,000,000, all salts together; about 12 MB): the history's bound.
- ``max_candidates`` (4096): the latest occurrences of the last token looked at per corpus.
- ``tree`` (True): a tree of the most probable nodes; False: the single most frequent path.
- ``native`` (None): draft with the compiled speculation (specdec/native/suffix.c) when it is
  built (None), always (True: an error when it is not), or never (False: numpy, the oracle).
  Both give identical drafts.

What it holds is in ``stats()`` (and ``memory_bytes``); the log says when the history first
fills. A request id that starts again (preemption) takes its unfinished text out of the
history; it comes back whole when the request ends.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from specdec.drafters import suffix_native, suffix_speculate
from specdec.drafters.base import BaseDrafter, DraftRequest, TargetInfo, TokenView, VerifiedBatch
from specdec.drafters.suffix_corpus import TokenCorpus
from specdec.drafters.suffix_history import SuffixHistory
from specdec.drafters.suffix_speculate import SpeculateParams
from specdec.tree import DraftTree

logger = logging.getLogger("specdec")

_UNKNOWN = object()  # a request's salt before its first propose


@dataclass
class SuffixState:
    """One request's corpus; it lives on the request (``Sequence.drafter_state``)."""

    request_id: str
    corpus: TokenCorpus  # the request's tokens heard so far (prompt + output)
    view: TokenView | None = None  # its live token list, read once more when it ends
    salt: object = _UNKNOWN  # its cache_salt (str or None), from its first propose


class SuffixDrafter(BaseDrafter):
    """Suffix decoding over the request and the finished requests of its salt (module doc)."""

    name = "suffix"
    # propose / on_verified only extend the request's corpus past what it holds and read it; a
    # second call finds nothing new (marking history documents used twice is harmless)
    replay_safe = True
    prefix_cache_safe = True  # the corpus is built from token_ids, cached or not

    def __init__(self, target: TargetInfo, max_depth: int = 24, max_spec_factor: float = 1.0,
                 max_spec_offset: float = -1.0, min_token_prob: float = 0.1,
                 max_history_tokens: int = 1_000_000, max_candidates: int = 4096,
                 tree: bool = True, native: bool | None = None) -> None:
        _check_int("max_depth", max_depth, 1)
        _check_int("max_history_tokens", max_history_tokens, 1)
        _check_int("max_candidates", max_candidates, 1)
        _check_float("max_spec_factor", max_spec_factor, 0.0, None)
        _check_float("max_spec_offset", max_spec_offset, None, None)
        _check_float("min_token_prob", min_token_prob, 0.0, 1.0)
        if not isinstance(tree, bool):
            raise ValueError(f"suffix drafter_args.tree must be a bool, got {tree!r}")
        self.speculate = _speculate_fn(native)
        self.target = target
        self.max_depth = max_depth
        self.params = SpeculateParams(float(max_spec_factor), float(max_spec_offset),
                                      float(min_token_prob), max_candidates, tree)
        self.history = SuffixHistory(max_history_tokens, self.speculate)
        logger.info("suffix drafter: history of at most %d tokens per engine (all cache salts; "
                    "about %.0f MB)", max_history_tokens, 12 * max_history_tokens / 2**20)

    @property
    def memory_bytes(self) -> int:
        """Bytes the shared history holds (each request's own corpus lives on its state)."""
        return self.history.memory_bytes

    def stats(self) -> dict:
        return self.history.stats()

    def init_state(self, request_id: str, prompt_token_ids: list[int]) -> SuffixState:
        self.history.forget(request_id)  # a preempted request restarting (module doc)
        return SuffixState(request_id, TokenCorpus())

    def on_verified(self, batch: VerifiedBatch) -> None:
        for r in batch.requests:
            _extend(r.state, r.token_ids)

    def release(self, state: SuffixState) -> None:
        if state.salt is not _UNKNOWN and state.view is not None:
            self.history.add(state.salt, state.request_id, state.view.tolist())
        state.view, state.corpus = None, TokenCorpus(1)

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        return [self._propose_one(r) for r in requests]

    def _propose_one(self, request: DraftRequest) -> DraftTree:
        state = request.state
        state.view, state.salt = request.token_ids, request.params.cache_salt
        _extend(state, request.token_ids)
        corpus, budget = state.corpus, request.budget
        pattern = corpus.buf[max(0, corpus.n - self.max_depth) : corpus.n]  # a view: read now
        depth = min(self.max_depth, budget.depth_limit)
        own = self.speculate(corpus, pattern, corpus.n - 1, budget.max_nodes, depth, self.params)
        shared = self.history.draft(state.salt, pattern, budget.max_nodes, depth, self.params)
        best = own if shared is None or (own is not None and own.score >= shared.score) \
            else shared
        if best is None:
            return DraftTree.empty()
        return DraftTree(torch.from_numpy(best.tokens), torch.from_numpy(best.parents),
                         path_probs=torch.from_numpy(best.probs))


def _extend(state: SuffixState, tokens: TokenView) -> None:
    """Append the tokens the request's corpus has not seen yet."""
    n = state.corpus.n
    assert len(tokens) >= n, "token lists only grow; a new request needs init_state"
    if len(tokens) > n:
        state.corpus.append(tokens[n:])


def _speculate_fn(native):
    """suffix_native.speculate or suffix_speculate.speculate, as ``native`` asks."""
    if native is not None and not isinstance(native, bool):
        raise ValueError(f"suffix drafter_args.native must be a bool or None, got {native!r}")
    if native is False:
        return suffix_speculate.speculate
    if suffix_native.load() is not None:
        return suffix_native.Speculate()
    if native:
        raise ValueError("suffix drafter_args.native is true but specdec's compiled kernels "
                         "have no suffix speculation (installed with SPECDEC_NO_NATIVE=1, or "
                         "built before it: pip install -e .); use native=false or leave it unset")
    return suffix_speculate.speculate


def _check_int(name: str, value, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"suffix drafter_args.{name} must be an int >= {low}, got {value!r}")


def _check_float(name: str, value, low: float | None, high: float | None) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value)
    if ok and ((low is not None and value < low) or (high is not None and value > high)):
        ok = False
    if not ok:
        bounds = " and ".join(b for b in (f">= {low}" if low is not None else "",
                                          f"<= {high}" if high is not None else "") if b)
        raise ValueError(f"suffix drafter_args.{name} must be a finite number"
                         f"{' ' + bounds if bounds else ''}, got {value!r}")
