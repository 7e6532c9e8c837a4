"""One LLM, many callers (specdec/engine/turns.py): streams consumed in random interleavings,
generate() while streams pause, generate() and streams from several threads, asyncio streams.
Every request's tokens must equal its output generated alone, every sample must end with one
final delta, and nothing may be left queued or holding pages."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from specdec import LLM, SamplingParams

PROMPTS = [[1, 5, 9, 2], [3, 3, 7], [11, 4, 6, 8, 10], [2, 7, 1, 8, 2, 8], [9, 9], [4, 12, 5]]
PARAMS = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
          SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=7, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=6, ignore_eos=True)]


@pytest.fixture(scope="module", params=[None, "ngram"], ids=["plain", "ngram"])
def llm(request, tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", max_model_len=64, max_num_seqs=4,
              drafter=request.param)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def alone(llm):
    """Each (prompt, params) generated alone: what every interleaving must give."""
    return {(p, q): [list(o.token_ids) for o in llm.generate([PROMPTS[p]], PARAMS[q])[0].outputs]
            for p in range(len(PROMPTS)) for q in range(len(PARAMS))}


def idle(llm: LLM) -> bool:
    eng = llm.engine
    return (not eng.scheduler.has_work() and eng.requests == {} and eng.samples == {}
            and eng.kv.pool.num_free == eng.kv.pool.num_pages)


class Collected:
    """One stream's deltas, per request and sample: tokens, and how many final deltas came.
    A stream's requests are queued together, in order: their ids sort as its jobs."""

    def __init__(self, jobs):
        self.jobs = jobs
        self.tokens: dict[tuple[str, int], list[int]] = {}
        self.finals: dict[tuple[str, int], int] = {}

    def add(self, delta) -> None:
        (sample,) = delta.outputs
        key = (delta.request_id, sample.index)
        assert self.finals.get(key, 0) == 0, f"a delta after the final one of {key}"
        self.tokens.setdefault(key, []).extend(sample.token_ids)
        self.finals[key] = self.finals.get(key, 0) + sample.finished

    def check(self, alone) -> None:
        rids = sorted({rid for rid, _ in self.tokens}, key=int)
        assert len(rids) == len(self.jobs), (rids, self.jobs)
        for rid, job in zip(rids, self.jobs):
            for s, want in enumerate(alone[job]):
                assert self.tokens.get((rid, s)) == want, f"job {job} sample {s}"
                assert self.finals[(rid, s)] == 1, f"job {job} sample {s}: no final delta"


def start(llm, jobs):
    """A stream of several prompts; its requests are queued at the first next()."""
    prompts = [PROMPTS[p] for p, _ in jobs]
    return llm.stream(prompts, [PARAMS[q] for _, q in jobs])


@pytest.mark.parametrize("seed", range(6))
def test_streams_consumed_in_any_interleaving_get_only_their_own_tokens(llm, alone, seed):
    rng = random.Random(seed)
    jobs = [[(rng.randrange(len(PROMPTS)), rng.randrange(len(PARAMS)))
             for _ in range(rng.randint(1, 2))] for _ in range(3)]
    streams = [start(llm, j) for j in jobs]
    got = [Collected(j) for j in jobs]
    live = list(range(len(streams)))
    while live:
        k = rng.choice(live)
        if rng.random() < 0.15:  # a generate() call while every stream is paused
            p, q = rng.randrange(len(PROMPTS)), rng.randrange(len(PARAMS))
            (out,) = llm.generate([PROMPTS[p]], PARAMS[q])
            assert [list(o.token_ids) for o in out.outputs] == alone[(p, q)]
        try:
            got[k].add(next(streams[k]))
        except StopIteration:
            live.remove(k)
    for g in got:
        g.check(alone)
    assert idle(llm)


