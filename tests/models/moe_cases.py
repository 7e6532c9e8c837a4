"""The tiny mixture-of-experts models the MoE tests share (tests/models/test_moe*.py): one
random folder per family (qwen3_moe, mixtral, qwen2_moe: 4 layers, 8 or 4 experts top 2,
qwen2_moe with its shared expert), the prompts they decode."""

from __future__ import annotations

from pathlib import Path

from conftest import make_tiny_model

from specdec import SamplingParams

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


def make_moe_models(root: Path) -> dict[str, Path]:
    """{family: folder} under ``root``."""
    return {mt: make_tiny_model(root / mt, mt, seed=i, **COMMON, **kw)
            for i, (mt, kw) in enumerate(FAMILIES.items())}
