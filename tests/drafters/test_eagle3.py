"""EAGLE-3 drafting: losslessness, tree properties, and the paged head against a dense oracle.

Random heads are fine for losslessness (the verifier keeps only what the target would produce).
The oracle test recomputes, without paging or batching, what the head must output for every
candidate path (each path's rows run densely, one at a time, from the target's own features) and
rebuilds EAGLE-2's dynamic tree from those distributions; the drafter's batched, paged proposal
must be exactly that tree.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model
from drafter_helpers import (
    PROMPTS,
    assert_samples_follow_target,
    greedy,
    random_head,
    record_proposals,
    sampling_target,
)

from specdec import LLM
from specdec.attention.dense import DenseAttention
from specdec.drafters.eagle3 import Eagle3Drafter
from specdec.models.heads.eagle3 import Eagle3Config, Eagle3Head
from specdec.models.loader import load_model

# tiny float64 models: on a shared 2-core machine a second OpenMP thread only waits on barriers
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target4(tmp_path_factory):
    """A 4-layer tiny llama (EAGLE-3's default layers need L >= 4) and its float64 decoder."""
    folder = make_tiny_model(tmp_path_factory.mktemp("l4"), num_hidden_layers=4, seed=4)
    model, cfg, hf = load_model(folder, torch.float64, "cpu", 512)
    return folder, model, cfg, hf


@pytest.fixture(scope="module")
def target16(tmp_path_factory):
    """The sampling tests' 16-token target (drafter_helpers.sampling_target), built once."""
    return sampling_target(tmp_path_factory.mktemp("v16"))


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("drafter", ["eagle3", "eagle3+ngram"])
def test_greedy_identical_to_plain(target4, batch, drafter):
    folder, model, cfg, hf = target4
    head = random_head(model, cfg, hf)
    eagle = {"head": head, "depth": 3, "topk": 2}
    args = eagle if drafter == "eagle3" else {"eagle3": eagle, "ngram": {"min_ngram": 1}}
    prompts = PROMPTS[:batch]
    plain = greedy(folder, prompts)
    spec = greedy(folder, prompts, drafter=drafter, drafter_args=args,
                   controller_args={"budget": 5})
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert all(o.metrics.draft_tokens_proposed > 0 for o in spec)


@pytest.mark.parametrize("budget, depth, topk", [(6, 3, 2), (10, 4, 3), (3, 5, 2)])
def test_tree_properties(target4, monkeypatch, budget, depth, topk):
    folder, model, cfg, hf = target4
    seen = record_proposals(monkeypatch, Eagle3Drafter)
    greedy(folder, PROMPTS[:4], drafter="eagle3",
            drafter_args={"head": random_head(model, cfg, hf), "depth": depth, "topk": topk},
            controller_args={"budget": budget})
    assert seen
    for _, b, tree in seen:
        tree.validate(max_nodes=b.max_nodes, vocab_size=cfg.vocab_size)
        assert tree.num_nodes == min(b.max_nodes, _num_candidates(depth, topk))
        assert tree.max_depth + 1 <= depth
        probs = tree.path_probs
        for i, p in enumerate(tree.parents.tolist()):
            if p >= 0:
                assert probs[i] <= probs[p] + 1e-12  # cumulative: never rises along a path
        assert bool((probs > 0).all() and (probs <= 1).all())


def _num_candidates(depth: int, k: int) -> int:
    return k + (depth - 1) * k * k


@pytest.mark.parametrize("depth, topk, budget", [(3, 2, 7), (4, 2, 3), (5, 3, 4), (6, 4, 2)])
def test_paged_batched_head_equals_dense_oracle(target4, monkeypatch, depth, topk, budget):
    """The oracle expands every level's top-k, each path from scratch; the drafter feeds each
    level's frontier as chains of their paths (``_forward_chains``: topk chains of s rows per
    request whose tree may go s + 1 deep), and must give exactly the oracle's trees."""
    folder, model, cfg, hf = target4
    head = random_head(model, cfg, hf, seed=1)
    seen = record_proposals(monkeypatch, Eagle3Drafter)
    forwards = []  # (requests, chain tokens' shape, s, the requests' depth limits)
    forward_chains = Eagle3Drafter._forward_chains
    monkeypatch.setattr(Eagle3Drafter, "_forward_chains", lambda self, reqs, ctok, f, s: (
        forwards.append((len(reqs), tuple(ctok.shape), s,
                         [min(depth, r.budget.depth_limit) for r in reqs]))
        or forward_chains(self, reqs, ctok, f, s)))
    greedy(folder, PROMPTS[:5], drafter="eagle3",
            drafter_args={"head": head, "depth": depth, "topk": topk},
            controller_args={"budget": budget})
    assert len(seen) > 10
    # the dense oracle costs a head run per path (~80 at depth 6, top-4): 12 steps spread over
    # the run, the first and the last among them, keep it to seconds on a slow CPU
    for tokens, b, tree in [seen[round(i * (len(seen) - 1) / 11)] for i in range(12)]:
        ref = _oracle_tree(model, head, tokens, depth, topk, b.max_nodes)
        assert tree.tokens.tolist() == ref[0] and tree.parents.tolist() == ref[1]
        torch.testing.assert_close(tree.path_probs.double(), torch.tensor(ref[2]).double(),
                                   rtol=1e-5, atol=0)
    assert forwards
    for m, shape, s, limits in forwards:
        assert shape == (m, topk, s) and all(lv > s for lv in limits)
    assert max(s for *_, s, _ in forwards) == min(depth, budget) - 1


def _oracle_tree(model, head, tokens, depth, k, budget):
    """EAGLE-2's tree for one request, from dense per-path head runs (no KV, no batching)."""
    cap = head.config.capture_layers
    with torch.no_grad():
        out = model.forward_dense(torch.tensor([tokens[:-1]]), capture_layers=cap)
        feats = head.fuse(torch.cat([out.layer_hidden[c][0] for c in cap], -1))
    n = len(tokens)
    d2t = head.d2t.tolist()
    memo = {}

    def next_logp(path: tuple[int, ...]) -> torch.Tensor:
        """log-probs of the token after the path (draft ids): the catch-up rows, then one row per
        path token whose feature is the previous row's output, each run densely from scratch."""
        if path not in memo:
            ids = list(tokens[1:]) + [d + d2t[d] for d in path]
            fs = list(feats)
            y = _dense_head(head, ids[:n - 1], torch.stack(fs))
            for j in range(len(path)):
                fs.append(y[-1])
                y = _dense_head(head, ids[:n + j], torch.stack(fs))
            memo[path] = head.compute_logits(y[-1:])[0].log_softmax(-1)
        return memo[path]

    cands = []  # (logp, level, index, path)
    frontier = [((), 0.0)]
    for level in range(depth):
        new = []
        for path, lp in frontier:
            top = next_logp(path).topk(k)
            new += [(path + (t,), lp + v) for t, v in zip(top.indices.tolist(),
                                                          top.values.tolist())]
        cands += [(lp, level, i, p) for i, (p, lp) in enumerate(new)]
        order = sorted(range(len(new)), key=lambda i: -new[i][1])[:k]
        frontier = [new[i] for i in order]
    cands.sort(key=lambda c: (-c[0], c[1], c[2]))
    chosen = cands[:budget]
    node = {c[3]: i for i, c in enumerate(chosen)}
    toks = [c[3][-1] + d2t[c[3][-1]] for c in chosen]
    parents = [node[c[3][:-1]] if len(c[3]) > 1 else -1 for c in chosen]
    return toks, parents, [float(torch.tensor(c[0]).exp()) for c in chosen]


def _dense_head(head, ids, features) -> torch.Tensor:
    """The head's outputs y [S, H] for rows (features[i], embedding of ids[i]) at positions 0..S-1,
    causal, no cache."""
    s = len(ids)
    backend = DenseAttention.causal(torch.ones(1, s, dtype=torch.bool))
    with torch.no_grad():
        return head(torch.tensor(ids), torch.arange(s), backend, None,
                    features=features[:s]).hidden


def test_head_for_another_target_is_refused(target4, tiny_llama):
    folder, model, cfg, hf = target4
    head = random_head(model, cfg, hf)
    with pytest.raises(ValueError, match="layer count 4.*layer count 2"):
        LLM(model=str(tiny_llama), dtype="float64", drafter="eagle3",
            drafter_args={"head": head})


def test_bad_args(target4):
    folder, model, cfg, hf = target4
    for bad in ({"depth": 0}, {"topk": "2"}, {}):
        with pytest.raises(ValueError, match="eagle3"):
            LLM(model=str(folder), dtype="float64", drafter="eagle3", drafter_args=bad)


@pytest.mark.parametrize("drafter", ["eagle3", "eagle3+draft_model"])
def test_sampled_tokens_follow_the_target(target16, drafter):
    """Sampled decoding with eagle3 trees (deterministic drafts, the q = 1 rule), alone and merged
    with a sampled draft model's chains (their draft probabilities dropped by the merge): tokens 2
    and 3 follow the target's exact joint distribution (chi-square over a 16-token vocabulary)."""
    folder, model, cfg, hf = target16
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_target(cfg, 12, (1, 1, 1)), model.embed, hf)
    head.reset_parameters(0.5)
    head.set_vocab(torch.arange(12))
    eagle = {"head": head, "depth": 2, "topk": 2}
    args = eagle if drafter == "eagle3" else {
        "eagle3": eagle, "draft_model": {"early_exit_layers": 1, "max_depth": 2}}
    assert_samples_follow_target(folder, drafter, args)


