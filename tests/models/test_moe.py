"""Mixture-of-experts targets (issue #55): qwen3_moe, mixtral, qwen2_moe.

Tiny random ``Qwen3MoeForCausalLM`` / ``MixtralForCausalLM`` / ``Qwen2MoeForCausalLM`` (8 or 4
experts, top 2; qwen2_moe with its shared expert) against HF transformers in float32 (its MoE
forward takes no float64 on a CPU): logits to a tolerance, greedy tokens equal. Row invariance
with the engine's default kernels: an MoE layer's rows, and a request's logits through the
runner, bitwise the same alone and beside 1..15 other rows (on the same and on other experts);
routing ties to the lowest expert index in every batch. Speculation (ngram, a random EAGLE-3
head) gives plain decoding's tokens, greedy and seeded, in float32. The experts' matrices run
through the installed compiled kernels like every other matrix.
"""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_model
from native_helpers import needs_kernels

from specdec import LLM, SamplingParams
from specdec.models.decoder.config import ModelConfig, model_config_from_hf
from specdec.models.loader import load_hf_config, load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_hidden_layers=4, initializer_range=0.1)
FAMILIES = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, norm_topk_prob=False),
}
PROMPTS = [[5, 6, 7, 8, 5, 6, 9, 5, 6], [3, 4, 3, 4, 3], [9, 8, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9],
           [11, 12], [7, 7, 7, 7], [40, 41, 42, 40, 41], [60]]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("moe")
    return {mt: make_tiny_model(root / mt, mt, seed=i, **COMMON, **kw)
            for i, (mt, kw) in enumerate(FAMILIES.items())}


def _config(**fields):
    base = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                rms_norm_eps=1e-6, eos_token_id=95, hidden_act="silu")
    return types.SimpleNamespace(**{**base, **fields})


# --- configs ---------------------------------------------------------------------------------

def test_configs_read_each_family(moe_models):
    cfgs = {mt: model_config_from_hf(load_hf_config(f)) for mt, f in moe_models.items()}
    q3, mx, q2 = cfgs["qwen3_moe"], cfgs["mixtral"], cfgs["qwen2_moe"]
    assert (q3.num_experts, q3.num_experts_per_tok, q3.moe_intermediate_size,
            q3.norm_topk_prob, q3.shared_expert_intermediate_size, q3.qk_norm) == (
        8, 2, 32, True, 0, True)
    # mixtral: num_local_experts, intermediate_size per expert, always renormalised
    assert (mx.num_experts, mx.num_experts_per_tok, mx.moe_intermediate_size,
            mx.norm_topk_prob, mx.shared_expert_intermediate_size) == (4, 2, 64, True, 0)
    assert (q2.num_experts, q2.moe_intermediate_size, q2.norm_topk_prob,
            q2.shared_expert_intermediate_size, q2.attention_bias) == (8, 32, False, 64, True)
    assert all(c.is_moe for c in cfgs.values())


def test_dense_configs_have_no_experts(tiny_models):
    for folder in tiny_models.values():
        cfg = model_config_from_hf(load_hf_config(folder))
        assert not cfg.is_moe
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                cfg.shared_expert_intermediate_size, cfg.norm_topk_prob) == (0, 0, 0, 0, False)


@pytest.mark.parametrize("fields, named", [
    (dict(decoder_sparse_step=2, mlp_only_layers=[]), "decoder_sparse_step=2"),
    (dict(decoder_sparse_step=1, mlp_only_layers=[1]), r"mlp_only_layers=\[1\]"),
])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_mixed_dense_and_moe_layers_are_refused_by_name(family, fields, named):
    hf = _config(model_type=family, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=16, shared_expert_intermediate_size=16, **fields)
    with pytest.raises(ValueError, match=named):
        model_config_from_hf(hf)


@pytest.mark.parametrize("family, why", [("deepseek_v3", "MLA"), ("gpt_oss", "sinks"),
                                         ("olmoe", "q/k norms")])
def test_uncovered_moe_families_are_refused_by_name(family, why):
    with pytest.raises(ValueError, match=f"model_type='{family}'.*{why}") as info:
        model_config_from_hf(_config(model_type=family))
    assert "qwen3_moe" in str(info.value)


