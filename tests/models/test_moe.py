"""Mixture-of-experts targets (issue #55): qwen3_moe, mixtral, qwen2_moe.

Tiny random ``Qwen3MoeForCausalLM`` / ``MixtralForCausalLM`` / ``Qwen2MoeForCausalLM`` (8 or 4
experts, top 2; qwen2_moe with its shared expert; tests/models/moe_cases.py) against HF
transformers in float32 (its MoE forward takes no float64 on a CPU): logits to a tolerance,
greedy tokens equal. Speculation (ngram, a random EAGLE-3 head) gives plain decoding's tokens,
greedy and seeded, in float32 and bf16. Loading: missing tensors named, bf16 checkpoints, tensor
parallelism's split. The kernels and row invariance: test_moe_invariance.py.
"""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
import torch
from moe_cases import FAMILIES, GREEDY, PROMPTS, make_moe_models
from native_helpers import needs_kernels

from specdec import LLM, SamplingParams
from specdec.models.decoder.config import ModelConfig, model_config_from_hf
from specdec.models.loader import load_hf_config, load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")



@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict:
    return make_moe_models(tmp_path_factory.mktemp("moe"))


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