@pytest.mark.parametrize("drafter, controller", [("eagle3", "static"),
                                                 ("eagle3+ngram", "goodput")])
def test_sampled_tokens_follow_the_target_with_q8_heads(target16, drafter, controller):
    """float32 with the head's matrices in Q8_0 blocks (draft_weights), alone under a static
    budget and composed with ngram under goodput (members drafting apart): tokens 2 and 3 still
    follow the target's exact joint distribution."""
    folder = target16[0]
    model, cfg, hf = load_model(folder, torch.float32, "cpu", 64)
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_target(cfg, 12, (1, 1, 1)), model.embed, hf)
    head.reset_parameters(0.5)
    head.set_vocab(torch.arange(12))
    eagle = {"head": head, "depth": 2, "topk": 2}
    args = eagle if drafter == "eagle3" else {"eagle3": eagle, "ngram": {"min_ngram": 1}}
    from specdec.controllers.costs import StepCosts

    # goodput with an injected, frozen cost curve: a 1 s forward whatever its rows, so the
    # measured draft time (milliseconds on any machine) never decides; it drafts, picking
    # among the arms
    budget = {"budget": 4} if controller == "static" else {
        "budget": 4, "explore_every": 1,
        "costs": StepCosts([1, 4096], [1.0, 1.0], rate=0.0, local_rate=0.0)}
    assert_samples_follow_target(folder, drafter, args, dtype="float32", draft_weights="q8_0",
                                 controller=controller, controller_args=budget)


