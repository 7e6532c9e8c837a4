"""Engine vs HF transformers generate; scheduling paths (chunking, preemption, abort); bad input."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.hookspecs import hookimpl

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 50)), [42] * 13, [3, 1, 4, 1, 5, 9, 2, 6]]


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(request):
    """The tiny-model tests on one torch thread (as ``one_torch_thread`` does for whole modules:
    on two busy cores each tiny op waits on an OpenMP barrier); the SmolLM2 tests (``slow``)
    keep every thread, their matmuls are big enough to share."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def hf_tiny(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float64)


def hf_greedy(hf, prompt, n):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def pages_all_free(llm: LLM) -> bool:
    pool = llm.engine.kv.pool
    return pool.num_free == pool.num_pages


def test_batch_greedy_matches_hf(tiny_llama, hf_tiny):
    llm = LLM(model=str(tiny_llama), dtype="float64")
    outs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(hf_tiny, prompt, 24)
        assert out.finish_reason == "length" and out.finished
    assert pages_all_free(llm)


def test_chunked_prefill_and_preemption_are_exact(tiny_llama, hf_tiny):
    # 40-token prompt in 8-token chunks; 12 pages of 4 slots cannot hold 5 requests at once
    llm = LLM(model=str(tiny_llama), dtype="float64", page_size=4, num_pages=18,
              max_num_batched_tokens=8, max_model_len=72)
    outs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(hf_tiny, prompt, 24)
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "the test must force preemption"
    assert pages_all_free(llm)


def test_stop_token_and_max_model_len(tiny_llama, hf_tiny):
    llm = LLM(model=str(tiny_llama), dtype="float64", max_model_len=20)
    ref = hf_greedy(hf_tiny, PROMPTS[0], 10)
    stop_at = ref[3]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10,
                                                  stop_token_ids=[stop_at]))[0]
    assert out.token_ids == ref[: ref.index(stop_at) + 1] and out.finish_reason == "stop"
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert len(PROMPTS[0]) + len(out.token_ids) == 20 and out.finish_reason == "length"


def test_seeded_sampling_is_reproducible(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32")
    p = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    a = llm.generate([PROMPTS[0], PROMPTS[1]], p)
    b = llm.generate([PROMPTS[1], PROMPTS[0]], p)  # other order, other batch neighbours
    assert a[0].token_ids == b[1].token_ids and a[1].token_ids == b[0].token_ids
    seeds = [SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True) for s in range(6)]
    outs = llm.generate([PROMPTS[0]] * 6, seeds)
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_abort_frees_pages_and_others_continue(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32")
    eng = llm.engine
    ids = [eng.add_request(p, GREEDY) for p in PROMPTS[:3]]
    eng.step()
    eng.step()
    eng.abort(ids[1])
    with pytest.raises(ValueError, match="prompt is empty"):
        eng.add_request([], GREEDY)  # a bad request does not disturb the running ones
    while eng.has_unfinished():
        eng.step()
    done = [eng.pop_finished(i) for i in ids]
    assert [s.finish_reason for s in done] == ["length", "abort", "length"]
    assert len(done[0].output_token_ids) == 24
    assert pages_all_free(llm)


def test_stream_deltas_add_up(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32")
    full = llm.generate(PROMPTS[:2], GREEDY)
    got = {o.request_id: [] for o in full}
    got = {}
    last = {}
    for delta in llm.stream(PROMPTS[:2], GREEDY):
        got.setdefault(delta.request_id, []).extend(delta.token_ids)
        last[delta.request_id] = delta
    assert sorted(map(tuple, got.values())) == sorted(tuple(o.token_ids) for o in full)
    assert all(d.finished and d.finish_reason == "length" for d in last.values())
    assert pages_all_free(llm)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_p=2.0), "min_p"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", max_model_len=32)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[1, 2], []], GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(1, 40))], GREEDY)
    with pytest.raises(ValueError, match=r"\[0, 96\)"):
        llm.generate([[1, 2, 500]], GREEDY)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("hello", GREEDY)
    assert pages_all_free(llm) and not llm.engine.has_unfinished()


def test_bad_engine_config(tiny_llama):
    with pytest.raises(ValueError, match="dtype"):
        LLM(model=str(tiny_llama), dtype="int8")
    with pytest.raises(ValueError, match="num_pages"):
        LLM(model=str(tiny_llama), num_pages=1, page_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="unknown drafter 'nope'"):
        LLM(model=str(tiny_llama), drafter="nope")
    with pytest.raises(ValueError, match="page_size"):
        LLM(model=str(tiny_llama), page_size=0)


def hf_greedy_forced(hf, prompt: list[int], ours: list[int], max_tokens: int) -> list[int]:
    """What ``hf.generate(prompt, max_new_tokens=max_tokens, do_sample=False)`` returns, as far
    as it agrees with ``ours`` and one token past, from ONE teacher-forced forward over
    prompt + ours: HF's greedy token at each step is its argmax after the prompt and the tokens
    before it, so up to the first difference these are generate's tokens (bar a near-tie that
    the cache-less forward rounds the other way), and they stop where generate stops (its
    ``eos_token_id``, max_tokens). Equal to ``ours`` exactly when generate's tokens are (the
    four prompts below: 2.1 s on one core here, generate 9.6 s)."""
    with torch.no_grad():
        logits = hf(torch.tensor([[*prompt, *ours]]), logits_to_keep=len(ours) + 1).logits[0]
    eos = hf.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or ())
    ref = []
    for i, token in enumerate(logits.argmax(-1).tolist()):
        ref.append(token)
        if len(ref) == max_tokens or token in eos or i == len(ours) or token != ours[i]:
            break
    return ref


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2_hf")  # the run builds smollm2_hf on one worker only
def test_smollm2_matches_hf_generate(smollm2_dir, smollm2_hf):
    hf = smollm2_hf
    # without the prefix cache: the chats share their template's system-prompt page, which
    # would spare the pages whose lack must force a preemption here
    engine_args = dict(model=str(smollm2_dir), max_num_batched_tokens=64, page_size=16,
                       num_pages=14, max_model_len=224, activations="float")  # HF's numbers
    llm = LLM(enable_prefix_caching=False, **engine_args)
    tok = llm.tokenizer
    chats = ["What is the capital of France?", "Write a haiku about autumn.",
             "Explain photosynthesis in detail, step by step, for a student. " * 6,
             "Name three prime numbers."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True)
               for c in chats]
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in prompts]
    # 24 new tokens: the long prompt (109 tokens) still arrives in chunks and preempts
    params = SamplingParams(temperature=0, max_tokens=24)
    batch = llm.generate([list(p) for p in prompts], params)
    single = [llm.generate([list(p)], params)[0] for p in prompts[:2]]
    for p, out in zip(prompts, batch):
        assert out.token_ids == hf_greedy_forced(hf, list(p), out.token_ids, 24)
    assert [o.token_ids for o in single] == [o.token_ids for o in batch[:2]]
    assert len(prompts[2]) > 64, "one prompt must be chunked"
    assert sum(o.metrics.num_preemptions for o in batch) > 0, "14 pages must force preemption"
    assert pages_all_free(llm)
    cached = LLM(**engine_args).generate([list(p) for p in prompts], params)
    assert [o.token_ids for o in cached] == [o.token_ids for o in batch]
    assert sum(o.metrics.num_cached_tokens for o in cached) > 0  # the system-prompt page


