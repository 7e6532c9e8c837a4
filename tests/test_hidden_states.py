"""Drafters that declare `hidden_layers` get, in `on_verified`, the target's hidden states of
exactly the tokens each step committed (prefill chunks, fed tokens, accepted tree nodes)."""

from __future__ import annotations

import torch
from conftest import OracleTree, oracle_plugin

from specdec import LLM, SamplingParams

PROMPT = list(range(3, 40))


class Recorder(OracleTree):
    """The oracle drafter (wrong first sibling, true continuation second), asking for layer 0's
    hidden states and recording every VerifiedStep."""

    hidden_layers = (0,)

    def __init__(self, target, truth, depth):
        super().__init__(target, truth, depth)
        self.steps = []

    def on_verified(self, state, step):
        self.steps.append(step)


def test_hidden_states_of_committed_tokens_match_hf(tiny_llama):
    from transformers import AutoModelForCausalLM

    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = LLM(model=str(tiny_llama), dtype="float64")
    truth = PROMPT + plain.generate([PROMPT], params)[0].token_ids
    llm = LLM(model=str(tiny_llama), dtype="float64", drafter="oracle",
              plugins=(oracle_plugin(truth, depth=2, cls=Recorder),), controller_args={"budget": 3},
              max_num_batched_tokens=16)  # the 37-token prompt comes in three chunks
    out = llm.generate([PROMPT], params)[0]
    steps = llm.engine.drafting.drafter.steps
    assert sum(s.num_accepted for s in steps) > 5 and any(s.num_proposed == 0 for s in steps)
    rows = torch.cat([s.hidden[0] for s in steps])
    for before, s in zip(steps, steps[1:]):  # committed ranges tile the sequence
        assert s.num_computed - s.num_committed == before.num_computed
    n = steps[-1].num_computed
    assert rows.shape == (n, 32)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float64)
    with torch.no_grad():
        ref = hf(torch.tensor([(PROMPT + out.token_ids)[:n]]), output_hidden_states=True)
    torch.testing.assert_close(rows, ref.hidden_states[1][0], rtol=1e-6, atol=1e-6)
