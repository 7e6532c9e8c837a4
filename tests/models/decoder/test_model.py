"""Our LlamaDecoder against HF transformers on the same weights (the model oracle).

Every forward goes through the paged KV cache with shuffled, non-contiguous pages, so the model,
the torch attention backend and the page layout are checked together.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model
from transformers import AutoModelForCausalLM

from specdec.attention.metadata import build_metadata
from specdec.attention.torch_backend import TorchAttentionBackend
from specdec.kv.cache import KVCache
from specdec.models.decoder.llama import rms_norm
from specdec.models.loader import hf_weights_kwargs, load_model
from specdec.models.tokenizer import load_tokenizer

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
PAGE = 4
NUM_PAGES = 16
TABLE = [11, 3, 7, 0, 14, 5, 9, 2]  # shuffled pages: 32 slots, crossed every 4 tokens
PROMPT_LEN = 20
DECODE_STEPS = 4


def _load_both(folder, dtype, max_positions=128):
    model, cfg, _ = load_model(folder, dtype, "cpu", max_positions)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype,
                                              **hf_weights_kwargs(folder)).eval()
    return model, cfg, hf


def _cache(cfg, dtype, num_pages=NUM_PAGES, page_size=PAGE) -> KVCache:
    return KVCache(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, dtype, "cpu")


def _step(model, kv, table, start, ids, capture=(), page_size=PAGE):
    """One request's new rows `ids` at positions start.. -> (logits [n, V], ForwardOutput)."""
    n = ids.numel()
    backend = TorchAttentionBackend()
    backend.plan(build_metadata([table], [start + n], [n], page_size))
    out = model(ids, torch.arange(start, start + n), backend, kv, capture_layers=capture)
    return model.compute_logits(out.hidden), out


def _hf_logits(hf, ids) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids[None]).logits[0]


def _prompt(cfg, n=PROMPT_LEN, seed=1) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def _prefill_then_decode(model, cfg, dtype):
    """Prefill a prompt, then greedy-decode DECODE_STEPS tokens one at a time through the cache.

    Returns (all token ids [PROMPT_LEN + DECODE_STEPS], prefill logits, [decode logits rows]).
    """
    kv = _cache(cfg, dtype)
    ids = _prompt(cfg)
    prefill, _ = _step(model, kv, TABLE, 0, ids)
    seq, decode_rows, nxt = ids.tolist(), [], int(prefill[-1].argmax())
    for _ in range(DECODE_STEPS):
        logits, _ = _step(model, kv, TABLE, len(seq), torch.tensor([nxt]))
        assert logits.shape == (1, cfg.vocab_size)
        seq.append(nxt)
        decode_rows.append(logits[0])
        nxt = int(logits[0].argmax())
    return torch.tensor(seq), prefill, torch.stack(decode_rows)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_decode_match_hf_float32(tiny_models, arch):
    model, cfg, hf = _load_both(tiny_models[arch], torch.float32)
    seq, prefill, decode = _prefill_then_decode(model, cfg, torch.float32)
    ref = _hf_logits(hf, seq)
    assert prefill.shape == (PROMPT_LEN, cfg.vocab_size) and prefill.dtype == torch.float32
    torch.testing.assert_close(prefill, ref[:PROMPT_LEN], atol=1e-4, rtol=0)
    # decode step k predicts from the token at position PROMPT_LEN + k
    torch.testing.assert_close(decode, ref[PROMPT_LEN:], atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def tiny_phi3(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("phi3"), "phi3")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_phi3_checkpoint_matches_hf(tiny_phi3, dtype):
    """A Phi-3 checkpoint stores q|k|v and gate|up fused (qkv_proj, gate_up_proj): the
    decoder's own layout, read as it is."""
    from safetensors.torch import load_file

    assert "model.layers.0.self_attn.qkv_proj.weight" in load_file(
        tiny_phi3 / "model.safetensors")
    model, cfg, hf = _load_both(tiny_phi3, dtype)
    assert cfg.model_type == "phi3"
    sd = hf.state_dict()
    assert torch.equal(model.layers[1].qkv_weight, sd["model.layers.1.self_attn.qkv_proj.weight"])
    seq, prefill, decode = _prefill_then_decode(model, cfg, dtype)
    ours, ref = torch.cat([prefill, decode]), _hf_logits(hf, seq)
    torch.testing.assert_close(ours, ref, atol=1e-5 if dtype == torch.float64 else 1e-4, rtol=0)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("arch", ARCHS)
def test_float64_argmax_exact_every_row(tiny_models, arch):
    model, cfg, hf = _load_both(tiny_models[arch], torch.float64)
    seq, prefill, decode = _prefill_then_decode(model, cfg, torch.float64)
    ours = torch.cat([prefill, decode])
    ref = _hf_logits(hf, seq)[: len(ours)]
    assert ours.dtype == torch.float64
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    # HF's RMSNorm runs in float32 even for float64 models, hence not 1e-12
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def _hf_layer_outputs(hf, ids):
    """(output of every decoder layer via forward hooks, HF hidden_states)."""
    outs = {}

    def hook(i):
        def fn(_module, _args, output):
            outs[i] = (output[0] if isinstance(output, tuple) else output)[0].detach().clone()
        return fn

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(hf.model.layers)]
    try:
        with torch.no_grad():
            hidden_states = hf(ids[None], output_hidden_states=True).hidden_states
    finally:
        for h in handles:
            h.remove()
    return outs, [h[0] for h in hidden_states]


