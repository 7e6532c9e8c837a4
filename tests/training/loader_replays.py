"""Pure-Python replays of vLLM's and SGLang's drafter loaders, run on the folders specdec writes.

A replay reads config.json as the engine's config class does (its defaults where a field is
missing), builds the parameter table the engine's model has (names, shapes, stacked shards) and
feeds the checkpoint's tensors through the engine's ``load_weights``: renames, skips, shard and
shape checks. What crashes the real loader raises ``LoaderCrash`` with the engine's message; what
it does silently is recorded on the returned ``Loaded``: tensors dropped, parameters left at
their init values, the target hidden states captured, the vocabulary map built, the config
values read. Parameter values are kept, so a test can compare them with specdec's weights.

Pinned sources (public repositories; the commit is the stored version read):

vLLM (vllm-project/vllm)
  V1  vllm/model_executor/models/llama_eagle3.py @ 00bd1493b3e8: Eagle3LlamaForCausalLM.load_weights,
      LlamaModel.load_weights / __init__, LlamaDecoderLayer.__init__
  V2  vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py @ 0cfdd2e15d69:
      get_eagle3_aux_layers_from_config, set_eagle3_aux_hidden_state_layers
  V3  vllm/model_executor/models/medusa.py @ 01dbb08195ca: Medusa.__init__ / load_weights, ResidualBlock
  V4  vllm/transformers_utils/configs/medusa.py @ 0531c2226a6a: MedusaConfig.__init__ / from_pretrained
  V5  vllm/model_executor/models/qwen3_dflash.py @ 036a00d1f5d0: DFlashQwen3ForCausalLM.load_weights,
      DFlashQwen3Model.__init__ (hf_to_vllm_mapper), DFlashQwen3Attention (q_norm, k_norm)
  V6  vllm/config/speculative.py (SpeculativeConfig.__post_init__): model_type "medusa" -> medusa
SGLang (sgl-project/sglang)
  S1  python/sglang/srt/models/llama_eagle3.py @ 03d5a7771f60: LlamaForCausalLMEagle3.__init__ /
      load_weights, LlamaModel.__init__
  S2  python/sglang/srt/models/llama.py @ 00239548f1cd: LlamaForCausalLM.set_eagle3_layers_to_capture
      (ids + 1); sglang#25454 (merged 2026-05-16) adds 1 only when the first id is 1
  S3  python/sglang/srt/model_executor/model_runner.py (ModelRunner.__init__): the ids come from
      the draft's eagle_config["eagle_aux_hidden_state_layer_ids"] only, None when absent
  S4  python/sglang/srt/models/dflash.py @ 003b23d7388e: DFlashDraftModel.__init__ / load_weights

Captured layers are given in HF ``hidden_states`` indices (j = the input of target layer j): both
engines' Llama forwards append ``hidden_states + residual`` before running layer j.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

# transformers' LlamaConfig defaults: what a vLLM / SGLang draft config holds for a missing field
LLAMA_DEFAULTS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
    "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10000.0,
    "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
}
VLLM_EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # vLLM's registry
SGLANG_EAGLE3_ARCHS = ("LlamaForCausalLMEagle3",)  # llama_eagle3.py's EntryClass


class LoaderCrash(Exception):
    """The real loader raises here (message as the engine words it)."""


@dataclass
class Loaded:
    engine: str
    values: dict[str, torch.Tensor]  # every parameter of the engine's model, NaN until loaded
    shards: dict[str, set] = field(default_factory=dict)  # stacked param -> shards still unset
    filled: set[str] = field(default_factory=set)
    shared: set[str] = field(default_factory=set)  # filled from the target by the engine
    dropped: list[str] = field(default_factory=list)  # checkpoint tensors ignored silently
    skipped: list[str] = field(default_factory=list)  # ignored by design (t2d)
    read: dict = field(default_factory=dict)  # config values the loader used
    captured: tuple[int, ...] | None = None  # target hidden_states fed to the drafter
    draft_to_target: torch.Tensor | None = None  # [Vd] int64

    @property
    def unloaded(self) -> list[str]:
        """Parameters left at their init values (not shared from the target)."""
        return sorted(n for n in self.values if n not in self.shared
                      and (n not in self.filled or self.shards.get(n)))

    def add(self, name: str, shape: tuple[int, ...], shards: dict | None = None) -> None:
        self.values[name] = torch.full(shape, float("nan"), dtype=torch.float64)
        if shards:
            self.shards[name] = set(shards)
            self._layout = getattr(self, "_layout", {})
            self._layout[name] = shards

    def load(self, name: str, w: torch.Tensor, shard=None) -> None:
        """The engines' weight_loader: shape asserted (per shard for stacked params)."""
        param = self.values[name]
        if shard is None:
            if tuple(param.shape) != tuple(w.shape):
                raise LoaderCrash(f"Attempted to load weight ({tuple(w.shape)}) into parameter "
                                  f"{name} ({tuple(param.shape)})")
            param.copy_(w.to(torch.float64))
        else:
            offset, size = self._layout[name][shard]
            part = param.narrow(0, offset, size)
            if tuple(part.shape) != tuple(w.shape):
                raise LoaderCrash(f"{name} shard {shard!r}: shape {tuple(part.shape)} != "
                                  f"loaded {tuple(w.shape)}")
            part.copy_(w.to(torch.float64))
            self.shards[name].discard(shard)
        self.filled.add(name)


