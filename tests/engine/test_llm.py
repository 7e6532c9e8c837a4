"""The user API around the engine: generate() checks every prompt before queueing any; stream()
ends every request with a final delta, failed ones included."""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams
from specdec.drafters.base import BaseDrafter
from specdec.hookspecs import hookimpl
from specdec.tree import DraftTree

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def nothing_queued(llm: LLM) -> bool:
    eng = llm.engine
    if eng.closed:  # its pages were checked back before close() let go of them
        return not eng.has_unfinished() and eng.requests == {} and eng.samples == {}
    pool = eng.kv.pool
    return (not eng.scheduler.has_work() and eng.requests == {}
            and pool.num_free == pool.num_pages)


@pytest.mark.parametrize("case", ["too-long", "sampled-with-greedy-verifier", "not-params",
                                  "wrong-count", "empty"])
def test_one_bad_prompt_or_params_queues_nothing(tiny_llama, case):
    llm = LLM(model=str(tiny_llama), dtype="float32", max_model_len=16, verifier="greedy")
    prompts, params = [[1, 2, 3], [4, 5, 6]], [GREEDY, GREEDY]
    needle = "prompt 1"
    if case == "too-long":
        prompts[1] = list(range(1, 20))
    elif case == "sampled-with-greedy-verifier":
        params[1] = SamplingParams(temperature=0.7, max_tokens=6)
    elif case == "not-params":
        params[1], needle = {"temperature": 0}, "sampling_params must be"
    elif case == "wrong-count":
        params, needle = [GREEDY] * 3, "list of 2"
    else:
        prompts[1], needle = [], "prompt 1: prompt is empty"
    with pytest.raises(ValueError, match=needle):
        llm.generate(prompts, params)
    assert nothing_queued(llm)
    outs = llm.generate(prompts[:1], GREEDY)  # the engine is still usable
    assert len(outs[0].token_ids) == 6 and nothing_queued(llm)