def test_a_stream_paused_while_generate_runs_it_to_the_end_still_ends(llm, alone):
    stream = start(llm, [(0, 0)])
    got = Collected([(0, 0)])
    got.add(next(stream))  # queued, and one step taken
    llm.generate([PROMPTS[1]], PARAMS[0])  # runs the paused stream's request to its end too
    for delta in stream:
        got.add(delta)
    got.check(alone)
    assert idle(llm)


def test_a_stream_closed_early_aborts_only_its_requests(llm, alone):
    a, b = start(llm, [(2, 0)]), start(llm, [(3, 1)])
    got = Collected([(3, 1)])
    next(a)
    got.add(next(b))
    a.close()
    for delta in b:
        got.add(delta)
    got.check(alone)
    assert idle(llm)


@pytest.mark.parametrize("round_", range(3))
def test_threads_calling_generate_and_stream_get_their_own_outputs(llm, alone, round_):
    errors, barrier = [], threading.Barrier(5)

    def generating(t):
        rng = random.Random(100 * round_ + t)
        barrier.wait()
        for _ in range(3):
            jobs = [(rng.randrange(len(PROMPTS)), rng.randrange(len(PARAMS)))
                    for _ in range(rng.randint(1, 3))]
            outs = llm.generate([PROMPTS[p] for p, _ in jobs], [PARAMS[q] for _, q in jobs])
            for job, out in zip(jobs, outs):
                assert [list(o.token_ids) for o in out.outputs] == alone[job], job

    def streaming():
        jobs = [(round_, 2), (5 - round_, 0)]
        got = Collected(jobs)
        barrier.wait()
        for delta in start(llm, jobs):
            got.add(delta)
        got.check(alone)

    def run(fn, *args):
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - reported below, with its thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(generating, t)) for t in range(4)]
    threads.append(threading.Thread(target=run, args=(streaming,)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a caller never returned"
    assert not errors, errors
    assert idle(llm)


def test_async_streams_run_side_by_side(llm, alone):
    async def consume(jobs):
        got = Collected(jobs)
        async for delta in llm.astream([PROMPTS[p] for p, _ in jobs],
                                       [PARAMS[q] for _, q in jobs]):
            got.add(delta)
        return got

    async def main():
        return await asyncio.gather(consume([(0, 1), (4, 2)]), consume([(1, 0)]))

    for got in asyncio.run(main()):
        got.check(alone)
    assert idle(llm)


def test_close_ends_a_paused_stream_and_later_calls_with_its_error(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", max_model_len=64)
    long = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    stream = llm.stream([PROMPTS[0]], long)
    next(stream)
    llm.close()
    with pytest.raises(RuntimeError, match="closed"):
        next(stream)
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([PROMPTS[1]], long)


def test_close_from_another_thread_ends_a_running_generate_with_its_error(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", max_model_len=256)
    raised = []

    def run():
        try:
            llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=240,
                                                      ignore_eos=True))
        except RuntimeError as e:
            raised.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    while not any(s.num_output_tokens for s in list(llm.engine.requests.values())):
        pass  # until its first token: the call is running
    llm.close()
    thread.join(60)
    assert not thread.is_alive() and len(raised) == 1 and "closed" in str(raised[0])


def test_threads_share_steps(tiny_llama):
    """Four threads' requests run as one batch (the engine's holder steps for all): far fewer
    steps than the same calls one after another."""
    llm = LLM(model=str(tiny_llama), dtype="float32", max_model_len=64, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    steps, step = [0], llm.engine.step

    def counted():
        steps[0] += 1
        return step()

    llm.engine.step = counted
    barrier = threading.Barrier(4)

    def run(p):
        barrier.wait()
        llm.generate([PROMPTS[p]], params)

    threads = [threading.Thread(target=run, args=(p,)) for p in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    together = steps[0]
    steps[0] = 0
    for p in range(4):
        llm.generate([PROMPTS[p]], params)
    assert together < 0.6 * steps[0], (together, steps[0])
    llm.close()
