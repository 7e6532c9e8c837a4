"""The engine loop: concurrent clients (threads and an event loop), streams that add up to
LLM.generate's output, aborts that free pages at once, a full queue, a failing step."""

from __future__ import annotations

import asyncio
import threading

import pytest

from specdec import LLM, SamplingParams
from specdec.serving.engine_loop import EngineLoop, QueueFullError

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


def test_bad_request_and_full_queue(llm):
    loop = EngineLoop(llm.engine, max_queued=1)  # not started: nothing leaves the queue
    with pytest.raises(ValueError, match="prompt is empty"):
        loop.submit([], GREEDY)
    loop.submit([1, 2], GREEDY)
    with pytest.raises(QueueFullError, match="max_queued=1"):
        loop.submit([1, 2], GREEDY)
    loop.start()
    loop.shutdown()


def test_a_failing_step_ends_every_request_with_its_error(llm, monkeypatch):
    def boom():
        raise RuntimeError("kaput")

    loop = EngineLoop(llm.engine).start()
    try:
        monkeypatch.setattr(llm.engine, "step", boom)
        events = list(loop.submit([1, 2, 3], GREEDY))
        assert events[-1].finished and events[-1].finish_reason == "error"
        assert "kaput" in events[-1].error and "kaput" in loop.last_error and loop.step_failures == 1
        assert llm.engine.kv.num_free_pages == llm.engine.kv.num_pages
    finally:
        loop.shutdown()