def test_stream_with_a_bad_prompt_queues_nothing(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", max_model_len=16)
    with pytest.raises(ValueError, match="prompt 1"):
        next(llm.stream([[1, 2], list(range(1, 30))], GREEDY))
    assert nothing_queued(llm)


class FailsInPrefill(BaseDrafter):
    """Raises in on_verified for requests whose prompt starts with 20 once a step commits more
    than one token (a prefill chunk). It keeps no state, so it declares itself replay-safe:
    the engine may retry it request by request and fail only the request it raises for."""

    name = "fails_in_prefill"
    replay_safe = True

    def __init__(self, target, **kwargs):
        pass

    def init_state(self, request_id, prompt_token_ids):
        return prompt_token_ids[0]

    def propose(self, requests):
        return [DraftTree.chain([r.token_ids[-1]]) for r in requests]

    def on_verified(self, batch):
        for r in batch.requests:
            if r.state == 20 and r.num_committed > 1:
                raise RuntimeError("cannot index the chunk")


class Plugin:
    @hookimpl
    def specdec_drafters(self):
        return {"fails_in_prefill": FailsInPrefill}


def test_stream_yields_a_final_delta_for_a_request_failed_in_a_prefill_chunk(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float64", drafter="fails_in_prefill",
              plugins=(Plugin(),), controller_args={"budget": 1}, max_num_batched_tokens=8)
    prompts = [[1, 2, 3], [20] + list(range(30, 50))]  # the second is prefilled in chunks
    full = LLM(model=str(tiny_llama), dtype="float64").generate(prompts[:1], GREEDY)[0]
    deltas: dict[str, list] = {}
    for delta in llm.stream(prompts, GREEDY):
        deltas.setdefault(delta.request_id, []).append(delta)
    ok, failed = deltas.values()
    assert [t for d in ok for t in d.token_ids] == full.token_ids
    assert ok[-1].finished and ok[-1].finish_reason == "length"
    assert all(not d.finished for d in ok[:-1])
    (final,) = failed  # the failure is the request's only (and final) delta
    assert final.finished and final.finish_reason == "error" and final.token_ids == []
    assert "on_verified" in final.error and "cannot index the chunk" in final.error
    assert nothing_queued(llm)


def test_close_lets_another_engine_open_the_tier(tiny_llama, tmp_path):
    """The tier file's lock is held while an engine lives: a second engine on the path is
    refused, naming it and how to close the first; after close() (or a with block) it opens,
    and finds the pages the first one stored."""
    path = tmp_path / "kv.tier"
    prompt = list(range(1, 40))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    kw = dict(model=str(tiny_llama), dtype="float64", page_size=4, kv_tier_path=str(path),
              num_pages=16, max_model_len=64)
    with LLM(**kw) as first:
        want = first.generate([prompt], params)[0].token_ids
        for k in range(3):  # every page of prompt's is evicted to the tier
            first.generate([[10 * k + 50 + i % 7 for i in range(40)]], params)
        with pytest.raises(ValueError, match=r"kv\.tier.*in use.*LLM\.close\(\)"):
            LLM(**kw)
        assert len(first.engine.parts.tier) > 0
    second = LLM(**kw)
    out = second.generate([prompt], params)[0]
    assert out.token_ids == want and second.engine.parts.tier.hits > 0
    second.close()
    second.close()  # twice is fine


def _tiered(tiny_llama, tmp_path) -> LLM:
    """An engine whose second request evicts the first one's cached pages into a disk tier."""
    return LLM(model=str(tiny_llama), dtype="float32", page_size=4, num_pages=8,
               max_model_len=32, kv_tier_path=str(tmp_path / "kv.tier"))


TIERED = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
FIRST, SECOND = list(range(1, 17)), list(range(30, 50))


def test_a_step_that_raises_leaves_no_request_and_no_page(tiny_llama, tmp_path, monkeypatch):
    """A tier whose write fails mid-step (here: a full disk) fails the call, and the engine
    keeps nothing of it: the allocation that evicted changed nothing, the call's requests are
    aborted and forgotten, and the next call runs."""
    llm = _tiered(tiny_llama, tmp_path)
    llm.generate([FIRST], TIERED)

    def disk_full(key, page):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(llm.engine.parts.tier, "put", disk_full)
    with pytest.raises(OSError, match="No space left"):
        llm.generate([SECOND], TIERED)
    assert nothing_queued(llm)
    monkeypatch.undo()
    assert len(llm.generate([SECOND], TIERED)[0].token_ids) == 4 and nothing_queued(llm)
    assert llm.engine.parts.tier.stores > 0
    llm.close()


def test_a_closed_engine_refuses_new_work_and_holds_nothing(tiny_llama, tmp_path):
    """After close() (which let go of the tier's file) every public entry point says the LLM
    was closed, rather than failing inside the closed tier; a request running at close() is
    aborted and forgotten, its pages back; close() twice is fine."""
    llm = _tiered(tiny_llama, tmp_path)
    llm.generate([FIRST], TIERED)
    running = llm.stream([SECOND], TIERED)
    assert not next(running).finished  # still running when the engine closes
    assert llm.engine.parts.tier.stores > 0  # the second request evicted the first one's pages
    pool = llm.engine.kv.pool
    llm.close()
    assert nothing_queued(llm) and pool.num_free == pool.num_pages
    closed = r"this LLM was closed.*make a new one"
    with pytest.raises(RuntimeError, match=closed):
        next(running)
    calls = {"generate": lambda: llm.generate([FIRST], TIERED),
             "stream": lambda: next(llm.stream([SECOND], TIERED)),
             "add_request": lambda: llm.engine.add_request(FIRST, TIERED),
             "step": llm.engine.step}
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=closed):
            call()
        assert nothing_queued(llm), name
    llm.close()
    assert nothing_queued(llm)


@pytest.mark.parametrize("drafter", [None, "draft_model"])
def test_close_returns_the_memory_while_the_llm_is_still_referenced(tiny_llama, drafter):
    """close() lets go of the model, the drafter's, the kernels and the KV (issue 51): weak
    references to them die at close() (no cycle waits for the garbage collector: the fused
    layers hold their model weakly), with the LLM and its engine still held; what the engine
    keeps of its parts says it was closed."""
    import gc
    import weakref

    kw = {} if drafter is None else dict(drafter=drafter, drafter_args={
        "model": str(tiny_llama), "max_depth": 2})
    llm = LLM(model=str(tiny_llama), dtype="float32", max_model_len=64, **kw)
    llm.generate([[1, 2, 3]], GREEDY)
    parts = llm.engine.parts
    refs = [weakref.ref(x) for x in (parts.model, parts.kernels, llm.engine.kv.cache.tensor,
                                     *(r.model for r in parts.drafter_runners))]
    del parts
    gc.collect()
    gc.disable()  # no cycle may hold them either: they go at close(), not at a collection
    try:
        llm.close()
        assert [r() is None for r in refs] == [True] * len(refs)
    finally:
        gc.enable()
    with pytest.raises(RuntimeError, match="this LLM was closed"):
        llm.engine.model  # noqa: B018
