"""Sampling options that change the logits (penalties, logit_bias, min_tokens, bad_words,
structured output) and logprobs, with speculation: the output equals plain decoding's token for
token (greedy and seeded sampling), logprobs are identical with and without a drafter and equal a
float64 forward of the emitted sequence; constrained output is valid."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import oracle_plugin
from logits_helpers import byte_model_fixture

from specdec import LLM, SamplingParams, native
from specdec.sampling_params import StructuredOutputs

byte_model = byte_model_fixture()
PROMPT = '{"name": "Bob", "age": 12} the cat'
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}
OPTIONS = {
    "penalties": dict(frequency_penalty=0.6, presence_penalty=0.4, repetition_penalty=1.3,
                      logit_bias={5: 3.0, 6: -2.0}),
    "min_and_bad": dict(min_tokens=12, bad_words=["the", "cat"]),
    "json": dict(structured_outputs=StructuredOutputs(json=SCHEMA)),
    "regex": dict(structured_outputs=StructuredOutputs(regex=r"(yes|no)( (yes|no)){2,4}")),
    "choice": dict(structured_outputs=StructuredOutputs(choice=["hello world", "hello there"])),
}


def _params(name: str, sampled: bool, **extra) -> SamplingParams:
    temp = dict(temperature=0.9, seed=11) if sampled else dict(temperature=0)
    return SamplingParams(max_tokens=24, logprobs=3, **temp, **OPTIONS[name], **extra)


def _run(model, params, drafter=None, plugins=(), verifier="gumbel", dtype="float32"):
    """float32: the row-invariant kernels (logits bitwise the same in a tree as alone); gumbel:
    a seed samples the same tokens with and without drafts."""
    llm = LLM(model=model, dtype=dtype, drafter=drafter, plugins=plugins,
              verifier=verifier if not params.greedy else "greedy")
    out = llm.generate([PROMPT], params)[0]
    llm.close()
    return out


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.skipif(native.load() is None, reason="the compiled kernels are not built")
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_speculation_equals_plain_decoding_with_the_option(byte_model, name, sampled):
    params = _params(name, sampled)
    plain = _run(byte_model, params)
    assert plain.logprobs is not None and len(plain.logprobs) == len(plain.token_ids)
    from transformers import AutoTokenizer
    prompt_ids = AutoTokenizer.from_pretrained(byte_model)(PROMPT).input_ids
    truth = prompt_ids + plain.token_ids
    for drafter, plugins in (("ngram", ()), ("oracle", (oracle_plugin(truth, depth=4),))):
        spec = _run(byte_model, params, drafter, plugins)
        assert spec.token_ids == plain.token_ids, (name, drafter)
        assert spec.logprobs == plain.logprobs, (name, drafter)  # bitwise, alternatives too
        assert spec.finish_reason == plain.finish_reason
        if drafter == "oracle" and not sampled and len(plain.token_ids) > 4:
            assert spec.metrics.tau > 1.2, spec.metrics  # the drafts were accepted
    text = plain.text
    if name == "json" and plain.finish_reason == "stop":
        value = json.loads(text)
        assert set(value) == {"name", "ok"} and isinstance(value["ok"], bool)
    if name == "regex":
        assert re.fullmatch(r"(yes|no)( (yes|no)){0,4}( )?(y|ye|n)?", text), text
    if name == "choice":
        assert plain.finish_reason == "stop" and text in ("hello world", "hello there")
    if name == "min_and_bad":
        assert len(plain.token_ids) >= 12 or plain.finish_reason == "length"


def test_logprobs_are_the_targets_log_softmax(byte_model):
    """Against a float64 transformers forward of prompt + output: each token's log-probability,
    its rank and the top alternatives, before temperature and penalties."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    params = SamplingParams(temperature=0.7, seed=5, max_tokens=16, logprobs=4,
                            frequency_penalty=1.0, ignore_eos=True)
    out = _run(byte_model, params, "ngram", dtype="float64")
    tok = AutoTokenizer.from_pretrained(byte_model)
    ids = tok(PROMPT).input_ids
    hf = AutoModelForCausalLM.from_pretrained(byte_model, dtype=torch.float64)
    with torch.no_grad():
        logits = hf(torch.tensor([ids + out.token_ids])).logits[0]
    logp = torch.log_softmax(logits, dim=-1)
    for j, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = logp[len(ids) - 1 + j]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(float(row[token]), abs=1e-6)  # rope rounding
        assert lp.rank == int((row > row[token]).sum()) + 1
        top = torch.topk(row, 4)
        assert [i for i, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-6)


def test_n_samples_each_keep_their_own_grammar(byte_model):
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=40,
                            structured_outputs=StructuredOutputs(json=SCHEMA))
    llm = LLM(model=byte_model, dtype="float64", drafter="ngram", verifier="rejection")
    out = llm.generate([PROMPT], params)[0]
    for sample in out.outputs:
        if sample.finish_reason == "stop":
            assert set(json.loads(sample.text)) == {"name", "ok"}
    assert len({tuple(s.token_ids) for s in out.outputs}) > 1


def test_bad_options_are_errors_before_anything_runs(byte_model, tiny_llama):
    llm = LLM(model=byte_model, dtype="float64")
    with pytest.raises(ValueError, match="logit_bias names token 100000"):
        llm.generate([PROMPT], SamplingParams(logit_bias={100000: 1.0}))
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        llm.generate([PROMPT], SamplingParams(structured_outputs=StructuredOutputs(regex="(")))
    assert not llm.engine.requests and llm.engine.kv.num_free_pages == llm.engine.kv.num_pages
    bare = LLM(model=str(tiny_llama), dtype="float64")  # no tokenizer
    with pytest.raises(ValueError, match="needs a tokenizer"):
        bare.generate([[5, 6]], SamplingParams(bad_words=["x"]))
    with pytest.raises(ValueError, match="needs a tokenizer"):
        bare.generate([[5, 6]], SamplingParams(
            structured_outputs=StructuredOutputs(json_object=True)))