def read_folder(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    folder = Path(folder)
    return json.loads((folder / "config.json").read_text()), load_file(folder / "model.safetensors")


def llama_config(raw: dict) -> dict:
    """AutoConfig for model_type "llama": LlamaConfig defaults under the file's fields."""
    if raw.get("model_type") != "llama":
        raise LoaderCrash(f"Unrecognized model_type {raw.get('model_type')!r} (AutoConfig)")
    c = {**LLAMA_DEFAULTS, **raw}
    c["num_key_value_heads"] = c["num_key_value_heads"] or c["num_attention_heads"]
    c["head_dim"] = c["head_dim"] or c["hidden_size"] // c["num_attention_heads"]
    return c


def _attention(out: Loaded, prefix: str, c: dict, d_in: int, bias: bool = False) -> None:
    q = c["num_attention_heads"] * c["head_dim"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    out.add(prefix + "qkv_proj.weight", (q + 2 * kv, d_in),
            {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)})
    out.add(prefix + "o_proj.weight", (c["hidden_size"], q))
    if bias:
        out.add(prefix + "qkv_proj.bias", (q + 2 * kv,),
                {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)})
        out.add(prefix + "o_proj.bias", (c["hidden_size"],))


def _mlp(out: Loaded, prefix: str, c: dict) -> None:
    h, i = c["hidden_size"], c["intermediate_size"]
    out.add(prefix + "gate_up_proj.weight", (2 * i, h), {0: (0, i), 1: (i, i)})
    out.add(prefix + "down_proj.weight", (h, i))


STACKED = ((".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"),
           (".qkv_proj", ".v_proj", "v"), (".gate_up_proj", ".gate_proj", 0),
           (".gate_up_proj", ".up_proj", 1))


def _read(c: dict, keys) -> dict:
    return {k: c.get(k) for k in keys}


# ------------------------------------------------------------------------------- vLLM EAGLE-3

