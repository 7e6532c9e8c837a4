"""Drafter checkpoint folders (config.json + model.safetensors): written atomically, read and
checked with errors that name the file, field or tensor at fault.

Every drafter format here (EAGLE-3, Medusa-style MTP, block diffusion) goes through these, so a
half-written folder never looks complete and a wrong file is reported the same way.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import uuid
from pathlib import Path

import safetensors.torch
import torch

from specdec.models.decoder.config import STATIC_ROPE_TYPES, rope_parameters
from specdec.models.decoder.rope import RotaryEmbedding

ROPE_FIELDS = ("rope_theta", "rope_scaling", "rope_parameters")
SAVE_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def write_folder(folder: Path, config: dict, tensors: dict[str, torch.Tensor], *,
                 overwrite: bool = False) -> None:
    """Write config.json and model.safetensors into ``folder``. The folder appears complete or
    not at all: files go into a hidden sibling that is renamed into place (on error the sibling
    is removed). An existing ``folder`` raises FileExistsError unless ``overwrite``; then it is
    moved aside, replaced by the rename, and deleted."""
    folder = Path(folder)
    if folder.exists() and not (overwrite and folder.is_dir()):
        raise FileExistsError(f"{folder} exists; pass overwrite=True to replace the folder")
    text = json.dumps(config, indent=2) + "\n"
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.tmp-{uuid.uuid4().hex}")
    tmp.mkdir()
    try:
        (tmp / "config.json").write_text(text)
        safetensors.torch.save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        # safetensors makes its file 0600; the weights get the mode any file written here gets
        # (config.json's: 0666 less the umask), not one the user did not ask for
        os.chmod(tmp / "model.safetensors", stat.S_IMODE((tmp / "config.json").stat().st_mode))
        for f in (tmp / "config.json", tmp / "model.safetensors", tmp):
            _fsync(f)
        _publish(tmp, folder, overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # already renamed away on success


def export_tensors(floats: dict[str, torch.Tensor], dtype: torch.dtype,
                   exact: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Fresh contiguous CPU copies: ``floats`` in ``dtype``, ``exact`` (index maps) as they are."""
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(SAVE_DTYPES.values())}, got {dtype}")
    out = {k: t.detach().to("cpu", dtype, copy=True).contiguous() for k, t in floats.items()}
    for k, t in (exact or {}).items():
        out[k] = t.detach().to("cpu", copy=True).contiguous()
    return out


def read_config(folder: Path, architectures: tuple[str, ...], what: str) -> dict:
    """config.json as a dict, checked to name one of ``architectures``; ValueError names the
    file. ``what``: the kind of checkpoint, for messages ("an MTP drafter")."""
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ValueError(f"{folder} is not {what}: {path} is missing") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"could not read {path}: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    archs = raw.get("architectures") or []
    if not any(a in architectures for a in archs):
        raise ValueError(f"{path}: architectures {archs} is not {what}; expected one of "
                         f"{list(architectures)}")
    return raw


def check_tensors(tensors: dict[str, torch.Tensor], layout: dict[str, tuple[int, ...]],
                  folder: Path, what: str, kinds: dict[str, str] | None = None,
                  ignored_suffixes: tuple[str, ...] = ()) -> None:
    """Every key of ``layout`` present with its shape and kind ("floating" unless ``kinds``
    says "integer" or "bool"); no key the model would silently drop."""
    kinds = kinds or {}
    where = f"{folder}/*.safetensors"
    for name, shape in layout.items():
        if name not in tensors:
            raise ValueError(f"{where} lacks tensor {name!r} (expected shape {shape})")
        t = tensors[name]
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{where}: tensor {name} has shape {tuple(t.shape)}, expected "
                             f"{tuple(shape)}")
        kind = ("bool" if t.dtype == torch.bool else "floating" if t.dtype.is_floating_point
                else "integer")
        if kind != kinds.get(name, "floating"):
            raise ValueError(f"{where}: tensor {name} has dtype {t.dtype}, expected "
                             f"{kinds.get(name, 'floating')} values")
    extra = [k for k in tensors if k not in layout and not k.endswith(ignored_suffixes)]
    if extra:
        raise ValueError(f"{where} has tensors {what} does not use: {sorted(extra)}")


def metadata(target_hf_config, target_num_layers: int, extra: dict | None) -> dict:
    """Our own metadata (config.json's "specdec" key): the target and ``extra`` (training
    metrics, calibration), checked to be JSON."""
    meta = {"target_model": getattr(target_hf_config, "name_or_path", None) or None,
            "target_num_layers": target_num_layers}
    if extra and "target_num_layers" in extra:
        raise ValueError("extra must not set 'target_num_layers' (it comes from the model)")
    meta.update(extra or {})
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as e:
        raise TypeError(f"extra must be JSON-serialisable: {e}") from e
    return meta


