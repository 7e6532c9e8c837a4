"""The engine loop: concurrent clients (threads and an event loop), streams that add up to
LLM.generate's output, aborts that free pages at once, a queue limit on what waits for a seat,
a failing step (the loop goes on), draining (running requests finish or time out), SIGTERM
while the main thread holds one of the loop's locks."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from contextlib import contextmanager

import pytest

from specdec import LLM, SamplingParams
from specdec.cli.serve import drain_on_sigterm
from specdec.serving.engine_loop import EngineLoop, QueueFullError, ShuttingDownError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], [3]]


@pytest.fixture()
def llm(tiny_llama) -> LLM:
    return LLM(model=str(tiny_llama), dtype="float64", page_size=4)


def _tokens(stream) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    finished = set()
    for ev in stream:
        assert ev.index not in finished, "an event after a sample's final one"
        out.setdefault(ev.index, []).extend(ev.token_ids)
        if ev.finished:
            finished.add(ev.index)
            assert ev.metrics is not None and ev.finish_reason == "length"
    assert finished == set(out)
    return out


def test_concurrent_threads_get_exactly_generates_tokens(llm):
    want = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    loop = EngineLoop(llm.engine).start()
    try:
        got: list = [None] * len(PROMPTS)

        def client(i):
            got[i] = _tokens(loop.submit(PROMPTS[i], GREEDY))[0]

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert got == want
        assert loop.num_steps > 0 and not llm.engine.requests
        assert llm.engine.kv.num_free_pages == llm.engine.kv.num_pages
    finally:
        loop.shutdown()


def test_async_clients_n_samples_and_an_abort_mid_stream(llm):
    loop = EngineLoop(llm.engine).start()

    async def main():
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        doomed = loop.submit([1, 2, 3], long)
        two = loop.submit([4, 5, 6], SamplingParams(temperature=1.0, n=2, seed=3,
                                                    max_tokens=10, ignore_eos=True))
        seen = 0
        async for ev in doomed:
            seen += len(ev.token_ids)
            if seen >= 3 and not ev.finished:
                doomed.abort()
            if ev.finished:
                assert ev.finish_reason == "abort"
        samples: dict[int, int] = {}
        async for ev in two:
            samples[ev.index] = samples.get(ev.index, 0) + len(ev.token_ids)
        return seen, samples

    try:
        seen, samples = asyncio.run(main())
        assert 3 <= seen < 200 and samples == {0: 10, 1: 10}
        assert llm.engine.kv.num_free_pages == llm.engine.kv.num_pages
        assert not llm.engine.requests and not llm.engine.samples
    finally:
        loop.shutdown()


def test_the_queue_limit_counts_what_waits_for_a_seat(tiny_llama):
    """Requests that free seats of the batch will take at once do not wait (a burst of 40 with
    32 seats free is not 38 x 503); a request's n samples are n sequences."""
    llm = LLM(model=str(tiny_llama), dtype="float64", page_size=4, max_num_seqs=3)
    loop = EngineLoop(llm.engine, max_queued=2)  # not started: nothing leaves the inbox
    with pytest.raises(ValueError, match="prompt is empty"):
        loop.submit([], GREEDY)
    for _ in range(3):
        loop.submit([1, 2], GREEDY)
    assert loop.num_waiting == 0  # three seats, three requests: none waits
    loop.submit([1, 2], SamplingParams(temperature=0, n=2, max_tokens=2))
    assert loop.num_waiting == 2
    with pytest.raises(QueueFullError, match="max_queued=2"):
        loop.submit([1, 2], GREEDY)
    loop.start()
    loop.shutdown()


def test_a_failing_step_ends_its_requests_and_the_loop_goes_on(llm, monkeypatch):
    real, failed = llm.engine.step, []

    def fails_once():
        if not failed:
            failed.append(True)
            raise RuntimeError("kaput")
        return real()

    loop = EngineLoop(llm.engine).start()
    try:
        monkeypatch.setattr(llm.engine, "step", fails_once)
        events = list(loop.submit([1, 2, 3], GREEDY))
        assert events[-1].finished and events[-1].finish_reason == "error"
        assert "kaput" in events[-1].error and "kaput" in loop.last_error
        assert llm.engine.kv.num_free_pages == llm.engine.kv.num_pages
        assert _tokens(loop.submit([1, 2, 3], GREEDY))[0]  # the next request runs
        assert loop.step_failures == 1 and not loop.ended
    finally:
        loop.shutdown()


