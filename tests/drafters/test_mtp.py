"""MTP drafting: losslessness (greedy float64 at batch 1-8, sampling chi-square), the tree is the
calibrated rank-path shape over the heads' top choices of the right hidden state, and bad heads
or arguments are refused."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model
from drafter_helpers import (
    PROMPTS,
    assert_samples_follow_target,
    greedy,
    record_proposals,
    sampling_target,
)

from specdec import LLM
from specdec.drafters.mtp import MTPDrafter
from specdec.drafters.rank_tree import rank_paths
from specdec.models.heads.mtp import MTPConfig, MTPHeads
from specdec.models.loader import load_model


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("mtp"), seed=3)
    model, cfg, hf = load_model(folder, torch.float64, "cpu", 512)
    return folder, model, cfg


def random_heads(model, cfg, num_heads: int = 3, draft_vocab: int = 64, seed: int = 0,
                 rates=None) -> MTPHeads:
    torch.manual_seed(seed)
    heads = MTPHeads(MTPConfig.for_target(cfg, draft_vocab, num_heads), torch.float64)
    used = torch.randperm(cfg.vocab_size)[:draft_vocab].sort().values
    heads.init_from_target(model.head_weight, used)
    with torch.no_grad():
        heads.blocks.normal_(0.0, 0.3)
    heads.rank_acceptance = rates
    return heads


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_identical_to_plain(target, batch):
    folder, model, cfg = target
    prompts = PROMPTS[:batch]
    plain = greedy(folder, prompts)
    spec = greedy(folder, prompts, drafter="mtp", drafter_args={"heads": random_heads(model, cfg)},
                   controller_args={"budget": 6})
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert all(o.metrics.draft_tokens_proposed > 0 for o in spec)


def test_heads_read_the_last_committed_state_and_trees_take_the_calibrated_shape(
        target, monkeypatch):
    """Every proposal's tree equals the rank paths of the calibration, filled with the top
    tokens of each head run densely on the target's final state at position N - 2."""
    folder, model, cfg = target
    rates = [[0.7, 0.2, 0.1], [0.5, 0.3, 0.05], [0.4, 0.1, 0.1]]
    heads = random_heads(model, cfg, rates=rates, seed=1)
    seen = record_proposals(monkeypatch, MTPDrafter)
    greedy(folder, PROMPTS[:5], drafter="mtp", drafter_args={"heads": heads, "topk": 3},
            controller_args={"budget": 7})
    assert len(seen) > 10
    rt = tuple(tuple(r) for r in rates)
    for tokens, budget, tree in seen:
        paths = rank_paths(rt, budget.max_nodes, budget.depth_limit)
        with torch.no_grad():
            ids = torch.tensor([tokens[:-1]])
            state = model.forward_dense(ids).hidden[0, -1]  # final-normed, position N - 2
            probs = heads.compute_logits(heads(state)).softmax(-1)  # [num_heads, Vd]
        top = probs.topk(3, dim=-1)
        want = [int(heads.token_map[top.indices[len(p) - 1, p[-1]]]) for p in paths]
        assert tree.tokens.tolist() == want
        parents = [paths.index(p[:-1]) if len(p) > 1 else -1 for p in paths]
        assert tree.parents.tolist() == parents
        tree.validate(max_nodes=budget.max_nodes, vocab_size=cfg.vocab_size)


def test_only_the_heads_a_budget_reaches_run(target, monkeypatch):
    """A depth-1 budget runs head 0 alone (its draft costs one head, not all of them)."""
    folder, model, cfg = target
    heads = random_heads(model, cfg, num_heads=3)
    ran, original = [], MTPHeads.head
    monkeypatch.setattr(MTPHeads, "head", lambda self, i, x: ran.append(i) or original(self, i, x))
    plain = greedy(folder, PROMPTS[:2])
    for depth in (1, 2):
        ran.clear()
        spec = greedy(folder, PROMPTS[:2], drafter="mtp", drafter_args={"heads": heads},
                      controller="static", controller_args={"budget": depth})
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
        assert ran and set(ran) == set(range(depth))


def test_heads_for_another_target_are_refused(target):
    folder, model, cfg = target
    heads = MTPHeads(MTPConfig(cfg.hidden_size, cfg.vocab_size, 64, 2, 1, cfg.num_layers + 1),
                     torch.float64)
    with pytest.raises(ValueError, match="layer count 3.*layer count 2"):
        LLM(model=str(folder), dtype="float64", drafter="mtp", drafter_args={"heads": heads})


def test_bad_args(target):
    folder, model, cfg = target
    for bad in ({"topk": 0}, {"topk": "2"}, {}):
        with pytest.raises(ValueError, match="mtp"):
            LLM(model=str(folder), dtype="float64", drafter="mtp", drafter_args=bad)


def test_sampled_tokens_follow_the_target(tmp_path):
    """Sampled decoding with MTP trees (deterministic drafts, the q = 1 rule): tokens 2 and 3
    follow the target's exact joint distribution (chi-square over a 16-token vocabulary)."""
    folder, model, cfg, hf = sampling_target(tmp_path)
    heads = MTPHeads(MTPConfig.for_target(cfg, 12, 2), torch.float64)
    heads.init_from_target(model.head_weight, torch.arange(12))
    assert_samples_follow_target(folder, "mtp", {"heads": heads, "topk": 2})