# --- against HF transformers -----------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_float32(moe_models, family):
    from transformers import AutoModelForCausalLM

    folder = moe_models[family]
    model, cfg, _ = load_model(folder, torch.float32, "cpu", 64)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, cfg.vocab_size, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        out = model.forward_dense(ids)
        got = model.compute_logits(out.hidden.reshape(-1, cfg.hidden_size)).view_as(want)
    assert want.abs().max() > 1.0  # peaked enough that the tolerance means something
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1]
            top = logits.topk(2).values
            assert top[0] - top[1] > 1e-4, "a near-tie: the comparison would be luck"
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers(moe_models, family):
    from transformers import AutoModelForCausalLM

    folder = moe_models[family]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(model=str(folder), dtype="float32", max_model_len=64)
    prompts = PROMPTS[:3]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outs] == [_hf_greedy(hf, p, 12) for p in prompts]


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
    seqs = [_prefilled(eng, str(i), p) for i, p in enumerate(prompts)]
    got = _step_logits(eng, seqs, [None] * 3)
    woken = model.experts_woken()
    assert all(0 < w <= model.cfg.num_experts for w in woken)
    fused, model.fused = model.fused, None
    try:
        for s in seqs:  # the same step again (its rows' K/V rewritten in place)
            eng.kv.release(s.block_table)
        seqs = [_prefilled(eng, str(i), p) for i, p in enumerate(prompts)]
        want = _step_logits(eng, seqs, [None] * 3)
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


def _prefilled(eng, request_id: str, prompt: list[int]):
    from specdec.engine.batch import build_forward_batch
    from specdec.engine.sequence import Sequence
    from specdec.engine.step import StepRequest

    seq = Sequence(request_id, list(prompt), SamplingParams(temperature=0), None)
    rec = StepRequest(seq, len(prompt) - 1)
    eng.kv.reserve(seq.block_table, len(prompt) - 1)
    eng.parts.runner.forward(build_forward_batch([rec], eng.config.page_size, eng.parts.device))
    seq.num_computed = len(prompt) - 1
    return seq


