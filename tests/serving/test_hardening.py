"""The server under hostile or careless clients and in operation: hang-ups abort, bodies are
refused before they are read, limits on stop strings, JSON depth and text, template errors,
tokenization off the event loop, draining, health after a failed step, max_tokens by default
the rest of the context and a 400 beyond it."""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest
import serving_helpers
from serving_helpers import USER, error_of, slow_steps

from specdec.models.tokenizer import chat_token_ids
from specdec.serving.limits import ServerLimits

chat_model_dir, served, make_server = (serving_helpers.chat_model_dir, serving_helpers.served,
                                       serving_helpers.make_server)  # fixtures

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _metric(s, name: str) -> float:
    text = httpx.get(s.url + "/metrics", timeout=10).text
    lines = [line for line in text.splitlines() if line.startswith(name + " ")
             or line.startswith(name + "{")]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_a_non_streaming_client_that_hangs_up_is_aborted(make_server, monkeypatch):
    s = make_server()
    slow_steps(monkeypatch, s.llm.engine, 0.02)  # 400 tokens: 8 s unless aborted
    with pytest.raises(httpx.ReadTimeout):
        s.post("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 400,
                                   "ignore_eos": True}, timeout=0.5)
    assert s.pages_back(5), "the request ran on after its client left"
    aborted = 'specdec_requests_finished_total{finish_reason="abort"}'
    assert _metric(s, aborted) == 1.0


def _raw(url: str, head: bytes, body: bytes = b"", timeout: float = 10) -> bytes:
    """Send a request as it is (no client fixing it up); the answer, up to its JSON's end."""
    u = urlparse(url)
    answer = b""
    with socket.create_connection((u.hostname, u.port), timeout=timeout) as sock:
        sock.sendall(head + body)
        while not answer.endswith(b"}") and (data := sock.recv(4096)):
            answer += data
    return answer


def test_content_length_is_checked_before_the_body_is_read(make_server):
    s = make_server(limits=ServerLimits(max_body_bytes=4096))
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000000\r\n\r\n")
    answer = _raw(s.url, head, b'{"prompt": ')  # the rest never comes: waiting would hang
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b'"error"' in answer


def test_a_chunked_body_is_capped_while_it_arrives(make_server):
    s = make_server(limits=ServerLimits(max_body_bytes=4096))
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b'{"prompt": "' + b"a" * 5000
    answer = _raw(s.url, head, b"%x\r\n%s\r\n" % (len(chunk), chunk))  # no last chunk
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


def test_limits_on_stop_strings(served):
    many = {"messages": USER, "stop": [f"s{i}" for i in range(17)]}
    assert error_of(served.post("/v1/chat/completions", many), 400)["param"] == "stop"
    long = {"messages": USER, "stop": ["ok", "x" * 257]}
    assert error_of(served.post("/v1/chat/completions", long), 400)["param"] == "stop.1"
    one = {"prompt": "x", "stop": "x" * 257}
    assert error_of(served.post("/v1/completions", one), 400)["param"] == "stop"
    fine = {"prompt": "x", "stop": ["x" * 256] * 16, "max_tokens": 2}
    assert served.post("/v1/completions", fine).status_code == 200


def test_deep_json_is_a_400_not_a_recursion_error(served):
    err = error_of(served.post("/v1/completions", b"[" * 100_000), 400)
    assert "nests deeper" in err["message"]
    deep = {"prompt": "x", "metadata": {}}
    node = deep["metadata"]
    for _ in range(40):
        node["a"] = {}
        node = node["a"]
    assert "nests deeper" in error_of(served.post("/v1/completions", deep), 400)["message"]


def test_a_lone_surrogate_is_a_400_naming_its_field(served):
    body = b'{"messages": [{"role": "user", "content": "\\ud800x"}]}'
    err = error_of(served.post("/v1/chat/completions", body), 400)
    assert err["param"] == "messages.0.content" and "surrogate" in err["message"]
    body = b'{"prompt": ["fine \\ud83d\\ude00", "\\udfff"], "max_tokens": 1}'
    assert error_of(served.post("/v1/completions", body), 400)["param"] == "prompt.1"
    pair = b'{"prompt": "a pair is text \\ud83d\\ude00", "max_tokens": 1}'
    assert served.post("/v1/completions", pair).status_code == 200


