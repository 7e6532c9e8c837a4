"""The engine stepping in one thread for many concurrent clients in others.

Clients ``submit`` requests from any thread (or event loop) and read their outputs from a
``RequestStream``: one ``StreamEvent`` per sample each time a step adds tokens, then a final one
per sample. Requests and aborts reach the engine thread through an inbox that it drains between
steps, so the engine itself is only ever touched by that thread. An abort (a client that went
away) ends the request before the next step: its pages go back at once.

``drain(timeout)`` stops taking requests and lets those in flight finish; whatever is still
running at the deadline ends with an error (a signal handler, SIGTERM's, calls ``drain_soon``:
it takes no lock). A step that raises ends the requests it ran with its error (counted in
``step_failures``); the loop goes on serving the next ones. Both, and a request that ends with
an error (a plugin that failed it: the message names the plugin and the cause), are logged on
``specdec.serving``: a client's 500 alone tells the operator nothing.

    loop = EngineLoop(llm.engine).start()   # a background thread (tests); a server calls
    stream = loop.submit(prompt_ids, SamplingParams(max_tokens=64))   # loop.run() instead
    for event in stream:                 # or `async for` inside an event loop
        print(event.text, end="")
    loop.shutdown()
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

from specdec.engine.streaming import DeltaTracker, changed
from specdec.outputs import RequestMetrics, TokenLogprob
from specdec.plugins import PluginError, Raised
from specdec.sampling_params import SamplingParams

log = logging.getLogger("specdec.serving")


class QueueFullError(RuntimeError):
    """``max_queued`` sequences already wait for a seat in the engine's batch; try later."""


class ShuttingDownError(RuntimeError):
    """The loop is draining or stopped: it takes no new requests."""


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
    logprobs: list[TokenLogprob] | None = None  # the new tokens' (SamplingParams.logprobs)
    # on a sample's first event: the prompt's ids and (SamplingParams.prompt_logprobs) their
    # log-probabilities
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


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
        self._pending = 0  # sequences submitted, not yet handed to the engine by its thread
        self._lock = threading.Lock()  # guards _pending, _closed and the order of inbox puts
        self._closed = False  # no more submissions (draining or stopped)
        self._drain_deadline: float | None = None  # time.monotonic() at which draining ends
        self._drain_asked: float | None = None  # drain_soon's timeout, for the engine thread
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ended = False  # the loop has stopped stepping (what /health reports)
        self.step_failures = 0  # steps that raised (each ended the requests it ran)
        self.last_error: str | None = None  # the latest failed step's error
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

    def drain(self, timeout: float) -> None:
        """Take no new requests (``ShuttingDownError``) and stop once the running ones have
        finished, or after ``timeout`` seconds: those still running then end with an error.
        Not from a signal handler: ``drain_soon``."""
        with self._lock:
            self._closed = True
            self._drain_deadline = time.monotonic() + timeout
        self._wake.set()

    def drain_soon(self, timeout: float) -> None:
        """``drain(timeout)`` from a signal handler: the engine thread drains before its next
        step (within 50 ms when idle). It takes no lock. A Python signal handler runs on the
        main thread between two bytecodes, and ``specdec serve`` steps the engine on the main
        thread, so the handler may run while that thread holds this loop's lock (``_drain``,
        ``_run``'s end) or its wake event's (inside ``Event.wait``): neither is reentrant, and
        waiting for it there would wait forever."""
        self._drain_asked = timeout  # one store; the engine thread reads it every turn

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    @property
    def num_waiting(self) -> int:
        """Sequences that would still wait after the engine's next admission: those queued
        for it (in the engine or in the inbox) beyond the batch's free seats. Requests in the
        inbox that a free seat will take at once do not wait."""
        scheduler = self.engine.scheduler
        free = max(0, scheduler.max_num_seqs - len(scheduler.running))
        return max(0, self._pending + len(scheduler.waiting) - free)

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               request_id: str | None = None) -> RequestStream:
        """Queue a request (ValueError for one the engine cannot run, QueueFullError when
        ``max_queued`` sequences wait for a seat, ShuttingDownError while draining); events
        arrive on the stream returned. ``request_id``: unique, default ``req-<uuid hex>``."""
        self.engine.check_request(prompt_ids, params)
        try:
            aio = asyncio.get_running_loop()
        except RuntimeError:
            aio = None
        stream = RequestStream(request_id or f"req-{uuid.uuid4().hex}", params.n, self, aio)
        with self._lock:
            if self._closed:
                raise ShuttingDownError("the server is shutting down: it takes no new requests")
            if self.num_waiting >= self.max_queued:
                raise QueueFullError(f"{self.num_waiting} sequences wait for a seat in the "
                                     f"batch (max_queued={self.max_queued})")
            self._pending += params.n
            self._inbox.put(("add", stream, list(prompt_ids), params))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    # ---- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        sent = DeltaTracker(self.engine.tokenizer)
        try:
            while not self._stop.is_set():
                if (asked := self._drain_asked) is not None:
                    self._drain_asked = None
                    self.drain(asked)
                if self._drained():
                    break
                self._drain(sent)
                if not self.engine.has_unfinished():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self._step(sent)
        finally:
            with self._lock:  # nothing is queued after this: every stream gets its end
                self._closed = True
            self._drain(sent)
            self._fail_all("the server is shutting down", sent)
            self.ended = True

    def _drained(self) -> bool:
        deadline = self._drain_deadline
        if deadline is None:
            return False
        return (not self._streams and self._inbox.empty()) or time.monotonic() >= deadline

    def _step(self, sent: DeltaTracker) -> None:
        try:
            result = self.engine.step()
        except Exception as e:  # the engine's state is unknown: end every request
            self.step_failures += 1
            self.last_error = f"engine step failed: {e!r}"
            log.error("%s; its %d requests end with this error", self.last_error,
                      len(self._streams), exc_info=e)
            if isinstance(e, PluginError):  # a plugin broke its contract: counted against it
                self.engine.faults.add([Raised.of("?", "an engine step", e)])
            self._fail_all(self.last_error, sent)
            return
        self.num_steps += 1
        self.last_stats = result.stats
        for seq in changed(result):
            self._emit(seq, sent)

    def _drain(self, sent: DeltaTracker) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "add":
                _, stream, ids, params = item
                with self._lock:
                    self._pending -= params.n
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
        first = not sent.started(seq)
        delta = sent.delta(seq)
        done = seq.is_finished
        event = StreamEvent(seq.sample_index, delta.token_ids, delta.text, done,
                            seq.finish_reason if done else None, seq.error,
                            seq.metrics() if done else None, seq.num_prompt_tokens)
        if seq.logprobs is not None:
            end = seq.num_output_tokens
            event.logprobs = seq.logprobs[end - len(delta.token_ids):end]
        if first:
            event.prompt_token_ids = list(seq.prompt_token_ids)
            if seq.prompt_logprobs is not None:
                event.prompt_logprobs = list(seq.prompt_logprobs)
        stream._put(event)
        if not done:
            return
        if seq.finish_reason == "error":
            log.error("request %s failed: %s", seq.request_id, seq.error)
        for hook in self.on_finish:
            hook(event)
        sent.forget(seq.request_id)
        self.engine.pop_finished(seq.request_id)
        if not any(s in self.engine.requests for s in self.engine.samples_of(rid)):
            del self._streams[rid]
            stream._put(None)

    def _fail_all(self, message: str, sent: DeltaTracker) -> None:
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
