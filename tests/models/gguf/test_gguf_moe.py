"""Mixture-of-experts GGUF files (issue #55) loaded as they are (specdec/models/gguf/model.py):
tiny random files of each family as llama.cpp's converter writes them (qwen3moe; qwen2moe with
its shared expert and gate; llama with expert tensors, i.e. Mixtral): routers ``ffn_gate_inp``
F32, experts stacked in 3-D ``ffn_{gate,up,down}_exps`` tensors (Q8_0 / Q4_0 quantized by
gguf-py, or random K-quant blocks), written with gguf-py.

Oracles: every expert's matrices are the file's own blocks (a ``BlockWeight`` over its slice of
the stacked tensor, no copy) and the logits with float activations are bitwise the dequantized
model's (``weights="dequantized"``); the dequantized weights saved as an HF checkpoint are
bitwise what our safetensors path computes and close to HF transformers' (float32); ngram
speculation gives plain decoding's tokens with float and with q8 activations. Uncovered MoE
architectures (gpt-oss, deepseek2) are refused by name before any weight is read.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_helpers import ascii_tokenizer, random_blocks
from native_helpers import needs_kernels

from specdec import LLM, SamplingParams
from specdec.models.gguf.block_weight import BlockWeight
from specdec.models.loader import load_model, resolve_model_path

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 96  # ascii_tokenizer's 94 printable characters, <s>, </s>
# family -> (GGUF architecture, experts, used, expert width, shared expert width)
FAMILIES = {"qwen3_moe": ("qwen3moe", 8, 2, 64, 0), "mixtral": ("llama", 4, 2, 256, 0),
            "qwen2_moe": ("qwen2moe", 8, 2, 64, 256)}
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 256, 4, 2, 64, 2


def tensors(arch: str, experts: int, width: int, shared: int, tied: bool
            ) -> dict[str, tuple[int, ...]]:
    """GGUF name -> shape (torch order) of every tensor llama.cpp's converter writes."""
    h, q, kv = HIDDEN, HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    out = {"token_embd.weight": (VOCAB, h), "output_norm.weight": (h,)}
    if not tied:
        out["output.weight"] = (VOCAB, h)
    for i in range(LAYERS):
        p = f"blk.{i}."
        out.update({p + "attn_norm.weight": (h,), p + "attn_q.weight": (q, h),
                    p + "attn_k.weight": (kv, h), p + "attn_v.weight": (kv, h),
                    p + "attn_output.weight": (h, q), p + "ffn_norm.weight": (h,),
                    p + "ffn_gate_inp.weight": (experts, h),
                    p + "ffn_gate_exps.weight": (experts, width, h),
                    p + "ffn_up_exps.weight": (experts, width, h),
                    p + "ffn_down_exps.weight": (experts, h, width)})
        if arch == "qwen2moe":
            out.update({p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,),
                        p + "attn_v.bias": (kv,),
                        p + "ffn_gate_inp_shexp.weight": (h,),
                        p + "ffn_gate_shexp.weight": (shared, h),
                        p + "ffn_up_shexp.weight": (shared, h),
                        p + "ffn_down_shexp.weight": (h, shared)})
        if arch == "qwen3moe":
            out.update({p + "attn_q_norm.weight": (HEAD_DIM,),
                        p + "attn_k_norm.weight": (HEAD_DIM,)})
    return out


