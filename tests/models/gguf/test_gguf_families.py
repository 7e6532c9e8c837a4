"""GGUF families beyond Llama / Qwen (specdec/models/gguf/model.py; docs/engine-options.md#gguf-families):
a llama file named "mistral" (a Mistral to transformers, inside its window), Llama 3.1+ rope
scaling read from its factors, Phi-3's rope variants the decoder does not run (refused by
name) and its sliding window. Each against HF transformers reading the same file, or refused
before any weight is used."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_helpers import write_tiny_gguf
from test_gguf_model import _load, _user_file, _with_tensor

from specdec import LLM, SamplingParams
from specdec.models.loader import load_model, resolve_model_path

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_llama_file_named_mistral_is_a_mistral_inside_its_window(tmp_path, cache):
    """transformers reads a "llama" file whose general.name is "mistral" as a Mistral, with
    its class's sliding window (4096; llama.cpp applies none): the engine stays inside the
    window, where Mistral is Llama. transformers cannot load such a file's weights (gguf-py
    has no "mistral" architecture), so the oracle is HF's Mistral with the weights it reads
    from the same file named otherwise."""
    from transformers import AutoConfig, AutoModelForCausalLM, MistralForCausalLM

    path = _user_file(tmp_path, kind="Q8_0", tied=False, name="mistral")
    model, cfg, _ = load_model(resolve_model_path(str(path)), torch.float32, "cpu", 64,
                               blocks=True)
    assert cfg.model_type == "mistral" and cfg.sliding_window == 4096
    sp = SamplingParams(temperature=0, max_tokens=12)
    plain = LLM(model=str(path), max_model_len=64)
    spec = LLM(model=str(path), max_model_len=64, drafter="ngram", controller="static",
               controller_args={"budget": 3})
    got = [o.token_ids for o in plain.generate(["hello", "abab"], sp)]
    assert [o.token_ids for o in spec.generate(["hello", "abab"], sp)] == got
    with pytest.raises(ValueError, match=r"max_model_len=5000 exceeds the model's limit 256"):
        LLM(model=str(path), max_model_len=5000)
    llama = write_tiny_gguf(tmp_path / "llama.gguf", kind="Q8_0", tied=False)
    weights = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=llama.name,
                                                   dtype=torch.float32).state_dict()
    hf_cfg = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    assert hf_cfg.model_type == "mistral" and hf_cfg.sliding_window == 4096
    hf = MistralForCausalLM(hf_cfg).eval()
    hf.load_state_dict(weights)
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.compute_logits(model.forward_dense(ids).hidden[0])
        torch.testing.assert_close(ours, hf(ids).logits[0], atol=1e-5, rtol=0)


def _llama3_file(tmp_path: Path, factors=None) -> Path:
    """A tiny llama file with Llama 3.1's rope scaling as llama.cpp's converter stores it
    (rope_freqs.weight), over rope theta 500000: every regime (unscaled, smoothed, divided by
    the factor) among its 8 frequencies."""
    from specdec.models.gguf.model import LLAMA3, rope_factors

    path = _user_file(tmp_path, tied=False, metadata={"llama.rope.freq_base": 500000.0})
    if factors is None:
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
        factors = rope_factors(inv_freq, 8.0, *LLAMA3.values())
        assert {1.0, 8.0} < set(factors.tolist())
    _with_tensor(path, "rope_freqs.weight", factors.numpy())
    return path


def test_llama3_rope_scaling_is_read_from_its_factors(tmp_path, cache):
    """transformers ignores rope_freqs.weight (its reading of such a file has plain RoPE);
    config.json gets the llama3 rope parameters that give these very divisors, and the model
    is transformers' Llama with them, on the weights transformers reads from the file."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

    path = _llama3_file(tmp_path)
    folder = resolve_model_path(str(path))
    rope = json.loads((folder / "config.json").read_text())["rope_parameters"]
    assert rope == {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}
    model, cfg, _ = load_model(folder, torch.float32, "cpu", 64, blocks=True)
    plain = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    hf = LlamaForCausalLM(AutoConfig.from_pretrained(folder)).eval()
    hf.load_state_dict(plain.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.compute_logits(model.forward_dense(ids).hidden[0])
        torch.testing.assert_close(ours, hf(ids).logits[0], atol=1e-5, rtol=0)
        assert (ours - plain(ids).logits[0]).abs().max() > 1e-3  # the scaling matters here


def test_rope_factors_that_are_not_llama3s_are_refused(tmp_path, cache):

    path = _llama3_file(tmp_path, torch.from_numpy(np.linspace(1, 4, 8, dtype=np.float32)))
    with pytest.raises(ValueError, match=re.escape(str(path)) + r": tensor rope_freqs\.weight "
                       r"\(8 rope frequency divisors\): not Llama 3's rope scaling"):
        resolve_model_path(str(path))


@pytest.mark.parametrize("what", ["longrope", "partial rotary"])
def test_phi3_rope_the_decoder_does_not_run(what, tmp_path, cache):
    """Phi-3 128k / Phi-3.5 (LongRoPE factors as tensors) and Phi-4-mini (partial rotary in
    rope.dimension_count): transformers would drop either silently; refused from the header."""

    if what == "longrope":
        path = _user_file(tmp_path, arch="phi3")
        _with_tensor(path, "rope_factors_long.weight", np.ones(8, np.float32))
        expect = r"tensor rope_factors_long\.weight holds LongRoPE factors .* plain RoPE only"
    else:
        path = _user_file(tmp_path, arch="phi3", metadata={"phi3.rope.dimension_count": 12})
        expect = (r"phi3\.rope\.dimension_count 12 rotates part of each head \(16\); "
                  r"LlamaDecoder rotates whole heads only")
    with pytest.raises(ValueError, match=re.escape(str(path)) + ": " + expect):
        resolve_model_path(str(path))


def test_phi3_sliding_window_keeps_the_engine_inside_it(tmp_path, cache):
    """transformers drops phi3's sliding window (llama.cpp does not apply it): config.json
    keeps it, so a sequence stays where windowed and full attention agree."""
    path = _user_file(tmp_path, arch="phi3", metadata={"phi3.attention.sliding_window": 48})
    model, cfg, _ = _load(path)
    assert cfg.sliding_window == 48
    with pytest.raises(ValueError, match=r"max_model_len=64 exceeds the model's limit 48"):
        LLM(model=str(path), max_model_len=64)
    assert LLM(model=str(path), weights="dequantized").engine.parts.max_model_len == 48
