"""Tensor parallelism of mixture-of-experts targets (issue #55 item 4): every expert split by its
width (Megatron style inside each expert), qwen2_moe's shared expert split like a dense MLP, the
router and the shared expert's gate replicated, the MoE output's partial sums reduced once.

What they show:
- the plan: N divides the experts' width (``moe_intermediate_size``, mixtral's
  ``intermediate_size``) and the shared expert's, quantized expert downs are cut at whole
  blocks; each refusal names the field, the sizes and the sizes that work; a qwen MoE's dense
  ``intermediate_size`` (used by no layer) does not constrain N;
- tiny qwen3_moe and qwen2_moe at TP 2 (gloo, spawned ranks): rank 0 gets the unsharded
  model's hidden states and logits (float64 to 1e-12; float32 with the compiled row-invariant
  kernels to 1e-5 of the scale), every rank the same bits, a row's bits independent of the
  other rows with the compiled kernels;
- q8_0 expert blocks: a rank's expert slices dequantize bitwise to the float slices;
- the engine at TP 2 on a tiny qwen2_moe: ngram speculation == plain greedy, token for token.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch
import tp_model_workers
from conftest import make_tiny_model

from specdec import LLM, SamplingParams
from specdec.distributed import launch, plan_tensor_parallel, tp_sizes_that_work
from specdec.distributed.shard_model import rank_config, shard_decoder
from specdec.distributed.sharding import block_size
from specdec.models.decoder.config import ModelConfig
from specdec.models.gguf.block_weight import BlockWeight
from specdec.models.loader import load_model

pytestmark = pytest.mark.xdist_group("distributed_spawn")

TIMEOUT_S = 60.0
COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_hidden_layers=2, initializer_range=0.1)
FAMILIES = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      intermediate_size=24, norm_topk_prob=True),  # 24: no layer's width
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False),
}
MODES = (("float64", "plain", 1e-12), ("float32", "invariant", 1e-5))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp_moe")
    return {mt: str(make_tiny_model(root / mt, mt, seed=10 + i, **COMMON, **kw))
            for i, (mt, kw) in enumerate(FAMILIES.items())}


def _cfg(**kw) -> ModelConfig:
    base = dict(model_type="qwen2_moe", vocab_size=96, hidden_size=64, intermediate_size=96,
                num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8, rms_norm_eps=1e-6,
                tie_word_embeddings=False, attention_bias=True, qk_norm=False,
                max_position_embeddings=64, sliding_window=None, eos_token_ids=(95,),
                num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=64,
                shared_expert_intermediate_size=96)
    return ModelConfig(**{**base, **kw})


# ---------------------------------------------------------------- the plan (no ranks)

def test_the_plan_splits_each_expert_and_the_shared_expert_by_their_width():
    cfg = _cfg()
    plan = plan_tensor_parallel(cfg, 2)
    assert plan.expert_intermediate_per_rank == 32 and plan.shared_intermediate_per_rank == 48
    r1 = plan.ranks[1]
    assert r1.expert_rows == (32, 64) and r1.expert_gate_up_rows == ((32, 64), (96, 128))
    assert r1.shared_rows == (48, 96) and r1.shared_gate_up_rows == ((48, 96), (144, 192))
    local = rank_config(cfg, plan)
    assert (local.moe_intermediate_size, local.shared_expert_intermediate_size) == (32, 48)
    assert local.num_experts == 8  # every rank holds every expert
    # the dense intermediate_size of a qwen MoE is used by no layer: not split, no constraint
    assert local.intermediate_size == 96 and r1.gate_rows == (0, 96)
    assert tp_sizes_that_work(_cfg(intermediate_size=7)) == [1, 2, 4, 8]


def test_widths_that_do_not_split_are_refused_naming_the_sizes_that_work():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide "
                       r"moe_intermediate_size=34 .*sizes that work: 1, 2 .*"
                       r"moe_intermediate_size=34, shared_expert_intermediate_size=96"):
        plan_tensor_parallel(_cfg(moe_intermediate_size=34), 4)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide "
                       r"shared_expert_intermediate_size=6 .*sizes that work: 1, 2"):
        plan_tensor_parallel(_cfg(shared_expert_intermediate_size=6), 4)
    mixtral = _cfg(model_type="mixtral", intermediate_size=36, moe_intermediate_size=36,
                   shared_expert_intermediate_size=0)
    with pytest.raises(ValueError, match=r"does not divide intermediate_size=36 .*experts' "
                       r"width.*sizes that work: 1, 2, 4 "):
        plan_tensor_parallel(mixtral, 8)
    assert plan_tensor_parallel(mixtral, 2).intermediate_per_rank == 18  # = the experts'


def test_quantized_expert_downs_are_cut_at_whole_blocks():
    q8 = {"experts.down_proj": block_size("Q8_0"), "shared_expert.down_proj": 32}
    plan_tensor_parallel(_cfg(shared_expert_intermediate_size=128), 2, q8)  # 32 and 64
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 cuts K=64 of "
                       r"experts.down_proj into shares of 16, not a multiple of its block "
                       r"size 32; sizes that work: 1, 2"):
        plan_tensor_parallel(_cfg(shared_expert_intermediate_size=128), 4, q8)
    with pytest.raises(ValueError, match=r"K=96 of shared_expert.down_proj into shares of 48"):
        plan_tensor_parallel(_cfg(), 2, {"shared_expert.down_proj": 32})


def test_q8_expert_blocks_slice_bitwise_and_misaligned_cuts_are_refused(tmp_path):
    folder = make_tiny_model(tmp_path / "q", "qwen2_moe", seed=3, **COMMON, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=64,
                             shared_expert_intermediate_size=128)
    full, cfg, _ = load_model(folder, torch.float32, "cpu", 64, quantize="q8_0")
    plan = plan_tensor_parallel(cfg, 2)
    model, _, _ = load_model(folder, torch.float32, "cpu", 64, quantize="q8_0")
    shard_decoder(model, plan, 1, lambda t: t)
    for e_full, e in ((full.layers[1].moe.experts[2], model.layers[1].moe.experts[2]),
                      (full.layers[0].moe.shared, model.layers[0].moe.shared)):
        assert isinstance(e.down_weight, BlockWeight)
        w = e_full.down_weight.shape[1]
        gu, down = e_full.gate_up_weight.dequantize(), e_full.down_weight.dequantize()
        half = slice(w // 2, w)
        assert torch.equal(e.down_weight.dequantize(), down[:, half])
        assert torch.equal(e.gate_up_weight.dequantize(),
                           torch.cat([gu[half], gu[w + w // 2:]]))
    assert torch.equal(model.layers[0].moe.router_weight, full.layers[0].moe.router_weight)
    small = make_tiny_model(tmp_path / "s", "qwen3_moe", seed=4, **COMMON, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=32)
    m, scfg, _ = load_model(small, torch.float32, "cpu", 64, quantize="q8_0")
    with pytest.raises(ValueError, match=r"layers.0.experts.0.down_proj \(Q8_0 blocks\) "
                       r"into shares of 16.*sizes that work for .*: 1.*dequantized"):
        shard_decoder(m, plan_tensor_parallel(scfg, 2), 0, lambda t: t)


# ---------------------------------------------------------------- sharded vs unsharded, TP 2

@pytest.fixture(scope="module")
def report(folders):
    cases = [(folders[name], dtype, kernels) for name in FAMILIES
             for dtype, kernels, _ in MODES]
    with launch(tp_model_workers.run_model_checks, 2, args=(TIMEOUT_S, cases),
                timeout_s=TIMEOUT_S, threads_per_rank=1) as workers:
        with workers.group(backend="gloo") as group:
            found = tp_model_workers.model_checks(group, cases)
        workers.join()
    assert not multiprocessing.active_children()
    names = {folders[n]: n for n in folders}
    return {(names[f], d, k): v for (f, d, k), v in found.items()}


def test_each_rank_holds_every_experts_share(report):
    for (name, _, _), e in report.items():
        m = e["moe"]
        shared = 48 if name == "qwen2_moe" else 0
        assert e["tp_size"] == 2 and e["num_heads"] == 2 and e["num_kv_heads"] == 1
        assert m["widths"] == (16, shared // 2)
        assert m["gate_up_shape"] == (32, 64) and e["down_shape"] == (64, 16)
        assert m["router_shape"] == (8, 64)  # replicated
        if name == "qwen2_moe":
            assert m["shared_shapes"] == ((48, 64), (64, 24), (1, 64))
        else:
            assert m["shared_shapes"] is None and e["intermediate_size"] == 24
        assert "tensor-parallel" in e["refusal"] and not e["fused"]


@pytest.mark.parametrize("dtype,kernels,tol", MODES)
def test_rank_0_gets_the_unsharded_moes_outputs(report, dtype, kernels, tol):
    for name in FAMILIES:
        e = report[(name, dtype, kernels)]
        assert e["embedded_equal"], name
        for out, diff in e["diff"].items():
            assert diff <= tol * max(1.0, e["scale"][out]), (name, dtype, out, diff)


def test_with_the_compiled_kernels_a_rows_bits_do_not_depend_on_the_other_rows(report):
    for name in FAMILIES:
        e = report[(name, "float32", "invariant")]
        assert all(e["full_invariant"].values()), (name, e["full_invariant"])
        assert all(e["invariant"].values()), (name, e["invariant"])


# ---------------------------------------------------------------- the engine at TP 2

def test_ngram_speculation_is_plain_decoding_on_a_moe_at_tp2(folders):
    prompts = [[5, 6, 7, 8, 5, 6, 9, 5, 6], [3, 4, 3, 4, 3], [9, 8, 7]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def generate(**kw):
        with LLM(model=folders["qwen2_moe"], tensor_parallel_size=2, max_model_len=64,
                 **kw) as llm:
            outs = llm.generate(prompts, greedy)
        assert not multiprocessing.active_children()
        return [o.token_ids for o in outs]

    plain = generate()
    assert generate(drafter="ngram", drafter_args={"min_ngram": 1}, controller="static",
                    controller_args={"budget": 4}) == plain