def write_moe_gguf(path: Path, family: str, kind: str = "Q8_0", tied: bool = False,
                   seed: int = 0, std: float = 0.08, kinds: dict[str, str] | None = None,
                   arch: str | None = None) -> Path:
    """A tiny random MoE file of ``family``: matrices of ``kind`` (``kinds`` by tensor name;
    Q8_0 / Q4_0 / Q5_0 ... quantized by gguf-py, a K-quant as random blocks, or where a row is
    not whole 256-value blocks llama-quantize's fallback, e.g. Q4_K -> Q5_0), routers and
    vectors F32 (norms near 1)."""
    import gguf

    from specdec.bench.quant_mix import fallback

    a, experts, used, width, shared = FAMILIES[family]
    a = arch or a
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), a)
    keys = {f"{a}.block_count": LAYERS, f"{a}.context_length": 256,
            f"{a}.embedding_length": HIDDEN, f"{a}.attention.head_count": HEADS,
            f"{a}.attention.head_count_kv": KV_HEADS, f"{a}.attention.key_length": HEAD_DIM,
            f"{a}.attention.value_length": HEAD_DIM, f"{a}.rope.freq_base": 10000.0,
            f"{a}.attention.layer_norm_rms_epsilon": 1e-6, f"{a}.vocab_size": VOCAB,
            f"{a}.expert_count": experts, f"{a}.expert_used_count": used}
    if a == "llama":  # Mixtral: the experts' width is the feed-forward length
        keys[f"{a}.feed_forward_length"] = width
        keys[f"{a}.rope.dimension_count"] = HEAD_DIM
    else:
        keys[f"{a}.feed_forward_length"] = 4 * width
        keys[f"{a}.expert_feed_forward_length"] = width
    if shared:
        keys[f"{a}.expert_shared_feed_forward_length"] = shared
    for k, v in keys.items():
        (w.add_float32 if isinstance(v, float) else w.add_uint32)(k, v)
    w.add_name(f"tiny {family}")
    ascii_tokenizer(w)
    for name, shp in tensors(a, experts, width, shared, tied).items():
        if len(shp) == 1:
            scale = 1.0 if "norm" in name else 0.0
            w.add_tensor(name, (scale + 0.1 * rng.standard_normal(shp)).astype(np.float32))
            continue
        k = "F32" if name.endswith("ffn_gate_inp.weight") else (kinds or {}).get(name, kind)
        if k not in ("F32", "F16"):
            k = fallback(gguf.GGMLQuantizationType[k], shp[-1]).name
        qtype = gguf.GGMLQuantizationType[k]
        if k.endswith("_K"):  # gguf-py cannot write K-quants: random blocks of their layout
            rows = int(np.prod(shp[:-1]))
            b = random_blocks(k, rows, shp[-1], seed=int(rng.integers(1 << 30)))
            w.add_tensor(name, b.rows.numpy().reshape(*shp[:-1], -1), raw_dtype=qtype)
            continue
        values = (std * rng.standard_normal(shp)).astype(np.float32)
        if k == "F32":
            w.add_tensor(name, values)
        else:
            w.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _user_file(tmp_path: Path, family: str, **kw) -> Path:
    (tmp_path / "user").mkdir(exist_ok=True)
    return write_moe_gguf(tmp_path / "user" / f"{family}.gguf", family, **kw)


def _load(path: Path):
    return load_model(resolve_model_path(str(path)), torch.float32, "cpu", 64, blocks=True)


def _logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """The runner's logits of every position of ``ids`` (one prefill)."""
    from specdec.kv.block_table import BlockTable

    runner = llm.engine.parts.runner
    table = BlockTable()
    assert runner.kv.try_reserve(table, len(ids))
    try:
        return runner.forward(runner.pack([ids], [0], [table], logits="all")).logits.clone()
    finally:
        runner.kv.release(table)


