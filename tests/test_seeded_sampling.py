"""A seed gives the same text with and without speculation, under any controller, batch and
drafter (the default gumbel verifier; float64, so that no near-tie of the perturbed logits can
flip between a 1-row and a k-row forward).

Every built-in drafter (ngram, a sampling draft model, EAGLE-3, MTP, block diffusion; random
learned heads) runs under the static controller and under goodput (with injected step costs, so
that it drafts whatever this machine's speed), one request at a time and eight at once; each
request's tokens must equal plain sampling's for its seed, and drafts must really have been
accepted (else the check would be empty).
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model

from specdec import LLM, SamplingParams
from specdec.controllers.costs import StepCosts
from specdec.models.heads.block_diffusion import BlockDiffusionConfig, BlockDiffusionModel
from specdec.models.heads.eagle3 import Eagle3Config, Eagle3Head
from specdec.models.heads.mtp import MTPConfig, MTPHeads
from specdec.models.loader import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
V = 16
PROMPTS = [[5, 6, 7, 8, 5, 6, 9, 5, 6], [3, 4, 3, 4, 3], [9, 8, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9],
           [11, 12], [7, 7, 7, 7], [10, 11, 12, 10, 11], [6]]
PARAMS = [SamplingParams(temperature=0.8, top_p=0.95, seed=1000 + i, max_tokens=14,
                         ignore_eos=True) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("seeded"), seed=1, vocab_size=V,
                             eos_token_id=V - 1, num_hidden_layers=3)
    model, cfg, hf = load_model(folder, torch.float64, "cpu", 64)
    return folder, model, cfg, hf


def _drafters(model, cfg, hf) -> dict[str, dict]:
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_target(cfg, 12, (1, 2, 2)), model.embed, hf)
    head.reset_parameters(0.5)
    head.set_vocab(torch.arange(12))
    heads = MTPHeads(MTPConfig.for_target(cfg, 12, 2), torch.float64)
    heads.init_from_target(model.head_weight, torch.arange(12))
    c = BlockDiffusionConfig.for_target(cfg, 12, num_layers=1, block_size=3,
                                        target_layer_ids=(0, 2))
    bd = BlockDiffusionModel(c, model.embed, hf)
    bd.init_from_target(model, torch.arange(12))
    return {"ngram": {"min_ngram": 1, "max_matches": 2},
            "draft_model": {"early_exit_layers": 2, "max_depth": 3},
            "eagle3": {"head": head, "depth": 3, "topk": 2},
            "mtp": {"heads": heads, "topk": 2},
            "block_diffusion": {"model": bd, "topk": 2}}


def _run(folder, batch: int, **kw) -> list:
    llm = LLM(model=str(folder), dtype="float64", max_num_seqs=batch, **kw)
    outs = llm.generate(PROMPTS, PARAMS)
    assert [o.error for o in outs] == [None] * len(outs)
    return outs


@pytest.fixture(scope="module")
def plain(target):
    return [o.token_ids for o in _run(target[0], 8)]


def _free_rows() -> StepCosts:
    rows = [1, 2, 4, 8, 16, 64, 512]
    return StepCosts(rows, [1.0 + 1e-4 * n for n in rows], rate=0.0, local_rate=0.0)


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("controller", ["static", "goodput"])
@pytest.mark.parametrize("drafter", ["ngram", "draft_model", "eagle3", "mtp", "block_diffusion"])
def test_seed_gives_the_plain_text(target, plain, drafter, controller, batch):
    folder, model, cfg, hf = target
    cargs = {"budget": 4} if controller == "static" else {"budget": 4, "costs": _free_rows()}
    outs = _run(folder, batch, drafter=drafter, drafter_args=_drafters(model, cfg, hf)[drafter],
                controller=controller, controller_args=cargs)
    assert [o.token_ids for o in outs] == plain
    assert sum(sum(o.metrics.accepted_by_depth) for o in outs) > 0, "no draft was accepted"


def test_plain_text_is_the_same_in_any_batch(target, plain):
    assert [o.token_ids for o in _run(target[0], 1)] == plain
    reordered = _run(target[0], 3)  # other neighbours, other steps
    assert [o.token_ids for o in reordered] == plain
    assert len({tuple(p) for p in plain}) == len(plain)  # the seeds really differ