def vllm_eagle3(folder: Path, target_num_layers: int) -> Loaded:
    """V1, V2: a folder loaded with ``--speculative-config '{"method": "eagle3", ...}'``."""
    raw, tensors = read_folder(folder)
    if not set(raw.get("architectures") or []) & set(VLLM_EAGLE3_ARCHS):
        raise LoaderCrash(f"Model architectures {raw.get('architectures')} are not supported "
                          "for eagle3")
    c = llama_config(raw)
    c["draft_vocab_size"] = raw.get("draft_vocab_size") or c["vocab_size"]
    eagle = raw.get("eagle_config") or {}
    use_aux = eagle.get("use_aux_hidden_state", True)
    h, ht = c["hidden_size"], raw.get("target_hidden_size") or c["hidden_size"]
    out = Loaded("vllm", {})
    out.read = _read(c, ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                         "intermediate_size", "rms_norm_eps", "vocab_size", "draft_vocab_size",
                         "rope_theta", "rope_scaling", "max_position_embeddings", "hidden_act",
                         "num_hidden_layers"))
    out.read.update(target_hidden_size=ht, use_aux_hidden_state=use_aux,
                    norm_before_residual=bool(raw.get("norm_before_residual", False)),
                    attention_bias=bool(c["attention_bias"]), mlp_bias=bool(c["mlp_bias"]))
    out.add("model.embed_tokens.weight", (c["vocab_size"], h))
    for j in range(c["num_hidden_layers"]):
        p = f"model.layers.{j}."
        _attention(out, p + "self_attn.", c, 2 * h if j == 0 else h, bool(c["attention_bias"]))
        _mlp(out, p + "mlp.", c)
        for n in ("input_layernorm", "post_attention_layernorm", "hidden_norm"):
            out.add(p + n + ".weight", (h,))
    if use_aux:
        out.add("model.fc.weight", (h, 3 * ht))
    out.add("model.norm.weight", (h,))
    out.add("lm_head.weight", (c["draft_vocab_size"], h))
    out.add("draft_id_to_target_id", (c["draft_vocab_size"],))
    _vllm_eagle3_weights(out, tensors, use_aux)
    out.captured = vllm_aux_layers(raw, target_num_layers)
    if "draft_id_to_target_id" in out.filled:
        d2t = out.values["draft_id_to_target_id"].to(torch.int64)
        out.draft_to_target = torch.arange(d2t.numel()) + d2t
    else:  # compute_logits: no map, logits over the target's vocabulary
        out.draft_to_target = torch.arange(c["draft_vocab_size"])
    return out


def _vllm_eagle3_weights(out: Loaded, tensors: dict, use_aux: bool) -> None:
    """Eagle3LlamaForCausalLM.load_weights -> AutoWeightsLoader -> LlamaModel.load_weights."""
    model_weights, has_d2t, has_embed = {}, False, False
    for name, w in tensors.items():
        if "t2d" in name:
            out.skipped.append(name)
            continue
        if "d2t" in name:
            name, has_d2t = name.replace("d2t", "draft_id_to_target_id"), True
        elif "mask_hidden" in name:
            out.dropped.append(name)  # not parallel drafting: warned and skipped
            continue
        elif "lm_head" not in name:
            name = "model." + name
        has_embed |= "embed_tokens" in name
        model_weights[name] = w
    skip = ["mask_hidden"] + ([] if has_d2t else ["draft_id_to_target_id"]) \
        + ([] if has_embed else ["embed_tokens"]) + ([] if use_aux else ["fc."])
    if not has_embed:  # the proposer shares the target's embedding
        out.shared.add("model.embed_tokens.weight")
    if not has_d2t:
        out.shared.add("draft_id_to_target_id")
    for name, w in model_weights.items():
        if any(s in name for s in skip):
            out.dropped.append(name)
            continue
        if name.startswith("model."):
            _vllm_llama_model_load(out, name[len("model."):], w)
        elif name in out.values:
            out.load(name, w)
        else:
            raise LoaderCrash(f"There is no module or parameter named '{name}' in "
                              "Eagle3LlamaForCausalLM")


def _vllm_llama_model_load(out: Loaded, name: str, w: torch.Tensor) -> None:
    if "midlayer." in name:
        name = name.replace("midlayer.", "layers.0.")
    for param, shard_name, shard in STACKED:
        if shard_name in name:
            name = "model." + name.replace(shard_name, param)
            if name not in out.values:
                raise LoaderCrash(f"KeyError: {name!r} (LlamaModel.load_weights params_dict)")
            out.load(name, w, shard)
            return
    name = "model." + name
    if name not in out.values:
        raise LoaderCrash(f"KeyError: {name!r} (LlamaModel.load_weights params_dict)")
    out.load(name, w)


