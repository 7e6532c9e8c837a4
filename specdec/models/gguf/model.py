"""A ``LlamaDecoder``'s weights straight from a GGUF file: its matrices as ``BlockWeight``s (the
file's blocks, no fp32 copy) or, where asked, dequantized once.

llama.cpp's tensor names map onto the decoder's fused parameters (q|k|v and gate|up are one
matrix each: two or three tensors in llama / qwen files, one in phi3 files, ``attn_qkv`` and
``ffn_up``; for ``general.architecture`` "llama" the q and k rows are put back in the order
transformers gives them, undoing the rope permutation of llama.cpp's converter; qwen2 / qwen3 /
phi3 files are stored unpermuted).

Mixture-of-experts files (specdec/models/gguf/moe.py, ``MOE_ARCHITECTURES``: qwen3moe, qwen2moe, and llama files with
expert tensors, i.e. Mixtral, as llama.cpp's converter writes them): a layer's router is
``ffn_gate_inp`` [experts, hidden] (kept float by llama-quantize), its experts three 3-D tensors
``ffn_{gate,up,down}_exps`` [experts, width, hidden] / [experts, hidden, width] (E stacked 2-D
block matrices), qwen2moe's shared expert ``ffn_{gate,up,down}_shexp`` and its gate
``ffn_gate_inp_shexp`` [hidden]. Each expert's gate|up and down is a ``BlockWeight`` over its
slice of the stacked blocks (a view: no copy), so the kernels run every expert on the file's own
blocks. The config comes from ``{arch}.expert_count``, ``expert_used_count``,
``expert_feed_forward_length`` (llama: ``feed_forward_length``) and
``expert_shared_feed_forward_length`` (``moe_config``); llama.cpp's routing per architecture
(softmax over all experts, top-k; renormalised for qwen3moe and llama, not for qwen2moe) is the
one transformers' classes compute. Other MoE architectures (gpt-oss, deepseek2, ...) are refused
by name (``UNSUPPORTED_MOE``). What the decoder cannot compute is refused from the header
alone (``check_architecture``: another architecture, phi3's LongRoPE factors or partial rotary);
what transformers' reading of the metadata misses goes into config.json (``config_overrides``:
Llama 3.1+'s rope scaling from its ``rope_freqs.weight``, phi3's sliding window).
Before any weight is used every tensor is checked: present, of the shape the metadata give
(config.json was made from them), of finite fp16 scales.

    f = open_gguf(path)
    check_tensors(f, cfg)                       # ValueError naming the file and the tensor
    matrices = gguf_matrices(f, cfg)            # {"layers.0.qkv": [Part, Part, Part], ...}
    put_weights(model, f, blocks=True)          # BlockWeights (float32 on the CPU) or dtype
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from specdec.models.decoder.config import ModelConfig
from specdec.models.gguf.block_weight import BlockWeight, Part, dequantize
from specdec.models.gguf.blocks import Blocks
from specdec.models.gguf.file import GGUFFile, check_finite
from specdec.models.gguf.moe import (
    UNSUPPORTED_MOE,
    check_moe,
    expert_matrices,
    expert_shapes,
    is_moe,
    moe_config,
)

logger = logging.getLogger("specdec")

# general.architecture -> the model_type LlamaDecoder runs (transformers' reading of the
# metadata; a "llama" file whose general.name is "mistral" is a mistral: same tensors)
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                 "qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}
PERMUTED_QK = ("llama",)  # architectures whose converter permutes q / k rows for rope
FUSED = ("phi3",)  # architectures whose files store q|k|v as attn_qkv and gate|up as ffn_up
# phi3 tensors of LongRoPE (Phi-3 *-128k, Phi-3.5, Phi-4-mini): transformers ignores them
LONGROPE = ("rope_factors_long.weight", "rope_factors_short.weight")


def check_architecture(f: GGUFFile) -> None:
    """ValueError naming the file unless the decoder computes what its header describes: an
    architecture of ``ARCHITECTURES`` and, for phi3, plain RoPE over the whole head (not the
    LongRoPE factors nor the partial rotary transformers would silently drop)."""
    a = f.architecture
    if a in UNSUPPORTED_MOE:
        raise ValueError(f"{f.path}: general.architecture {a!r} is a mixture of experts "
                         f"LlamaDecoder does not compute ({UNSUPPORTED_MOE[a]}); it runs "
                         f"{', '.join(map(repr, ARCHITECTURES))} (llama with experts: Mixtral)")
    if a not in ARCHITECTURES:
        raise ValueError(f"{f.path}: general.architecture {a!r} is not supported; "
                         f"LlamaDecoder runs {', '.join(map(repr, ARCHITECTURES))}")
    if is_moe(f):
        check_moe(f)
    if a != "phi3":
        return
    factors = [n for n in LONGROPE if n in f.tensors]
    if factors:
        raise ValueError(f"{f.path}: tensor {factors[0]} holds LongRoPE factors (Phi-3 128k, "
                         "Phi-3.5, Phi-4-mini); LlamaDecoder runs phi3 files with plain RoPE "
                         "only (Phi-3 *-4k, Phi-4)")
    rot, head = f.metadata.get(f"{a}.rope.dimension_count"), _head_dim(f)
    if rot is not None and head is not None and rot != head:
        raise ValueError(f"{f.path}: {a}.rope.dimension_count {rot} rotates part of each "
                         f"head ({head}); LlamaDecoder rotates whole heads only")


def _head_dim(f: GGUFFile) -> int | None:
    a, m = f.architecture, f.metadata
    if f"{a}.attention.key_length" in m:
        return m[f"{a}.attention.key_length"]
    heads, width = m.get(f"{a}.attention.head_count"), m.get(f"{a}.embedding_length")
    return width // heads if isinstance(heads, int) and isinstance(width, int) and heads else None


def model_type(f: GGUFFile) -> str:
    """The transformers model_type LlamaDecoder runs the file as (a llama file with experts:
    mixtral)."""
    return "mixtral" if f.architecture == "llama" and is_moe(f) else ARCHITECTURES[f.architecture]


def gguf_config(f: GGUFFile, config):
    """transformers' config read from ``f``'s metadata, with what that reading misses or drops
    (``config_overrides``, ``moe_config``); a llama file with experts becomes a
    ``MixtralConfig`` (transformers reads it as a dense llama)."""
    overrides = {**config_overrides(f), **moe_config(f)}
    if overrides.get("model_type", config.model_type) != config.model_type:
        from transformers import AutoConfig

        values = config.to_dict()
        for key in ("model_type", "architectures", "transformers_version"):
            values.pop(key, None)
        values.update(overrides)
        kind = values.pop("model_type")
        name = config._name_or_path
        config = AutoConfig.for_model(kind, **values)
        config._name_or_path = name
        return config
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def config_overrides(f: GGUFFile) -> dict:
    """What config.json takes from the file besides transformers' reading: the head size
    (transformers leaves qwen3's at its class default, 128); phi3's sliding window, which
    transformers drops and llama.cpp does not apply (the engine keeps a sequence inside it, where
    windowed and full attention are the same numbers); Llama 3.1+'s rope scaling
    (``llama3_rope``), which transformers ignores."""
    a, out = f.architecture, {}
    head_dim = f.metadata.get(f"{a}.attention.key_length")
    if isinstance(head_dim, int):
        out["head_dim"] = head_dim
    window = f.metadata.get(f"{a}.attention.sliding_window")
    if a == "phi3" and isinstance(window, int) and window > 0:
        out["sliding_window"] = window
    if ROPE_FREQS in f.tensors:
        out["rope_parameters"] = llama3_rope(f)
    return out


ROPE_FREQS = "rope_freqs.weight"
# Llama 3.1 / 3.2 / 3.3's rope scaling but for its factor (8 or 32)
LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def rope_factors(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                 high_freq_factor: float, original_max_position_embeddings: int) -> torch.Tensor:
    """What llama.cpp's converter stores as ``rope_freqs.weight`` for a llama3 rope scaling
    (convert_hf_to_gguf.py, LlamaModel): the divisor of each inverse frequency."""
    old = original_max_position_embeddings
    low, high = old / low_freq_factor, old / high_freq_factor
    out = []
    for freq in inv_freq.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high:
            out.append(1.0)
        elif wavelen > low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def llama3_rope(f: GGUFFile) -> dict:
    """transformers' ``rope_parameters`` for the file's ``rope_freqs.weight`` (Llama 3.1+'s
    rope scaling as per-frequency divisors): llama3 with Llama 3.x's constants and the factor
    the divisors reach; ValueError naming the file unless they give these very divisors."""
    a, m = f.architecture, f.metadata
    head = m.get(f"{a}.rope.dimension_count") or _head_dim(f)
    base = float(m.get(f"{a}.rope.freq_base", 10000.0))
    stored = _vector(f, ROPE_FREQS)
    where = f"{f.path}: tensor {ROPE_FREQS} ({stored.numel()} rope frequency divisors)"
    if a != "llama" or not head or stored.numel() != head // 2:
        raise ValueError(f"{where}: LlamaDecoder reads them for llama files of head size "
                         f"{head} (that many / 2 divisors) only")
    inv_freq = 1.0 / (base ** (torch.arange(0, head, 2, dtype=torch.float32) / head))
    params = {"rope_type": "llama3", "rope_theta": base, "factor": float(stored.max()), **LLAMA3}
    ours = rope_factors(inv_freq, params["factor"], *LLAMA3.values())
    if not torch.allclose(ours, stored, rtol=1e-5, atol=0):
        raise ValueError(f"{where}: not Llama 3's rope scaling (low / high frequency factors "
                         f"1 / 4 over 8192 positions, factor {params['factor']:g}); "
                         "LlamaDecoder runs that one only")
    return params


def _unpermute(n_head: int, out: int) -> torch.Tensor:
    """Row order transformers gives llama's q / k after GGUF's rope permutation (its
    ``_reverse_permute_weights``): new row r is file row index[r]."""
    return torch.arange(out).reshape(n_head, out // n_head // 2, 2).transpose(1, 2).reshape(-1)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder reads, by its GGUF name, with the shape (torch order) the
    config gives it."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    out = {"token_embd.weight": (cfg.vocab_size, h), "output_norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = (cfg.vocab_size, h)
    fused = cfg.model_type in FUSED
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        out.update({p + "attn_norm.weight": (h,), p + "ffn_norm.weight": (h,)})
        if fused:
            out.update({p + "attn_qkv.weight": (q + 2 * kv, h), p + "attn_output.weight": (h, q),
                        p + "ffn_up.weight": (2 * inter, h)})
        else:
            out.update({p + "attn_q.weight": (q, h), p + "attn_k.weight": (kv, h),
                        p + "attn_v.weight": (kv, h), p + "attn_output.weight": (h, q)})
        if cfg.is_moe:
            out.update(expert_shapes(cfg, i))
        elif not fused:
            out.update({p + "ffn_gate.weight": (inter, h), p + "ffn_up.weight": (inter, h)})
        if not cfg.is_moe:
            out[p + "ffn_down.weight"] = (h, inter)
        if cfg.attention_bias:
            out.update({p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,),
                        p + "attn_v.bias": (kv,)})
        if cfg.qk_norm:
            out.update({p + "attn_q_norm.weight": (cfg.head_dim,),
                        p + "attn_k_norm.weight": (cfg.head_dim,)})
    return out


def check_tensors(f: GGUFFile, cfg: ModelConfig) -> None:
    """ValueError naming the file and tensor unless every tensor the decoder reads is there, of
    the shape the metadata give, with finite scales, and the file has no further layers."""
    a = f.architecture
    meta = ", ".join(f"{k.removeprefix(a + '.')} {f.metadata[k]}" for k in (
        f"{a}.block_count", f"{a}.embedding_length", f"{a}.feed_forward_length",
        f"{a}.attention.head_count", f"{a}.attention.head_count_kv",
        f"{a}.attention.key_length", f"{a}.expert_count", f"{a}.expert_feed_forward_length",
        f"{a}.expert_shared_feed_forward_length") if k in f.metadata)
    where = f"{f.path}: the metadata ({meta}; vocabulary {cfg.vocab_size})"
    for name, shape in expected_shapes(cfg).items():
        t = f.tensors.get(name)
        if t is None:
            raise ValueError(f"{where} need tensor {name!r}, which the file lacks")
        if tuple(t.shape) != shape and not (len(shape) == 1 and t.shape == (1, *shape)):
            raise ValueError(f"{where} give tensor {name} the shape {list(shape)}; the file "
                             f"stores {list(t.shape)}")
        check_finite(f, name, dequantize)
    extra = f"blk.{cfg.num_layers}.attn_{'qkv' if cfg.model_type in FUSED else 'q'}.weight"
    if extra in f.tensors:
        raise ValueError(f"{where} say {cfg.num_layers} layers; the file has tensor {extra}")


def _part(f: GGUFFile, name: str, permute_heads: int | None = None) -> Part:
    t = f.tensors[name]
    blocks = Blocks(t.kind, f.rows(name), t.shape[-1])
    order = None if permute_heads is None else _unpermute(permute_heads, t.shape[0])
    return Part(blocks, order, name)


def gguf_matrices(f: GGUFFile, cfg: ModelConfig) -> dict[str, list[Part]]:
    """Every matrix ``LlamaDecoder.named_matrices()`` multiplies by, plus ``embed`` (the token
    embedding, which is also ``head`` when tied), as parts of the file's tensors (a mixture of
    experts: ``expert_matrices`` in place of gate_up and down)."""
    perm = f.architecture in PERMUTED_QK
    out = {"embed": [_part(f, "token_embd.weight")]}
    out["head"] = out["embed"] if cfg.tie_word_embeddings else [_part(f, "output.weight")]
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        if cfg.model_type in FUSED:  # already in the decoder's order: q|k|v, gate|up
            out[f"layers.{i}.qkv"] = [_part(f, p + "attn_qkv.weight")]
            out[f"layers.{i}.gate_up"] = [_part(f, p + "ffn_up.weight")]
        else:
            out[f"layers.{i}.qkv"] = [
                _part(f, p + "attn_q.weight", cfg.num_heads if perm else None),
                _part(f, p + "attn_k.weight", cfg.num_kv_heads if perm else None),
                _part(f, p + "attn_v.weight")]
            if not cfg.is_moe:
                out[f"layers.{i}.gate_up"] = [_part(f, p + "ffn_gate.weight"),
                                              _part(f, p + "ffn_up.weight")]
        out[f"layers.{i}.o"] = [_part(f, p + "attn_output.weight")]
        if cfg.is_moe:
            out.update({f"layers.{i}.{n}": parts
                        for n, parts in expert_matrices(f, cfg, i).items()})
        else:
            out[f"layers.{i}.down"] = [_part(f, p + "ffn_down.weight")]
    return out


def _vector(f: GGUFFile, name: str, permute_heads: int | None = None) -> torch.Tensor:
    t = f.tensors[name]
    values = dequantize(t.kind, f.rows(name), t.shape[-1]).reshape(-1)
    return values if permute_heads is None else values[_unpermute(permute_heads, values.numel())]


def put_weights(model, f: GGUFFile, blocks: bool) -> None:
    """Give ``model`` (a LlamaDecoder made for ``f``'s config, checked by ``check_tensors``)
    the file's weights: norms and biases as plain tensors; matrices as ``BlockWeight``s when
    ``blocks`` and the model computes in float32 on the CPU, else dequantized once into its
    dtype (logged)."""
    cfg = model.cfg
    dtype, device = model.final_norm.dtype, model.final_norm.device
    lean = blocks and dtype == torch.float32 and device.type == "cpu"
    mats = gguf_matrices(f, cfg)
    weights = {}
    for name, parts in mats.items():
        if name == "head" and cfg.tie_word_embeddings:
            continue
        w = BlockWeight(parts, f"{name} ({'|'.join(p.name for p in parts)})", f)
        weights[name] = w if lean else w.dequantize().to(dtype=dtype, device=device)
    if not lean:
        logger.info("weights: %s dequantized into %s on %s (%.0f MB)", f.path,
                    str(dtype).removeprefix("torch."), device.type,
                    sum(w.numel() * w.element_size() for w in weights.values()) / 1e6)

    def put(module, attr: str, value: torch.Tensor) -> None:
        setattr(module, attr, nn.Parameter(value.to(device=device) if not isinstance(
            value, BlockWeight) else value, requires_grad=False))

    for name, w in weights.items():  # embed, head, layers.{i}.{qkv, o, gate_up, down | experts}
        put(*model.owner(name), w)
    put(model, "final_norm", _vector(f, "output_norm.weight").to(dtype))
    perm = f.architecture in PERMUTED_QK
    for i, layer in enumerate(model.layers):
        p = f"blk.{i}."
        put(layer, "input_norm", _vector(f, p + "attn_norm.weight").to(dtype))
        put(layer, "post_attn_norm", _vector(f, p + "ffn_norm.weight").to(dtype))
        if cfg.attention_bias:
            heads = (cfg.num_heads, cfg.num_kv_heads, None) if perm else (None,) * 3
            bias = [_vector(f, p + f"attn_{x}.bias", n) for x, n in zip("qkv", heads)]
            put(layer, "qkv_bias", torch.cat(bias).to(dtype))
        if cfg.qk_norm:
            put(layer, "q_norm", _vector(f, p + "attn_q_norm.weight").to(dtype))
            put(layer, "k_norm", _vector(f, p + "attn_k_norm.weight").to(dtype))
    f.release_pages()  # what the checks and the vectors read; matrices are read when prepared


def materialize(model) -> int:
    """Replace every ``BlockWeight`` of ``model`` by its dequantized values (float32
    parameters); returns how many. For a model whose matrices the kernels do not run from the
    blocks (``weights="dequantized"``, another kernel choice, a type they do not take)."""
    done = 0
    for module in model.modules():
        for attr, p in list(module.named_parameters(recurse=False)):
            if isinstance(p, BlockWeight):
                setattr(module, attr, nn.Parameter(p.dequantize(), requires_grad=False))
                done += 1
    if done:
        logger.info("weights: %d matrices of %s dequantized into float32 (%.0f MB)", done,
                    type(model).__name__,
                    sum(w.numel() * 4 for w in model.matrices()) / 1e6)
    return done