@pytest.mark.parametrize("arch", ARCHS)
def test_captured_layers_match_hf_hidden_states(tiny_models, arch):
    model, cfg, hf = _load_both(tiny_models[arch], torch.float32)
    ids = _prompt(cfg, seed=2)
    layers = tuple(range(cfg.num_layers))
    _, out = _step(model, _cache(cfg, torch.float32), TABLE, 0, ids, capture=layers)
    hooked, hidden_states = _hf_layer_outputs(hf, ids)
    assert sorted(out.layer_hidden) == list(layers)
    for i in layers:
        assert out.layer_hidden[i].shape == (PROMPT_LEN, cfg.hidden_size)
        torch.testing.assert_close(out.layer_hidden[i], hooked[i], atol=1e-5, rtol=0)
    # HF: hidden_states[i + 1] is layer i's output, except the last entry, which is final-normed
    assert len(hidden_states) == cfg.num_layers + 1
    for i in layers[:-1]:
        torch.testing.assert_close(out.layer_hidden[i], hidden_states[i + 1], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.hidden, hidden_states[-1], atol=1e-5, rtol=0)
    last = out.layer_hidden[layers[-1]]
    torch.testing.assert_close(rms_norm(last, model.final_norm, cfg.rms_norm_eps), out.hidden)


def test_capture_only_requested_layers(tiny_models):
    model, cfg, hf = _load_both(tiny_models["llama"], torch.float32)
    ids = _prompt(cfg, seed=3)
    _, out = _step(model, _cache(cfg, torch.float32), TABLE, 0, ids, capture=(0,))
    assert list(out.layer_hidden) == [0]
    _, none = _step(model, _cache(cfg, torch.float32), TABLE, 0, ids)
    assert none.layer_hidden == {}
    hooked, _ = _hf_layer_outputs(hf, ids)
    torch.testing.assert_close(out.layer_hidden[0], hooked[0], atol=1e-5, rtol=0)


ROPE_ATOL = 1e-5
ROPE_SCALINGS = {
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16, rope_theta=10000.0),
    "linear": dict(rope_type="linear", factor=4.0, rope_theta=10000.0),
}


@pytest.mark.parametrize("kind", sorted(ROPE_SCALINGS))
def test_rope_scaling_matches_hf(tmp_path, kind):
    scaled = make_tiny_model(tmp_path / kind, "llama", seed=5, rope_scaling=ROPE_SCALINGS[kind])
    plain = make_tiny_model(tmp_path / "plain", "llama", seed=5)  # same weights, default RoPE
    model, cfg, hf = _load_both(scaled, torch.float32)
    ids = _prompt(cfg, n=48, seed=4)  # longer than original_max_position_embeddings
    table = list(range(12, 0, -1))
    logits, _ = _step(model, _cache(cfg, torch.float32), table, 0, ids)
    torch.testing.assert_close(logits, _hf_logits(hf, ids), atol=ROPE_ATOL, rtol=0)
    # the scaling must move the logits well past the tolerance, or this test could not fail
    # (tiny random models have logits of ~0.1; scaling moves them by ~1e-3)
    unscaled = _hf_logits(AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32), ids)
    assert (logits - unscaled).abs().max() > 10 * ROPE_ATOL


# ---- the real SmolLM2-135M (fp32) ----------------------------------------------------------

SMOL_PROMPTS = ("The capital of France is", "def fibonacci(n):\n    ")


@pytest.fixture(scope="module")
def smollm2(smollm2_dir, smollm2_hf):
    model, cfg, _ = load_model(smollm2_dir, torch.float32, "cpu", 256)
    return model, cfg, smollm2_hf, load_tokenizer(smollm2_dir)


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2_hf")  # the run builds smollm2_hf on one worker only
def test_smollm2_matches_hf(smollm2):
    """Both prompts prefilled in ONE plan (two requests), then one decode step for both."""
    model, cfg, hf, tok = smollm2
    prompts = [torch.tensor(tok(p)["input_ids"]) for p in SMOL_PROMPTS]
    lens = [len(p) for p in prompts]
    tables = [[5, 1, 7, 3], [2, 6, 0, 4]]
    page = 16
    kv = _cache(cfg, torch.float32, num_pages=8, page_size=page)
    backend = TorchAttentionBackend()
    backend.plan(build_metadata(tables, lens, lens, page))
    positions = torch.cat([torch.arange(n) for n in lens])
    out = model(torch.cat(prompts), positions, backend, kv)
    logits = model.compute_logits(out.hidden).split(lens)
    nxt = [int(lg[-1].argmax()) for lg in logits]
    backend.plan(build_metadata(tables, [n + 1 for n in lens], [1, 1], page))
    step = model(torch.tensor(nxt), torch.tensor(lens), backend, kv)
    decode = model.compute_logits(step.hidden)
    for b, ids in enumerate(prompts):
        ref = _hf_logits(hf, torch.cat([ids, torch.tensor([nxt[b]])]))
        ours = torch.cat([logits[b], decode[b : b + 1]])
        torch.testing.assert_close(ours, ref, atol=1e-3, rtol=0)
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
