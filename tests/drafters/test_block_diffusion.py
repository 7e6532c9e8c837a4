"""Block-diffusion drafting: losslessness (greedy float64 at batch 1-8, sampling chi-square), the
paged batched forward and the training layout against a dense reference whose mask is written
out by hand (non-causal in the block, causal to the context), the masks themselves, and bad
drafters or arguments refused."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model
from drafter_helpers import (
    PROMPTS,
    assert_samples_follow_target,
    greedy,
    random_block_diffusion,
    record_proposals,
    sampling_target,
)

from specdec import LLM
from specdec.attention.block_masks import anchor_blocks_mask, block_mask
from specdec.attention.dense import DenseAttention
from specdec.drafters.block_diffusion import BlockDiffusionDrafter
from specdec.drafters.rank_tree import rank_paths
from specdec.models.heads.block_diffusion import BlockDiffusionConfig, BlockDiffusionModel
from specdec.models.loader import load_model
from specdec.training.block_loss import block_forward
from specdec.training.target import target_batch


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("bd"), seed=5, num_hidden_layers=3)
    model, cfg, hf = load_model(folder, torch.float64, "cpu", 512)
    return folder, model, cfg, hf


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_identical_to_plain(target, batch):
    folder, model, cfg, hf = target
    prompts = PROMPTS[:batch]
    plain = greedy(folder, prompts)
    spec = greedy(folder, prompts, drafter="block_diffusion",
                   drafter_args={"model": random_block_diffusion(model, cfg, hf)},
                   controller_args={"budget": 5})
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert all(o.metrics.draft_tokens_proposed > 0 for o in spec)


def test_block_mask_by_hand():
    # prefix 2 cached slots, 2 new context rows, block of 3
    m = block_mask(2, 2, 3)
    want = torch.tensor([[1, 1, 1, 0, 0, 0, 0],
                         [1, 1, 1, 1, 0, 0, 0],
                         [1, 1, 1, 1, 1, 1, 1],
                         [1, 1, 1, 1, 1, 1, 1],
                         [1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(m, want)
    # training: sequence 4, anchors 1 and 3, block 2
    t = anchor_blocks_mask(4, torch.tensor([[1, 3]]), 2)[0].int()
    assert t[4:].tolist() == [[1, 0, 0, 0, 1, 1, 0, 0], [1, 0, 0, 0, 1, 1, 0, 0],
                              [1, 1, 1, 0, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0, 1, 1]]
    assert torch.equal(t[:4, :4], torch.eye(4, dtype=torch.int32)) and not t[:4, 4:].any()


def _reference_block(model, bd, tokens: list[int]) -> torch.Tensor:
    """Final-normed block states [B, H] for a request with ``tokens`` (N committed), computed
    densely with the mask written out: context rows 0..N-2 see only themselves; block row i
    (position N-1+i, input: token N-1 or MASK_i, plus the fused state of position N-2) sees every
    context row and every block row."""
    n, b = len(tokens), bd.config.block_size
    with torch.no_grad():
        out = model.forward_dense(torch.tensor([tokens[:-1]]),
                                  capture_layers=bd.config.target_layer_ids)
        aux = torch.cat([out.layer_hidden[j][0] for j in bd.config.target_layer_ids], -1)
        ctx = bd.fuse(aux)
        rows = (n - 1) + b
        mask = torch.zeros(rows, rows, dtype=torch.bool)
        for i in range(rows):
            for j in range(rows):
                mask[i, j] = (i == j) if i < n - 1 else True
        ids = [0] * (n - 1) + [tokens[-1]] + [96 + i for i in range(b - 1)]  # vocab 96
        feats = torch.cat([ctx, ctx[-1].expand(b, -1)])
        flags = torch.tensor([True] * (n - 1) + [False] * b)
        hidden = bd(torch.tensor(ids), torch.arange(rows), DenseAttention(mask[None]), None,
                    features=feats, context_rows=flags).hidden
    return hidden[n - 1:]


def test_paged_batched_forward_and_training_layout_equal_the_dense_reference(target,
                                                                             monkeypatch):
    folder, model, cfg, hf = target
    rates = [[0.8, 0.1], [0.6, 0.2], [0.5, 0.1]]
    bd = random_block_diffusion(model, cfg, hf, seed=2, rates=rates)
    seen = record_proposals(monkeypatch, BlockDiffusionDrafter)
    greedy(folder, PROMPTS[:6], drafter="block_diffusion",
            drafter_args={"model": bd, "topk": 2}, controller_args={"budget": 5})
    assert len(seen) > 10
    rt = tuple(tuple(r) for r in rates)
    for tokens, budget, tree in seen:
        if len(tokens) < 2:
            continue
        ref = _reference_block(model, bd, tokens)
        probs = bd.compute_logits(ref[1:]).softmax(-1)
        top = probs.topk(2, dim=-1)
        paths = rank_paths(rt, budget.max_nodes, budget.depth_limit)
        want = [int(bd.token_map[top.indices[len(p) - 1, p[-1]]]) for p in paths]
        assert tree.tokens.tolist() == want
        torch.testing.assert_close(tree.path_probs.double()[:1], top.values[0, :1].float().double())
    # the training layout (many anchors, one dense forward) gives the same block states
    seq = PROMPTS[3] + [2, 9, 4]
    ids = torch.tensor([seq])
    valid = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        tb = target_batch(model, bd.config.target_layer_ids, bd.token_map, ids, valid,
                          teacher=False)
        anchors = torch.tensor([[1, 4, 8]])
        got = block_forward(bd, tb, ids, anchors)[0]
    for a, t in enumerate(anchors[0].tolist()):
        torch.testing.assert_close(got[a], _reference_block(model, bd, seq[:t + 1]))


def test_drafter_for_another_target_is_refused(target, tiny_llama):
    folder, model, cfg, hf = target
    bd = random_block_diffusion(model, cfg, hf)
    with pytest.raises(ValueError, match="layer count 3.*layer count 2"):
        LLM(model=str(tiny_llama), dtype="float64", drafter="block_diffusion",
            drafter_args={"model": bd})


def test_bad_args(target):
    folder, model, cfg, hf = target
    for bad in ({"topk": 0}, {"topk": 1.5}, {}):
        with pytest.raises(ValueError, match="block_diffusion"):
            LLM(model=str(folder), dtype="float64", drafter="block_diffusion", drafter_args=bad)


def test_sampled_tokens_follow_the_target(tmp_path):
    """Sampled decoding with block-diffusion drafts (deterministic, the q = 1 rule): tokens 2 and
    3 follow the target's exact joint distribution (chi-square over a 16-token vocabulary)."""
    folder, model, cfg, hf = sampling_target(tmp_path)
    c = BlockDiffusionConfig.for_target(cfg, 12, num_layers=1, block_size=3,
                                        target_layer_ids=(1,))
    bd = BlockDiffusionModel(c, model.embed, hf)
    bd.init_from_target(model, torch.arange(12))
    assert_samples_follow_target(folder, "block_diffusion", {"model": bd, "topk": 2})
