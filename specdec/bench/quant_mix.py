"""Which GGML type llama.cpp's ``llama-quantize`` gives each tensor of a Llama model, per file
type: the type mix of the K-quant files people download, for model files of a real shape
(docs/bench/shape_gguf.py).

Transcribed from ggml-org/llama.cpp, src/llama-quant.cpp: ``llama_tensor_get_type`` (the outer
rule: 1-D tensors and norms keep their type, i.e. F32), ``llama_tensor_get_type_impl`` (the mix),
``tensor_type_fallback`` (shapes a type cannot hold) and ``llama_ftype_get_default_type``;
its counters run in layer order (src/llama-model-loader.h sorts the weights by layer with
``weight_name_comparer``), so ``i_attention_wv`` and ``i_ffn_down`` are the layer index. For a
dense Llama (no experts, not Falcon, not 70B), with no imatrix or overrides:

    q4_k_m  default Q4_K; attn_v and ffn_down Q6_K where ``use_more_bits(layer, n_layers)``
            (the first and last eighth of the layers and every third one between); output, and
            token_embd when tied to it, Q6_K (Q8_0 if its row is not a multiple of 256);
            an untied token_embd Q4_K
    q5_k_m  the same with Q5_K for Q4_K
    q8_0    every matrix Q8_0
then the fallback for rows (in_features) a type's block does not divide: Q4_K -> Q5_0,
Q5_K -> Q5_1, Q6_K -> Q8_0, and F16 if even 32 does not divide them.

A mixture of experts (``n_expert`` > 0: a llama file with experts, qwen3moe, qwen2moe): the
router ``ffn_gate_inp`` stays F32 (llama-quantize never quantizes it), the stacked experts
``ffn_{gate,up}_exps`` and the shared expert's ``ffn_{gate,up}_shexp`` take the default type,
``ffn_down_exps`` / ``ffn_down_shexp`` the ffn_down rule with the layer read from the tensor's
name (``layer_info``; ``n_ffn_down`` is the layer count); qwen3's per-head ``attn_q_norm`` /
``attn_k_norm`` are norms (F32). With exactly 8 experts (Mixtral) llama.cpp bumps attn_v and
attn_k to Q8_0 and, for q4_k_m, attn_output to Q5_K.

    tensor_type("q4_k_m", "attn_v", layer=0, n_layers=24, cols=2048, tied=True) -> Q6_K
"""

from __future__ import annotations

FTYPES = ("q4_k_m", "q5_k_m", "q8_0")
MATRIX_ROLES = ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                "ffn_up", "ffn_down", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
                "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
NORM_ROLES = ("attn_norm", "ffn_norm", "output_norm", "attn_q_norm", "attn_k_norm")
FLOAT_ROLES = ("ffn_gate_inp", "ffn_gate_inp_shexp")  # MoE routers / gates: never quantized


def file_type(ftype: str):
    """``general.file_type`` of an ftype (gguf.LlamaFileType)."""
    from gguf import LlamaFileType as F

    _check_ftype(ftype)
    return {"q4_k_m": F.MOSTLY_Q4_K_M, "q5_k_m": F.MOSTLY_Q5_K_M, "q8_0": F.MOSTLY_Q8_0}[ftype]


def default_type(ftype: str):
    """``llama_ftype_get_default_type``."""
    from gguf import GGMLQuantizationType as Q

    _check_ftype(ftype)
    return {"q4_k_m": Q.Q4_K, "q5_k_m": Q.Q5_K, "q8_0": Q.Q8_0}[ftype]


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighth, and every third layer between."""
    return (i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8
            or (i_layer - n_layers // 8) % 3 == 2)


def tensor_type(ftype: str, role: str, layer: int | None, n_layers: int, cols: int, tied: bool,
                n_expert: int = 0):
    """The type of tensor ``role`` (GGUF name without ``blk.N.`` and ``.weight``) of layer
    ``layer`` (None for a global tensor) whose rows hold ``cols`` values (in_features), in a
    model of ``n_layers`` layers whose output matrix is ``tied`` to token_embd, with
    ``n_expert`` experts a layer (0: dense)."""
    from gguf import GGMLQuantizationType as Q

    _check_ftype(ftype)
    if role in NORM_ROLES or role in FLOAT_ROLES:
        return Q.F32
    if role not in MATRIX_ROLES:
        raise ValueError(f"unknown tensor role {role!r} (allowed: {', '.join(MATRIX_ROLES)}, "
                         f"{', '.join(NORM_ROLES)})")
    if (layer is None) != (role in ("token_embd", "output")):
        raise ValueError(f"{role} is {'a global' if layer is None else 'a layer'} tensor here; "
                         f"token_embd and output are global, the rest per layer")
    return fallback(_mix(ftype, role, layer, n_layers, cols, tied, n_expert), cols)


def _mix(ftype: str, role: str, layer: int | None, n_layers: int, cols: int, tied: bool,
         n_expert: int = 0):
    """``llama_tensor_get_type_impl`` for a Llama-like model (dense, or with experts)."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as Q

    new = default_type(ftype)
    if role == "output" or (tied and role == "token_embd"):
        if cols % GGML_QUANT_SIZES[new][0]:
            return Q.Q8_0
        return new if new == Q.Q8_0 else Q.Q6_K
    if n_expert == 8 and role in ("attn_v", "attn_k"):  # "bumping this to Q8_0 trades ~128MB"
        return Q.Q8_0
    if n_expert == 8 and role == "attn_output" and ftype == "q4_k_m":
        return Q.Q5_K
    if ftype in ("q4_k_m", "q5_k_m") and role in ("attn_v", "ffn_down", "ffn_down_exps",
                                                   "ffn_down_shexp"):
        if use_more_bits(layer, n_layers):
            return Q.Q6_K
    return new


def fallback(kind, cols: int):
    """``tensor_type_fallback``: a type whose block holds a row of ``cols`` values."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as Q

    if cols % GGML_QUANT_SIZES[kind][0] == 0:
        return kind
    to = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}.get(kind)
    if to is None:
        raise ValueError(f"a row of {cols} values does not split into {kind.name} blocks and "
                         f"llama.cpp defines no fallback for {kind.name}")
    return to if cols % GGML_QUANT_SIZES[to][0] == 0 else Q.F16


def _check_ftype(ftype: str) -> None:
    if ftype not in FTYPES:
        raise ValueError(f"unknown ftype {ftype!r} (allowed: {', '.join(FTYPES)})")
