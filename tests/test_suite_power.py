"""The suite's power: deliberately broken engines must fail the losslessness checks.

- Sampling: a target with a peaked distribution, sampled at a temperature far from 1, so that
  computing the target's probabilities at temperature 1 in the speculative path, racing every
  row with the same noise (gumbel verifier), keeping the rejected token's mass in the q = 1
  residual, or drawing the correction after a rejected q-draft from p instead of
  norm(max(0, p - q)) (rejection verifier, a uniform q far from p), shifts the distribution of
  speculative tokens enough for the chi-square test to reject it; the unbroken engine passes the
  same test with each verifier.
- Greedy: an oracle drafter whose accepted nodes never sit in their final KV slots; with the KV
  move disabled the speculative output parts from plain decoding, with it they are identical.
"""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
from conftest import make_tiny_model, oracle_plugin
from test_spec_sampling import chi_square_pvalue

from specdec import LLM, SamplingParams
from specdec.kv.cache import KVCache
from specdec.sampling import logits_to_probs, params_to_tensors

V = 16
PROMPT = [1, 5, 2, 5, 2, 5, 2, 5]
PARAMS = dict(temperature=0.5, max_tokens=5, ignore_eos=True)
N = 2500
N_BROKEN = 1000  # each mutant shifts the distribution far more than the correct engine's test sees
# tiny float64 ops: on a shared 2-core machine a second OpenMP thread only waits on barriers
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def peaked_target(tmp_path_factory):
    """A 16-token model whose LM head is scaled up: next-token distributions are peaked."""
    from safetensors.torch import load_file, save_file

    folder = make_tiny_model(tmp_path_factory.mktemp("peaked"), seed=3, vocab_size=V,
                             eos_token_id=V - 1, hidden_size=32)
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 3.0
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def exact_x1_x2(folder) -> torch.Tensor:
    """[V, V] exact probability of the first two sampled tokens at PARAMS (computed once per
    model folder)."""
    return _exact_x1_x2(str(folder)).clone()


@functools.lru_cache(maxsize=4)
def _exact_x1_x2(folder: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    with torch.no_grad():
        first = hf(torch.tensor([PROMPT])).logits[0, -1]
        second = hf(torch.tensor([PROMPT + [a] for a in range(V)])).logits[:, -1]
    params = SamplingParams(**PARAMS)
    p1 = logits_to_probs(first[None], *params_to_tensors([params], "cpu"))[0]
    p2 = logits_to_probs(second, *params_to_tensors([params] * V, "cpu"))
    return p1[:, None] * p2


class FixedTree:
    """Proposes the same three sibling tokens every step: deterministic drafts (the q = 1 rule),
    chosen as the most likely second tokens so that most are accepted."""

    name = "fixed"
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, target, tokens) -> None:
        self.tokens = torch.tensor(tokens)

    def init_state(self, request_id, prompt_token_ids):
        return None

    def propose(self, requests):
        from specdec.tree import DraftTree

        return [DraftTree(self.tokens[:r.budget.max_nodes],
                          torch.full_like(self.tokens, -1)[:r.budget.max_nodes]) for r in requests]

    def on_verified(self, batch) -> None:
        return None

    def release(self, state) -> None:
        return None


class UniformQ(FixedTree):
    """Proposes one node drawn from the uniform distribution (far from the peaked target) with
    the noise of its position, and says so in draft_probs: the rejection verifier's q rule, with
    most drafts rejected, so that the correction decides most second tokens."""

    name = "uniform_q"

    def propose(self, requests):
        from specdec import randomness
        from specdec.tree import DraftTree

        q = torch.full((1, V), 1.0 / V, dtype=torch.float64)
        keys = [randomness.key(r.seed, len(r.token_ids)) for r in requests]
        tokens = randomness.draw(q.expand(len(requests), V), keys)
        return [DraftTree.chain(tokens[i:i + 1], q) for i in range(len(requests))]


