"""specdec serve through real clients: the openai package (chat and completions, streamed and
not, n samples, stop strings spanning tokens, seeds) against LLM.generate's output; concurrent
streams with aborts mid-stream; auth, limits and bad input; /health, /v1/models, /metrics."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import serving_helpers

from specdec import LLM, SamplingParams
from specdec.serving.engine_loop import EngineLoop
from specdec.serving.server import ServerLimits, ServerThread, create_app

pytestmark = pytest.mark.slow
chat_model_dir = serving_helpers.chat_model_dir  # a fixture: a tiny model with a tokenizer

KEY = "test-key"
CHAT = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]


# the tests of the served fixture run on one xdist worker (--dist loadgroup): it is built once
on_one_worker = pytest.mark.xdist_group("server_served")


@pytest.fixture(scope="module")
def served(smollm2_dir):
    llm = LLM(model=str(smollm2_dir), max_model_len=256)
    greedy = [SamplingParams(temperature=0, max_tokens=24), SamplingParams(temperature=0,
                                                                           max_tokens=8)]
    llm.reference = [o.text for o in llm.generate([CHAT, "The capital of France is"], greedy)]
    loop = EngineLoop(llm.engine, max_queued=8).start()
    app = create_app(loop, "smollm2", KEY, ServerLimits(max_body_bytes=4096, max_tokens=64))
    server = ServerThread(app)
    yield llm, loop, server
    server.stop()
    loop.shutdown()


@pytest.fixture(scope="module")
def client(served):
    from openai import OpenAI

    return OpenAI(base_url=served[2].url + "/v1", api_key=KEY, max_retries=0)


@on_one_worker
def test_chat_and_completion_equal_the_engine_streamed_or_not(served, client):
    llm = served[0]
    want, want_completion = llm.reference  # LLM.generate's, before the server started
    ids = llm.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    got = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=24,
                                         temperature=0)
    assert got.choices[0].message.content == want
    assert got.usage.completion_tokens == 24 and got.usage.prompt_tokens == len(ids)
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="smollm2", messages=CHAT, max_tokens=24, temperature=0, stream=True)
        if c.choices]
    assert "".join(parts) == want
    comp = client.completions.create(model="smollm2", prompt="The capital of France is",
                                     max_tokens=8, temperature=0)
    assert comp.choices[0].text == want_completion


@on_one_worker
def test_n_samples_stop_strings_and_seeds(client):
    stop = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=60,
                                          temperature=0, stop=["\n7. 7"])
    assert stop.choices[0].finish_reason == "stop"
    assert stop.choices[0].message.content.endswith("6. 6")
    a = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=12,
                                       temperature=1.0, seed=5, n=3)
    b = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=12,
                                       temperature=1.0, seed=5, n=3)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1


@on_one_worker
def test_concurrent_streams_with_aborts_leak_nothing(served):
    llm, loop, server = served
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "smollm2", "messages": CHAT, "max_tokens": 64, "temperature": 0,
            "stream": True}
    results: dict[int, str] = {}

    def client(i: int):
        with httpx.Client(base_url=server.url, headers=headers, timeout=60) as c:
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = 0
                for line in r.iter_lines():
                    lines += line.startswith("data: ")
                    if i % 2 and lines >= 4:  # odd clients hang up mid-stream
                        results[i] = "aborted"
                        return
                    if line == "data: [DONE]":
                        results[i] = "done"

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {i: "aborted" if i % 2 else "done" for i in range(6)}
    deadline = time.time() + 10
    while (llm.engine.requests or llm.engine.kv.num_free_pages != llm.engine.kv.num_pages) \
            and time.time() < deadline:
        time.sleep(0.05)
    assert not llm.engine.requests, "an aborted request was left running"
    assert llm.engine.kv.num_free_pages == llm.engine.kv.num_pages
    text = httpx.get(server.url + "/metrics", headers=headers, timeout=10).text
    aborted = [line for line in text.splitlines()
               if line.startswith('specdec_requests_finished_total{finish_reason="abort"}')]
    assert aborted and float(aborted[0].split()[-1]) == 3.0, aborted  # ended, not run out


@pytest.mark.parametrize("body,status,field", [
    (b"{not json", 400, None),
    (b'{"model": "smollm2", "messages": [], "max_tokens": 4}', 400, "messages"),
    (b'{"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], '
     b'"max_tokens": "4"}', 400, "max_tokens"),
    (b'{"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], '
     b'"max_tokens": 65}', 400, "max_tokens"),
    (b'{"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], '
     b'"temperature": -1}', 400, "temperature"),
    (b'{"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "n": 0}', 400,
     "n"),
    (b'{"model": "other", "messages": [{"role": "user", "content": "hi"}]}', 404, "model"),
    (b'{"model": "smollm2", "messages": [{"role": "user", "content": "' + b"x" * 5000 + b'"}]}',
     413, None),
])
@on_one_worker
def test_bad_input_is_an_openai_error_naming_the_field(served, body, status, field):
    r = httpx.post(served[2].url + "/v1/chat/completions", content=body, timeout=30,
                   headers={"Authorization": f"Bearer {KEY}",
                            "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["param"] == field


@on_one_worker
def test_prompt_over_max_model_len_auth_health_models_metrics(served):
    url, auth = served[2].url, {"Authorization": f"Bearer {KEY}"}
    long = {"model": "smollm2", "prompt": list(range(1, 300)), "max_tokens": 4}
    r = httpx.post(url + "/v1/completions", json=long, headers=auth, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "max_model_len" in r.json()["error"]["message"]
    assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"},
                     timeout=10).status_code == 401
    assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}
    models = httpx.get(url + "/v1/models", headers=auth, timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["smollm2"]
    text = httpx.get(url + "/metrics", headers=auth, timeout=10).text
    for name in ("specdec_requests_running", "specdec_time_to_first_token_seconds_bucket",
                 "specdec_kv_cache_usage", "specdec_prefix_cache_hit_rate",
                 "specdec_tokens_per_target_forward", "specdec_draft_time_share"):
        assert name in text


def test_a_full_queue_answers_503_with_retry_after(smollm2_dir):
    llm = LLM(model=str(smollm2_dir), max_model_len=128, max_num_seqs=1)
    loop = EngineLoop(llm.engine, max_queued=1)  # not started: requests stay queued
    server = ServerThread(create_app(loop, "smollm2"))
    try:
        loop.submit([1, 2, 3], SamplingParams(max_tokens=2))  # takes the one seat
        loop.submit([1, 2, 3], SamplingParams(max_tokens=2))  # waits
        r = httpx.post(server.url + "/v1/completions", timeout=30,
                       json={"prompt": [1, 2, 3], "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "server_busy"
    finally:
        server.stop()
        loop.shutdown()


@on_one_worker
def test_bench_serve_load_measures_every_request(served):
    """The load generator's figures on a short run: every request counted, each token once."""
    import asyncio

    from specdec.bench.serve import run_load, summarize

    results, seconds = asyncio.run(run_load(served[2].url, "smollm2", [CHAT] * 3, rate=20.0,
                                            max_concurrency=2, max_tokens=8, poisson=True,
                                            api_key=KEY))
    assert [r.ok for r in results] == [True] * 3 and all(r.tokens == 8 for r in results)
    s = summarize(results, seconds, slo_ttft_ms=1e6, slo_tpot_ms=1e-6)
    assert s["failed"] == 0 and s["ttft_ms"]["p50"] > 0 and s["slo_met"] == 0.0
    assert s["goodput_tokens_per_s"] == 0 < s["output_tokens_per_s"]


