"""Drafters that declare `hidden_layers` get, in `on_verified`, the target's hidden states of
exactly the tokens each step committed (prefill chunks, fed tokens, accepted tree nodes)."""

from __future__ import annotations

import torch
from conftest import OracleTree, oracle_plugin

from specdec import LLM, SamplingParams

PROMPT = list(range(3, 40))


class Recorder(OracleTree):
    """The oracle drafter (wrong first sibling, true continuation second), asking for layer 0's
    hidden states and recording, per step and request, the VerifiedRequest and its rows."""

    hidden_layers = (0,)

    def __init__(self, target, truth, depth):
        super().__init__(target, truth, depth)
        self.steps = []

    def on_verified(self, batch):
        for i, r in enumerate(batch.requests):
            self.steps.append((r, batch.hidden_of(i)))


def test_hidden_states_of_committed_tokens_match_hf(tiny_llama):
    from transformers import AutoModelForCausalLM

    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = LLM(model=str(tiny_llama), dtype="float64")
    truth = PROMPT + plain.generate([PROMPT], params)[0].token_ids
    llm = LLM(model=str(tiny_llama), dtype="float64", drafter="oracle",
              plugins=(oracle_plugin(truth, depth=2, cls=Recorder),), controller="static",
              controller_args={"budget": 3},
              max_num_batched_tokens=16)  # the 37-token prompt comes in three chunks
    out = llm.generate([PROMPT], params)[0]
    recorded = llm.engine.drafting.drafter.plugin.steps
    steps = [r for r, _ in recorded]
    assert sum(s.num_accepted for s in steps) > 5 and any(s.num_proposed == 0 for s in steps)
    assert all(h[0].shape == (s.num_committed, 32) for s, h in recorded)
    rows = torch.cat([h[0] for _, h in recorded])
    for before, s in zip(steps, steps[1:]):  # committed ranges tile the sequence
        assert s.num_computed - s.num_committed == before.num_computed
    n = steps[-1].num_computed
    assert rows.shape == (n, 32)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float64)
    with torch.no_grad():
        ref = hf(torch.tensor([(PROMPT + out.token_ids)[:n]]), output_hidden_states=True)
    torch.testing.assert_close(rows, ref.hidden_states[1][0], rtol=1e-6, atol=1e-6)


def test_hidden_rows_of_each_request_in_a_batch(tiny_llama):
    """Two requests per step (one chunked): each request's rows (``hidden_of``) are its own."""
    from transformers import AutoModelForCausalLM

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [PROMPT, [7, 8, 9, 7, 8]]
    plain = LLM(model=str(tiny_llama), dtype="float64")
    truth = PROMPT + plain.generate([PROMPT], params)[0].token_ids
    llm = LLM(model=str(tiny_llama), dtype="float64", drafter="oracle",
              plugins=(oracle_plugin(truth, depth=2, cls=Recorder),), controller="static",
              controller_args={"budget": 3}, max_num_batched_tokens=16)
    outs = llm.generate(prompts, params)
    recorded = llm.engine.drafting.drafter.plugin.steps
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float64)
    for prompt, out in zip(prompts, outs):
        mine = [(r, h) for r, h in recorded if r.request_id == out.request_id]
        assert sum(r.num_committed for r, _ in mine) == mine[-1][0].num_computed
        rows = torch.cat([h[0] for _, h in mine])
        n = rows.shape[0]
        with torch.no_grad():
            ref = hf(torch.tensor([(prompt + out.token_ids)[:n]]), output_hidden_states=True)
        torch.testing.assert_close(rows, ref.hidden_states[1][0], rtol=1e-6, atol=1e-6)
    assert sum(r.num_accepted for r, _ in recorded) > 0
