"""Save and load MTP heads in the Medusa format vLLM loads (``MedusaModel``).

    config.json        architectures ["MedusaModel"], model_type "medusa", hidden_size,
                       vocab_size (target), num_heads, num_hidden_layers (blocks per head),
                       truncated_vocab_size (draft vocabulary), original_lm_head true (one LM
                       head shared by the heads), medusa_fc_bias false, torch_dtype; our
                       metadata under "specdec" (target layer count, the calibrated
                       ``rank_acceptance`` the tree shape comes from, training metrics)
    model.safetensors  blocks.{h}.layers.{l}.weight [H, H]; lm_heads.0.weight [Vd, H];
                       token_map int64 [Vd] (draft id -> target id, ascending)

The heads read the target's final-normed hidden state (what vLLM hands a Medusa model).
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.models.decoder.config import ModelConfig
from specdec.models.heads.checkpoint import (
    SAVE_DTYPES,
    check_tensors,
    check_vocab_map,
    export_tensors,
    metadata,
    rank_acceptance,
    read_config,
    target_num_layers,
    write_folder,
)
from specdec.models.heads.export_formats import check_formats
from specdec.models.heads.mtp import MTPConfig, MTPHeads
from specdec.models.loader import read_safetensors

MTP_ARCHITECTURES = ("MedusaModel",)
PREFIX = "medusa_heads."  # some exporters prefix the keys (vLLM strips it too)


def tensor_layout(c: MTPConfig) -> dict[str, tuple[int, ...]]:
    h = c.hidden_size
    out = {f"blocks.{i}.layers.{j}.weight": (h, h) for i in range(c.num_heads)
           for j in range(c.num_layers)}
    out["lm_heads.0.weight"] = (c.draft_vocab_size, h)
    out["token_map"] = (c.draft_vocab_size,)
    return out


def save_mtp(heads: MTPHeads, folder: Path, target_hf_config, *,
             dtype: torch.dtype = torch.bfloat16, extra: dict | None = None,
             overwrite: bool = False, formats: tuple[str, ...] = ()) -> None:
    """Write ``heads`` to ``folder`` atomically; ``extra`` goes under config.json's "specdec".
    ``formats``: engines the folder must load in besides specdec ("vllm"; SGLang has no Medusa
    loader: ValueError)."""
    check_formats("mtp", formats)
    c = heads.config
    floats = {f"blocks.{i}.layers.{j}.weight": heads.blocks[i, j] for i in range(c.num_heads)
              for j in range(c.num_layers)}
    floats["lm_heads.0.weight"] = heads.lm_head
    tensors = export_tensors(floats, dtype, {"token_map": heads.token_map})
    config = {"architectures": list(MTP_ARCHITECTURES), "model_type": "medusa",
              "hidden_size": c.hidden_size, "vocab_size": c.vocab_size,
              "num_heads": c.num_heads, "num_hidden_layers": c.num_layers,
              "truncated_vocab_size": c.draft_vocab_size, "original_lm_head": True,
              "medusa_fc_bias": False, "torch_dtype": SAVE_DTYPES[dtype],
              "specdec": metadata(target_hf_config, c.target_num_layers, extra)}
    write_folder(Path(folder), config, tensors, overwrite=overwrite)


def load_mtp(folder: Path, target_cfg: ModelConfig, dtype: torch.dtype, device=None,
             trainable: bool = False) -> MTPHeads:
    """MTPHeads from a folder in this format, checked against the target; ValueError names the
    file, field or tensor at fault. ``heads.rank_acceptance``: the calibration, or None."""
    folder = Path(folder)
    raw = read_config(folder, MTP_ARCHITECTURES, "an MTP (Medusa) drafter")
    where = folder / "config.json"
    try:
        h, vocab = int(raw["hidden_size"]), int(raw["vocab_size"])
        config = MTPConfig(h, vocab, int(raw.get("truncated_vocab_size") or vocab),
                           int(raw["num_heads"]), int(raw.get("num_hidden_layers", 1)),
                           target_num_layers(raw, target_cfg.num_layers))
    except KeyError as e:
        raise ValueError(f"{where}: the field {e.args[0]!r} is missing") from e
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: malformed field: {e}") from e
    if raw.get("medusa_fc_bias"):
        raise ValueError(f"{where}: medusa_fc_bias true is not supported (blocks without bias)")
    if config.num_heads < 1 or config.num_layers < 1:
        raise ValueError(f"{where}: num_heads and num_hidden_layers must be >= 1")
    config.check_target(target_cfg)
    tensors = {k.removeprefix(PREFIX): v for k, v in read_safetensors(folder).items()}
    if not raw.get("original_lm_head", False):
        raise ValueError(f"{where}: original_lm_head false (one LM head per MTP head) is not "
                         "supported; the heads share lm_heads.0")
    if "token_map" not in tensors and config.draft_vocab_size == vocab:
        tensors["token_map"] = torch.arange(vocab)
    check_tensors(tensors, tensor_layout(config), folder, "these MTP heads",
                  {"token_map": "integer"})
    used = check_vocab_map(tensors["token_map"], vocab, f"{folder}/*.safetensors")
    heads = MTPHeads(config, dtype, device, trainable)
    heads.set_vocab(used)
    with torch.no_grad():
        for i in range(config.num_heads):
            for j in range(config.num_layers):
                heads.blocks[i, j].copy_(tensors[f"blocks.{i}.layers.{j}.weight"])
        heads.lm_head.copy_(tensors["lm_heads.0.weight"])
    heads.rank_acceptance = rank_acceptance(raw, config.num_heads, where, "head")
    return heads