@pytest.mark.slow
def test_smollm2_stop_strings_and_chat(smollm2_dir):
    llm = LLM(model=str(smollm2_dir), max_model_len=512)
    chat = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    full = llm.generate(chat, SamplingParams(temperature=0, max_tokens=60))[0]
    assert "5" in full.text, full.text
    cut = llm.generate(chat, SamplingParams(temperature=0, max_tokens=60, stop=["5"]))[0]
    assert cut.finish_reason == "stop" and "5" not in cut.text
    assert full.text.startswith(cut.text) and len(cut.token_ids) < len(full.token_ids)
    assert full.token_ids[: len(cut.token_ids)] == cut.token_ids


def test_check_request_rejects_without_queueing(tiny_llama):
    eng = LLM(model=str(tiny_llama), dtype="float32", max_model_len=16).engine
    with pytest.raises(TypeError, match="params must be SamplingParams"):
        eng.check_request([1, 2], {"temperature": 0})
    for ids, needle in [([], "empty"), ((), "empty"), ([1, True], r"\[0, 96\)"),
                        ([1, 96], r"\[0, 96\)"), ([1.0], r"\[0, 96\)"),
                        (list(range(16)), "at most 15 prompt tokens")]:
        with pytest.raises(ValueError, match=needle):
            eng.check_request(ids, GREEDY)
        with pytest.raises(ValueError, match=needle):
            eng.add_request(ids, GREEDY)
    eng.check_request(list(range(15)), GREEDY)
    rid = eng.add_request([1, 2], GREEDY, request_id="x")
    with pytest.raises(ValueError, match="'x' is already in use"):
        eng.add_request([3, 4], GREEDY, request_id="x")
    assert list(eng.requests) == [rid] and len(eng.scheduler.waiting) == 1


def test_engine_seed_seeds_unseeded_requests(tiny_llama):
    p = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)  # no seed of its own

    def run(**kw) -> list[list[int]]:
        llm = LLM(model=str(tiny_llama), dtype="float32", **kw)
        return [o.token_ids for o in llm.generate([PROMPTS[0]] * 3, p)]

    a = run(seed=5)
    assert run(seed=5) == a and run(seed=6) != a
    assert len({tuple(t) for t in a}) > 1  # each request still gets its own seed
    torch.manual_seed(0)
    b = run()
    torch.manual_seed(0)
    assert run() == b  # seed None: torch's global RNG
    with pytest.raises(ValueError, match="seed must be None or an int"):
        LLM(model=str(tiny_llama), seed=-1)


def test_step_stats_count_the_step(tiny_llama):
    class Recorder:
        def __init__(self):
            self.steps = []

        @hookimpl
        def specdec_step_end(self, stats):
            self.steps.append(stats)

    rec = Recorder()
    llm = LLM(model=str(tiny_llama), dtype="float64", drafter="ngram", plugins=(rec,),
              drafter_args={"min_ngram": 1}, controller="static", controller_args={"budget": 3},
              max_num_batched_tokens=16)
    outs = llm.generate(PROMPTS, GREEDY)
    steps = rec.steps
    assert sum(s.num_emitted for s in steps) == sum(len(o.token_ids) for o in outs)
    assert sum(s.num_accepted for s in steps) == sum(sum(o.metrics.accepted_by_depth)
                                                     for o in outs) > 0
    assert sum(s.num_draft_nodes for s in steps) == sum(o.metrics.draft_tokens_proposed
                                                        for o in outs)
    assert sum(s.num_prefill_tokens for s in steps) >= sum(len(p) for p in PROMPTS) - len(PROMPTS)
    for s in steps:
        assert s.num_verified_rows >= s.num_decode + s.num_draft_nodes
        assert s.num_draft_no_kv == 0 and s.failed_requests == []
        assert min(s.draft_seconds, s.forward_seconds, s.verify_seconds) >= 0
        assert s.step_seconds >= s.forward_seconds + s.verify_seconds
    assert any(s.num_decode == len(PROMPTS) for s in steps)
    assert llm.engine.totals.steps == len(steps)