def _step_logits(eng, seqs, trees) -> list[torch.Tensor]:
    from specdec.engine.batch import build_forward_batch
    from specdec.engine.step import StepRequest

    records = []
    for seq, tree in zip(seqs, trees):
        rec = StepRequest(seq, 1)
        rec.tree = tree
        eng.kv.reserve(seq.block_table, seq.num_computed + 1 + rec.num_nodes)
        records.append(rec)
    logits = eng.parts.runner.forward(build_forward_batch(records, eng.config.page_size,
                                                          eng.parts.device)).logits
    return [logits[r.logits_start:r.logits_start + 1 + r.num_nodes].clone() for r in records]


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
    seqs = [_prefilled(eng, str(i), p) for i, p in enumerate(prompts)]
    me, others = seqs[0], seqs[1:]
    alone = _step_logits(eng, [me], [None])[0]
    woken = {min(eng.parts.model.experts_woken())}
    alone_tree = _step_logits(eng, [me], [tree])[0]
    for n in range(1, 16):
        batch = [*others[:n // 2], me, *others[n // 2:n]]
        got = _step_logits(eng, batch, [None] * len(batch))[n // 2]
        assert torch.equal(got, alone), n
        trees = [tree if i % 2 else None for i in range(len(batch))]
        trees[n // 2] = tree
        got = _step_logits(eng, batch, trees)[n // 2]
        assert torch.equal(got, alone_tree), n
        woken.add(min(eng.parts.model.experts_woken()))
    if threads > 1:  # both ways of running the experts ran
        assert min(woken) < 2 * threads <= max(woken), woken


# --- speculation -----------------------------------------------------------------------------

def _eagle3_args(folder) -> dict:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "drafters"))
    from drafter_helpers import random_head

    model, cfg, hf = load_model(folder, torch.float32, "cpu", 64)
    return {"head": random_head(model, cfg, hf, aux_layer_ids=(1, 2, 3)), "depth": 3,
            "topk": 2}


def _tokens(folder, params, dtype: str = "float32", **kw) -> tuple[list[list[int]], int]:
    llm = LLM(model=str(folder), dtype=dtype, max_model_len=64, **kw)
    outs = llm.generate(PROMPTS, params)
    assert [o.error for o in outs] == [None] * len(outs)
    return [o.token_ids for o in outs], sum(sum(o.metrics.accepted_by_depth) for o in outs)


@needs_kernels
@pytest.mark.parametrize("drafter", ["ngram", "eagle3"])
@pytest.mark.parametrize("family", FAMILIES)
def test_speculation_equals_plain_greedy_and_seeded(moe_models, family, drafter):
    folder = moe_models[family]
    args = ({"min_ngram": 1, "max_depth": 4} if drafter == "ngram" else _eagle3_args(folder))
    spec = dict(drafter=drafter, drafter_args=args, controller="static",
                controller_args={"budget": 4})
    sampled = [SamplingParams(temperature=0.2, seed=50 + i, max_tokens=20, ignore_eos=True)
               for i in range(len(PROMPTS))]
    for params in (GREEDY, sampled):
        got, accepted = _tokens(folder, params, **spec)
        want, _ = _tokens(folder, params)
        assert got == want
        assert accepted > 0, "no draft accepted: the test would pass vacuously"


@needs_kernels
@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_ngram_speculation_equals_plain(moe_models, family):
    spec = dict(drafter="ngram", drafter_args={"min_ngram": 1, "max_depth": 4},
                controller="static", controller_args={"budget": 4})
    sampled = [SamplingParams(temperature=0.2, seed=70 + i, max_tokens=20, ignore_eos=True)
               for i in range(len(PROMPTS))]
    for params in (GREEDY, sampled):
        got, accepted = _tokens(moe_models[family], params, "bfloat16", **spec)
        assert got == _tokens(moe_models[family], params, "bfloat16")[0]
        assert accepted > 0


# --- loading ---------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_missing_expert_tensor_is_named(moe_models, family, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(moe_models[family], tmp_path / family)
    w = load_file(folder / "model.safetensors")
    gone = next(n for n in w if ".experts.3." in n and "layers.2." in n)
    del w[gone]
    save_file(w, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=gone.replace(".", r"\.")):
        load_model(folder, torch.float32, "cpu", 64)


def test_moe_config_field_checks():
    cfg = ModelConfig("qwen3_moe", 96, 32, 64, 2, 4, 2, 8, 1e-6, False, False, True, 64, None,
                      (95,))
    assert not cfg.is_moe
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        dataclasses.replace(cfg, num_experts=4, num_experts_per_tok=5)
    assert json.dumps(dataclasses.asdict(dataclasses.replace(cfg, num_experts=4,
                                                             num_experts_per_tok=2)))


def _cast(src, dst, dtype: torch.dtype, then: torch.dtype | None = None):
    """A copy of the checkpoint folder with every tensor in ``dtype`` (then in ``then``)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    w = {k: v.to(dtype) if then is None else v.to(dtype).to(then)
         for k, v in load_file(src / "model.safetensors").items()}
    save_file(w, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _greedy_logprobs(llm: LLM):
    outs = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=12,
                                                    ignore_eos=True, logprobs=2))
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs])
            for o in outs]


@needs_kernels
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_bf16_checkpoint_own_bytes_and_quantized(moe_models, family, tmp_path):
    """A bf16 checkpoint's experts run on its own bytes (no float32 copy), bitwise the float32
    model upcast from it; quantized at load (q8_0, q8 activations) the routers and the shared
    expert's gate stay in the file's dtype, and ngram speculation equals plain decoding
    bitwise (logprobs too)."""
    from specdec.models.gguf.block_weight import BlockWeight

    kw = dict(max_model_len=64, num_pages=16)
    half = _cast(moe_models[family], tmp_path / "bf16", torch.bfloat16)
    up = _cast(moe_models[family], tmp_path / "up", torch.bfloat16, torch.float32)
    own = LLM(model=str(half), **kw)
    assert own.engine.parts.weights == "native"
    mats = own.engine.parts.model.named_matrices()
    assert all(isinstance(w, BlockWeight) and w.kinds == ("BF16",) * len(w.kinds)
               for w in mats.values())
    assert _greedy_logprobs(own) == _greedy_logprobs(
        LLM(model=str(up), weights="dequantized", **kw))
    plain = LLM(model=str(half), quantize="q8_0", **kw)
    assert (plain.engine.parts.weights, plain.engine.parts.activations) == ("q8_0", "q8")
    mats = plain.engine.parts.model.named_matrices()
    for name, w in mats.items():
        float_kept = name.endswith((".router", ".shared_gate"))
        assert set(w.kinds) == ({"BF16"} if float_kept else {"Q8_0"}), name
    spec = LLM(model=str(half), quantize="q8_0", drafter="ngram",
               drafter_args={"min_ngram": 1}, controller="static",
               controller_args={"budget": 4}, **kw)
    assert _greedy_logprobs(spec) == _greedy_logprobs(plain)


def test_tensor_parallelism_splits_experts_by_their_width(moe_models):
    """(tests/distributed/test_tp_moe.py runs sharded MoEs against the unsharded ones.)"""
    from specdec.distributed.shard_model import shard_decoder
    from specdec.distributed.sharding import plan_tensor_parallel, tp_sizes_that_work

    model, cfg, _ = load_model(moe_models["qwen3_moe"], torch.float32, "cpu", 64)
    assert tp_sizes_that_work(cfg) == [1, 2, 4]  # 4 heads, experts of 32
    shard_decoder(model, plan_tensor_parallel(cfg, 2), 1, lambda x: x)
    assert model.layers[0].moe.experts[0].down_weight.shape == (64, 16)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide num_heads=4"):
        plan_tensor_parallel(cfg, 3)
