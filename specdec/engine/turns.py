"""One engine, many callers: ``LLM.generate`` / ``LLM.stream`` from several threads, and several
streams consumed interleaved, each receiving only its own requests' outputs.

The callers take turns with one lock. Whoever needs progress takes the lock, reads the state
of *its own* sequences, and steps the engine once if they have nothing new; a step advances
every running request (one batch), whoever stepped it. A caller never reads another's
sequences and never yields while holding the lock, so a paused stream only falls behind: on
its next turn it sends, as one delta, everything its requests produced meanwhile, and its
final delta when they finished, even if another caller's steps ran them to the end.

The caller steps in its own thread (no engine thread): a single-threaded user pays nothing,
and its OpenMP thread team stays the one of the thread that steps (see
specdec.serving.engine_loop.EngineLoop.run for what a second team costs on a small machine).

    turns = EngineTurns(engine)
    ids = turns.add([[1, 2, 3]], [SamplingParams(max_tokens=4)])
    cursor = StreamCursor(turns, ids, deltas)       # deltas: (seq, DeltaTracker) -> output
    while batch := cursor.next_batch():            # blocks: steps until one of ours moved
        ...
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from specdec.engine.sequence import Sequence
from specdec.engine.streaming import DeltaTracker

T = TypeVar("T")


class EngineTurns:
    """An engine shared by callers in any threads; every engine call goes through ``locked``
    or ``advance``."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.lock = threading.Lock()

    def add(self, token_lists: list[list[int]], params: list) -> list[str]:
        """Queue requests (already checked) in one turn: another caller's step never sees half
        of them."""
        with self.lock:
            return [self.engine.add_request(ids, p) for ids, p in zip(token_lists, params)]

    def advance(self, ready: Callable[[], T | None]) -> T:
        """Step the engine, a turn at a time, until ``ready()`` (called under the lock, before
        every step) returns something other than None; returns it."""
        while True:
            with self.lock:
                self.engine.check_open()  # closed meanwhile (another thread): say so
                got = ready()
                if got is not None:
                    return got
                assert self.engine.has_unfinished(), "a caller waits on no running request"
                self.engine.step()

    def sequences(self, ids: list[str]) -> list[Sequence]:
        """The samples of requests ``ids`` that the engine still holds (under the lock)."""
        requests = self.engine.requests
        return [requests[s] for i in ids for s in self.engine.samples_of(i) if s in requests]

    def end(self, ids: list[str]) -> None:
        """Abort what of ``ids`` still runs and forget every sample (their pages go back)."""
        with self.lock:
            if self.engine.closed:
                return
            samples = [s for i in ids for s in self.engine.samples_of(i)]
            for i in ids:
                self.engine.abort(i)
            for s in samples:
                if s in self.engine.requests and self.engine.requests[s].is_finished:
                    self.engine.pop_finished(s)


class StreamCursor:
    """What one stream has sent of its requests, and the next deltas to send."""

    def __init__(self, turns: EngineTurns, ids: list[str],
                 make_delta: Callable[[Sequence, DeltaTracker], T]) -> None:
        self.turns, self.ids, self.make_delta = turns, ids, make_delta
        self.sent = DeltaTracker(turns.engine.tokenizer)
        self.seen: dict[str, tuple[int, bool]] = {}  # sequence id -> (tokens, finished) sent

    def next_batch(self) -> list[T]:
        """The deltas of this stream's sequences that moved since the last batch (stepping the
        engine until one did); [] once every sample's final delta was sent."""
        return self.turns.advance(self._pending)

    def _pending(self) -> list[T] | None:
        out, running = [], False
        for seq in self.turns.sequences(self.ids):
            state = (seq.num_output_tokens, seq.is_finished)
            if self.seen.get(seq.request_id, (0, False)) == state:
                running |= not seq.is_finished
                continue
            self.seen[seq.request_id] = state
            out.append(self.make_delta(seq, self.sent))
            running |= not seq.is_finished
        if out:
            return out
        return None if running else []
