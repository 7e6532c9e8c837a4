"""A bf16 checkpoint starts with no float32 copy of its matrices: the resident memory an engine
start adds is about the checkpoint's own bytes (as bf16 panels), half its float32 matrices
(a start that kept a float32 copy, as before, holds two and a half: parameters and panels).
Quantized at load, it holds the panels (the blocks are cached and mapped, their pages
dropped). Measured in a subprocess (VmRSS, VmHWM), after
the imports a start makes, as test_gguf_memory.py does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from memory_helpers import START
from native_helpers import needs_kernels
from safetensors.torch import save_file

LAYERS, HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = 4, 1024, 2048, 16, 4, 96


def write_bf16_checkpoint(folder: Path) -> Path:
    """A random llama of the shape above as one bf16 model.safetensors (~67 MB)."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                tie_word_embeddings=False, eos_token_id=VOCAB - 1,
                bos_token_id=0).save_pretrained(folder)
    g = torch.Generator().manual_seed(0)
    kv = HIDDEN // HEADS * KV_HEADS

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).bfloat16()

    w = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN), "lm_head.weight": rand(VOCAB, HIDDEN),
         "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)}
    for i in range(LAYERS):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        w.update({a + "q_proj.weight": rand(HIDDEN, HIDDEN), a + "k_proj.weight": rand(kv, HIDDEN),
                  a + "v_proj.weight": rand(kv, HIDDEN), a + "o_proj.weight": rand(HIDDEN, HIDDEN),
                  m + "gate_proj.weight": rand(INTER, HIDDEN),
                  m + "up_proj.weight": rand(INTER, HIDDEN),
                  m + "down_proj.weight": rand(HIDDEN, INTER)})
        for n in ("input_layernorm", "post_attention_layernorm"):
            w[f"model.layers.{i}.{n}.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    save_file(w, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _start(folder: Path, quantize: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    code = START.replace("weights=sys.argv[2]",
                         "quantize=None if sys.argv[2] == 'none' else sys.argv[2]")
    assert code != START
    done = subprocess.run([sys.executable, "-c", code, str(folder), quantize], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory) -> Path:
    return write_bf16_checkpoint(tmp_path_factory.mktemp("bf16-memory"))


@needs_kernels
@pytest.mark.parametrize("quantize", ["none", "q8_0"])
def test_a_bf16_start_keeps_no_fp32_copy(bf16_folder, quantize):
    got = _start(bf16_folder, quantize)
    fp32 = got["matrices"]  # of the matrices the forward multiplies by, as float32
    assert got["weights"] == ("native" if quantize == "none" else quantize)
    # measured (2-core EPYC, loaded; 143 MB of float32 matrices, 71 MB of bf16): own bytes
    # +87 MB, peak +103 MB; q8_0 +57 MB, peak +91 MB (quantized and cached; from the cache +54,
    # +76); q4_k +45 MB, peak +178 MB (preparing its panels); a float32 start
    # (weights="dequantized") +360 MB
    assert got["grew"] < 0.8 * fp32, got
    assert got["peak"] < 1.25 * fp32, got
