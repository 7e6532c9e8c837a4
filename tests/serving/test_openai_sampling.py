"""Item 1 of issue 32 through the server and the official ``openai`` client: logprobs
(chat ``logprobs``/``top_logprobs``, completions ``logprobs: k`` and ``echo``), structured
output (``response_format`` json_object / json_schema, vLLM's ``structured_outputs`` and
``guided_*``), penalties and ``logit_bias`` — each equal to what ``LLM.generate`` gives for the
same options, with a drafter on; bad values are 400s naming the field."""

from __future__ import annotations

import json

import pytest
import serving_helpers
from logits_helpers import byte_model_fixture
from serving_helpers import error_of, serve

from specdec import LLM, SamplingParams, StructuredOutputs

byte_model = byte_model_fixture()
chat_model_dir, served = serving_helpers.chat_model_dir, serving_helpers.served  # fixtures
pytestmark = pytest.mark.usefixtures("one_torch_thread")
CHAT = [{"role": "user", "content": 'give {"name": "Bob", "ok": true}'}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def byte_served(byte_model):
    s = serve(byte_model, drafter="ngram")
    yield s
    s.server.stop()
    s.loop.shutdown()


def _reference(model, prompt, **params) -> object:
    llm = LLM(model=model, dtype="float64", page_size=4)
    return llm.generate([prompt], SamplingParams(**params))[0]


def test_chat_logprobs_and_json_schema_equal_the_python_api(byte_served, byte_model):
    client = byte_served.openai()
    got = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=30, temperature=0, logprobs=True,
        top_logprobs=2, frequency_penalty=0.5, logit_bias={"5": -3},
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": SCHEMA}})
    ref = _reference(byte_model, CHAT, temperature=0, max_tokens=30, logprobs=2,
                     frequency_penalty=0.5, logit_bias={5: -3.0},
                     structured_outputs=StructuredOutputs(json=SCHEMA))
    choice = got.choices[0]
    assert choice.message.content == ref.text
    content = choice.logprobs.content
    # (float64 with a drafter against without: the same to rounding; bitwise on the
    # invariant kernels, tests/logits)
    assert [c.logprob for c in content] == pytest.approx([lp.logprob for lp in ref.logprobs],
                                                         abs=1e-9)
    assert all(len(c.top_logprobs) == 2 for c in content)
    assert b"".join(bytes(c.bytes) for c in content).decode() == ref.text
    if choice.finish_reason == "stop":
        assert set(json.loads(choice.message.content)) == {"name", "ok"}
    # streamed: the same tokens' logprobs, chunk by chunk
    stream = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=30, temperature=0, logprobs=True,
        frequency_penalty=0.5, logit_bias={"5": -3}, stream=True,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": SCHEMA}})
    streamed = [c for chunk in stream for c in (chunk.choices[0].logprobs.content
                                                 if chunk.choices[0].logprobs else [])]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content],
                                                          abs=1e-9)


def test_completions_logprobs_and_echo(byte_served, byte_model):
    client = byte_served.openai()
    prompt = "hello world, hello"
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                    logprobs=3, echo=True)
    ref = _reference(byte_model, prompt, temperature=0, max_tokens=6, logprobs=3,
                     prompt_logprobs=3)
    choice = got.choices[0]
    assert choice.text == prompt + ref.text
    lps = choice.logprobs
    n_prompt = len(ref.prompt_token_ids)
    assert len(lps.tokens) == n_prompt + len(ref.token_ids)
    assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    assert lps.token_logprobs[1:n_prompt] == pytest.approx(
        [lp.logprob for lp in ref.prompt_logprobs[1:]], abs=1e-9)
    assert lps.token_logprobs[n_prompt:] == pytest.approx([lp.logprob for lp in ref.logprobs],
                                                          abs=1e-9)
    assert all(len(t) <= 3 for t in lps.top_logprobs[1:])
    assert lps.text_offset == sorted(lps.text_offset) and lps.text_offset[0] == 0
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].text == ref.text


@pytest.mark.parametrize("extra, check", [
    ({"response_format": {"type": "json_object"}}, lambda t: t.startswith("{")),
    ({"structured_outputs": {"regex": "(yes|no) (yes|no)"}},
     lambda t: t in ("yes yes", "yes no", "no yes", "no no")),
    ({"guided_choice": ["hello world", "hello there"]},
     lambda t: t in ("hello world", "hello there")),
    ({"guided_regex": "[0-9]{3}"}, lambda t: len(t) == 3 and t.isdigit()),
])
def test_each_way_to_constrain_the_output(byte_served, extra, check):
    r = byte_served.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 12,
                                                  "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    assert check(r.json()["choices"][0]["message"]["content"]), r.text


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"logit_bias": {"x": 1}}, "logit_bias.x"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"logit_bias": {"999999": 1}}, "logit_bias.999999"),
    ({"top_logprobs": 2}, None),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
])
def test_bad_values_are_400s_naming_the_field(byte_served, body, param):
    r = byte_served.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 10, **body})
    err = error_of(r, 400)
    if param is not None:
        assert err["param"] == param, err
    assert byte_served.pages_back()


def test_best_of_and_suffix_stay_refused(byte_served):
    for body, param in (({"best_of": 2}, "best_of"), ({"suffix": "x"}, "suffix")):
        r = byte_served.post("/v1/completions", {"prompt": "hello", **body})
        assert error_of(r, 400)["param"] == param


def test_logprobs_with_a_tokenizer_llguidance_cannot_read(served):
    """A word-level tokenizer: token texts from its own decoding; grammars refused by name."""
    got = served.openai().chat.completions.create(
        model="tiny", messages=serving_helpers.USER, max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=1)
    content = got.choices[0].logprobs.content
    assert len(content) == 4 and all(c.token and c.top_logprobs for c in content)
    words = [c.token for c in content if not c.token.startswith("<")]  # the text skips specials
    assert " ".join(words) == got.choices[0].message.content
