"""A mixture-of-experts target's experts in the engine's kernels, and row invariance (issue #55).

The compiled layer call runs every MoE layer, experts included (specdec/native/moe.c): nothing
goes through the per-matrix hook, the tokens are the torch layer's, the same experts woken, and
the weight bytes a one-row step streams count k of the E experts. Row invariance: an MoE layer's
rows (the torch layer over the compiled matmuls), and a request's logits through the runner
(the compiled layer, at 1 and 2 threads: both ways of running the experts), bitwise the same
alone and beside 1..15 other rows, on the same and on other experts; routing ties to the
lowest expert index in every batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from moe_cases import FAMILIES, GREEDY, PROMPTS, make_moe_models
from native_helpers import needs_kernels
from step_helpers import prefilled, step_logits

from specdec import LLM
from specdec.models.loader import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict:
    return make_moe_models(tmp_path_factory.mktemp("moe"))


# --- the kernels -----------------------------------------------------------------------------

@needs_kernels
@pytest.mark.parametrize("family", FAMILIES)
def test_experts_run_through_the_installed_kernels(moe_models, family):
    llm = LLM(model=str(moe_models[family]), dtype="float32", max_model_len=64)
    parts = llm.engine.parts
    model, kernels = parts.model, parts.kernels
    names = model.named_matrices()
    cfg = model.cfg
    per_layer = 2 + 1 + 2 * cfg.num_experts + (3 if cfg.shared_expert_intermediate_size else 0)
    assert len(names) == 1 + cfg.num_layers * per_layer
    assert {f"layers.0.experts.{cfg.num_experts - 1}.gate_up", "layers.3.router"} <= set(names)
    # every matrix (the experts, the routers, qwen2_moe's shared expert and gate) is prepared
    assert all(kernels._key(w) in kernels._panels for w in names.values())
    # what a one-row step streams: every matrix but the experts, and k of the E experts' share
    dense = sum(kernels.prepared(w).nbytes for n, w in names.items() if ".experts." not in n)
    experts = sum(kernels.prepared(w).nbytes for n, w in names.items() if ".experts." in n)
    want = dense + experts * cfg.num_experts_per_tok / cfg.num_experts
    assert abs(parts.weight_bytes_per_forward - want) <= 1
    assert parts.weight_bytes_per_forward < kernels.weight_bytes
    # the compiled layer call runs every layer, its experts in C (specdec/native/moe.c)
    assert model.fused is not None and model.compiled_refusal() is None
    assert all(a.moe for a in model.fused.args)
    called = []
    original = type(kernels).__call__

    def spy(self, x, weight, bias=None):
        called.append(id(weight))
        return original(self, x, weight, bias)

    mp = pytest.MonkeyPatch()
    mp.setattr(type(kernels), "__call__", spy)
    try:
        fused = llm.generate(PROMPTS[:4], GREEDY)
    finally:
        mp.undo()
    expert_ids = {id(w) for n, w in names.items() if ".experts." in n}
    assert not expert_ids & set(called)  # no expert went through the per-matrix hook
    # the framework path over the same prepared kernels (its experts through the hook)
    model.fused = None
    plain = llm.generate(PROMPTS[:4], GREEDY)
    assert [o.token_ids for o in plain] == [o.token_ids for o in fused]


@needs_kernels
@pytest.mark.parametrize("family", FAMILIES)
def test_the_compiled_layer_wakes_what_the_torch_layer_wakes(moe_models, family):
    """One step through the compiled layers and through the torch layers over the same
    prepared weights: the same experts woken per layer, logits within float32 rounding (exp
    and silu are libm's in C, torch's vectorised ones in the framework: not bitwise)."""
    eng = LLM(model=str(moe_models[family]), dtype="float32", max_model_len=64).engine
    model = eng.parts.model
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(90, (n,), generator=gen).tolist() for n in (5, 9, 13)]
    seqs = [prefilled(eng, str(i), p) for i, p in enumerate(prompts)]
    got = step_logits(eng, seqs, [None] * 3)
    woken = model.experts_woken()
    assert all(0 < w <= model.cfg.num_experts for w in woken)
    fused, model.fused = model.fused, None
    try:
        for s in seqs:  # the same step again (its rows' K/V rewritten in place)
            eng.kv.release(s.block_table)
        seqs = [prefilled(eng, str(i), p) for i, p in enumerate(prompts)]
        want = step_logits(eng, seqs, [None] * 3)
        assert model.experts_woken() == woken
    finally:
        model.fused = fused
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-4)


# --- row invariance --------------------------------------------------------------------------

def _moe_layer(family: str, moe_models, kernels):
    model, cfg, _ = load_model(moe_models[family], torch.float32, "cpu", 64)
    return model.layers[1].moe, cfg, (kernels or F.linear)


def _kernels():
    from specdec import native
    from specdec.models.matmul.prepared import PreparedLinears

    compiled = native.load()
    return None if compiled is None else PreparedLinears(compiled)


@needs_kernels
@pytest.mark.parametrize("family", FAMILIES)
def test_a_rows_moe_output_does_not_depend_on_its_companions(moe_models, family):
    moe, cfg, mm = _moe_layer(family, moe_models, _kernels())
    gen = torch.Generator().manual_seed(5)
    others = torch.randn(64, cfg.hidden_size, generator=gen)
    row = torch.randn(1, cfg.hidden_size, generator=gen)
    with torch.no_grad():
        alone = moe(row, mm)
        experts = moe.route(others, mm)[0]
        mine = set(moe.route(row, mm)[0][0].tolist())
        same = others[[i for i, e in enumerate(experts.tolist()) if set(e) & mine]]
        other = others[[i for i, e in enumerate(experts.tolist()) if not set(e) & mine]]
        assert len(same) >= 4 and len(other) >= 4
        for n in range(1, 16):
            for companions in (same[:n], other[:n], others[:n], row.expand(n, -1)):
                for at in (0, len(companions)):  # first, last
                    batch = torch.cat([companions[:at], row, companions[at:]])
                    got = moe(batch, mm)[at:at + 1]
                    assert torch.equal(got, alone), (n, at)


def test_routing_ties_go_to_the_lowest_expert_in_every_batch(moe_models):
    moe, cfg, mm = _moe_layer("qwen3_moe", moe_models, _kernels())
    with torch.no_grad():  # experts 1, 3, 6 score alike and above the rest: top 2 = {1, 3}
        w = moe.router_weight.clone()
        w[[1, 3, 6]] = 0.5 * w[0].sign()
        moe.router_weight.copy_(w)
        gen = torch.Generator().manual_seed(6)
        rows = w[0].sign() + 0.01 * torch.randn(16, cfg.hidden_size, generator=gen)
        for n in (1, 2, 7, 16):
            experts, weights = moe.route(rows[:n], mm)
            assert experts.tolist() == [[1, 3]] * n
            assert torch.equal(weights[:, 0], weights[:, 1])


@needs_kernels
def test_the_compiled_layer_sends_ties_to_the_lowest_experts(moe_models):
    """Every expert of layer 1 scoring alike for every row (equal router rows): the compiled
    layer routes each row to experts 0 .. k - 1, so the layer wakes exactly k whatever the
    batch, and its logits are the torch layer's (which sorts stably)."""
    eng = LLM(model=str(moe_models["qwen3_moe"]), dtype="float32", max_model_len=64).engine
    model = eng.parts.model
    with torch.no_grad():
        router = model.layers[1].moe.router_weight
        router.copy_(router[:1].expand_as(router))
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(90, (n,), generator=gen).tolist() for n in (4, 7, 11, 6)]
    seqs = [prefilled(eng, str(i), p) for i, p in enumerate(prompts)]
    got = step_logits(eng, seqs, [None] * 4)
    assert model.fused is not None and model.experts_woken()[1] == model.cfg.num_experts_per_tok
    fused, model.fused = model.fused, None
    try:
        for s in seqs:
            eng.kv.release(s.block_table)
        seqs = [prefilled(eng, str(i), p) for i, p in enumerate(prompts)]
        want = step_logits(eng, seqs, [None] * 4)
        assert model.experts_woken()[1] == model.cfg.num_experts_per_tok
    finally:
        model.fused = fused
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("family, threads", [*((f, 1) for f in FAMILIES), ("qwen2_moe", 2)])
def test_a_requests_logits_do_not_depend_on_the_batch(moe_models, family, threads):
    """A decode row, and a request's tree rows, through the engine's runner alone and beside
    1..15 other requests' rows: bitwise the same logits. With 2 threads the compiled layer
    runs a step that wakes fewer than 4 experts a layer with each linear split over the threads
    and a larger one with whole experts per thread (specdec/native/moe.c): the same bits."""
    from specdec.tree import DraftTree

    torch.set_num_threads(threads)  # (one_torch_thread restores the count after the test)
    eng = LLM(model=str(moe_models[family]), dtype="float32", max_model_len=64).engine
    assert eng.parts.model.fused is not None  # the compiled layers' experts (moe.c)
    tree = DraftTree(torch.tensor([3, 4, 5, 6, 7]), torch.tensor([-1, -1, 0, 0, 2]))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(90, (n,), generator=gen).tolist() for n in range(5, 21)]
    seqs = [prefilled(eng, str(i), p) for i, p in enumerate(prompts)]
    me, others = seqs[0], seqs[1:]
    alone = step_logits(eng, [me], [None])[0]
    woken = {min(eng.parts.model.experts_woken())}
    alone_tree = step_logits(eng, [me], [tree])[0]
    for n in range(1, 16):
        batch = [*others[:n // 2], me, *others[n // 2:n]]
        got = step_logits(eng, batch, [None] * len(batch))[n // 2]
        assert torch.equal(got, alone), n
        trees = [tree if i % 2 else None for i in range(len(batch))]
        trees[n // 2] = tree
        got = step_logits(eng, batch, trees)[n // 2]
        assert torch.equal(got, alone_tree), n
        woken.add(min(eng.parts.model.experts_woken()))
    if threads > 1:  # both ways of running the experts ran
        assert min(woken) < 2 * threads <= max(woken), woken
