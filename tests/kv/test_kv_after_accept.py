"""After acceptance the paged KV holds exactly what plain decoding of the same tokens holds, and
the next-step logits equal plain decoding's. An oracle drafter puts a wrong sibling first and the
target's true continuation second, so accepted nodes sit in non-final slots and the move of
accepted KV into place is exercised (and counted)."""

from __future__ import annotations

import torch
from conftest import oracle_plugin

from specdec import LLM, SamplingParams
from specdec.engine.batch import build_forward_batch
from specdec.engine.step import StepRequest

PROMPT = [5, 6, 7, 8, 5, 6, 9, 5, 6, 7, 2, 5, 6, 9, 1, 5, 6]


def sequence_kv(llm: LLM, seq, n: int) -> torch.Tensor:
    """[layers, n, 2, kv_heads, head_dim]: the KV of the first n tokens of seq."""
    cache, ps = llm.engine.kv.cache.tensor, llm.engine.config.page_size
    pages = torch.tensor([seq.block_table.pages[i // ps] for i in range(n)])
    offsets = torch.arange(n) % ps
    return cache[:, pages, :, offsets].transpose(0, 1)


def next_logits(llm: LLM, seq) -> torch.Tensor:
    """Logits after the sequence's last token, from its cached KV (the step plain decoding runs)."""
    eng = llm.engine
    req = StepRequest(seq, seq.num_tokens - seq.num_computed)
    eng.kv.reserve(seq.block_table, seq.num_tokens)
    batch = build_forward_batch([req], eng.config.page_size, eng.parts.device)
    return eng.parts.runner.forward(batch).logits[-1]


def test_kv_and_next_logits_after_tree_acceptance(tiny_llama, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    plain = LLM(model=str(tiny_llama), dtype="float64")
    truth = PROMPT + plain.generate([PROMPT], params)[0].token_ids
    spec = LLM(model=str(tiny_llama), dtype="float64", drafter="oracle",
               plugins=(oracle_plugin(truth),), controller="static",
               controller_args={"budget": 4})
    moves = []
    move = spec.engine.kv.cache.move_slots
    monkeypatch.setattr(spec.engine.kv.cache, "move_slots",
                        lambda src, dst: (moves.append(len(src)), move(src, dst)))
    rid = spec.engine.add_request(PROMPT, params)
    seq = spec.engine.requests[rid]
    while seq.num_output_tokens < 40:
        spec.engine.step()
    assert len(moves) >= 8, "accepted nodes sat outside their final slots and were moved"
    assert seq.token_ids == truth[: seq.num_tokens]

    pid = plain.engine.add_request(list(seq.token_ids), SamplingParams(temperature=0, max_tokens=2))
    pseq = plain.engine.requests[pid]
    pseq.num_computed = 0
    n = seq.num_computed
    ref_logits = _prefill_all_but_last(plain, pseq)
    assert torch.allclose(sequence_kv(spec, seq, n), sequence_kv(plain, pseq, n), atol=1e-10)
    assert torch.allclose(next_logits(spec, seq), ref_logits, atol=1e-10)


def _prefill_all_but_last(llm: LLM, seq) -> torch.Tensor:
    """Prefill every token of seq in one forward; return the last row's logits."""
    eng = llm.engine
    eng.scheduler.waiting.remove(seq)
    eng.kv.reserve(seq.block_table, seq.num_tokens)
    req = StepRequest(seq, seq.num_tokens)
    logits = eng.parts.runner.forward(build_forward_batch([req], eng.config.page_size, eng.parts.device)).logits
    seq.num_computed = seq.num_tokens
    return logits[-1]
