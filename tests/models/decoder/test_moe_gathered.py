"""A mixture-of-experts layer's experts gathered (``MoEMLP.stack_experts``: one launch per
matrix over every (row, expert) pair, specdec/kernels/invariant_moe.py), what the engine sets up
on a GPU with the row-invariant Triton kernels: bitwise the one-expert-at-a-time loop with
``invariant_linear`` as the matmul, the same experts woken (left on the device, read once for
every layer), a row's output the same beside any other rows, and a decoder of such layers
installed by ``install_kernels`` with its experts stacked.

Without a GPU the kernels run under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), each tl.dot as a row-by-row in-order sum (interpreter_helpers).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))
from interpreter_helpers import host_independent_interpreter_dot  # noqa: E402, F401

from specdec.kernels.invariant_matmul import InvariantLinear  # noqa: E402
from specdec.models.decoder.config import ModelConfig  # noqa: E402
from specdec.models.decoder.moe import MoEMLP  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FAMILIES = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    "mixtral": dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                      shared_expert_intermediate_size=48),
}


def _layer(family: str, dtype: torch.dtype, seed: int = 0) -> MoEMLP:
    cfg = ModelConfig(model_type=family, vocab_size=96, hidden_size=64, intermediate_size=64,
                      num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                      qk_norm=False, max_position_embeddings=64, sliding_window=None,
                      eos_token_ids=(2,), moe_intermediate_size=32, **FAMILIES[family])
    torch.manual_seed(seed)
    moe = MoEMLP(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return moe.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_gathered_experts_are_the_loop_bitwise(family, dtype):
    moe, mm = _layer(family, dtype), InvariantLinear()
    h = (torch.randn(11, 64, generator=torch.Generator().manual_seed(1))).to(dtype)
    with torch.no_grad():
        looped = moe(h, mm)
        woken = moe.woken
        before = [e.gate_up_weight.clone() for e in moe.experts]
        moe.stack_experts()
        assert moe.stacked_gate_up.shape == (moe.cfg.num_experts, 64, 64)
        # the experts' parameters are views of the stacked tensors: one copy of the weights
        assert all(e.gate_up_weight.data_ptr() == moe.stacked_gate_up[j].data_ptr()
                   and torch.equal(e.gate_up_weight, w)
                   for j, (e, w) in enumerate(zip(moe.experts, before)))
        gathered = moe(h, mm)
    assert torch.equal(gathered, looped)
    assert isinstance(moe.woken, torch.Tensor) and int(moe.woken) == woken


def test_a_rows_gathered_output_does_not_depend_on_its_companions():
    moe, mm = _layer("qwen3_moe", torch.float32, seed=2), InvariantLinear()
    moe.stack_experts()
    rows = torch.randn(20, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        alone = moe(rows[:1], mm)
        for n in (1, 4, 19):
            for at in (0, n):
                batch = torch.cat([rows[1:1 + at], rows[:1], rows[1 + at:1 + n]])
                assert torch.equal(moe(batch, mm)[at:at + 1], alone), (n, at)


def test_a_decoder_gets_its_experts_stacked_and_counts_read_once(tmp_path, monkeypatch):
    from conftest import make_tiny_model

    from specdec.models.loader import load_model
    from specdec.models.matmul import choice

    folder = make_tiny_model(tmp_path / "m", "qwen3_moe", seed=0, hidden_size=64,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=32)
    model, cfg, _ = load_model(folder, torch.float32, "cpu", 64)
    # the hook _choose returns on a GPU with triton (here handed over on the CPU)
    monkeypatch.setattr(choice, "_choose", lambda *a: InvariantLinear())
    choice.install_kernels([model], "invariant", torch.float32, torch.device("cpu"))
    assert isinstance(model.matmul, InvariantLinear) and model.fused is None
    assert all(layer.moe.stacked_gate_up is not None for layer in model.layers)
    with torch.no_grad():
        model.forward_dense(torch.tensor([[5, 6, 7, 8, 9]]))
    woken = model.experts_woken()  # every layer's device count, in one tensor
    assert isinstance(woken, torch.Tensor) and woken.shape == (cfg.num_layers,)
    assert all(0 < w <= cfg.num_experts for w in woken.tolist())
