"""Save and load a block-diffusion drafter (DFlash's layout, on Llama layers).

    config.json        architectures ["DFlashDraftModel"], model_type "llama", the draft layers'
                       shapes (num_hidden_layers, hidden_size, heads, head_dim,
                       intermediate_size, rms_norm_eps), RoPE (rope_theta / rope_scaling),
                       vocab_size (target), draft_vocab_size, block_size, dflash_config
                       {target_layer_ids (outputs of those target layers, DFlash's convention),
                       mask_token_id null, mask_embedding true (one per block position),
                       anchor_state true (block rows' inputs carry the last context row's
                       state)}, torch_dtype; our metadata under
                       "specdec" (target layer count, calibrated rank_acceptance, metrics)
    model.safetensors  fc.weight [H, n Ht]; hidden_norm.weight; layers.{i}.self_attn.{q,k,v,o}
                       _proj.weight; layers.{i}.mlp.{gate,up,down}_proj.weight;
                       layers.{i}.{input,post_attention}_layernorm.weight; norm.weight;
                       lm_head.weight [Vd, H]; mask_embedding [B-1, H]; token_map int64 [Vd]

Where it departs from z-lab's DFlash (Qwen3 layers with q/k-norm, MASK as a token row of the
target's embedding, block rows from embeddings alone, the target's full LM head): Llama layers
without q/k-norm (our targets'), learned MASK embeddings per block position (SmolLM2 has no free
token row), the anchor's state in every block row's input, a reduced-vocabulary head (see models/block_diffusion.py for why). vLLM's and SGLang's DFlash
loaders do not read these; serving it there needs them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.models.decoder.config import ModelConfig
from specdec.models.heads.block_diffusion import BlockDiffusionConfig, BlockDiffusionModel
from specdec.models.heads.checkpoint import (
    SAVE_DTYPES,
    check_rope,
    check_tensors,
    check_vocab_map,
    export_tensors,
    has_rope,
    metadata,
    rank_acceptance,
    read_config,
    rope_config,
    rope_json,
    target_num_layers,
    write_folder,
)
from specdec.models.heads.export_formats import check_formats
from specdec.models.heads.feature_head import layer_shape
from specdec.models.loader import read_safetensors

BLOCK_ARCHITECTURES = ("DFlashDraftModel",)


def _layer_keys(i: int) -> dict[str, str]:
    a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
    return {"q": a + "q_proj.weight", "k": a + "k_proj.weight", "v": a + "v_proj.weight",
            "o": a + "o_proj.weight", "gate": m + "gate_proj.weight", "up": m + "up_proj.weight",
            "down": m + "down_proj.weight", "in": f"layers.{i}.input_layernorm.weight",
            "post": f"layers.{i}.post_attention_layernorm.weight"}


def tensor_layout(c: BlockDiffusionConfig) -> dict[str, tuple[int, ...]]:
    h, inter = c.hidden_size, c.intermediate_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    out = {"fc.weight": (h, len(c.target_layer_ids) * c.target_hidden_size),
           "hidden_norm.weight": (h,)}
    for i in range(c.num_layers):
        k = _layer_keys(i)
        out.update({k["q"]: (q, h), k["k"]: (kv, h), k["v"]: (kv, h), k["o"]: (h, q),
                    k["gate"]: (inter, h), k["up"]: (inter, h), k["down"]: (h, inter),
                    k["in"]: (h,), k["post"]: (h,)})
    out.update({"norm.weight": (h,), "lm_head.weight": (c.draft_vocab_size, h),
                "mask_embedding": (c.block_size - 1, h), "token_map": (c.draft_vocab_size,)})
    return out


def save_block_diffusion(model: BlockDiffusionModel, folder: Path, target_hf_config, *,
                         dtype: torch.dtype = torch.bfloat16, extra: dict | None = None,
                         overwrite: bool = False, formats: tuple[str, ...] = ()) -> None:
    """Write ``model`` to ``folder`` atomically; ``extra`` goes under config.json's "specdec".
    ``formats``: engines besides specdec; this format is specdec's own, so "vllm" or "sglang"
    raise ValueError naming the drafter and the format."""
    check_formats("block_diffusion", formats)
    c, lc = model.config, model.cfg
    check_rope(model.rope, c.head_dim, target_hf_config)
    floats = {"fc.weight": model.fc, "hidden_norm.weight": model.hidden_norm}
    for i, layer in enumerate(model.layers):
        k = _layer_keys(i)
        q, kk, v = layer.qkv_weight.split([lc.q_size, lc.kv_size, lc.kv_size])
        gate, up = layer.gate_up_weight.chunk(2)
        floats.update({k["q"]: q, k["k"]: kk, k["v"]: v, k["o"]: layer.o_weight,
                       k["gate"]: gate, k["up"]: up, k["down"]: layer.down_weight,
                       k["in"]: layer.input_norm, k["post"]: layer.post_attn_norm})
    floats.update({"norm.weight": model.norm_weight, "lm_head.weight": model.lm_head,
                   "mask_embedding": model.mask_embedding})
    tensors = export_tensors(floats, dtype, {"token_map": model.token_map})
    config = {
        "architectures": list(BLOCK_ARCHITECTURES), "model_type": "llama",
        "num_hidden_layers": c.num_layers, "hidden_size": c.hidden_size,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "intermediate_size": c.intermediate_size, "hidden_act": "silu",
        "attention_bias": False, "rms_norm_eps": c.rms_norm_eps, **rope_json(target_hf_config),
        "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size, "block_size": c.block_size,
        "tie_word_embeddings": False,
        "dflash_config": {"target_layer_ids": list(c.target_layer_ids), "mask_token_id": None,
                          "mask_embedding": True, "anchor_state": True},
        "torch_dtype": SAVE_DTYPES[dtype],
        "specdec": metadata(target_hf_config, c.target_num_layers, extra),
    }
    if c.target_hidden_size != c.hidden_size:
        config["target_hidden_size"] = c.target_hidden_size
    write_folder(Path(folder), config, tensors, overwrite=overwrite)


def load_block_diffusion(folder: Path, target_cfg: ModelConfig, embed: torch.Tensor,
                         target_hf_config, trainable: bool = False) -> BlockDiffusionModel:
    """A BlockDiffusionModel (dtype and device of ``embed``, the target's embedding) from a
    folder in this format, checked against the target; ValueError names the file, field or
    tensor at fault. ``model.rank_acceptance``: the calibration, or None."""
    folder = Path(folder)
    raw = read_config(folder, BLOCK_ARCHITECTURES, "a block-diffusion drafter")
    where = folder / "config.json"
    config = _config_from_json(raw, target_cfg, where)
    config.check_target(target_cfg)
    tensors = read_safetensors(folder)
    check_tensors(tensors, tensor_layout(config), folder, "this block-diffusion drafter",
                  {"token_map": "integer"})
    used = check_vocab_map(tensors["token_map"], config.vocab_size, f"{folder}/*.safetensors")
    rope = rope_config(raw, folder) if has_rope(raw) else target_hf_config
    model = BlockDiffusionModel(config, embed, rope, trainable)
    model.set_vocab(used)
    with torch.no_grad():
        model.fc.copy_(tensors["fc.weight"])
        model.hidden_norm.copy_(tensors["hidden_norm.weight"])
        for i, layer in enumerate(model.layers):
            k = _layer_keys(i)
            layer.qkv_weight.copy_(torch.cat([tensors[k["q"]], tensors[k["k"]],
                                              tensors[k["v"]]]))
            layer.o_weight.copy_(tensors[k["o"]])
            layer.gate_up_weight.copy_(torch.cat([tensors[k["gate"]], tensors[k["up"]]]))
            layer.down_weight.copy_(tensors[k["down"]])
            layer.input_norm.copy_(tensors[k["in"]])
            layer.post_attn_norm.copy_(tensors[k["post"]])
        model.norm_weight.copy_(tensors["norm.weight"])
        model.lm_head.copy_(tensors["lm_head.weight"])
        model.mask_embedding.copy_(tensors["mask_embedding"])
    model.rank_acceptance = rank_acceptance(raw, config.block_size - 1, where, "block position")
    return model


def _config_from_json(raw: dict, target_cfg: ModelConfig, where: Path) -> BlockDiffusionConfig:
    dflash = raw.get("dflash_config") or {}
    if dflash.get("mask_token_id") is not None or not dflash.get("mask_embedding", False):
        raise ValueError(f"{where}: dflash_config has mask_token_id "
                         f"{dflash.get('mask_token_id')!r}; only a learned mask embedding "
                         "(mask_token_id null, mask_embedding true) is supported")
    if not dflash.get("anchor_state", False):
        raise ValueError(f"{where}: dflash_config.anchor_state must be true: block rows without "
                         "the anchor's state (plain DFlash) are not supported")
    if raw.get("hidden_act", "silu") != "silu" or raw.get("attention_bias", False):
        raise ValueError(f"{where}: only silu layers without attention bias are supported")
    try:
        shape = layer_shape(raw)
        ids = dflash["target_layer_ids"]
        if not isinstance(ids, list) or not ids:
            raise ValueError(f"dflash_config.target_layer_ids {ids!r} must be a non-empty list")
        return BlockDiffusionConfig(
            **shape, vocab_size=int(raw["vocab_size"]),
            draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]),
            target_hidden_size=int(raw.get("target_hidden_size") or shape["hidden_size"]),
            target_num_layers=target_num_layers(raw, target_cfg.num_layers),
            target_layer_ids=tuple(int(j) for j in ids),
            num_layers=int(raw["num_hidden_layers"]), block_size=int(raw["block_size"]),
            max_position_embeddings=target_cfg.max_position_embeddings)
    except KeyError as e:
        raise ValueError(f"{where}: the field {e.args[0]!r} is missing") from e
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: malformed field: {e}") from e