IDS = [5, 6, 7, 8, 5, 6, 9, 5, 6, 40, 41, 42, 40, 41, 3, 4, 3, 4]
PROMPTS = [[5, 6, 7, 8, 5, 6, 9, 5, 6], [3, 4, 3, 4, 3], [9, 8, 7], [40, 41, 42, 40, 41],
           [60, 61]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


# --- what loads --------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_config_and_experts_are_the_files_blocks(family, tmp_path, cache):
    arch, experts, used, width, shared = FAMILIES[family]
    path = _user_file(tmp_path, family, kind="Q8_0")
    model, cfg, hf_config = _load(path)
    assert (cfg.model_type, cfg.num_experts, cfg.num_experts_per_tok,
            cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size) == (
        family, experts, used, width, shared)
    assert cfg.norm_topk_prob == (family != "qwen2_moe")  # llama.cpp's routing per family
    assert (cfg.head_dim, cfg.qk_norm, cfg.attention_bias) == (
        HEAD_DIM, family == "qwen3_moe", family == "qwen2_moe")
    mats = model.named_matrices()
    per_layer = 2 + 1 + 2 * experts + (3 if shared else 0)
    assert len(mats) == 1 + LAYERS * per_layer
    assert all(isinstance(w, BlockWeight) for w in mats.values())
    moe = model.layers[1].moe
    assert moe.router_weight.kinds == ("F32",)
    # expert j's gate|up: views of its slices of the stacked tensors, no copy
    from specdec.models.gguf.file import open_gguf

    f = open_gguf(path)
    gate = f.rows("blk.1.ffn_gate_exps.weight")
    e = moe.experts[experts - 1]
    assert e.gate_up_weight.kinds == ("Q8_0",) and e.gate_up_weight.shape == (2 * width, HIDDEN)
    first = e.gate_up_weight.parts[0].blocks.rows
    assert torch.equal(first, gate[(experts - 1) * width:experts * width])
    t = f.tensors["blk.1.ffn_gate_exps.weight"]  # a view of the mapped stacked tensor
    assert first.untyped_storage().nbytes() == t.nbytes
    assert first.storage_offset() == (experts - 1) * width * t.row_bytes
    assert e.down_weight.shape == (HIDDEN, width)
    if shared:
        assert moe.shared_gate_weight.shape == (1, HIDDEN)
        assert moe.shared.gate_up_weight.shape == (2 * shared, HIDDEN)


@pytest.mark.parametrize("arch, why", [("gpt-oss", "sinks and MXFP4"), ("deepseek2", "MLA")])
def test_uncovered_moe_architectures_are_refused_by_name(arch, why, tmp_path, cache):
    path = _user_file(tmp_path, "qwen3_moe", arch=arch)
    with pytest.raises(ValueError, match=re.escape(str(path)) + f".*'{arch}' is a mixture of "
                       f"experts LlamaDecoder does not compute.*{why}"):
        resolve_model_path(str(path))


def test_a_gating_the_decoder_does_not_compute_is_refused(tmp_path, cache):
    import gguf

    path = _user_file(tmp_path, "qwen3_moe")
    r = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(path) + ".new", "qwen3moe")
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub)
    w.add_uint32("qwen3moe.expert_gating_func", 2)  # sigmoid
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    Path(str(path) + ".new").replace(path)
    with pytest.raises(ValueError, match=r"expert_gating_func 2 \(not 1, softmax\)"):
        resolve_model_path(str(path))


def test_a_missing_expert_tensor_is_named(tmp_path, cache):
    import gguf

    path = _user_file(tmp_path, "mixtral")
    folder = resolve_model_path(str(path))
    r = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(path) + ".new", "llama")
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub)
    for t in r.tensors:
        if t.name != "blk.1.ffn_up_exps.weight":
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    Path(str(path) + ".new").replace(path)
    with pytest.raises(ValueError, match=r"need tensor 'blk\.1\.ffn_up_exps\.weight', which "
                                         r"the file lacks"):
        load_model(folder, torch.float32, "cpu", 64, blocks=True)


# --- bitwise the dequantized model; the HF model of the same weights ---------------------------

# K-quants: the experts' gate / up (rows of hidden 256) in the type, a down of 64-value rows in
# llama-quantize's fallback (Q4_K -> Q5_0, Q6_K -> Q8_0); mixtral's experts are 256 wide
CASES = [("qwen3_moe", "Q8_0", {}), ("qwen3_moe", "Q4_K", {"blk.1.ffn_gate_exps.weight": "Q6_K"}),
         ("mixtral", "Q4_0", {}), ("mixtral", "Q5_K", {"blk.0.attn_v.weight": "Q8_0",
                                                        "blk.1.ffn_down_exps.weight": "Q6_K"}),
         ("qwen2_moe", "Q8_0", {"blk.0.ffn_gate_exps.weight": "Q4_0"}),
         ("qwen2_moe", "Q4_K", {"blk.1.ffn_down_shexp.weight": "Q6_K"})]


@needs_kernels
@pytest.mark.parametrize("family, kind, kinds", CASES)
def test_native_logits_are_bitwise_the_dequantized_models(family, kind, kinds, tmp_path, cache):
    path = _user_file(tmp_path, family, kind=kind, kinds=kinds)
    kw = dict(model=str(path), max_model_len=64, activations="float")
    nat = LLM(weights="native", **kw)
    assert nat.engine.parts.weights == "native"
    model, kernels = nat.engine.parts.model, nat.engine.parts.kernels
    moe = model.layers[0].moe
    assert isinstance(moe.experts[0].down_weight, BlockWeight)
    assert all(kernels._key(w) in kernels._panels for w in model.named_matrices().values())
    deq = LLM(weights="dequantized", **kw)
    assert not any(isinstance(w, BlockWeight) for w in deq.engine.parts.model.matrices())
    got, want = _logits(nat, IDS), _logits(deq, IDS)
    assert want.abs().max() > 0.5  # the layers matter
    assert torch.equal(got, want)