def target_num_layers(raw: dict, default: int) -> int:
    """Recorded by specdec under "specdec"; other exporters do not record it: ``default``."""
    meta = raw.get("specdec") or {}
    try:
        return int(meta.get("target_num_layers", default))
    except (TypeError, ValueError) as e:
        raise ValueError(f"specdec.target_num_layers is malformed: {e}") from e


def rank_acceptance(raw: dict, depth: int, where: Path, what: str) -> list[list[float]] | None:
    """The calibration a rank-path tree is shaped by, [depth][rank] rates in [0, 1], from
    config.json's "specdec": ``rank_acceptance_conditional`` (P(rank r of depth d is the
    target's token | the depths above were right): the chain rule along a path) where the
    drafter was calibrated so, else ``rank_acceptance`` (unconditional), else None.
    ``what``: "head", "block position"."""
    meta = raw.get("specdec") or {}
    key = ("rank_acceptance_conditional" if "rank_acceptance_conditional" in meta
           else "rank_acceptance")
    table = meta.get(key)
    if table is None:
        return None
    ok = (isinstance(table, list) and len(table) == depth
          and all(isinstance(row, list) and row and all(
              isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1
              for v in row) for row in table))
    if not ok:
        raise ValueError(f"{where}: specdec.{key} must list, for each of the {depth} "
                         f"{what}s, the acceptance rate of each rank in [0, 1]")
    return [[float(v) for v in row] for row in table]


def check_vocab_map(token_map: torch.Tensor, vocab_size: int, where: str) -> torch.Tensor:
    """A draft vocabulary given as target ids [Vd]: ascending, unique, inside the target's."""
    ids = token_map.to(torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"{where}: token_map has ids {int(ids.min())}..{int(ids.max())}, "
                         f"outside the target vocabulary 0..{vocab_size - 1}")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError(f"{where}: token_map must list ascending, distinct target ids")
    return ids


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, folder: Path, overwrite: bool) -> None:
    """Rename ``tmp`` to ``folder``. An existing folder (overwrite) is moved aside first and put
    back if the second rename fails: ``folder`` is the old checkpoint, the new one, or (between
    the two renames) absent, never a mix. POSIX has no portable rename over a full folder."""
    if not folder.exists():
        os.rename(tmp, folder)
        return
    if not overwrite:
        raise FileExistsError(f"{folder} appeared while saving; not replacing it")
    old = folder.with_name(f".{folder.name}.old-{uuid.uuid4().hex}")
    os.rename(folder, old)
    try:
        os.rename(tmp, folder)
    except BaseException:
        os.rename(old, folder)
        raise
    shutil.rmtree(old)


# ------------------------------------------------------------------------------------------ RoPE

def rope_json(target_hf_config) -> dict:
    """rope_theta / rope_scaling as a draft model's config.json writes them (the legacy spelling:
    transformers 4 — vLLM, SGLang — reads it; transformers 5 converts it)."""
    rope = rope_parameters(target_hf_config)
    return {"rope_theta": rope["rope_theta"],
            "rope_scaling": None if rope.get("rope_type", "default") == "default"
            else {k: v for k, v in rope.items() if k != "rope_theta"}}


def has_rope(raw: dict) -> bool:
    return any(k in raw for k in ROPE_FIELDS)


def check_rope(rope: RotaryEmbedding, head_dim: int, target_hf_config) -> None:
    """The RoPE written (the target's) must be the one the model runs with."""
    cos = rope.cos
    ref = RotaryEmbedding(target_hf_config, head_dim, cos.shape[0], cos.dtype, "cpu")
    if not torch.equal(ref.cos, cos.cpu()):
        raise ValueError(f"target_hf_config's RoPE ({rope_parameters(target_hf_config)}) is not "
                         "the one this model was built with")


def rope_config(raw: dict, folder: Path):
    """A transformers LlamaConfig of the draft layers, for their RoPE (legacy and new
    spellings)."""
    from transformers import LlamaConfig

    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
            "partial_rotary_factor")
    path = Path(folder) / "config.json"
    try:
        hf = LlamaConfig(**{k: raw[k] for k in keys if k in raw})
    except Exception as e:
        raise ValueError(f"{path}: bad RoPE settings: {e}") from e
    rope_type = rope_parameters(hf).get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(f"{path}: unsupported rope_type={rope_type!r}; supported: "
                         f"{', '.join(STATIC_ROPE_TYPES)}")
    return hf