def _slow(monkeypatch, engine, seconds: float) -> None:
    real = engine.step

    def step():
        time.sleep(seconds)
        return real()

    monkeypatch.setattr(engine, "step", step)


def test_drain_refuses_new_requests_and_lets_running_ones_finish(llm, monkeypatch):
    _slow(monkeypatch, llm.engine, 0.01)
    loop = EngineLoop(llm.engine).start()
    try:
        stream = loop.submit([1, 2, 3], GREEDY)
        loop.drain(timeout=60)
        with pytest.raises(ShuttingDownError):
            loop.submit([1, 2, 3], GREEDY)
        assert len(_tokens(stream)[0]) == GREEDY.max_tokens  # finished: "length"
        loop._thread.join(10)
        assert loop.ended and llm.engine.kv.num_free_pages == llm.engine.kv.num_pages
    finally:
        loop.shutdown()


def test_drain_ends_what_outlasts_its_timeout(llm, monkeypatch):
    _slow(monkeypatch, llm.engine, 0.02)
    loop = EngineLoop(llm.engine).start()
    try:
        stream = loop.submit([1, 2, 3], SamplingParams(temperature=0, max_tokens=400,
                                                       ignore_eos=True))
        t0 = time.perf_counter()
        loop.drain(timeout=0.3)
        events = list(stream)
        assert time.perf_counter() - t0 < 5
        assert events[-1].finish_reason == "error" and "shutting down" in events[-1].error
        assert sum(len(e.token_ids) for e in events) < 400
        loop._thread.join(10)
        assert loop.ended and llm.engine.kv.num_free_pages == llm.engine.kv.num_pages
    finally:
        loop.shutdown()


@contextmanager
def _held(lock, seconds: float = 3.0):
    """Hold ``lock`` in this thread for the block; yields a list that is non-empty when the
    block deadlocked on it: a watchdog thread then released the lock after ``seconds`` (a
    plain Lock may be released by any thread), so the test fails instead of hanging."""
    lock.acquire()
    done, broke = threading.Event(), []

    def watchdog():
        if not done.wait(seconds):
            broke.append(True)
            lock.release()

    guard = threading.Thread(target=watchdog, daemon=True)
    guard.start()
    try:
        yield broke
    finally:
        done.set()
        guard.join()
        if not broke:
            lock.release()


@pytest.mark.parametrize("lock", ["the loop's lock", "its wake event's lock"])
def test_sigterm_while_the_main_thread_holds_a_loop_lock_drains(llm, lock):
    """``specdec serve`` steps the engine on the main thread, where Python runs signal
    handlers, between two bytecodes: SIGTERM may come while that thread holds the loop's lock
    (``_drain``, ``_run``'s end) or its wake event's (inside ``Event.wait``, 20 times a second
    when idle). Neither is reentrant: a handler that waits for one waits forever."""
    loop = EngineLoop(llm.engine)
    # CPython's Event keeps a Condition over a plain Lock: what Event.wait holds between waits
    held = loop._lock if lock == "the loop's lock" else loop._wake._cond
    previous = signal.getsignal(signal.SIGTERM)
    try:
        drain_on_sigterm(loop, timeout=30.0)  # what `specdec serve` installs
        with _held(held) as broke:
            signal.raise_signal(signal.SIGTERM)  # its handler runs here, the lock held
        assert not broke, f"the SIGTERM handler deadlocked on {lock}"
    finally:
        signal.signal(signal.SIGTERM, previous)
    t0 = time.monotonic()
    loop.run()  # drains on its first turn: nothing in flight, so it ends at once
    assert loop.ended and loop.draining and time.monotonic() - t0 < 5
    with pytest.raises(ShuttingDownError):
        loop.submit([1, 2, 3], GREEDY)