def vllm_aux_layers(raw: dict, target_num_layers: int) -> tuple[int, ...]:
    """V2 get_eagle3_aux_layers_from_config, else the Llama target's default (2, L//2, L-3)."""
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if not ids and isinstance(raw.get("dflash_config"), dict):
        ids = [i + 1 for i in (raw["dflash_config"].get("target_layer_ids") or [])]
    if not ids and raw.get("target_layer_ids"):
        ids = [i + 1 for i in raw["target_layer_ids"]]
    if not ids:
        for key in ("dflash_config", "eagle_config"):
            sub = raw.get(key)
            if isinstance(sub, dict) and sub.get("layer_ids"):
                ids = sub["layer_ids"]
                break
    if ids and isinstance(ids, (list, tuple)):
        return tuple(ids)
    return (2, target_num_layers // 2, target_num_layers - 3)


# ----------------------------------------------------------------------------- SGLang EAGLE-3

def sglang_eagle3(folder: Path, target_num_layers: int, pr25454: bool = True) -> Loaded:
    """S1-S3; ``pr25454``: the release has sglang#25454 (no +1 unless the first id is 1)."""
    raw, tensors = read_folder(folder)
    if not set(raw.get("architectures") or []) & set(SGLANG_EAGLE3_ARCHS):
        raise LoaderCrash(f"Model architectures {raw.get('architectures')} are not supported")
    c = llama_config(raw)
    if "draft_vocab_size" not in raw:
        raise LoaderCrash("AttributeError: 'LlamaConfig' object has no attribute "
                          "'draft_vocab_size'")
    h = c["hidden_size"]
    ht = raw["target_hidden_size"] if "target_hidden_size" in raw else h
    out = Loaded("sglang", {})
    vd = raw["draft_vocab_size"]
    tie = bool(c["tie_word_embeddings"])
    out.read = _read(c, ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                         "intermediate_size", "rms_norm_eps", "vocab_size", "rope_theta",
                         "rope_scaling", "max_position_embeddings", "hidden_act",
                         "num_hidden_layers"))
    out.read.update(draft_vocab_size=vd if vd is not None else c["vocab_size"],
                    target_hidden_size=ht, tie_word_embeddings=tie,
                    attention_bias=False, mlp_bias=False, norm_before_residual=False,
                    use_aux_hidden_state=(raw.get("eagle_config") or {}).get(
                        "use_aux_hidden_state", True))
    out.add("model.embed_tokens.weight", (c["vocab_size"], h))
    out.add("model.fc.weight", (h, 3 * ht))
    _attention(out, "model.midlayer.self_attn.", c, 2 * h)
    _mlp(out, "model.midlayer.mlp.", c)
    for n in ("input_layernorm", "post_attention_layernorm", "hidden_norm"):
        out.add(f"model.midlayer.{n}.weight", (h,))
    for i in range(1, c["num_hidden_layers"]):
        p = f"model.additional_layers.{i - 1}."
        _attention(out, p + "self_attn.", c, h)
        _mlp(out, p + "mlp.", c)
        for n in ("post_attention_layernorm", "hidden_norm"):
            out.add(p + n + ".weight", (h,))
    out.add("model.norm.weight", (h,))
    if ht == h:  # set_embed: the target's embedding (kept otherwise)
        out.shared.add("model.embed_tokens.weight")
    if tie:  # lm_head is the (shared) embedding
        out.read["draft_vocab_size"] = c["vocab_size"]
    else:
        out.add("lm_head.weight", (out.read["draft_vocab_size"], h))
        if vd is None:  # load_lm_head_from_target
            out.shared.add("lm_head.weight")
    _sglang_eagle3_weights(out, tensors)
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    out.captured = sglang_capture(ids, target_num_layers, pr25454)
    if out.draft_to_target is None:
        out.draft_to_target = torch.arange(out.read["draft_vocab_size"])
    return out


def _sglang_eagle3_weights(out: Loaded, tensors: dict) -> None:
    """LlamaForCausalLMEagle3.load_weights: unknown names are skipped without a word."""
    for name, w in tensors.items():
        if "d2t" in name:
            out.draft_to_target = w.to(torch.int64) + torch.arange(w.shape[0])
            continue
        if "t2d" in name:
            out.skipped.append(name)
            continue
        for param, shard_name, shard in STACKED:
            if shard_name in name:
                name = name.replace(shard_name, param)
                target = name if name in out.values else f"model.{name}"
                if target in out.values:
                    out.load(target, w, shard)
                else:
                    out.dropped.append(name)
                break
        else:
            target = name if name in out.values else f"model.{name}"
            if target in out.values:
                out.load(target, w)
            else:
                out.dropped.append(name)