def sampled_grid(folder, verifier: str = "gumbel", drafter: str = "fixed", n: int = N):
    """Counts of (x1, x2) over N seeded requests; x2 always comes out of a verified tree (three
    deterministic siblings, or one node drawn from a uniform q). Also returns how many draft
    nodes were accepted."""
    from specdec.hookspecs import hookimpl

    top3 = exact_x1_x2(folder).sum(0).topk(3).indices.tolist()

    class Plugin:
        @hookimpl
        def specdec_drafters(self):
            return {"fixed": lambda target: FixedTree(target, top3),
                    "uniform_q": lambda target: UniformQ(target, top3)}

    llm = LLM(model=str(folder), dtype="float64", controller="static", drafter=drafter,
              plugins=(Plugin(),), verifier=verifier, controller_args={"budget": 3},
              max_num_seqs=512, max_num_batched_tokens=4096)
    outs = llm.generate([PROMPT] * n, [SamplingParams(**PARAMS, seed=s) for s in range(n)])
    grid = torch.zeros(V, V, dtype=torch.float64)
    for (a, b), c in Counter(tuple(o.token_ids[:2]) for o in outs).items():
        grid[a, b] = c
    return grid, sum(sum(o.metrics.accepted_by_depth) for o in outs)


@pytest.mark.parametrize("verifier, drafter", [("gumbel", "fixed"), ("rejection", "fixed"),
                                               ("rejection", "uniform_q")])
def test_correct_engine_passes(peaked_target, verifier, drafter):
    grid, accepted = sampled_grid(peaked_target, verifier, drafter)
    assert accepted > (N // 5 if drafter == "fixed" else 20)  # speculation really decides
    assert chi_square_pvalue(grid.flatten(), exact_x1_x2(peaked_target).flatten()) > 1e-3


def _temperature_one(params, device):
    t, k, p, m = params_to_tensors(params, device)
    return torch.ones_like(t), k, p, m


def _keep_rejected_mass(r, x):
    return r.clone()


def _correction_from_p(r, q):
    return r.clone()


def _one_noise_for_every_position(self):
    """Every logits row raced with the same noise (keyed by the seed alone)."""
    return [0] * self.cu_rows[-1]


@pytest.mark.parametrize("verifier, drafter, target, replacement", [
    ("gumbel", "fixed", "specdec.engine.verify_stage.params_to_tensors", _temperature_one),
    ("gumbel", "fixed", "specdec.verifiers.base.VerifyBatch.row_positions",
     _one_noise_for_every_position),
    ("rejection", "fixed", "specdec.verifiers.rejection.residual_without", _keep_rejected_mass),
    ("rejection", "uniform_q", "specdec.verifiers.rejection.residual_with_q", _correction_from_p),
], ids=["target-probs-at-temperature-1", "gumbel-noise-not-per-position",
        "q1-residual-keeps-rejected-token", "q-rule-correction-drawn-from-p"])
def test_broken_sampling_is_caught(peaked_target, monkeypatch, verifier, drafter, target,
                                   replacement):
    monkeypatch.setattr(target, replacement)
    grid, _ = sampled_grid(peaked_target, verifier, drafter, n=N_BROKEN)
    assert chi_square_pvalue(grid.flatten(), exact_x1_x2(peaked_target).flatten()) < 1e-6


@pytest.mark.parametrize("move", ["real", "disabled"])
def test_kv_move_is_needed_for_greedy_equality(tiny_llama, monkeypatch, move):
    prompts = [[5, 6, 7, 8, 5, 6, 9], [3, 4, 3, 4, 3], [9, 8, 7]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(model=str(tiny_llama), dtype="float64")
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    moves = []
    original = KVCache.move_slots

    def spy(self, src, dst):
        moves.extend(zip(src, dst))
        if move == "real":
            original(self, src, dst)

    monkeypatch.setattr(KVCache, "move_slots", spy)
    outputs = []
    for prompt, truth in zip(prompts, expected):  # the oracle knows one continuation each
        spec = LLM(model=str(tiny_llama), dtype="float64", controller="static", drafter="oracle",
                   plugins=(oracle_plugin(prompt + truth),), controller_args={"budget": 4})
        outputs.append(spec.generate([prompt], params)[0].token_ids)
    assert moves, "the oracle's accepted nodes must have needed moving"
    if move == "real":
        assert outputs == expected
    else:
        assert outputs != expected
