"""One engine step by hand, for the row-invariance tests (tests/test_row_invariance.py,
tests/models/test_moe_invariance.py): a request prefilled but its last token, then one verify
step of several requests (each its last token plus a draft tree) in one forward."""

from __future__ import annotations

import torch

from specdec import SamplingParams
from specdec.engine.batch import build_forward_batch
from specdec.engine.sequence import Sequence
from specdec.engine.step import StepRequest
from specdec.tree import DraftTree


def prefilled(eng, request_id: str, prompt: list[int]) -> Sequence:
    """A request whose prompt but the last token is in the KV (its next step feeds that one)."""
    seq = Sequence(request_id, list(prompt), SamplingParams(temperature=0), None)
    rec = StepRequest(seq, len(prompt) - 1)
    eng.kv.reserve(seq.block_table, len(prompt) - 1)
    eng.parts.runner.forward(build_forward_batch([rec], eng.config.page_size, eng.parts.device))
    seq.num_computed = len(prompt) - 1
    return seq


def step_logits(eng, seqs: list[Sequence], trees: list[DraftTree | None]) -> list[torch.Tensor]:
    """One verify step of ``seqs`` (each feeds its last token plus its tree) in one forward:
    per request its logits rows [1 + nodes, V] (the verifier's input)."""
    records = []
    for seq, tree in zip(seqs, trees):
        rec = StepRequest(seq, 1)
        rec.tree = tree
        eng.kv.reserve(seq.block_table, seq.num_computed + 1 + rec.num_nodes)
        records.append(rec)
    logits = eng.parts.runner.forward(build_forward_batch(records, eng.config.page_size,
                                                    eng.parts.device)).logits
    return [logits[r.logits_start:r.logits_start + 1 + r.num_nodes].clone() for r in records]
