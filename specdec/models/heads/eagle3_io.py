"""Save and load an EAGLE-3 head in the checkpoint format vLLM and SGLang load (SpecForge's export).

A folder with two files (no embedding: the head uses the target's)::

    config.json        architectures ["LlamaForCausalLMEagle3"], model_type "llama",
                       num_hidden_layers 1, the draft layer's shapes, RoPE (rope_theta /
                       rope_scaling), vocab_size (target), draft_vocab_size,
                       tie_word_embeddings false, eagle_aux_hidden_state_layer_ids (what vLLM
                       reads), eagle_config {eagle_aux_hidden_state_layer_ids (what SGLang
                       reads), use_aux_hidden_state}, torch_dtype, our metadata under "specdec"
    model.safetensors  fc.weight [H, 3 Ht]; midlayer.self_attn.{q,k,v}_proj.weight [*, 2 H];
                       midlayer.self_attn.o_proj.weight; midlayer.mlp.{gate,up,down}_proj.weight;
                       midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight;
                       norm.weight; lm_head.weight [Vd, H]; d2t int64 [Vd]; t2d bool [V]

``d2t`` holds offsets, not ids: draft id i is target id ``i + d2t[i]``; ``t2d`` marks exactly those
target ids. Example, target vocab 6, draft vocabulary {1, 4}: d2t = [1, 3],
t2d = [F, T, F, F, T, F].

Aux-layer ids are HF ``hidden_states`` indices (id j = the input of target layer j), which vLLM
reads as is; SGLang adds 1 when the first id is 1, so ids should start at 2 (the default does).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from specdec.models.decoder.config import ModelConfig
from specdec.models.heads.checkpoint import (
    SAVE_DTYPES,
    check_rope,
    check_tensors,
    export_tensors,
    has_rope,
    metadata,
    read_config,
    rope_config,
    rope_json,
    target_num_layers,
    write_folder,
)
from specdec.models.heads.eagle3 import Eagle3Config, Eagle3Head, default_aux_layer_ids
from specdec.models.heads.export_formats import check_formats
from specdec.models.heads.feature_head import layer_shape
from specdec.models.loader import read_safetensors

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# Variants of the format that our head does not implement, with the value it does implement.
UNSUPPORTED_FLAGS = {"norm_before_residual": False, "fc_norm": False, "norm_output": False,
                     "norm_before_fc": False, "attention_bias": False, "mlp_bias": False}
# Keys some exporters add that the head does not use (it shares the target's embedding).
IGNORED_KEY_SUFFIXES = ("embed_tokens.weight", "rotary_emb.inv_freq")


def tensor_layout(config: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of the format with its shape; floating point except d2t (int64), t2d (bool)."""
    h, i, vd = config.hidden_size, config.intermediate_size, config.draft_vocab_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    a, m = "midlayer.self_attn.", "midlayer.mlp."
    return {
        "fc.weight": (h, 3 * config.target_hidden_size),
        a + "q_proj.weight": (q, 2 * h), a + "k_proj.weight": (kv, 2 * h),
        a + "v_proj.weight": (kv, 2 * h), a + "o_proj.weight": (h, q),
        m + "gate_proj.weight": (i, h), m + "up_proj.weight": (i, h), m + "down_proj.weight": (h, i),
        "midlayer.input_layernorm.weight": (h,), "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,), "norm.weight": (h,),
        "lm_head.weight": (vd, h), "d2t": (vd,), "t2d": (config.vocab_size,),
    }


# ----------------------------------------------------------------------------------------- save

def save_eagle3(head: Eagle3Head, folder: Path, target_hf_config, *,
                dtype: torch.dtype = torch.bfloat16, extra: dict | None = None,
                overwrite: bool = False, formats: tuple[str, ...] = ()) -> None:
    """Write ``head`` to ``folder`` (config.json + model.safetensors) for vLLM, SGLang and us.

    ``formats``: engines the folder must load in besides specdec (any of "vllm", "sglang": this
    format holds both; see ``export_formats``).

    ``target_hf_config``: the target's HF config, whose RoPE the head was built with (checked)
    and whose name/path is recorded. ``extra``: JSON-serialisable metadata (training metrics…)
    stored under config.json's "specdec" key. Atomic (``checkpoint.write_folder``): an existing
    ``folder`` raises FileExistsError unless ``overwrite``.
    """
    check_formats("eagle3", formats)
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(SAVE_DTYPES.values())}, got {dtype}")
    check_rope(head.rope, head.config.head_dim, target_hf_config)
    write_folder(Path(folder), _config_json(head, target_hf_config, dtype, extra),
                 _export_tensors(head, dtype), overwrite=overwrite)


