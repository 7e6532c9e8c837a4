"""Speculation is exact in every precision the CPU kernels cover: with the row-invariant prepared
linears and attention (the default), greedy speculative output equals plain output token for
token in float32, bfloat16 and float16, and a seed's sampled text (gumbel verifier) is the same
with and without speculation — not only in float64. Batch 1 and 8, a chain drafter (the
target's first layer) and a tree drafter (EAGLE-3). (Row invariance itself, logits bitwise:
test_row_invariance.py.)"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model

from specdec import LLM, SamplingParams, native

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(native.load() is None, reason="the compiled kernels are not "
                                 "built (test_native.py says why)")]

PROMPTS = [[5, 6, 7, 8, 5, 6, 9, 5, 6], [3, 4, 3, 4, 3], [9, 8, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9],
           [11, 12], [7, 7, 7, 7], [10, 11, 12, 10, 11], [6]]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
SAMPLED = [SamplingParams(temperature=0.8, seed=50 + i, max_tokens=20, ignore_eos=True)
           for i in range(len(PROMPTS))]


def _drafter_args(folder, dtype: str, drafter: str) -> dict:
    """A chain drafter (the target's first layer) or a tree drafter (a random EAGLE-3 head,
    top-2 at every level)."""
    if drafter == "draft_model":
        return {"early_exit_layers": 1, "max_depth": 3}
    from specdec.models.heads.eagle3 import Eagle3Config, Eagle3Head
    from specdec.models.loader import load_model

    model, cfg, hf = load_model(folder, getattr(torch, dtype), "cpu", 64)
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_target(cfg, 12, (1, 2, 2)), model.embed, hf)
    head.reset_parameters(0.5)
    head.set_vocab(torch.arange(12))
    return {"head": head.to(getattr(torch, dtype)), "depth": 3, "topk": 2}


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Wide enough (hidden 256) that one-row and many-row matmuls take different paths; 16
    tokens, so that even random drafters are accepted now and then."""
    return make_tiny_model(tmp_path_factory.mktemp("wide"), seed=7, hidden_size=256,
                           vocab_size=16, eos_token_id=15,
                           intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                           num_hidden_layers=3)


def _tokens(folder, dtype, params, batch, **kw) -> list[list[int]]:
    llm = LLM(model=str(folder), dtype=dtype, max_num_seqs=batch, **kw)
    outs = llm.generate(PROMPTS, params)
    assert [o.error for o in outs] == [None] * len(outs)
    if kw.get("drafter"):
        assert sum(sum(o.metrics.accepted_by_depth) for o in outs) > 0
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("drafter", ["draft_model", "eagle3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_greedy_and_seeded_speculation_equal_plain(wide, dtype, drafter, batch):
    spec = dict(drafter=drafter, drafter_args=_drafter_args(wide, dtype, drafter),
                controller="static", controller_args={"budget": 4})
    for params in (GREEDY, SAMPLED):
        assert _tokens(wide, dtype, params, batch, **spec) == _tokens(wide, dtype, params, 8)


@pytest.mark.slow
def test_smollm2_bfloat16_speculation_equals_plain(smollm2_dir):
    """The real model in bfloat16 (where the kernels change a step's numerics most against
    F.linear): ngram speculation at batch 2 gives the plain tokens, greedy and seeded."""
    prompts = ["List the planets of the solar system, one per line.", "def fibonacci(n):"]
    kw = dict(model=str(smollm2_dir), dtype="bfloat16", max_model_len=256)
    plain = LLM(**kw)
    spec = LLM(drafter="ngram", controller="static", controller_args={"budget": 6}, **kw)
    for sp in (SamplingParams(temperature=0, max_tokens=40),
               SamplingParams(temperature=0.8, seed=7, max_tokens=40)):
        want = [o.token_ids for o in plain.generate(prompts, sp)]
        got = spec.generate(prompts, sp)
        assert [o.token_ids for o in got] == want
    assert sum(o.metrics.num_target_forwards for o in got) < sum(len(w) for w in want)