def test_speculation_figures_in_usage_and_metrics(tiny_llama):
    """A drafter behind the server: usage counts its drafted and accepted tokens, /metrics
    shows the controller's figures and acceptance by depth (a tokenizer-less model: token-id
    prompts, empty text)."""
    llm = LLM(model=str(tiny_llama), dtype="float64", drafter="ngram",
              drafter_args={"min_ngram": 1}, controller="static",
              controller_args={"budget": 4})  # static: drafts whatever this machine's speed
    loop = EngineLoop(llm.engine).start()
    server = ServerThread(create_app(loop, "tiny"))
    try:
        body = {"prompt": [5, 6, 7, 5, 6, 7, 5, 6], "max_tokens": 24, "temperature": 0,
                "ignore_eos": True}
        usage = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["usage"]
        assert usage["completion_tokens"] == 24 and usage["drafted_tokens"] > 0
        assert 0 <= usage["accepted_tokens"] <= usage["drafted_tokens"]
        text = httpx.get(server.url + "/metrics", timeout=10).text
        assert "specdec_accepted_tokens_by_depth_total" in text
        assert "specdec_draft_tokens_total" in text
        # the controller's figures: what a goodput controller's last decision said
        loop.last_stats = SimpleNamespace(controller={"expected_tokens": 1.7, "depths": [2, 4],
                                                      "sources": ["ngram"]})
        text = httpx.get(server.url + "/metrics", timeout=10).text
        assert 'specdec_controller_figure{figure="expected_tokens"} 1.7' in text
        assert 'specdec_controller_figure{figure="depths_mean"} 3.0' in text
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    finally:
        server.stop()
        loop.shutdown()


def test_specdec_serve_starts_answers_and_drains_on_sigterm(chat_model_dir):
    import os
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--model",
                             str(chat_model_dir), "--port", "0", "--dtype", "float64",
                             "--drafter", "none", "--drain-timeout", "300"],
                            # (generous: the drain must outlast 400 tokens on a slow, busy CPU)
                            stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        url = None
        deadline = time.time() + 120
        while url is None and time.time() < deadline:
            line = proc.stderr.readline()
            if "specdec serve: http://" in line:
                url = line.split("serve: ")[1].split("/v1")[0]
            assert line or proc.poll() is None, "specdec serve exited at start"
        assert url is not None
        assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0})
        assert r.json()["usage"]["completion_tokens"] == 3
        body = {"prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # running when the signal comes
            proc.send_signal(signal.SIGTERM)  # drains: the stream finishes, not fails
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in rest[-2]
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
