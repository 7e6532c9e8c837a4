"""Every GGUF type end to end: a tiny random model whose matrices mix all of them (as a
Q4_K_M file mixes Q4_K, Q6_K and, where in_features % 256 != 0, the 32-wide types), run by the
engine on its own blocks (weights="native") in both activation modes: speculation (ngram)
gives token for token plain decoding's output, greedy and seeded.

The model is an HF folder (config.json, model.safetensors of the dequantized weights) with the
file beside it (model.gguf), the layout the loader makes of a converted GGUF
(specdec/models/aliases.py); the native weights are checked bitwise against the safetensors
ones at load (gguf_weights._checked_panels).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_gguf_weights import needs_kernels, random_blocks

from specdec import LLM, SamplingParams
from specdec.models import gguf_blocks as gb
from specdec.models import q8_activations as qa
from specdec.models.gguf_model import _unpermute

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 96
# per layer: the GGUF type of (qkv, o, gate_up, down); and the LM head's
LAYER_KINDS = [("Q4_0", "Q4_1", "Q5_0", "Q5_1"), ("Q8_0", "Q4_K", "Q5_K", "Q6_K")]
HEAD_KIND = "Q6_K"


def _write_matrix(writer, name: str, b: gb.Blocks, heads: int | None = None) -> None:
    """The blocks under ``name``, rows in the file's order: q / k permuted for rope as GGUF
    stores them (read_matrices un-permutes them)."""
    from gguf import GGMLQuantizationType

    rows = b.rows
    if heads is not None:
        rows = torch.empty_like(b.rows)
        rows[_unpermute(heads, b.rows.shape[0])] = b.rows
    writer.add_tensor(name, rows.numpy(), raw_dtype=GGMLQuantizationType[b.kind])


def make_mixed_model(folder: Path, seed: int = 0) -> Path:
    """The tiny llama (2 layers, hidden 256, inter 512) of LAYER_KINDS / HEAD_KIND."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                      num_hidden_layers=len(LAYER_KINDS), num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, max_position_embeddings=512,
                      rms_norm_eps=1e-6, eos_token_id=VOCAB - 1, bos_token_id=0,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    folder.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(folder / "model.gguf"), "llama")
    kv = HIDDEN // HEADS * KV_HEADS
    n = seed
    with torch.no_grad():
        for i, kinds in enumerate(LAYER_KINDS):
            layer, p = model.model.layers[i], f"blk.{i}."
            parts = [("attn_q", layer.self_attn.q_proj, kinds[0], HIDDEN, HIDDEN, HEADS),
                     ("attn_k", layer.self_attn.k_proj, kinds[0], kv, HIDDEN, KV_HEADS),
                     ("attn_v", layer.self_attn.v_proj, kinds[0], kv, HIDDEN, None),
                     ("attn_output", layer.self_attn.o_proj, kinds[1], HIDDEN, HIDDEN, None),
                     ("ffn_gate", layer.mlp.gate_proj, kinds[2], INTER, HIDDEN, None),
                     ("ffn_up", layer.mlp.up_proj, kinds[2], INTER, HIDDEN, None),
                     ("ffn_down", layer.mlp.down_proj, kinds[3], HIDDEN, INTER, None)]
            for name, linear, kind, out, inp, heads in parts:
                n += 1
                b = random_blocks(kind, out, inp, seed=n)
                linear.weight.copy_(gb.dequantize(b))
                _write_matrix(writer, p + name + ".weight", b, heads)
        b = random_blocks(HEAD_KIND, VOCAB, HIDDEN, seed=n + 1)
        model.lm_head.weight.copy_(gb.dequantize(b))
        _write_matrix(writer, "output.weight", b)
        writer.add_tensor("token_embd.weight", model.model.embed_tokens.weight.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def mixed_model(tmp_path_factory) -> Path:
    return make_mixed_model(tmp_path_factory.mktemp("gguf-types") / "model")


def test_the_model_holds_every_type():
    kinds = {k for layer in LAYER_KINDS for k in layer} | {HEAD_KIND}
    assert kinds == set(gb.BLOCK_BYTES)


@needs_kernels
@pytest.mark.parametrize("activations", ["float", "q8"])
def test_speculation_is_plain_decoding_on_every_type(mixed_model, activations):
    kw = dict(model=str(mixed_model), max_model_len=256, weights="native",
              activations=activations)
    plain = LLM(**kw)
    assert plain.engine.weights == "native"
    table = gb.FORMATS if activations == "float" else qa.FORMATS
    codes = {table[gb.KERNEL_FORMAT[kind]] for kind in gb.BLOCK_BYTES}  # the formats prepare picks
    assert {p.fmt for p in plain.engine.kernels._panels.values()} == codes
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 9, 5, 9, 5, 9, 5]] * 2
    sp = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 2 + [
        SamplingParams(temperature=0.8, seed=3 + i, max_tokens=24, ignore_eos=True)
        for i in range(2)]
    want = [o.token_ids for o in plain.generate(prompts, sp)]
    spec = LLM(**kw, drafter="ngram", controller="static", controller_args={"budget": 4})
    got = spec.generate(prompts, sp)
    assert [o.token_ids for o in got] == want
    assert sum(sum(o.metrics.accepted_by_depth) for o in got) > 0  # not vacuous
    assert np.unique(np.concatenate(want)).size > 2  # the model says more than one thing
