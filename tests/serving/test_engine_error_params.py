"""What the engine refuses when a request is submitted (SamplingParams' checks, then
``LLMEngine.check_request``: the verifier, the logit options against the model, the prompt's
ids and length) is a 400 whose ``param`` names the field as the client wrote it, not the
prompt: the engine's ``RequestError`` names its field and the server maps it
(``specdec.serving.options.request_field``)."""

from __future__ import annotations

import pytest
import serving_helpers
from serving_helpers import error_of, serve

from specdec.serving.options import request_field
from specdec.serving.protocol import ChatRequest, CompletionRequest

chat_model_dir = serving_helpers.chat_model_dir  # a fixture: a tiny model (a ~40-token vocab)
pytestmark = pytest.mark.usefixtures("one_torch_thread")

HI = [{"role": "user", "content": "write a poem"}]
LONG = [{"role": "user", "content": "sea " * 40}]
MAX_MODEL_LEN = 32


@pytest.fixture(scope="module")
def greedy_served(chat_model_dir):
    """A server whose verifier takes greedy requests only (so a temperature is refused by the
    engine) and whose context is short (so a prompt can outgrow it)."""
    s = serve(chat_model_dir, verifier="greedy", max_model_len=MAX_MODEL_LEN)
    yield s
    s.server.stop()
    s.loop.shutdown()


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.mark.parametrize("path, body, param", [
    # LLMEngine.check_request: the verifier
    (CHAT, {"messages": HI, "temperature": 0.7}, "temperature"),
    (COMPLETIONS, {"prompt": [5, 6], "temperature": 1}, "temperature"),
    # ... the logit options against the model (LogitsSetup.check): the key as written
    (CHAT, {"messages": HI, "logit_bias": {"500": 1}}, "logit_bias.500"),
    (COMPLETIONS, {"prompt": [5, 6], "logit_bias": {"5": 1, "0500": -1}}, "logit_bias.0500"),
    (COMPLETIONS, {"prompt": [[5], [6]], "logit_bias": {"500": 1}}, "logit_bias.500"),
    # ... the prompt: each of a list named by its index
    (COMPLETIONS, {"prompt": ""}, "prompt"),
    (COMPLETIONS, {"prompt": [5, 999]}, "prompt"),
    (COMPLETIONS, {"prompt": [[5], [5, 999]]}, "prompt.1"),
    (COMPLETIONS, {"prompt": [5] * MAX_MODEL_LEN}, "prompt"),
    (CHAT, {"messages": LONG}, "messages"),
    # SamplingParams' own checks, past the protocol's
    (CHAT, {"messages": HI, "min_tokens": 9, "max_completion_tokens": 4}, "min_tokens"),
    (CHAT, {"messages": HI, "bad_words": [" "]}, "bad_words"),
    (COMPLETIONS, {"prompt": [5], "stop": ["sea", ""]}, "stop"),
])
def test_param_names_the_field_the_engine_refuses(greedy_served, path, body, param):
    body = {"temperature": 0, "max_tokens": 4, **body}
    err = error_of(greedy_served.post(path, body), 400)
    assert err["param"] == param, err
    assert err["message"].startswith(f"{param}: "), err
    assert greedy_served.pages_back()  # a refused prompt of a list leaves none queued


def test_request_field_maps_each_renamed_sampling_params_field():
    """The SamplingParams fields a request sets under another name (the protocol's bounds keep
    these from the engine today; a wider bound there must still name the right field)."""
    chat = ChatRequest(messages=HI, logprobs=True, top_logprobs=3, max_completion_tokens=5,
                       guided_regex="a+")
    assert request_field(chat, "logprobs", "messages") == "top_logprobs"
    assert request_field(chat, "max_tokens", "messages") == "max_completion_tokens"
    assert request_field(chat, "structured_outputs.regex", "messages") == "guided_regex"
    assert request_field(chat, "prompt", "messages") == "messages"
    echo = CompletionRequest(prompt="hi", echo=True, logprobs=2, max_tokens=3,
                             response_format={"type": "json_object"})
    assert request_field(echo, "prompt_logprobs", "prompt.2") == "logprobs"
    assert request_field(echo, "max_tokens", "prompt") == "max_tokens"
    assert request_field(echo, "structured_outputs", "prompt") == "response_format"
    assert request_field(echo, "prompt", "prompt.2") == "prompt.2"
    assert request_field(echo, "stop_token_ids", "prompt") is None  # no request sets it