def _hf_checkpoint(model, cfg, config_json: Path, out: Path) -> Path:
    """The model's (dequantized) weights as an HF checkpoint of transformers' names."""
    from safetensors.torch import save_file

    from specdec.models.checkpoints.weights import expert_matrix_names

    def values(w):
        return (w.dequantize() if isinstance(w, BlockWeight) else w.detach()).contiguous()

    t = {"model.embed_tokens.weight": values(model.embed),
         "model.norm.weight": values(model.final_norm)}
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = values(model.lm_head)
    for i, layer in enumerate(model.layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]
        for x, v in zip("qkv", values(layer.qkv_weight).split(sizes)):
            t[a + f"{x}_proj.weight"] = v.contiguous()
        if cfg.attention_bias:
            for x, v in zip("qkv", values(layer.qkv_bias).split(sizes)):
                t[a + f"{x}_proj.bias"] = v.contiguous()
        t[a + "o_proj.weight"] = values(layer.o_weight)
        if cfg.qk_norm:
            t[a + "q_norm.weight"], t[a + "k_norm.weight"] = (values(layer.q_norm),
                                                              values(layer.k_norm))
        t[p + "input_layernorm.weight"] = values(layer.input_norm)
        t[p + "post_attention_layernorm.weight"] = values(layer.post_attn_norm)
        for name, parts in expert_matrix_names(cfg, i).items():
            module, attr = layer.owner(name)
            rows = values(getattr(module, attr)).split([s[0] for _, s in parts])
            t.update({n: r.contiguous() for (n, _), r in zip(parts, rows)})
    out.mkdir()
    save_file(t, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads(config_json.read_text())
    (out / "config.json").write_text(json.dumps(config))
    return out


@needs_kernels
@pytest.mark.parametrize("family, kind", [("qwen3_moe", "Q4_K"), ("mixtral", "Q8_0"),
                                          ("qwen2_moe", "Q4_0")])
def test_the_same_weights_as_a_checkpoint_and_in_transformers(family, kind, tmp_path, cache):
    """The dequantized weights saved under transformers' names: our safetensors path gives the
    GGUF's logits bitwise; transformers' MoE classes, read from the same config, agree in
    float32."""
    from transformers import AutoModelForCausalLM

    path = _user_file(tmp_path, family, kind=kind)
    folder = resolve_model_path(str(path))
    model, cfg, _ = load_model(folder, torch.float32, "cpu", 64, blocks=True)
    ckpt = _hf_checkpoint(model, cfg, folder / "config.json", tmp_path / "hf")
    kw = dict(max_model_len=64, activations="float")
    want = _logits(LLM(model=str(path), **kw), IDS)
    assert torch.equal(_logits(LLM(model=str(ckpt), dtype="float32", **kw), IDS), want)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    assert hf.config.model_type == family
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
    scale = float(ref.abs().max())  # random K-quant blocks: logits in the hundreds
    assert scale > 0.5
    torch.testing.assert_close(want, ref, rtol=0, atol=2e-5 * max(1.0, scale / 10))


# --- speculation -------------------------------------------------------------------------------

@needs_kernels
@pytest.mark.parametrize("activations", ["float", "q8"])
@pytest.mark.parametrize("family, kind", [("qwen3_moe", "Q4_K"), ("mixtral", "Q4_0"),
                                          ("qwen2_moe", "Q8_0")])
def test_ngram_speculation_equals_plain(family, kind, activations, tmp_path, cache):
    path = _user_file(tmp_path, family, kind=kind)
    kw = dict(model=str(path), max_model_len=64, activations=activations, weights="native")
    sampled = [SamplingParams(temperature=0.5, seed=30 + i, max_tokens=16, ignore_eos=True)
               for i in range(len(PROMPTS))]
    plain = LLM(**kw)
    assert (plain.engine.parts.weights, plain.engine.parts.activations) == (
        "native", activations)
    spec = LLM(drafter="ngram", drafter_args={"min_ngram": 1, "max_depth": 4},
               controller="static", controller_args={"budget": 4}, **kw)
    for params in (GREEDY, sampled):
        want = [o.token_ids for o in plain.generate(PROMPTS, params)]
        outs = spec.generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == want
        assert sum(sum(o.metrics.accepted_by_depth) for o in outs) > 0  # drafts were accepted