def test_goodput_drafts_with_composed_members_apart(target4, monkeypatch):
    """Under goodput a composed drafter's members draft alone or together (DraftBudget.sources):
    a member not asked for a request does not run for it, and output stays the plain one."""
    from specdec.drafters.compose import ComposedDrafter

    folder, model, cfg, hf = target4
    asked, eagle_requests = [], []
    original, eagle_propose = ComposedDrafter.propose, Eagle3Drafter.propose

    def spy(self, requests):
        asked.extend(r.budget.sources for r in requests)
        return original(self, requests)

    def eagle_spy(self, requests):
        eagle_requests.extend(requests)
        return eagle_propose(self, requests)

    monkeypatch.setattr(ComposedDrafter, "propose", spy)
    monkeypatch.setattr(Eagle3Drafter, "propose", eagle_spy)
    args = {"eagle3": {"head": random_head(model, cfg, hf), "depth": 3, "topk": 2},
            "ngram": {"min_ngram": 1}}
    plain = greedy(folder, PROMPTS)
    spec = greedy(folder, PROMPTS, drafter="eagle3+ngram", drafter_args=args,
                  controller="goodput", controller_args={"budget": 4, "explore_every": 1})
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert len(set(asked)) >= 2 and set(asked) <= {("eagle3",), ("ngram",), ("eagle3", "ngram")}
    assert len(eagle_requests) == sum(s is None or "eagle3" in s for s in asked) < len(asked)
