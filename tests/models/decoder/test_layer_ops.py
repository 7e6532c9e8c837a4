"""The decoder's one-kernel-per-step forward (``LlamaDecoder.layer_ops``, what CUDA runners run)
against its torch loop: on a CPU the fused ops run as the torch ops they replace, so the two
forwards must agree bitwise (hidden states, captured layers and the K/V written), for every
architecture's options (q/k norms, qkv bias) and dtype, over prefill, decode and tree rows."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model

from specdec.attention.metadata import build_metadata
from specdec.attention.torch_backend import TorchAttentionBackend
from specdec.kv.cache import KVCache
from specdec.models.decoder import layer_ops
from specdec.models.loader import load_model
from specdec.tree import DraftTree, step_mask

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PAGE = 4


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def folder(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


def _steps(model, layer_ops_on: bool):
    """Prefill 9 tokens of request 0 and 6 of request 1, then a step with request 0's decode
    row + a 3-node tree and request 1's decode row: (hidden of both steps, layers, cache)."""
    cfg = model.cfg
    model.layer_ops = layer_ops_on
    kv = KVCache(cfg.num_layers, 12, PAGE, cfg.num_kv_heads, cfg.head_dim, model.embed.dtype,
                 "cpu")
    tables = [[5, 2, 9, 0], [7, 3, 11]]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (9, 6)]
    backend = TorchAttentionBackend(kernels=None)
    backend.plan(build_metadata(tables, [9, 6], [9, 6], PAGE))
    first = model(torch.cat(prompts), torch.cat([torch.arange(9), torch.arange(6)]), backend, kv,
                  capture_layers=(0, 1))
    tree = DraftTree(torch.tensor([4, 5, 6]), torch.tensor([-1, -1, 0]))
    ids = torch.cat([torch.tensor([7]), tree.tokens, torch.tensor([8])])
    positions = torch.cat([torch.tensor([9]), tree.positions(10), torch.tensor([6])])
    backend.plan(build_metadata(tables, [13, 7], [4, 1], PAGE, [step_mask(tree, 9, 10), None]))
    second = model(ids, positions, backend, kv, capture_layers=(1,))
    return first, second, kv


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_layer_ops_forward_is_bitwise_the_torch_loop(folder, dtype):
    model = load_model(folder, dtype, "cpu", 64)[0]
    with torch.inference_mode():
        want = _steps(model, False)
        got = _steps(model, True)
    for w, g in zip(want[:2], got[:2]):
        assert torch.equal(w.hidden, g.hidden)
        assert w.layer_hidden.keys() == g.layer_hidden.keys()
        assert all(torch.equal(w.layer_hidden[i], g.layer_hidden[i]) for i in w.layer_hidden)
    assert torch.equal(want[2].tensor, got[2].tensor)


def test_add_rms_norm_updates_both_in_place():
    g = torch.Generator().manual_seed(1)
    x, residual, w = (torch.randn(3, 8, generator=g) for _ in range(3))
    w = w[0]
    want_residual = residual + x
    want = layer_ops.rms_norm_reference(want_residual, w, 1e-6)
    layer_ops.add_rms_norm_(x, residual, w, 1e-6)
    assert torch.equal(residual, want_residual) and torch.equal(x, want)
