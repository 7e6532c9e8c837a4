"""The commit stage of a step: what the target computed becomes the requests' state.

After the output stage appended each frontier request's tokens, per record:

    prefill chunk (not at the frontier)  num_computed advances by the chunk
    at the frontier, still running       the accepted nodes' KV moves into place (one batched
                                         copy for the step: KVManager.commit_all)
    at the frontier, finished            the request finishes (its KV past the accepted
                                         tokens is never read again: not moved)

then every full page below a running request's computed tokens is named for the prefix cache
(``specdec.kv.prefix``). Finishing — a stop, an abort, a failure — is here too: the request's
full pages are named, then its drafter state goes (``release_drafter``) and the scheduler frees
its pages and its seat (``unschedule``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from specdec.engine.sequence import Sequence
from specdec.engine.step import Failures, StepRequest
from specdec.kv.block_table import TableAllocator


class CommitStage:
    def __init__(self, kv: TableAllocator, page_size: int, prefix_caching: bool,
                 release_drafter: Callable[[Sequence], Failures],
                 unschedule: Callable[[Sequence], None]) -> None:
        self.kv = kv
        self.page_size = page_size
        self.prefix_caching = prefix_caching
        self.release_drafter = release_drafter
        self.unschedule = unschedule

    def commit(self, records: list[StepRequest]) -> Failures:
        """The step's computed KV kept; requests that stopped are finished (what their ending
        reported is returned)."""
        commits, failures = [], Failures()
        for rec in records:
            seq = rec.seq
            if rec.result is None:
                if not rec.at_frontier:
                    seq.num_computed += rec.num_new_tokens
                continue
            n = rec.computed_before + rec.num_new_tokens  # tokens before this step's
            accepted = rec.result.accepted
            seq.num_computed = n + len(accepted)
            if seq.finish_reason is not None:  # the accepted nodes' KV is not moved
                failures.add(self.finish(seq, final_slots=n))
            else:
                commits.append((seq.block_table, n, accepted))
        self.kv.commit_all(commits)
        if self.prefix_caching:
            for rec in records:
                if not rec.seq.is_finished:
                    self._register(rec.seq, rec.seq.num_computed)
        return failures

    def finish(self, seq: Sequence, final_slots: int | None = None) -> Failures:
        """End ``seq`` (finish_reason "abort" unless set): its full pages below
        ``final_slots`` (default: what it computed) are named, then everything is freed; what
        its drafter's release reported is returned."""
        if seq.finish_reason is None:
            seq.finish_reason = "abort"
        self._register(seq, seq.num_computed if final_slots is None else final_slots)
        failures = self.release_drafter(seq)
        self.unschedule(seq)
        seq.times.finished = time.perf_counter()
        return failures

    def _register(self, seq: Sequence, final_slots: int) -> None:
        """Name the full pages below ``final_slots`` (KV that will never be written again), so
        later requests with the same prefix reuse them (``specdec.kv.prefix``)."""
        ps = self.page_size
        full = min(final_slots // ps, len(seq.block_table.pages))
        if self.prefix_caching and full > seq.block_table.num_keyed:
            self.kv.register_full(seq.block_table, seq.keys(ps, full), final_slots)
