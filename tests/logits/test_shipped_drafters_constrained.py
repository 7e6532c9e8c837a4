"""ngram and every learned drafter shipped for SmolLM2, under structured output, penalties and logprobs: the output
and its logprobs equal unspeculated decoding's (greedy, and a seed's sample through the gumbel
verifier), the JSON parses against its schema, and drafts are still accepted (constrained JSON
is where drafts are most often right)."""

from __future__ import annotations

import json

import pytest

from specdec import LLM, SamplingParams
from specdec.sampling_params import StructuredOutputs

CHAT = [{"role": "user", "content": "Describe a person named Bob, aged 12, as JSON."}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"},
                                           "hobbies": {"type": "array",
                                                       "items": {"type": "string"}}},
          "required": ["name", "age", "hobbies"], "additionalProperties": False}
PARAMS = [SamplingParams(temperature=0, max_tokens=40, logprobs=2, frequency_penalty=0.2,
                         structured_outputs=StructuredOutputs(json=SCHEMA)),
          SamplingParams(temperature=0.8, seed=7, max_tokens=40, logprobs=0,
                         structured_outputs=StructuredOutputs(json_object=True))]
# two requests of < 100 tokens: KV for them, not the default 1 GiB each engine would zero
ENGINE = dict(max_model_len=256, max_num_seqs=2)
# on a shared 2-core machine a second OpenMP thread mostly waits on barriers
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.slow
def test_shipped_drafters_under_constraints_equal_plain(smollm2_dir):
    want = LLM(model=str(smollm2_dir), **ENGINE).generate([CHAT, CHAT], PARAMS)
    value = json.loads(want[0].text)
    assert set(value) == {"name", "age", "hobbies"}, want[0].text
    for kind in ("ngram", "eagle3", "mtp", "block_diffusion"):
        llm = LLM(model=str(smollm2_dir), drafter=kind, controller="static",
                  controller_args={"budget": 4}, **ENGINE)
        outs = llm.generate([CHAT, CHAT], PARAMS)
        for got, ref in zip(outs, want):
            assert got.token_ids == ref.token_ids, kind
            assert got.logprobs == ref.logprobs, kind
        assert sum(sum(o.metrics.accepted_by_depth) for o in outs) > 0, kind
        llm.close()
