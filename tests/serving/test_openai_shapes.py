"""OpenAI's shapes exactly, through the official ``openai`` client and raw bodies (a tiny chat
model): the naive stream loop, the usage chunk only when asked, an error mid-stream as an error
event, unique ids, content parts and nulls, prompt lists, ``param`` as the client wrote it,
fields not served refused by name, every error OpenAI-shaped."""

from __future__ import annotations

import re

import httpx
import pytest
import serving_helpers
from serving_helpers import USER, error_of

chat_model_dir, served, make_server = (serving_helpers.chat_model_dir, serving_helpers.served,
                                       serving_helpers.make_server)  # fixtures

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_naive_stream_loop_and_no_usage_chunk_unless_asked(served):
    client = served.openai()
    stream = client.chat.completions.create(model="tiny", messages=USER, max_tokens=6,
                                            temperature=0, stream=True)
    chunks = list(stream)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)  # never []
    whole = client.chat.completions.create(model="tiny", messages=USER, max_tokens=6,
                                           temperature=0)
    assert text == whole.choices[0].message.content
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    asked = list(client.chat.completions.create(model="tiny", messages=USER, max_tokens=6,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
    assert asked[-1].choices == [] and asked[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in asked[:-1])
    completion = list(client.completions.create(model="tiny", prompt="write a poem",
                                                max_tokens=4, stream=True))
    assert all(c.choices for c in completion) and completion[-1].usage is None


def test_ids_are_openai_prefixed_uuids(served):
    client = served.openai()
    chats = [client.chat.completions.create(model="tiny", messages=USER, max_tokens=1).id
             for _ in range(2)]
    completion = client.completions.create(model="tiny", prompt="the sea", max_tokens=1).id
    assert all(re.fullmatch(r"chatcmpl-[0-9a-f]{32}", i) for i in chats)
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", completion) and chats[0] != chats[1]
    chunk_ids = {c.id for c in client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=3, stream=True)}
    assert len(chunk_ids) == 1 and chunk_ids.pop().startswith("chatcmpl-")


def test_content_parts_assistant_null_and_null_sampling_fields(served):
    client = served.openai()
    plain = [{"role": "user", "content": "write a short\npoem"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "write a short"},
                                          {"type": "text", "text": "poem"}]}]
    want = client.chat.completions.create(model="tiny", messages=plain, max_tokens=5,
                                          temperature=0).choices[0].message.content
    got = served.post("/v1/chat/completions", {
        "model": "tiny", "messages": parts, "max_tokens": 5, "temperature": 0, "top_p": None,
        "n": None, "seed": None, "stop": None, "presence_penalty": None, "top_k": None})
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["message"]["content"] == want
    history = [*USER, {"role": "assistant", "content": None}, *USER]
    r = served.post("/v1/chat/completions", {"messages": history, "max_tokens": 2,
                                             "temperature": None})
    assert r.status_code == 200, r.text


def test_a_list_of_prompts_gives_each_its_n_choices_in_openai_order(served):
    client = served.openai()
    prompts = ["write a poem about the sea", "explain how python lists work"]
    kw = dict(model="tiny", max_tokens=4, temperature=1.0, seed=7, n=2)
    alone = [client.completions.create(prompt=p, **kw) for p in prompts]
    both = client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [c.text for a in alone for c in a.choices]
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert both.usage.completion_tokens == 16
    texts = [""] * 4
    for chunk in client.completions.create(prompt=prompts, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in both.choices]
    ids = client.completions.create(prompt=[[5, 6, 7], [8, 9]], model="tiny", max_tokens=2)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": HI, "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"messages": HI, "stop": ["a", 3]}, "stop.1"),
    ("/v1/chat/completions", {"messages": HI, "stop": 3}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
     "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]},
     "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": "u"}}]}]},
     "messages.0.content.1.type"),
    ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function"}]}, "tools"),
    # a word-level tokenizer llguidance cannot read: no grammar, named
    ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "json_object"}},
     "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None,
                                            "tool_calls": [{"id": "x"}]}]},
     "messages.0.tool_calls"),
    ("/v1/chat/completions", {"messages": HI, "frobnicate": 1}, "frobnicate"),
    ("/v1/chat/completions", {"messages": HI, "stream_options": {"include_usage": True}},
     "stream_options"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "x", "suffix": "end"}, "suffix"),
    ("/v1/completions", {"prompt": ["write", []]}, "prompt.1"),
    ("/v1/completions", {"prompt": ["write", {}]}, "prompt.1"),
    ("/v1/completions", {"prompt": [[5], 6]}, "prompt.1"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": 0}, "max_tokens"),
])
def test_param_names_the_field_as_the_client_wrote_it(served, path, body, param):
    err = error_of(served.post(path, body), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert param.split(".")[0] in err["message"]


def test_neutral_values_of_fields_not_served_are_accepted(served):
    body = {"messages": HI, "max_tokens": 2, "logprobs": False, "presence_penalty": 0,
            "frequency_penalty": 0.0, "logit_bias": {}, "tools": [], "tool_choice": "none",
            "response_format": {"type": "text"}, "user": "someone", "metadata": {"a": "b"}}
    assert served.post("/v1/chat/completions", body).status_code == 200
    body = {"prompt": "x", "max_tokens": 2, "echo": False, "best_of": 1, "suffix": None}
    assert served.post("/v1/completions", body).status_code == 200


def test_every_error_is_openai_shaped(served):
    assert error_of(served.post("/v1/nowhere", {}), 404)["type"] == "not_found_error"
    error_of(httpx.get(served.url + "/v1/completions", timeout=10), 405)
    assert error_of(served.post("/v1/completions", {"model": "gpt-4", "prompt": "x"}),
                    404)["param"] == "model"
    error_of(served.post("/v1/completions", b"{not json"), 400)


def test_a_failure_mid_stream_is_an_error_event_and_a_500_when_whole(make_server,
                                                                     monkeypatch):
    import openai

    s = make_server()
    real, steps = s.llm.engine.step, []

    def fails_at_the_third():
        steps.append(1)
        if len(steps) == 3:
            raise RuntimeError("kaput")
        return real()

    monkeypatch.setattr(s.llm.engine, "step", fails_at_the_third)
    stream = s.openai().chat.completions.create(model="tiny", messages=USER, max_tokens=50,
                                                temperature=0, stream=True)
    texts = []
    with pytest.raises(openai.APIError, match="kaput"):
        for chunk in stream:
            texts.append(chunk.choices[0].delta.content)
            assert chunk.choices[0].finish_reason != "error"
    assert texts  # the role chunk and text before the failure
    steps.clear()
    monkeypatch.setattr(s.llm.engine, "step", lambda: (_ for _ in ()).throw(RuntimeError("x")))
    err = error_of(s.post("/v1/completions", {"prompt": "write", "max_tokens": 3}), 500)
    assert err["type"] == "server_error" and "generation failed" in err["message"]


def test_an_unexpected_exception_is_an_openai_500(make_server, monkeypatch):
    s = make_server()

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(s.loop, "submit", broken)
    err = error_of(s.post("/v1/completions", {"prompt": [5, 6], "max_tokens": 2}), 500)
    assert err["type"] == "server_error" and "RuntimeError" in err["message"]


def test_serve_takes_drafter_none():
    from specdec.cli import parse_args

    assert parse_args(["serve", "--drafter", "none"]).drafter is None
    assert parse_args(["serve", "--drafter", "ngram"]).drafter == "ngram"
