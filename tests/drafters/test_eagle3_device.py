"""EAGLE-3 drafting without reads in its levels (issue #53 item 1): the same trees as the
host-driven propose it replaced (tests/drafters/eagle3_reference.py), and one device -> host
read per propose, none of its own copies.

The comparison runs the engine twice on the same prompts, once with each propose, and compares
every step's trees; a spy gives each request of a call its own budget (nodes and depth) from its
length, so a batch mixes budgets and depth limits. The new propose recomputes each frontier
node's ancestors' rows in other batch shapes than the reference computed them: float64 rows
(and float32 rows of ``linear_kernels="plain"`` on this CPU) come out the same to rounding, so
tokens and parents must match exactly and probabilities to rounding.
"""

from __future__ import annotations

import os

import eagle3_reference
import pytest
import torch
from conftest import make_tiny_model
from drafter_helpers import PROMPTS, random_head

from specdec import LLM, SamplingParams
from specdec.controllers.base import DraftBudget
from specdec.drafters.eagle3 import Eagle3Drafter
from specdec.models.loader import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EAGLE3_FILE = os.path.join("drafters", "eagle3.py")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A 4-layer tiny llama (EAGLE-3's default layers need L >= 4)."""
    return make_tiny_model(tmp_path_factory.mktemp("l4"), num_hidden_layers=4, seed=4)


def _mixed_budget(r) -> DraftBudget:
    """A smaller budget than the controller's, varied per request by its length: node counts
    from 1 up, and every third request a depth limit."""
    n, top = len(r.token_ids), r.budget.max_nodes
    nodes = 1 + (n * 5) % top
    depth = None if n % 3 else 1 + n % 4
    return DraftBudget(nodes, depth, r.budget.sources)


def _run(folder, dtype, head, depth, topk, budget, monkeypatch, reference: bool,
         mixed: bool) -> list:
    """Per propose call: per request, (tokens, budget, tree)."""
    with monkeypatch.context() as m:
        if reference:
            eagle3_reference.install(m)
        original = Eagle3Drafter.propose
        calls = []

        def spy(self, requests):
            if mixed:
                for r in requests:
                    r.budget = _mixed_budget(r)
            trees = original(self, requests)
            calls.append([(r.token_ids.tolist(), r.budget, t) for r, t in zip(requests, trees)])
            return trees

        m.setattr(Eagle3Drafter, "propose", spy)
        llm = LLM(model=str(folder), dtype=dtype, linear_kernels="plain", controller="static",
                  controller_args={"budget": budget}, drafter="eagle3",
                  drafter_args={"head": head, "depth": depth, "topk": topk})
        # different lengths of output too: budgets shrink with the tokens left at different steps
        params = [SamplingParams(temperature=0, max_tokens=12 + 3 * i, ignore_eos=True)
                  for i in range(len(PROMPTS))]
        outs = llm.generate(PROMPTS, params)
        assert [o.error for o in outs] == [None] * len(PROMPTS)
    return calls


# path probabilities: float32 exp of float64 sums of each level's float32 (float64) log-probs
RTOL = {"float64": 1e-12, "float32": 1e-5}


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("depth, topk, budget, mixed", [
    (3, 2, 5, False), (4, 3, 10, True), (5, 2, 3, False), (6, 4, 12, True), (2, 1, 4, True),
    (4, 1, 6, False)])
def test_same_trees_as_the_host_driven_propose(folder, monkeypatch, dtype, depth, topk, budget,
                                                mixed):
    model, cfg, hf = load_model(folder, getattr(torch, dtype), "cpu", 512)
    head = random_head(model, cfg, hf, seed=depth * 10 + topk)
    ref = _run(folder, dtype, head, depth, topk, budget, monkeypatch, True, mixed)
    new = _run(folder, dtype, head, depth, topk, budget, monkeypatch, False, mixed)
    assert len(new) == len(ref) > 5
    assert sum(len(c) > 1 for c in new) > 2  # batched calls
    if mixed:  # a batch of different budgets
        assert any(len({b for _, b, _ in c}) > 1 for c in new)
    nodes = exact = trees = 0
    for call_new, call_ref in zip(new, ref):
        assert [(t, b) for t, b, _ in call_new] == [(t, b) for t, b, _ in call_ref]
        for (_, _, a), (_, _, b) in zip(call_new, call_ref):
            assert a.tokens.tolist() == b.tokens.tolist()
            assert a.parents.tolist() == b.parents.tolist()
            if not a.num_nodes:  # (no draft: a one-token prompt's first step, an empty tree)
                continue
            assert a.path_probs.dtype == b.path_probs.dtype == torch.float32
            torch.testing.assert_close(a.path_probs, b.path_probs, rtol=RTOL[dtype], atol=0)
            nodes += a.num_nodes
            exact += bool(torch.equal(a.path_probs, b.path_probs))
            trees += 1
    print(f"{dtype}: {exact}/{trees} trees' path_probs bitwise equal")
    assert nodes > 50


@pytest.fixture(scope="module")
def bf16_target(tmp_path_factory):
    from specdec.models.loader import load_model

    folder = make_tiny_model(tmp_path_factory.mktemp("audit") / "m", num_hidden_layers=4)
    return (folder, *load_model(folder, torch.bfloat16, "cpu", 512))


@pytest.mark.parametrize("batch", [1, 4])
def test_no_read_and_no_copies_of_its_own_per_propose(bf16_target, flashinfer_api_model,
                                                      monkeypatch, batch):
    """Audited as on CUDA (tests/transfer_audit.py): a propose makes no device -> host read
    (its trees stay on the device: the step's verification read brings them) and no host ->
    device copy of its own (its runner's forwards stage their inputs, one copy and a plan each:
    the catch-up and one per expansion level); the step reads once."""
    from transfer_audit import audit_engine

    folder, model, cfg, hf = bf16_target
    head = random_head(model, cfg, hf, aux_layer_ids=(1, 2, 3))
    forwards = []
    original = Eagle3Drafter._forward_chains

    def count(self, reqs, ctok, features, s):
        forwards.append((len(reqs), s))
        return original(self, reqs, ctok, features, s)

    monkeypatch.setattr(Eagle3Drafter, "_forward_chains", count)
    llm = LLM(model=str(folder), dtype="bfloat16", linear_kernels="plain",
              attention_backend="flashinfer", max_model_len=256, controller="static",
              controller_args={"budget": 4}, drafter="eagle3",
              drafter_args={"head": head, "depth": 3, "topk": 2})
    with audit_engine(llm.engine) as audit:
        llm.generate(PROMPTS[:batch], SamplingParams(temperature=0, max_tokens=8,
                                                     ignore_eos=True))
    spec = [s for s in audit.steps if s.kind == "speculative"]
    assert spec and forwards
    for step in spec:
        own = [e for e in step.events if EAGLE3_FILE in e.site]
        assert not own, [f"{e.kind} {e.op} {e.site}" for e in own]
        assert step.d2h == 1, [f"{e.kind} {e.op} {e.site}" for e in step.events]
    # the levels' forwards: topk chains of s rows for every request whose tree may be s deep
    assert {s for _, s in forwards} == {1, 2}
