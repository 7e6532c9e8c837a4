"""Every GGUF type end to end: a tiny random model whose matrices mix all of them (as a
Q4_K_M file mixes Q4_K, Q6_K and, where in_features % 256 != 0, the 32-wide types), run by the
engine on its own blocks (weights="native") in both activation modes: speculation (ngram)
gives token for token plain decoding's output, greedy and seeded.

And a tiny Q4_K_M-like model whose fused matrices mix types (q|k Q4_K beside v Q6_K, as
llama.cpp's Q4_K_M stores attn_v in some layers; a q|k|v of three types and a gate|up of two),
which the kernels run in parts (native.PanelParts): the same checks, and its native tokens in
float are the dequantized model's.

The models are HF folders (config.json, model.safetensors of the dequantized weights) with the
file beside it (model.gguf), the layout the loader makes of a converted GGUF
(specdec/models/aliases.py); the native weights are checked bitwise against the safetensors
ones at load (gguf_weights._checked_panels).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_helpers import random_blocks
from native_helpers import needs_kernels

from specdec import LLM, SamplingParams
from specdec.models.gguf import blocks as gb
from specdec.models.gguf import q8_activations as qa
from specdec.models.gguf.model import _unpermute
from specdec.native import PanelParts, Panels

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 96
# per layer: the GGUF type of (qkv, o, gate_up, down); and the LM head's
LAYER_KINDS = [("Q4_0", "Q4_1", "Q5_0", "Q5_1"), ("Q8_0", "Q4_K", "Q5_K", "Q6_K")]
HEAD_KIND = "Q6_K"
ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# per layer, per file tensor: layer 0 as llama.cpp's Q4_K_M stores its first layers (Q6_K
# attn_v and ffn_down), layer 1 fused matrices of more types than a Q4_K_M file has (q|k|v of
# three, gate|up of two: the parts' paths through the layer call)
Q4_K_M_KINDS = [dict(zip(ROLES, ("Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q4_K", "Q4_K", "Q6_K"))),
                dict(zip(ROLES, ("Q4_K", "Q5_K", "Q6_K", "Q4_K", "Q4_K", "Q6_K", "Q4_K")))]


def _per_tensor(kinds: tuple[str, str, str, str]) -> dict[str, str]:
    """(qkv, o, gate_up, down) types -> a type per file tensor."""
    qkv, o, gate_up, down = kinds
    return dict(zip(ROLES, (qkv, qkv, qkv, o, gate_up, gate_up, down)))


def _write_matrix(writer, name: str, b: gb.Blocks, heads: int | None = None) -> None:
    """The blocks under ``name``, rows in the file's order: q / k permuted for rope as GGUF
    stores them (read_matrices un-permutes them)."""
    from gguf import GGMLQuantizationType

    rows = b.rows
    if heads is not None:
        rows = torch.empty_like(b.rows)
        rows[_unpermute(heads, b.rows.shape[0])] = b.rows
    writer.add_tensor(name, rows.numpy(), raw_dtype=GGMLQuantizationType[b.kind])


def make_mixed_model(folder: Path, seed: int = 0, layers: list[dict[str, str]] | None = None,
                     head: str = HEAD_KIND) -> Path:
    """The tiny llama (hidden 256, inter 512) of ``layers`` (a GGUF type per file tensor and
    layer; default LAYER_KINDS) and ``head`` (the LM head's type)."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    layers = layers or [_per_tensor(k) for k in LAYER_KINDS]
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                      num_hidden_layers=len(layers), num_attention_heads=HEADS,
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
        for i, kinds in enumerate(layers):
            layer, p = model.model.layers[i], f"blk.{i}."
            parts = [("attn_q", layer.self_attn.q_proj, HIDDEN, HIDDEN, HEADS),
                     ("attn_k", layer.self_attn.k_proj, kv, HIDDEN, KV_HEADS),
                     ("attn_v", layer.self_attn.v_proj, kv, HIDDEN, None),
                     ("attn_output", layer.self_attn.o_proj, HIDDEN, HIDDEN, None),
                     ("ffn_gate", layer.mlp.gate_proj, INTER, HIDDEN, None),
                     ("ffn_up", layer.mlp.up_proj, INTER, HIDDEN, None),
                     ("ffn_down", layer.mlp.down_proj, HIDDEN, INTER, None)]
            for name, linear, out, inp, heads in parts:
                n += 1
                b = random_blocks(kinds[name], out, inp, seed=n)
                linear.weight.copy_(gb.dequantize(b))
                _write_matrix(writer, p + name + ".weight", b, heads)
        b = random_blocks(head, VOCAB, HIDDEN, seed=n + 1)
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


PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 9, 5, 9, 5, 9, 5]] * 2
PARAMS = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 2 + [
    SamplingParams(temperature=0.8, seed=3 + i, max_tokens=24, ignore_eos=True)
    for i in range(2)]