def _config_json(head: Eagle3Head, target_hf_config, dtype: torch.dtype,
                 extra: dict | None) -> dict:
    c = head.config
    out = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "num_hidden_layers": 1, "hidden_size": c.hidden_size,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "intermediate_size": c.intermediate_size, "hidden_act": "silu",
        "attention_bias": False, "rms_norm_eps": c.rms_norm_eps,
        # the legacy spelling: transformers 4 (vLLM, SGLang) reads it, transformers 5 converts it
        **rope_json(target_hf_config),
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size,
        "tie_word_embeddings": False,  # SGLang ties lm_head to the embedding when true
    }
    if c.target_hidden_size != c.hidden_size:
        out["target_hidden_size"] = c.target_hidden_size
    if c.aux_layer_ids[0] == 1:
        warnings.warn("aux layer ids start at 1: SGLang reads such ids as output-of-layer "
                      "and shifts them by one; vLLM and specdec read them as given", stacklevel=3)
    # vLLM reads the ids at the top level only (v1/worker/gpu/spec_decode/eagle/eagle3_utils.py),
    # SGLang only inside eagle_config (model_runner.py): a head trained on other layers than
    # the default would be fed the wrong hidden states by the engine that missed them
    out["eagle_aux_hidden_state_layer_ids"] = list(c.aux_layer_ids)
    out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
                           "use_aux_hidden_state": True}
    out["torch_dtype"] = SAVE_DTYPES[dtype]
    out["specdec"] = metadata(target_hf_config, c.target_num_layers, extra)
    return out


def _export_tensors(head: Eagle3Head, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Our fused parameters split into the format's tensors (fresh CPU copies, none shared)."""
    c, layer = head.config.layer_config(), head.layer
    q, k, v = layer.qkv_weight.split([c.q_size, c.kv_size, c.kv_size])
    gate, up = layer.gate_up_weight.chunk(2)
    a, m = "midlayer.self_attn.", "midlayer.mlp."
    floats = {
        "fc.weight": head.fc, a + "q_proj.weight": q, a + "k_proj.weight": k,
        a + "v_proj.weight": v, a + "o_proj.weight": layer.o_weight,
        m + "gate_proj.weight": gate, m + "up_proj.weight": up,
        m + "down_proj.weight": layer.down_weight,
        "midlayer.input_layernorm.weight": layer.input_norm,
        "midlayer.hidden_norm.weight": head.hidden_norm,
        "midlayer.post_attention_layernorm.weight": layer.post_attn_norm,
        "norm.weight": head.norm_weight, "lm_head.weight": head.lm_head,
    }
    return export_tensors(floats, dtype, {"d2t": head.d2t.to(torch.int64),
                                          "t2d": head.t2d.to(torch.bool)})


# ----------------------------------------------------------------------------------------- load

def load_eagle3(folder: Path, target_cfg: ModelConfig, embed: torch.Tensor, target_hf_config,
                trainable: bool = False) -> Eagle3Head:
    """An Eagle3Head (dtype and device of ``embed``, the target's [vocab, hidden] embedding)
    from a folder in this format, checked against the target.

    RoPE comes from the checkpoint's own config.json (rope_theta / rope_scaling or
    rope_parameters), as in vLLM and SGLang; only a config.json with none of those fields takes
    ``target_hf_config``'s (vLLM would take transformers' default theta 10000 there; we export
    rope_theta always). The target's layer count comes from ``specdec.target_num_layers`` when
    present; otherwise only the aux-layer ids can be checked against the target. ValueError
    names the file, field or tensor at fault.
    """
    folder = Path(folder)
    raw = read_eagle3_config(folder)
    try:
        config = eagle3_config_from_json(raw, target_cfg)
    except ValueError as e:
        raise ValueError(f"{folder / 'config.json'}: {e}") from e
    config.check_target(target_cfg)
    if tuple(embed.shape) != (target_cfg.vocab_size, target_cfg.hidden_size):
        raise ValueError(f"embed has shape {tuple(embed.shape)}, expected the target's "
                         f"{(target_cfg.vocab_size, target_cfg.hidden_size)}")
    tensors = read_safetensors(folder)
    _check_tensors(tensors, config, folder)
    try:
        used = vocab_ids(tensors["d2t"], tensors["t2d"])
    except ValueError as e:
        raise ValueError(f"{folder}/*.safetensors: {e}") from e
    rope = rope_config(raw, folder) if has_rope(raw) else target_hf_config
    head = Eagle3Head(config, embed, rope, trainable)
    _fill(head, tensors)
    head.set_vocab(used)
    return head


def read_eagle3_config(folder: Path) -> dict:
    """config.json as a dict, checked to be an EAGLE-3 head; ValueError names the file."""
    return read_config(folder, EAGLE3_ARCHITECTURES, "an EAGLE-3 head")


def eagle3_config_from_json(raw: dict, target_cfg: ModelConfig) -> Eagle3Config:
    """The head's Eagle3Config from config.json; shape fields are required, the rest default as
    vLLM defaults them. The RoPE table covers the target's positions (the rows it drafts for)."""
    _check_supported(raw)
    num_layers = _target_num_layers(raw, target_cfg)
    aux = _aux_layer_ids(raw, num_layers)
    try:
        shape, vocab = layer_shape(raw), int(raw["vocab_size"])
        return Eagle3Config(
            **shape, vocab_size=vocab,
            draft_vocab_size=int(raw.get("draft_vocab_size") or vocab),
            target_hidden_size=int(raw.get("target_hidden_size") or shape["hidden_size"]),
            target_num_layers=num_layers, aux_layer_ids=aux,
            max_position_embeddings=target_cfg.max_position_embeddings)
    except KeyError as e:
        raise ValueError(f"the field {e.args[0]!r} is missing") from e
    except (TypeError, ValueError) as e:
        raise ValueError(f"malformed field: {e}") from e


def _check_supported(raw: dict) -> None:
    if raw.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"num_hidden_layers {raw['num_hidden_layers']}; only "
                         "one-layer EAGLE-3 heads are supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {raw['hidden_act']!r}; only 'silu' is supported")
    if not (raw.get("eagle_config") or {}).get("use_aux_hidden_state", True):
        raise ValueError("eagle_config.use_aux_hidden_state false (no fc) is not supported")
    for name, ours in UNSUPPORTED_FLAGS.items():
        if bool(raw.get(name, ours)) != ours:
            raise ValueError(f"{name}={raw[name]!r} is not supported "
                             f"(this head implements {name}={ours})")


