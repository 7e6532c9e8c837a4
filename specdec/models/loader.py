"""Find a model (alias, HF folder, GGUF file, hub id), check it, and load our decoder from it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from specdec.models.aliases import ALIASES, GGUF_NAME, alias_folder, gguf_folder
from specdec.models.checkpoints.quantize import check_choice
from specdec.models.checkpoints.safetensors_file import open_checkpoint
from specdec.models.checkpoints.weights import expert_matrix_names, put_checkpoint_weights
from specdec.models.decoder.config import ModelConfig, model_config_from_hf
from specdec.models.decoder.llama import LlamaDecoder
from specdec.models.gguf.file import open_gguf
from specdec.models.gguf.model import check_architecture, check_tensors, put_weights

DERIVED_PREFIX = "native_panels"  # what earlier versions wrote beside a GGUF (gguf/weights.py)


def resolve_model_path(model: str) -> Path:
    """The model's folder: config.json, the tokenizer, and the weights (*.safetensors, or a
    GGUF file as ``model.gguf``: see `specdec.models.aliases`).

    `model` is an alias (see `specdec.models.aliases.ALIASES`), a local HF folder, a local .gguf
    file, or a hub id (only when online).
    """
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a non-empty string, got {model!r}")
    if model in ALIASES:
        return alias_folder(model)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_folder(path)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model folder {path} has no config.json")
        return path
    return _hub_snapshot(model)


def _hub_snapshot(model: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
        return Path(snapshot_download(model, allow_patterns=patterns))
    except Exception as e:
        raise ValueError(
            f"unknown model {model!r}: not an alias ({', '.join(ALIASES)}), not a local folder "
            f"with config.json or a .gguf file, and not fetchable as a hub id ({e})"
        ) from e


def load_hf_config(folder: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder)
    except Exception as e:
        raise ValueError(f"could not read {folder / 'config.json'}: {e}") from e


def load_model(folder: Path, dtype: torch.dtype, device, max_positions: int,
               blocks: bool = False, quantize: str | None = None):
    """(LlamaDecoder with weights, ModelConfig, HF config) from a model folder (kept as
    ``model.source_folder``). Weights from its *.safetensors (memory-mapped; with ``blocks``
    or ``quantize`` and float32 on a CPU a bf16 / fp16 checkpoint's matrices stay its own
    bytes or are quantized into GGUF blocks as they are read: specdec.models.
    checkpoint_weights), else from its ``model.gguf`` (checked before any is used:
    specdec.models.gguf.model): with ``blocks`` and float32 on a CPU its matrices stay the
    file's blocks (``BlockWeight``: no fp32 copy; the engine runs them through the kernels),
    otherwise they are dequantized once into ``dtype`` (logged). ``quantize`` ("q8_0" |
    "q4_k") is a ValueError for a GGUF (its blocks are what it runs) and off float32 / CPU."""
    check_choice(quantize)
    hf_config = load_hf_config(folder)
    cfg = model_config_from_hf(hf_config)
    gguf = gguf_source(folder)
    lean = dtype == torch.float32 and torch.device(device).type == "cpu"
    if quantize is not None and gguf is not None:
        raise ValueError(f"quantize={quantize!r} quantizes a safetensors checkpoint; {folder} "
                         f"holds a GGUF ({gguf.resolve()}), whose own blocks run as they are")
    if quantize is not None and not lean:
        raise ValueError(f"quantize={quantize!r} runs on the compiled CPU kernels in float32, "
                         f"not {str(dtype).removeprefix('torch.')} on {device}")
    model = LlamaDecoder(cfg, hf_config, max_positions, dtype, device)
    if gguf is None:
        files = open_checkpoint(_checkpoint_files(folder))
        if lean and (blocks or quantize is not None):
            put_checkpoint_weights(model, files, quantize)
        else:
            load_weights(model, files)
            files.release_pages()
    else:
        f = open_gguf(gguf.resolve())  # errors name the user's file, not the link to it
        check_architecture(f)
        check_tensors(f, cfg)
        put_weights(model, f, blocks)
    model.source_folder = Path(folder)
    return model, cfg, hf_config


def gguf_source(folder: Path) -> Path | None:
    """The folder's ``model.gguf`` when it holds no other weights (a GGUF's folder), else None."""
    gguf = Path(folder) / GGUF_NAME
    return gguf if gguf.exists() and not _safetensors_files(folder) else None


def hf_weights_kwargs(folder: Path) -> dict:
    """What ``AutoModelForCausalLM.from_pretrained(folder, **kwargs)`` needs to read the
    folder's weights (a GGUF's folder holds no safetensors: transformers dequantizes the file)."""
    return {} if gguf_source(folder) is None else {"gguf_file": GGUF_NAME}


def _safetensors_files(folder: Path) -> list[Path]:
    return sorted(f for f in Path(folder).glob("*.safetensors")
                  if not f.name.startswith(DERIVED_PREFIX))


def _checkpoint_files(folder: Path) -> list[Path]:
    files = _safetensors_files(folder)
    if not files:
        raise ValueError(f"no *.safetensors weights file in {folder}")
    return files


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors weights file in the folder (not the panels specdec
    caches there); ValueError names a bad file."""
    tensors = {}
    for f in _checkpoint_files(folder):
        try:
            with safe_open(f, framework="pt") as sf:
                for name in sf.keys():
                    tensors[name] = sf.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ValueError(f"corrupt or truncated weights file {f}: {e}") from e
    return tensors


