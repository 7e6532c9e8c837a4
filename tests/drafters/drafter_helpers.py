"""What the drafter tests share: prompts, a greedy float64 run, a spy on proposals, random
EAGLE-3 heads and block-diffusion drafters for a target, and the sampling chi-square check."""

from __future__ import annotations

import torch

from specdec import LLM, SamplingParams
from specdec.models.heads.block_diffusion import BlockDiffusionConfig, BlockDiffusionModel
from specdec.models.heads.eagle3 import Eagle3Config, Eagle3Head

PROMPTS = [[5, 6, 7, 8, 5, 6, 9, 5, 6], [3, 4, 3, 4, 3], [9, 8, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9],
           [11, 12], [7, 7, 7, 7], [40, 41, 42, 40, 41], [60]]


def greedy(folder, prompts, **kw) -> list:
    """Greedy float64 outputs (24 tokens, static controller unless given), none failed."""
    llm = LLM(model=str(folder), dtype="float64", **{"controller": "static", **kw})
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.error for o in outs] == [None] * len(prompts)
    return outs


def record_proposals(monkeypatch, drafter_cls) -> list:
    """Record (token ids, budget, tree) of every proposal of ``drafter_cls``."""
    seen = []
    original = drafter_cls.propose

    def spy(self, requests):
        trees = original(self, requests)
        seen.extend((r.token_ids.tolist(), r.budget, t) for r, t in zip(requests, trees))
        return trees

    monkeypatch.setattr(drafter_cls, "propose", spy)
    return seen


def random_head(model, cfg, hf, draft_vocab: int = 64, seed: int = 0,
                aux_layer_ids: tuple[int, int, int] | None = None) -> Eagle3Head:
    """A random EAGLE-3 head for ``model`` (on its device, in its dtype; EAGLE-3's default
    layers unless ``aux_layer_ids``: a target of fewer than 4 layers needs them)."""
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(cfg, draft_vocab, aux_layer_ids), model.embed, hf)
    head.reset_parameters(0.5)  # large weights: peaked, tie-free distributions
    used = torch.randperm(cfg.vocab_size)[:draft_vocab].sort().values
    head.set_vocab(used.to(model.embed.device))
    return head


def random_block_diffusion(model, cfg, hf, block_size: int = 4, seed: int = 0,
                           rates=None) -> BlockDiffusionModel:
    """A block-diffusion drafter for ``model`` (3+ layers), initialised from it and perturbed."""
    torch.manual_seed(seed)
    c = BlockDiffusionConfig.for_target(cfg, 64, num_layers=2, block_size=block_size,
                                        target_layer_ids=(0, 2))
    bd = BlockDiffusionModel(c, model.embed, hf)
    bd.init_from_target(model, torch.randperm(cfg.vocab_size)[:64].sort().values)
    with torch.no_grad():  # away from the target's copy, so that a mix-up shows
        for p in bd.parameters():
            p.add_(0.05 * torch.randn_like(p))
    bd.rank_acceptance = rates
    return bd


def sampling_target(tmp_path):
    """(folder, float64 model, cfg, hf config) of the 16-token target the sampling tests use."""
    from conftest import make_tiny_model
    from test_spec_sampling import V

    from specdec.models.loader import load_model

    folder = make_tiny_model(tmp_path / "v16", seed=1, vocab_size=V, eos_token_id=V - 1,
                             hidden_size=32)
    return (folder, *load_model(folder, torch.float64, "cpu", 64))


def assert_samples_follow_target(folder, drafter: str, drafter_args: dict, **engine) -> None:
    """Sampled decoding with ``drafter`` (float64, static budget 4, unless ``engine`` — LLM
    keywords — says otherwise): more than 100 drafts accepted, and tokens 2 and 3 follow the
    target's exact joint distribution (chi-square, p > 1e-3)."""
    from collections import Counter

    from test_spec_sampling import N_SAMPLES, PARAMS, PROMPT, V, chi_square_pvalue, exact_joint

    engine = {"dtype": "float64", "controller": "static", "controller_args": {"budget": 4},
              **engine}
    llm = LLM(model=str(folder), drafter=drafter, drafter_args=drafter_args, max_num_seqs=512,
              max_num_batched_tokens=4096, **engine)
    outs = llm.generate([PROMPT] * N_SAMPLES,
                        [SamplingParams(**PARAMS, seed=s) for s in range(N_SAMPLES)])
    assert sum(sum(o.metrics.accepted_by_depth) for o in outs) > 100  # drafts really decide
    grid = torch.zeros(V, V, dtype=torch.float64)
    for (a, b), c in Counter(tuple(o.token_ids[1:3]) for o in outs).items():
        grid[a, b] = c
    exact = exact_joint(folder, PROMPT).sum(dim=0)
    assert chi_square_pvalue(grid.flatten(), exact.flatten()) > 1e-3