def sglang_capture(ids, target_num_layers: int, pr25454: bool) -> tuple[int, ...]:
    """S2 set_eagle3_layers_to_capture: the target layers whose input is captured."""
    if ids is None:
        n = target_num_layers
        return (2, n // 2, n - 3)
    if pr25454 and ids[0] != 1:
        return tuple(ids)
    return tuple(v + 1 for v in ids)


# ------------------------------------------------------------------------------- vLLM Medusa

def medusa_config(raw: dict) -> dict:
    """V4 MedusaConfig.from_pretrained: keys with "num" and "heads" / "layers" renamed (in file
    order, the last one wins), then the constructor's defaults."""
    d = dict(raw)
    for k in list(d):
        if "num" in k:
            if "heads" in k:
                d["num_heads"] = d.pop(k)
            elif "layers" in k:
                d["num_hidden_layers"] = d.pop(k)
    c = {"hidden_size": 4096, "vocab_size": 32001, "num_heads": 5, "num_hidden_layers": 1,
         "truncated_vocab_size": None, **d}
    if c["truncated_vocab_size"] is None:
        c["truncated_vocab_size"] = c["vocab_size"]
    return c


def vllm_medusa(folder: Path) -> Loaded:
    """V3, V4, V6: method "medusa" (detected from model_type "medusa")."""
    raw, tensors = read_folder(folder)
    if raw.get("model_type") != "medusa":
        raise LoaderCrash(f"model_type {raw.get('model_type')!r}: not detected as a Medusa "
                          "draft (SpeculativeConfig wants model_type 'medusa')")
    c = medusa_config(raw)
    h, vd, v = c["hidden_size"], c["truncated_vocab_size"], c["vocab_size"]
    bias = bool(c.get("medusa_fc_bias", False))
    original = bool(c.get("original_lm_head", False))
    out = Loaded("vllm", {})
    out.read = {"hidden_size": h, "vocab_size": v, "num_heads": c["num_heads"],
                "num_hidden_layers": c["num_hidden_layers"], "truncated_vocab_size": vd,
                "medusa_fc_bias": bias, "original_lm_head": original,
                "logit_scale": c.get("logit_scale", 1.0)}
    for i in range(c["num_heads"]):
        for j in range(c["num_hidden_layers"]):
            out.add(f"blocks.{i}.layers.{j}.weight", (h, h))
            if bias:
                out.add(f"blocks.{i}.layers.{j}.bias", (h,))
    if original:
        out.add("lm_head.weight", (vd, h))
    else:
        for i in range(c["num_heads"]):
            out.add(f"lm_heads.{i}.weight", (vd, h))
    token_map, weights = None, {}
    for name, w in tensors.items():
        name = name.replace("medusa_heads.", "")
        if name == "token_map":
            if vd < v:
                token_map = w
            else:
                out.dropped.append(name)
        elif name in out.values:
            weights[name] = w
        elif original and name == "lm_heads.0.weight":
            weights["lm_head.weight"] = w
        else:
            out.dropped.append(name)
    for name, w in weights.items():
        if "lm_head" in name and token_map is not None and w.shape[0] > token_map.shape[0]:
            w = w[token_map]
        out.load(name, w)
    if not (vd == v or token_map is not None):
        raise LoaderCrash("AssertionError: truncated_vocab_size < vocab_size needs a token_map")
    missing = [n for n in out.values if n not in out.filled]
    if missing:  # DefaultModelLoader: Medusa.load_weights returns the loaded names
        raise LoaderCrash(f"Following weights were not initialized from checkpoint: {missing}")
    if token_map is not None and (token_map.dtype.is_floating_point or
                                  token_map.dtype == torch.bool):
        raise LoaderCrash(f"token_map of dtype {token_map.dtype} cannot index logits[..., map]")
    out.draft_to_target = (token_map.to(torch.int64) if token_map is not None
                           else torch.arange(v))
    return out


# ------------------------------------------------------------------------------- DFlash

def _dflash_layers(out: Loaded, prefix: str, c: dict) -> None:
    h = c["hidden_size"]
    for i in range(c["num_hidden_layers"]):
        p = f"{prefix}layers.{i}."
        _attention(out, p + "self_attn.", c, h)
        out.add(p + "self_attn.q_norm.weight", (c["head_dim"],))
        out.add(p + "self_attn.k_norm.weight", (c["head_dim"],))
        _mlp(out, p + "mlp.", c)
        out.add(p + "input_layernorm.weight", (h,))
        out.add(p + "post_attention_layernorm.weight", (h,))


def vllm_dflash(folder: Path, target_vocab_size: int) -> Loaded:
    """V5: DFlashQwen3ForCausalLM.load_weights (AutoWeightsLoader raises on unknown names)."""
    raw, tensors = read_folder(folder)
    c = {**LLAMA_DEFAULTS, **raw}
    c["num_key_value_heads"] = c["num_key_value_heads"] or c["num_attention_heads"]
    c["head_dim"] = c["head_dim"] or c["hidden_size"] // c["num_attention_heads"]
    dflash = {**(raw.get("eagle_config") or {}), **(raw.get("dflash_config") or {})}
    mask_token_id = dflash.get("mask_token_id", raw.get("mask_token_id"))
    vd = raw.get("draft_vocab_size") or c["vocab_size"]
    h = c["hidden_size"]
    aux = vllm_aux_layers(raw, 0) if dflash.get("target_layer_ids") else None
    n = len(aux) if aux else c["num_hidden_layers"]
    out = Loaded("vllm", {})
    out.read = {"mask_token_id": mask_token_id, "draft_vocab_size": vd}
    _dflash_layers(out, "model.", c)
    out.add("model.fc.weight", (h, (raw.get("target_hidden_size") or h) * n))
    out.add("model.hidden_norm.weight", (h,))
    out.add("model.norm.weight", (h,))
    out.add("model.mask_embedding", (h,))
    out.shared.add("model.mask_embedding")  # only a separate mask_embedding.pt fills it
    if vd != target_vocab_size:
        out.add("draft_id_to_target_id", (vd,))
    names, has = {}, {"d2t": False, "embed": False, "lm_head": False}
    for name, w in tensors.items():
        if "t2d" in name:
            out.skipped.append(name)
            continue
        if "d2t" in name:
            name, has["d2t"] = name.replace("d2t", "draft_id_to_target_id"), True
        elif "lm_head" not in name:
            name = "model." + name
        has["embed"] |= "embed_tokens" in name
        has["lm_head"] |= "lm_head" in name
        names[name] = w
    if has["lm_head"]:
        out.add("lm_head.weight", (vd, h))
    drop = [s for s, keep in (("draft_id_to_target_id", has["d2t"]),
                              ("embed_tokens", has["embed"]), ("mask_embedding", False))
            if not keep]
    for name, w in names.items():
        if any(s in name for s in drop):
            out.dropped.append(name)
            continue
        name = name.replace("midlayer.", "layers.0.")
        for param, shard_name, shard in STACKED:
            if shard_name in name:
                target = name.replace(shard_name, param)
                if target not in out.values:
                    raise LoaderCrash(f"There is no module or parameter named '{target}'")
                out.load(target, w, shard)
                break
        else:
            if name not in out.values:
                raise LoaderCrash(f"There is no module or parameter named '{name}' in "
                                  "DFlashQwen3ForCausalLM")
            out.load(name, w)
    return out


def sglang_dflash(folder: Path) -> Loaded:
    """S4: DFlashDraftModel.load_weights (unknown names ignored; no lm_head, no token map)."""
    raw, tensors = read_folder(folder)
    c = {**LLAMA_DEFAULTS, **raw}
    c["num_key_value_heads"] = c["num_key_value_heads"] or c["num_attention_heads"]
    c["head_dim"] = c["head_dim"] or c["hidden_size"] // c["num_attention_heads"]
    ids = (raw.get("dflash_config") or {}).get("target_layer_ids") or []
    h = c["hidden_size"]
    out = Loaded("sglang", {})
    out.read = {"mask_token_id": (raw.get("dflash_config") or {}).get("mask_token_id")}
    _dflash_layers(out, "", c)
    out.add("norm.weight", (h,))
    out.add("fc.weight", (h, max(len(ids), 1) * h))
    out.add("hidden_norm.weight", (h,))

    def resolve(name):
        if name in out.values:
            return name
        alt = name[len("model."):] if name.startswith("model.") else f"model.{name}"
        return alt if alt in out.values else None

    for name, w in tensors.items():
        for param, shard_name, shard in ((p.strip("."), s.strip("."), i) for p, s, i in STACKED):
            if f".{shard_name}." in name:
                target = resolve(name.replace(shard_name, param))
                if target is None:
                    out.dropped.append(name)
                else:
                    out.load(target, w, shard)
                break
        else:
            target = resolve(name)
            if target is None:
                out.dropped.append(name)
            else:
                out.load(target, w)
    return out