def load_weights(model: LlamaDecoder, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy HF-named tensors (a dict, or a checkpoint's mapped files) into our fused parameters
    (shapes checked, names reported)."""
    cfg = model.cfg
    get = _getter(tensors, cfg)
    with torch.no_grad():
        _put(model.embed, get("model.embed_tokens.weight"), "model.embed_tokens.weight")
        _put(model.final_norm, get("model.norm.weight"), "model.norm.weight")
        if model.lm_head is not None:
            _put(model.lm_head, get("lm_head.weight"), "lm_head.weight")
        for i, layer in enumerate(model.layers):
            _load_layer(layer, f"model.layers.{i}.", get, cfg)
            if layer.moe is not None:
                _load_experts(layer, i, get, cfg)


def _load_experts(layer, i: int, get, cfg: ModelConfig) -> None:
    """A mixture-of-experts layer's router, experts (gate|up fused) and shared expert."""
    for name, parts in expert_matrix_names(cfg, i).items():
        value = torch.cat([_checked(get, n, shape) for n, shape in parts])
        module, attr = layer.owner(name)
        _put(getattr(module, attr), value, "|".join(n for n, _ in parts))


def _load_layer(layer, prefix: str, get, cfg: ModelConfig) -> None:
    a, m = prefix + "self_attn.", prefix + "mlp."
    # Parts of fused parameters are checked one by one, so a bad shape names its own tensor.
    rows = {"q": cfg.q_size, "k": cfg.kv_size, "v": cfg.kv_size}
    qkv = [_checked(get, a + f"{p}_proj.weight", (n, cfg.hidden_size)) for p, n in rows.items()]
    _put(layer.qkv_weight, torch.cat(qkv), a + "{q,k,v}_proj.weight")
    if cfg.attention_bias:
        bias = [_checked(get, a + f"{p}_proj.bias", (n,)) for p, n in rows.items()]
        _put(layer.qkv_bias, torch.cat(bias), a + "{q,k,v}_proj.bias")
    _put(layer.o_weight, get(a + "o_proj.weight"), a + "o_proj.weight")
    if not cfg.is_moe:  # experts: _load_experts
        mlp_shape = (cfg.intermediate_size, cfg.hidden_size)
        gate_up = [_checked(get, m + f"{p}_proj.weight", mlp_shape) for p in ("gate", "up")]
        _put(layer.gate_up_weight, torch.cat(gate_up), m + "{gate,up}_proj.weight")
        _put(layer.down_weight, get(m + "down_proj.weight"), m + "down_proj.weight")
    for norm, param in (("input_layernorm", layer.input_norm),
                        ("post_attention_layernorm", layer.post_attn_norm)):
        _put(param, get(prefix + norm + ".weight"), prefix + norm + ".weight")
    if cfg.qk_norm:
        _put(layer.q_norm, get(a + "q_norm.weight"), a + "q_norm.weight")
        _put(layer.k_norm, get(a + "k_norm.weight"), a + "k_norm.weight")


def _getter(tensors: Mapping[str, torch.Tensor], cfg: ModelConfig):
    def get(name: str) -> torch.Tensor:
        if name in tensors:
            return tensors[name]
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            return tensors["model.embed_tokens.weight"]
        part = _fused_part(tensors, name, cfg)
        if part is not None:
            return part
        raise ValueError(f"weights are missing tensor {name!r}")

    return get


# a projection a checkpoint stores fused (phi3: qkv_proj, gate_up_proj): its name -> the fused
# tensor's name and the part's index
FUSED_PARTS = {"self_attn.q_proj": ("self_attn.qkv_proj", 0),
               "self_attn.k_proj": ("self_attn.qkv_proj", 1),
               "self_attn.v_proj": ("self_attn.qkv_proj", 2),
               "mlp.gate_proj": ("mlp.gate_up_proj", 0), "mlp.up_proj": ("mlp.gate_up_proj", 1)}


def _fused_part(tensors: dict[str, torch.Tensor], name: str, cfg: ModelConfig
                ) -> torch.Tensor | None:
    """``name``'s rows of the fused tensor the checkpoint holds instead (q|k|v, gate|up), or
    None; a fused tensor of the wrong size is reported by its own name."""
    prefix, _, rest = name.rpartition(".layers.")
    layer, _, tail = rest.partition(".")
    fused, index = FUSED_PARTS.get(tail.removesuffix(".weight"), (None, 0))
    full = f"{prefix}.layers.{layer}.{fused}.weight"
    if fused is None or full not in tensors:
        return None
    sizes = ([cfg.q_size, cfg.kv_size, cfg.kv_size] if fused.endswith("qkv_proj")
             else [cfg.intermediate_size] * 2)
    if tensors[full].shape[0] != sum(sizes):
        raise ValueError(f"tensor {full}: {tensors[full].shape[0]} rows, expected {sum(sizes)} "
                         f"({' + '.join(map(str, sizes))})")
    return tensors[full].split(sizes)[index]


def _checked(get, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    value = get(name)
    if tuple(value.shape) != shape:
        raise ValueError(f"tensor {name}: shape {tuple(value.shape)}, expected {shape}")
    return value


def _put(param: torch.nn.Parameter, value: torch.Tensor, name: str) -> None:
    if param.shape != value.shape:
        raise ValueError(f"tensor {name}: shape {tuple(value.shape)}, expected {tuple(param.shape)}")
    param.copy_(value.to(param.dtype))