def test_a_chat_template_error_is_a_400(served, monkeypatch):
    template = ("{% for m in messages %}{% if loop.index0 > 0 and m['role'] == "
                "messages[loop.index0 - 1]['role'] %}{{ raise_exception('roles must "
                "alternate') }}{% endif %}{{ m['content'] }} {% endfor %}")
    monkeypatch.setattr(served.llm.engine.tokenizer, "chat_template", template)
    err = error_of(served.post("/v1/chat/completions", {"messages": USER + USER}), 400)
    assert err["param"] == "messages" and "roles must alternate" in err["message"]


def test_tokenization_does_not_stall_the_event_loop(served, monkeypatch):
    tokenizer = served.llm.engine.tokenizer
    real = tokenizer.apply_chat_template

    def slow(*args, **kwargs):
        time.sleep(1.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", slow)
    thread = threading.Thread(target=served.post, args=(
        "/v1/chat/completions", {"messages": USER, "max_tokens": 1}))
    thread.start()
    time.sleep(0.3)  # the request is tokenizing
    t0 = time.perf_counter()
    assert httpx.get(served.url + "/health", timeout=10).status_code == 200
    waited = time.perf_counter() - t0
    thread.join(30)
    assert waited < 1.0, f"/health waited {waited:.2f} s behind a tokenization"


def test_draining_refuses_new_requests_and_health_says_so(make_server, monkeypatch):
    s = make_server()
    slow_steps(monkeypatch, s.llm.engine, 0.01)
    out = {}
    body = {"prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True}
    thread = threading.Thread(target=lambda: out.update(r=s.post("/v1/completions", body)))
    thread.start()
    deadline = time.time() + 10
    while not s.llm.engine.requests and time.time() < deadline:
        time.sleep(0.01)
    s.loop.drain(timeout=60)
    err = error_of(s.post("/v1/completions", body), 503)
    assert "shutting down" in err["message"]
    assert httpx.get(s.url + "/health", timeout=10).json() == {"status": "draining"}
    thread.join(30)
    assert out["r"].status_code == 200 and out["r"].json()["usage"]["completion_tokens"] == 40
    s.loop._thread.join(10)
    assert httpx.get(s.url + "/health", timeout=10).status_code == 503  # stopped


def test_health_stays_ok_after_a_failed_step_which_metrics_count(make_server, monkeypatch):
    s = make_server()
    real, failed = s.llm.engine.step, []

    def fails_once():
        if not failed:
            failed.append(1)
            raise RuntimeError("kaput")
        return real()

    monkeypatch.setattr(s.llm.engine, "step", fails_once)
    assert s.post("/v1/completions", {"prompt": [5, 6], "max_tokens": 2}).status_code == 500
    assert httpx.get(s.url + "/health", timeout=10).json() == {"status": "ok"}
    assert _metric(s, "specdec_step_failures_total") == 1.0
    r = s.post("/v1/completions", {"prompt": [5, 6], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_max_tokens_defaults_to_the_rest_of_the_context(make_server):
    s = make_server(max_model_len=300)
    r = s.post("/v1/completions", {"prompt": [5, 6, 7, 8], "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 296, r.text  # not 256
    capped = make_server(max_model_len=300, limits=ServerLimits(max_tokens=10))
    r = capped.post("/v1/completions", {"prompt": [5, 6, 7, 8], "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 10


def test_a_prompt_and_max_tokens_beyond_the_context_is_a_400_naming_the_limits(make_server):
    """As OpenAI and vLLM answer: the context, the tokens asked for, and how they split; a
    request that just fits runs to its end (prompt + max_tokens == max_model_len)."""
    s = make_server(max_model_len=300)
    r = s.post("/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 297})
    err = error_of(r, 400)
    assert err["message"].startswith(
        "This model's maximum context length is 300 tokens. However, you requested 301 "
        "tokens (4 in the prompt, 297 in the completion)."), err
    assert (err["param"], err["code"]) == ("max_tokens", "context_length_exceeded")
    ids = chat_token_ids(s.llm.engine.tokenizer, USER)
    r = s.post("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 300})
    err = error_of(r, 400)
    assert f"({len(ids)} in the messages, 300 in the completion)" in err["message"], err
    assert err["param"] == "max_completion_tokens"
    r = s.post("/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 296,
                                   "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 296, r.text
    assert s.pages_back()


def test_the_error_body_of_a_bad_content_length_or_json_is_openai_shaped(served):
    r = served.post("/v1/chat/completions", json.dumps({"messages": "hi"}).encode())
    assert error_of(r, 400)["param"] == "messages"
