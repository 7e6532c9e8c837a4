"""Speculation equals plain decoding under tensor parallelism (issue #54's tests) for the drafters
test_tp_engine.py leaves out: MTP, block diffusion, a separate draft model and a composition, at
TP 2 (MTP at TP 3 too), with trees and chains (static budgets), a batch of 4 prompts, preemption
(a KV of 12 pages of 4 tokens for 4 requests of ~26 tokens) and prefix-cache hits (a second
generate on the same engine, its prompts extending the first call's). A draft_model drafting
with the target's own early layers is refused at TP 2. No process outlives an engine."""

from __future__ import annotations

import multiprocessing
import sys
from pathlib import Path

import pytest
import torch

from specdec import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(0, str(Path(__file__).parents[1] / "drafters"))
from conftest import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.xdist_group("distributed_spawn")

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4], [7, 8, 9, 7, 8, 9, 7, 8], [11, 12, 13, 14, 11, 12],
           [20, 21, 22, 23, 24, 25, 20, 21, 22]]
AGAIN = [p + [40, 41, 42] for p in PROMPTS]  # the first call's prompts, extended: cache hits
# a KV too small for the batch (4 x ~26 tokens in 12 pages of 4): requests are preempted
SMALL_KV = dict(max_model_len=40, page_size=4, num_pages=12)
TREE = {"budget": 8, "max_depth": 3}  # more nodes than levels: trees (top-k drafters)
CHAIN = {"budget": 4, "max_depth": 4}  # as many nodes as levels


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(folder, model, cfg, hf) of a target TP 2 and 3 split: 12 heads over 6 KV heads, an MLP
    of 96, 4 layers (block diffusion reads layers 0 and 2)."""
    from specdec.models.loader import load_model

    folder = make_tiny_model(tmp_path_factory.mktemp("tp_spec") / "m", hidden_size=96,
                             intermediate_size=96, num_attention_heads=12,
                             num_key_value_heads=6, num_hidden_layers=4)
    return (folder, *load_model(folder, torch.float32, "cpu", 64))


@pytest.fixture(scope="module")
def draft_folder(tmp_path_factory):
    """A separate, smaller draft model over the target's vocabulary (run on rank 0 only)."""
    return make_tiny_model(tmp_path_factory.mktemp("tp_draft") / "d", seed=3)


def run(folder, tp: int, **kw) -> tuple[list[list[int]], int, int]:
    """Greedy tokens of PROMPTS then AGAIN on one engine with the small KV; the preemptions and
    the prompt tokens read from the prefix cache over both calls. No process is left, and this
    process's torch threads are as they were (rank 0 takes its share while the engine runs)."""
    threads = torch.get_num_threads()
    with LLM(model=str(folder), tensor_parallel_size=tp, **SMALL_KV, **kw) as llm:
        outs = llm.generate(PROMPTS, GREEDY) + llm.generate(AGAIN, GREEDY)
    assert not multiprocessing.active_children()  # the workers ended with the engine
    assert torch.get_num_threads() == threads
    assert [o.error for o in outs] == [None] * len(outs)
    return ([o.token_ids for o in outs], sum(o.metrics.num_preemptions for o in outs),
            sum(o.metrics.num_cached_tokens for o in outs))


@pytest.fixture(scope="module")
def plain2(target):
    tokens, preempted, cached = run(target[0], 2)
    assert preempted > 0, "the small KV must preempt, or the test shows nothing of it"
    assert cached > 0, "the second call must read the prefix cache"
    return tokens


def mtp(target) -> dict:
    from specdec.models.heads.mtp import MTPConfig, MTPHeads

    _, model, cfg, _ = target
    torch.manual_seed(0)
    heads = MTPHeads(MTPConfig.for_target(cfg, 64, 3), torch.float32)
    heads.init_from_target(model.head_weight,
                           torch.randperm(cfg.vocab_size)[:64].sort().values)
    return dict(drafter="mtp", drafter_args={"heads": heads, "topk": 3})


def block_diffusion(target) -> dict:
    """Block diffusion's rank-1 tokens only (topk 1): chains."""
    from drafter_helpers import random_block_diffusion

    _, model, cfg, hf = target
    return dict(drafter="block_diffusion", drafter_args={
        "model": random_block_diffusion(model, cfg, hf), "topk": 1})


