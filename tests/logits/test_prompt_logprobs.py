"""prompt_logprobs: every prompt token after the first gets the target's log-probability from the
row that decides it, in chunked prefill too, never from the prefix cache (a repeated prompt is
recomputed), the same with and without a drafter."""

from __future__ import annotations

import pytest
import torch
from logits_helpers import byte_model_fixture
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec import LLM, SamplingParams

byte_model = byte_model_fixture()
PROMPT = '{"name": "Bob", "age": 12} the cat sat on the mat, hello world'


@pytest.mark.parametrize("chunk", [None, 8])
def test_prompt_logprobs_are_the_targets_and_never_cached(byte_model, chunk):
    tok = AutoTokenizer.from_pretrained(byte_model)
    ids = tok(PROMPT).input_ids
    hf = AutoModelForCausalLM.from_pretrained(byte_model, dtype=torch.float64)
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0], dim=-1)
    kw = {} if chunk is None else {"max_num_batched_tokens": chunk}
    llm = LLM(model=byte_model, dtype="float64", drafter="ngram", enable_prefix_caching=True,
              page_size=4, **kw)
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)
    first, again = (llm.generate([PROMPT], params)[0] for _ in range(2))
    assert again.metrics.num_cached_tokens == 0  # recomputed: a cached page has no logits
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4))[0]
    assert plain.metrics.num_cached_tokens > 0 and plain.prompt_logprobs is None
    for out in (first, again):
        lps = out.prompt_logprobs
        assert len(lps) == len(ids) and lps[0] is None
        for j in range(1, len(ids)):
            lp = lps[j]
            assert lp.token_id == ids[j]
            assert lp.logprob == pytest.approx(float(logp[j - 1, ids[j]]), abs=1e-6)
            assert [i for i, _ in lp.top] == torch.topk(logp[j - 1], 2).indices.tolist()
    assert [x.logprob for x in first.prompt_logprobs[1:]] == \
        [x.logprob for x in again.prompt_logprobs[1:]]
    assert first.token_ids == plain.token_ids
    assert not llm.engine.requests
