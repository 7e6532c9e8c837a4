"""One engine, many callers: ``LLM.generate`` / ``LLM.stream`` from several threads, and several
streams consumed interleaved, each receiving only its own requests' outputs.

Every use of the engine is a job: queue requests, end them, or wait until the caller's own
requests have something for it (``ready()``, which reads only that caller's sequences). One
caller at a time holds the engine and serves every job queued: it runs each, and steps the
engine while its own job waits; a step advances every running request (one batch), whoever
queued it, and after each step every waiting job is checked and the callers whose jobs are done
are woken with their results. When the holder's own job is done it hands the engine to a caller
still waiting, which goes on stepping in its thread. So threads' requests share steps as one
call's would, the engine steps in one thread for long runs (its OpenMP thread team stays the
one of the thread that steps: specdec.serving.engine_loop.EngineLoop.run says what switching
costs on a small machine), and a single-threaded caller holds the engine itself and pays
nothing. A paused stream only falls behind: on its next turn it sends, as one delta, everything
its requests produced meanwhile, and its final delta when they finished, even if another
caller's steps ran them to the end.

    turns = EngineTurns(engine)
    ids = turns.call(lambda: [engine.add_request([1, 2, 3], SamplingParams(max_tokens=4))])
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


class _Job:
    """A caller's use of the engine: ``run()`` returns its result, or None to wait a step."""

    def __init__(self, run: Callable[[], object | None]) -> None:
        self.run = run
        self.woken = threading.Event()
        self.done = False
        self.result: object | None = None
        self.error: BaseException | None = None

    def attempt(self) -> None:
        """Run once (by the engine's holder); done when it returns a result or raises."""
        try:
            result = self.run()
        except BaseException as e:  # noqa: BLE001 - handed to the caller, raised there
            self.finish(error=e)
            return
        if result is not None:
            self.finish(result)

    def finish(self, result: object | None = None, error: BaseException | None = None) -> None:
        self.result, self.error, self.done = result, error, True
        self.woken.set()


class EngineTurns:
    """An engine shared by callers in any threads: every engine call goes through ``call``
    (once) or ``advance`` (until ready)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()  # guards _jobs and _holder (never held during a step)
        self._jobs: list[_Job] = []
        self._holder: _Job | None = None  # the job whose caller holds the engine

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` with the engine held, after the step in progress (if any)."""
        return self.advance(lambda: (fn(),))[0]

    def advance(self, ready: Callable[[], T | None]) -> T:
        """Step the engine (or let the caller holding it step it) until ``ready()``, called with
        the engine held before every step, returns something other than None; returns it."""
        job = _Job(ready)
        with self._lock:
            self._jobs.append(job)
            if self._holder is None:
                self._holder = job
        while not job.done:
            if self._holder is job:
                self._serve(job)
            else:
                job.woken.wait()  # its result, or the engine handed over
                job.woken.clear()
        if job.error is not None:
            raise job.error
        return job.result

    def _serve(self, own: _Job) -> None:
        """Hold the engine: run every queued job, step while ``own`` waits; then hand over."""
        try:
            while True:
                with self._lock:
                    waiting = [j for j in self._jobs if not j.done]
                for job in waiting:
                    job.attempt()
                if not own.done and not self.engine.has_unfinished():
                    own.attempt()  # a job after it ended the work (close, abort): once more
                if own.done:
                    return
                assert self.engine.has_unfinished(), "a caller waits on no running request"
                self.engine.step()
        except BaseException as e:  # a step raised: the holder's call ends with it
            own.finish(error=e)
        finally:
            with self._lock:
                self._jobs = [j for j in self._jobs if not j.done]
                self._holder = self._jobs[0] if self._jobs else None
                if self._holder is not None:
                    self._holder.woken.set()  # its caller wakes holding the engine

    def sequences(self, ids: list[str]) -> list[Sequence]:
        """The samples of requests ``ids`` that the engine still holds (engine held)."""
        requests = self.engine.requests
        return [requests[s] for i in ids for s in self.engine.samples_of(i) if s in requests]

    def end(self, ids: list[str]) -> None:
        """Abort what of ``ids`` still runs and forget every sample (their pages go back)."""
        self.call(lambda: self._end(ids))

    def _end(self, ids: list[str]) -> None:
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
        self.turns.engine.check_open()  # closed meanwhile (another thread): say so
        out, running = [], False
        for seq in self.turns.sequences(self.ids):
            state = (seq.num_output_tokens, seq.is_finished)
            running |= not seq.is_finished
            if self.seen.get(seq.request_id, (0, False)) != state:
                self.seen[seq.request_id] = state
                out.append(self.make_delta(seq, self.sent))
        if out:
            return out
        return None if running else []