def _target_num_layers(raw: dict, target_cfg: ModelConfig) -> int:
    return target_num_layers(raw, target_cfg.num_layers)


def _aux_layer_ids(raw: dict, target_num_layers: int) -> tuple[int, int, int]:
    """Top level (vLLM also reads it there) or eagle_config; absent: the default for the target."""
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if top and nested and list(top) != list(nested):
        raise ValueError(f"eagle_aux_hidden_state_layer_ids {top} at top level and "
                         f"{nested} in eagle_config disagree")
    ids = top or nested
    if not ids:
        return default_aux_layer_ids(target_num_layers)
    if len(ids) != 3:
        raise ValueError(f"eagle_aux_hidden_state_layer_ids {ids} must name 3 "
                         "layers (low, mid, high)")
    try:
        return tuple(int(j) for j in ids)
    except (TypeError, ValueError) as e:
        raise ValueError(f"eagle_aux_hidden_state_layer_ids {ids}: {e}") from e


def _check_tensors(tensors: dict[str, torch.Tensor], config: Eagle3Config, folder: Path) -> None:
    """Every key present with its shape and kind; no key this head would silently drop."""
    check_tensors(tensors, tensor_layout(config), folder, "this EAGLE-3 head",
                  {"d2t": "integer", "t2d": "bool"}, IGNORED_KEY_SUFFIXES)


def vocab_ids(d2t: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """[draft_vocab] ascending target ids ``arange + d2t``, checked to be exactly ``t2d``'s."""
    ids = torch.arange(d2t.numel(), dtype=torch.int64) + d2t.to(torch.int64)
    marked = t2d.nonzero().flatten()
    if marked.numel() != ids.numel():
        raise ValueError(f"d2t and t2d disagree: t2d marks {marked.numel()} target ids, d2t maps "
                         f"{ids.numel()} draft ids")
    wrong = (marked != ids).nonzero().flatten()
    if wrong.numel():
        i = int(wrong[0])
        raise ValueError(f"d2t and t2d disagree: draft id {i} maps to target id {int(ids[i])} "
                         f"(= {i} + d2t[{i}]), but t2d's marked id number {i} is {int(marked[i])}")
    return ids


def _fill(head: Eagle3Head, tensors: dict[str, torch.Tensor]) -> None:
    """Copy the format's tensors into our fused parameters (q|k|v rows, gate|up rows)."""
    a, m, layer = "midlayer.self_attn.", "midlayer.mlp.", head.layer
    parts = [
        (head.fc, ["fc.weight"]),
        (layer.qkv_weight, [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]),
        (layer.o_weight, [a + "o_proj.weight"]),
        (layer.gate_up_weight, [m + "gate_proj.weight", m + "up_proj.weight"]),
        (layer.down_weight, [m + "down_proj.weight"]),
        (layer.input_norm, ["midlayer.input_layernorm.weight"]),
        (head.hidden_norm, ["midlayer.hidden_norm.weight"]),
        (layer.post_attn_norm, ["midlayer.post_attention_layernorm.weight"]),
        (head.norm_weight, ["norm.weight"]),
        (head.lm_head, ["lm_head.weight"]),
    ]
    with torch.no_grad():
        for param, names in parts:
            value = torch.cat([tensors[n] for n in names])
            assert value.shape == param.shape, (names, value.shape, param.shape)
            param.copy_(value.to(param.dtype))