def spy_trees(monkeypatch, drafter_cls) -> list:
    """The trees ``drafter_cls`` proposes (rank 0 runs every drafter: in this process)."""
    seen = []
    original = drafter_cls.propose

    def propose(self, requests):
        trees = original(self, requests)
        seen.extend(trees)
        return trees

    monkeypatch.setattr(drafter_cls, "propose", propose)
    return seen


def shapes(trees) -> set[str]:
    return {"tree" if len(set(t.parents.tolist())) < t.num_nodes else "chain"
            for t in trees if t.num_nodes > 1}


@pytest.mark.parametrize("case", ["mtp_trees", "block_diffusion_chains", "draft_model",
                                  "ngram+suffix_trees"])
def test_speculation_is_plain_decoding_at_tp2(target, draft_folder, plain2, case,
                                              monkeypatch):
    from specdec.drafters.block_diffusion import BlockDiffusionDrafter
    from specdec.drafters.mtp import MTPDrafter

    if case == "mtp_trees":
        kw, budget, spied = mtp(target), TREE, spy_trees(monkeypatch, MTPDrafter)
    elif case == "block_diffusion_chains":
        kw, budget = block_diffusion(target), CHAIN
        spied = spy_trees(monkeypatch, BlockDiffusionDrafter)
    elif case == "draft_model":
        kw, budget, spied = dict(drafter="draft_model", drafter_args={
            "model": str(draft_folder), "max_depth": 4}), {"budget": 4}, None
    else:  # a composition, ngram's matches merged into trees
        kw, budget, spied = dict(drafter="ngram+suffix", drafter_args={
            "ngram": {"min_ngram": 1, "max_matches": 3, "max_depth": 3}}), TREE, None
    tokens, preempted, cached = run(target[0], 2, controller="static",
                                    controller_args=budget, **kw)
    assert tokens == plain2
    assert preempted > 0 and cached > 0
    if spied is not None:  # trees among the drafts (a step near the end clips to a chain)
        assert "tree" in shapes(spied) if budget is TREE else shapes(spied) == {"chain"}


class PlainThenTrees:
    """Budget 0 (plain decoding: no drafts in the step) for the first call's requests (ids
    0..3), TREE for the later ones: plain and speculative decoding on one engine."""

    name = "plain_then_trees"

    def budgets(self, requests, batch):
        from specdec.controllers.base import DraftBudget

        return [DraftBudget(0) if int(r.request_id) < len(PROMPTS) else DraftBudget(
            TREE["budget"], TREE["max_depth"]) for r in requests]

    def observe(self, report):
        pass


class PlainThenTreesPlugin:
    from specdec.hookspecs import hookimpl

    @hookimpl
    def specdec_controllers(self):
        return {"plain_then_trees": PlainThenTrees}


def test_speculation_is_plain_decoding_at_tp3(target):
    """MTP's trees at 3 ranks (each 4 heads over 2 KV heads, 32 of the MLP), against plain
    decoding of the same prompts on the same engine (one engine: 3 ranks on 2 cores start
    slowly), the second time partly from the prefix cache."""
    with LLM(model=str(target[0]), tensor_parallel_size=3, max_model_len=64,
             controller="plain_then_trees", plugins=(PlainThenTreesPlugin(),),
             **mtp(target)) as llm:
        plain = llm.generate(PROMPTS, GREEDY)
        spec = llm.generate(PROMPTS, GREEDY)
    assert [o.metrics.draft_tokens_proposed for o in plain] == [0] * len(PROMPTS)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.metrics.draft_tokens_proposed for o in spec) > 0
    assert not multiprocessing.active_children()


def test_draft_model_early_exit_is_refused_at_tp2_before_any_process(target):
    with pytest.raises(ValueError, match=r"early_exit_layers=1 .*tensor_parallel_size=2"):
        LLM(model=str(target[0]), tensor_parallel_size=2, drafter="draft_model",
            drafter_args={"early_exit_layers": 1})
    assert not multiprocessing.active_children()
