"""The dense (training) path of the decoder: same weights, same numbers as HF and as the paged
path; gradients flow to trainable layers built from the same class; no second implementation."""

from __future__ import annotations

import pytest
import torch

from specdec.attention.dense import DenseAttention
from specdec.models.decoder.llama import DecoderLayer
from specdec.models.loader import load_model


@pytest.fixture(scope="module")
def llama64(tiny_llama):
    model, cfg, _ = load_model(tiny_llama, torch.float64, "cpu", 128)
    return model, cfg


def _hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()


def test_dense_forward_matches_hf_with_padding(tiny_llama, llama64):
    model, cfg = llama64
    hf = _hf(tiny_llama)
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1, 6:] = False  # right padding
    mask[2, :4] = False  # left padding
    with torch.no_grad():
        out = model.forward_dense(ids, mask, capture_layers=(0,))
        logits = model.compute_logits(out.hidden.reshape(-1, cfg.hidden_size)).view(3, 9, -1)
        positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
        ref = hf(input_ids=ids, attention_mask=mask.long(), position_ids=positions,
                 output_hidden_states=True)
    for b in range(3):
        real = mask[b]
        torch.testing.assert_close(logits[b, real], ref.logits[b, real], atol=1e-6, rtol=0)  # RoPE tables are float32 in both
        # captured layer 0 output = HF hidden_states[1]
        torch.testing.assert_close(out.layer_hidden[0][b, real], ref.hidden_states[1][b, real],
                                   atol=1e-6, rtol=0)  # RoPE tables are float32 in both
    assert torch.isfinite(logits).all()  # padding rows too (they see themselves)


def test_dense_equals_paged_forward(tiny_llama, llama64):
    from specdec.engine.runner import ModelRunner
    from specdec.kv.block_table import BlockTable

    model, cfg = llama64
    runner = ModelRunner(model, "t", "torch", 4, "cpu")
    runner.allocate(8)
    ids = list(range(3, 14))
    table = BlockTable()
    runner.kv.reserve(table, len(ids))
    paged = runner.forward(runner.pack([ids], [0], [table], logits="all"))
    with torch.no_grad():
        dense = model.forward_dense(torch.tensor([ids]))
    torch.testing.assert_close(paged.final_hidden, dense.hidden[0], atol=1e-10, rtol=1e-10)


def test_trainable_layer_gets_gradients_and_target_does_not(llama64):
    model, cfg = llama64
    layer = DecoderLayer(cfg, trainable=True).to(torch.float64)
    layer.reset_parameters()
    ids = torch.randint(0, cfg.vocab_size, (2, 5))
    with torch.no_grad():
        feats = model.forward_dense(ids).hidden  # target features, no grad
    assert not feats.requires_grad
    valid = torch.ones(2, 5, dtype=torch.bool)
    backend = DenseAttention.causal(valid)
    positions = torch.arange(5).repeat(2)
    cos, sin = model.rope.lookup(positions)
    y = layer(feats.reshape(10, -1), cos, sin, backend, None)
    loss = model.compute_logits(model.norm(y)).logsumexp(-1).mean()
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())
    assert all(p.grad is None for p in model.parameters())


def test_dense_attention_custom_mask_equals_reference():
    """A non-causal block mask (as block-diffusion drafters use) against a dense softmax."""
    torch.manual_seed(0)
    b, s, h, d = 2, 5, 2, 4
    q, k, v = (torch.randn(b * s, h, d, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(b, s, s) > 0.4
    mask |= torch.eye(s, dtype=torch.bool)
    out = DenseAttention(mask).run(q, k, v, None, 0.5)
    qh, kh, vh = (x.view(b, s, h, d) for x in (q, k, v))
    scores = torch.einsum("bihd,bjhd->bhij", qh, kh) * 0.5
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    ref = torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), vh).reshape(b * s, h, d)
    torch.testing.assert_close(out, ref)
