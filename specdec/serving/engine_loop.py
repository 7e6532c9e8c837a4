"""The engine stepping in one thread for many concurrent clients in others.

Clients ``submit`` requests from any thread (or event loop) and read their outputs from a
``RequestStream``: one ``StreamEvent`` per sample each time a step adds tokens, then a final one
per sample. Requests and aborts reach the engine thread through an inbox that it drains between
steps, so the engine itself is only ever touched by that thread. An abort (a client that went
away) ends the request before the next step: its pages go back at once.

    loop = EngineLoop(llm.engine).start()   # a background thread (tests); a server calls
    stream = loop.submit(prompt_ids, SamplingParams(max_tokens=64))   # loop.run() instead
    for event in stream:                 # or `async for` inside an event loop
        print(event.text, end="")
    loop.shutdown()
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

from specdec.outputs import RequestMetrics
from specdec.sampling_params import SamplingParams
from specdec.serving.streaming import DeltaTracker, changed


class QueueFullError(RuntimeError):
    """The loop already holds ``max_queued`` requests that have not started; try later."""


@dataclass
class StreamEvent:
    index: int  # the sample (SamplingParams.n)
    token_ids: list[int]  # new tokens
    text: str  # new text
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    metrics: RequestMetrics | None = None  # on the final event
    num_prompt_tokens: int = 0


@dataclass
class RequestStream:
    """One request's events, in order; the last event of each sample has ``finished``."""

    request_id: str
    num_samples: int
    _loop: EngineLoop = field(repr=False)
    _aio: asyncio.AbstractEventLoop | None = field(default=None, repr=False)
    _sync: queue.Queue = field(default_factory=queue.Queue, repr=False)
    _async: asyncio.Queue | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self._aio is not None:
            self._async = asyncio.Queue()

    def _put(self, event: StreamEvent | None) -> None:  # engine thread
        if self._aio is not None:
            self._aio.call_soon_threadsafe(self._async.put_nowait, event)
        else:
            self._sync.put(event)

    def abort(self) -> None:
        """End the request now (all samples); its pages go back before the next step."""
        self._loop.abort(self.request_id)

    def __iter__(self) -> Iterator[StreamEvent]:
        while (event := self._sync.get()) is not None:
            yield event

    async def __aiter__(self) -> AsyncIterator[StreamEvent]:
        assert self._async is not None, "submit from inside an event loop to iterate with async"
        while (event := await self._async.get()) is not None:
            yield event


class EngineLoop:
    """Owns an engine and steps it in a thread while it has work."""

    def __init__(self, engine, max_queued: int = 256) -> None:
        self.engine = engine
        self.max_queued = max_queued
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}  # request id -> stream (engine thread)
        self._pending = 0  # submitted, not yet admitted by the engine thread
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.error: str | None = None  # a step that raised: every request then failed with it
        # called in the engine thread with every sample's final event (aborted ones too)
        self.on_finish: list = []
        self.num_steps = 0
        self.last_stats = None  # the latest step's StepStats (controller figures, for /metrics)

    def start(self) -> EngineLoop:
        """Step in a background thread (see ``run`` for why the main thread is better)."""
        self._thread = threading.Thread(target=self.run, name="specdec-engine", daemon=True)
        self._thread.start()
        return self

    def run(self) -> None:
        """Step in the calling thread until ``shutdown`` (from another thread). Prefer the thread
        that built the engine, and run the HTTP server and clients in others: OpenMP (the
        compiled kernels' threads) keeps one thread team per calling thread, and with a second
        team alive on a 2-core machine libgomp throttles its spinning, so every parallel region
        wakes its workers from sleep (measured: 10 -> 19 ms a token for SmolLM2 stepped from a
        second thread)."""
        self._run()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def num_waiting(self) -> int:
        return self._pending + len(self.engine.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        """Queue a request (ValueError for one the engine cannot run, QueueFullError when
        ``max_queued`` requests are waiting); events arrive on the stream returned."""
        self.engine.check_request(prompt_ids, params)
        try:
            aio = asyncio.get_running_loop()
        except RuntimeError:
            aio = None
        with self._lock:
            if self.num_waiting >= self.max_queued:
                raise QueueFullError(f"{self.num_waiting} requests are waiting "
                                     f"(max_queued={self.max_queued})")
            self._pending += 1
        stream = RequestStream(f"req-{next(self._ids)}", params.n, self, aio)
        self._inbox.put(("add", stream, list(prompt_ids), params))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    # ---- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        sent = DeltaTracker(self.engine.tokenizer)
        while not self._stop.is_set():
            self._drain(sent)
            if not self.engine.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                result = self.engine.step()
            except Exception as e:  # the engine's state is unknown: end every request
                self._fail_all(f"engine step failed: {e!r}", sent)
                continue
            self.num_steps += 1
            self.last_stats = result.stats
            for seq in changed(result):
                self._emit(seq, sent)
        self._fail_all("the server is shutting down", sent)

    def _drain(self, sent: DeltaTracker) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "add":
                _, stream, ids, params = item
                with self._lock:
                    self._pending -= 1
                try:
                    self.engine.add_request(ids, params, stream.request_id)
                except ValueError as e:
                    stream._put(StreamEvent(0, [], "", True, "error", str(e)))
                    stream._put(None)
                    continue
                self._streams[stream.request_id] = stream
            else:
                rid = item[1]
                if rid in self._streams:
                    self.engine.abort(rid)
                    for sid in self.engine.samples_of(rid):
                        seq = self.engine.requests.get(sid)
                        if seq is not None:
                            self._emit(seq, sent)

    def _emit(self, seq, sent: DeltaTracker) -> None:
        rid = seq.request_id if seq.leader is None else seq.leader.request_id
        stream = self._streams.get(rid)
        if stream is None:
            return
        delta = sent.delta(seq)
        done = seq.is_finished
        event = StreamEvent(seq.sample_index, delta.token_ids, delta.text, done,
                            seq.finish_reason if done else None, seq.error,
                            seq.metrics() if done else None, seq.num_prompt_tokens)
        stream._put(event)
        if not done:
            return
        for hook in self.on_finish:
            hook(event)
        sent.forget(seq.request_id)
        self.engine.pop_finished(seq.request_id)
        if not any(s in self.engine.requests for s in self.engine.samples_of(rid)):
            del self._streams[rid]
            stream._put(None)

    def _fail_all(self, message: str, sent: DeltaTracker) -> None:
        self.error = message
        for rid in list(self._streams):
            group = self.engine.samples_of(rid)
            ended = [s for s in group if s in self.engine.requests
                     and not self.engine.requests[s].is_finished]
            self.engine.abort(rid)
            for sid in group:
                seq = self.engine.requests.get(sid)
                if seq is None:
                    continue
                if sid in ended:
                    seq.finish_reason, seq.error = "error", message
                self._emit(seq, sent)
