"""Drafters whose own runner is graphed too (the EAGLE-3 head: per-row features; the block-
diffusion drafter: features and context rows), on the CPU: every runner of the engine replays
graphs (graph_helpers.py) over the flashinfer API model, and greedy speculation still gives the
plain output token for token."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model
from drafter_helpers import PROMPTS, greedy, random_block_diffusion, random_head
from graph_helpers import graph_everything

from specdec import LLM, SamplingParams
from specdec.models.loader import load_model


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("graphs"), num_hidden_layers=4, seed=4)
    model, cfg, hf = load_model(folder, torch.float64, "cpu", 512)
    return folder, model, cfg, hf


@pytest.mark.parametrize("drafter", ["eagle3", "block_diffusion"])
def test_graphed_drafter_runners_keep_greedy_exact(target, flashinfer_api_model, drafter):
    folder, model, cfg, hf = target
    prompts = PROMPTS[:3]
    want = [o.token_ids for o in greedy(folder, prompts)]
    args = ({"head": random_head(model, cfg, hf), "depth": 3, "topk": 2} if drafter == "eagle3"
            else {"model": random_block_diffusion(model, cfg, hf), "topk": 2})
    llm = LLM(model=str(folder), dtype="float64", attention_backend="flashinfer",
              drafter=drafter, drafter_args=args, controller="static",
              controller_args={"budget": 5}, max_num_seqs=8, max_num_batched_tokens=64)
    capture = graph_everything(llm.engine)
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in got] == want
    drafter_graphs = llm.engine.parts.drafter_runners[0].graphs
    assert drafter_graphs.num_graphs > 0  # the drafter's own steps went through graphs
    assert sum(g.replays for g in capture.graphs) > llm.engine.totals.steps
    assert all(o.metrics.draft_tokens_proposed > 0 for o in got)
    for runner in [llm.engine.parts.runner, *llm.engine.parts.drafter_runners]:  # no page leaked
        assert runner.kv.pool.num_free == runner.kv.pool.num_pages - len(runner.graphs.scratch)