def _speculation_is_plain(kw: dict) -> list[list[int]]:
    """Plain decoding's tokens of PROMPTS, checked equal to ngram speculation's."""
    plain = LLM(**kw)
    want = [o.token_ids for o in plain.generate(PROMPTS, PARAMS)]
    spec = LLM(**kw, drafter="ngram", controller="static", controller_args={"budget": 4})
    got = spec.generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in got] == want
    assert sum(sum(o.metrics.accepted_by_depth) for o in got) > 0  # not vacuous
    assert np.unique(np.concatenate(want)).size > 2  # the model says more than one thing
    return want


@needs_kernels
@pytest.mark.parametrize("activations", ["float", "q8"])
def test_speculation_is_plain_decoding_on_every_type(mixed_model, activations):
    kw = dict(model=str(mixed_model), max_model_len=256, weights="native",
              activations=activations)
    plain = LLM(**kw)
    assert plain.engine.parts.weights == "native"
    table = gb.FORMATS if activations == "float" else qa.FORMATS
    codes = {table[gb.KERNEL_FORMAT[kind]] for kind in gb.BLOCK_BYTES}  # the formats prepare picks
    assert {p.fmt for p in plain.engine.parts.kernels._panels.values()} == codes
    _speculation_is_plain(kw)


@needs_kernels
def test_auto_is_q8_wherever_the_blocks_run_also_beside_safetensors(mixed_model):
    """One rule for activations="auto" (issue 51): the folder's fp32 safetensors sit beside a
    GGUF whose blocks they equal, so the kernels run the file's blocks ("native") and auto
    multiplies them as llama.cpp would (q8), as for a model loaded from the file itself; with
    the weights dequantized, float."""
    kw = dict(model=str(mixed_model), max_model_len=256)
    auto = LLM(**kw)
    assert (auto.engine.parts.weights, auto.engine.parts.activations) == ("native", "q8")
    assert {p.fmt for p in auto.engine.parts.kernels._panels.values()} <= set(
        qa.FORMATS.values())
    deq = LLM(weights="dequantized", **kw)
    assert (deq.engine.parts.weights, deq.engine.parts.activations) == ("dequantized", "float")


@pytest.fixture(scope="module")
def q4_k_m_model(tmp_path_factory) -> Path:
    return make_mixed_model(tmp_path_factory.mktemp("gguf-q4-k-m") / "model", seed=7,
                            layers=Q4_K_M_KINDS, head="Q6_K")


@needs_kernels
@pytest.mark.parametrize("activations", ["float", "q8"])
def test_fused_matrices_of_several_types_run_in_parts(q4_k_m_model, activations):
    """q|k Q4_K + v Q6_K (layer 0), q Q4_K + k Q5_K + v Q6_K and gate Q4_K + up Q6_K (layer
    1) run natively in parts, each in its own kernel format; speculation is plain decoding, and
    in float the tokens are the dequantized model's."""
    kw = dict(model=str(q4_k_m_model), max_model_len=256, activations=activations)
    nat = LLM(weights="native", **kw)
    assert nat.engine.parts.weights == "native"
    codes = gb.FORMATS if activations == "float" else qa.FORMATS
    m, panels = nat.engine.parts.model, nat.engine.parts.kernels.prepared
    kinds = {(0, "qkv"): ("Q4_K", "Q6_K"), (1, "qkv"): ("Q4_K", "Q5_K", "Q6_K"),
             (1, "gate_up"): ("Q4_K", "Q6_K")}
    want = {at: tuple(gb.KERNEL_FORMAT[k] for k in ks) for at, ks in kinds.items()}
    for i, layer in enumerate(m.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            p = panels(getattr(layer, f"{name}_weight"))
            fmts = tuple(codes[f] for f in want.get((i, name), ()))
            if fmts:
                assert isinstance(p, PanelParts) and tuple(q.fmt for q in p.parts) == fmts
            else:
                assert isinstance(p, Panels), (i, name)
    assert m.fused is not None  # the layers run as compiled calls, over the parts
    tokens = _speculation_is_plain(dict(weights="native", **kw))
    if activations == "float":  # the same numbers as the fp32 weights
        deq = LLM(weights="dequantized", **kw)
        assert [o.token_ids for o in deq.generate(PROMPTS, PARAMS)] == tokens


@needs_kernels
@pytest.mark.parametrize("activations", ["float", "q8"])
def test_parts_are_made_again_at_every_start(q4_k_m_model, activations, cache):
    """Nothing is cached (issue 46): a second engine makes the same parts again (q|k|v of
    three types as three panel sets) and gives the same tokens; the cache holds no panels."""
    kw = dict(model=str(q4_k_m_model), max_model_len=256, weights="native",
              activations=activations)
    first = LLM(**kw)
    again = LLM(**kw)
    m = again.engine.parts.model
    p = again.engine.parts.kernels.prepared(m.layers[1].qkv_weight)
    assert isinstance(p, PanelParts) and [q.out_features for q in p.parts] == [256, 128, 128]
    assert again.engine.parts.kernels.weight_bytes == first.engine.parts.kernels.weight_bytes
    want = [o.token_ids for o in first.generate(PROMPTS[:2], PARAMS[:2])]
    assert [o.token_ids for o in again.generate(PROMPTS[:2], PARAMS[:2])] == want
    assert not any(p.name.startswith("native_panels") for p in cache.rglob("*"))
