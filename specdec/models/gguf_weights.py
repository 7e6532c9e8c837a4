"""A GGUF file's own quantized weights (Q4_1, Q8_0), prepared for the compiled kernels.

The engine's fp32 weights of a GGUF model are what transformers dequantizes from it (gguf-py:
``(d * q) + m`` for Q4_1, ``q * d`` for Q8_0, float32, two roundings). Streaming them costs
5.6x the bytes the file holds (SmolLM2-135M: 540 MB of fp32 against 96 MB of blocks), and a
one-row decode step is bound by that stream. Here the blocks are read as they are, put in the
model's matrix order (q and k rows un-permuted as transformers does, q|k|v and gate|up
concatenated, as ``LlamaDecoder`` fuses them), and laid out for ``sd_linear`` (panel pairs of 16
output rows, block by block; specdec/native/linear.c), which dequantizes in registers exactly
as gguf-py does. So a matmul over them uses bitwise the weights of the fp32 model, and its rows
are bitwise those of the fp32 panels (same fma chain per element): ``weights="native"`` and
``"dequantized"`` give the same tokens, the native ones streaming a sixth of the bytes.

    blocks = read_matrices(gguf_path, cfg)        # {"layers.0.qkv": Blocks, ..., "head": ...}
    panels = gguf_blocks.prepare(blocks["layers.0.qkv"])      # -> native.Panels (fmt Q4_1)
    gguf_blocks.dequantize(blocks["head"])                    # [out, in] float32, bitwise gguf-py's
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch

from specdec.models import native, q8_activations
from specdec.models.gguf_blocks import BLOCK_BYTES, Blocks, dequantize
from specdec.models.native import Panels

logger = logging.getLogger("specdec")


def _unpermute(n_head: int, out: int) -> torch.Tensor:
    """Row order transformers gives llama's q / k after GGUF's rope permutation (its
    ``_reverse_permute_weights``): new row r is file row index[r]."""
    return torch.arange(out).reshape(n_head, out // n_head // 2, 2).transpose(1, 2).reshape(-1)


def _cat(parts: list[Blocks]) -> Blocks:
    kinds = {p.kind for p in parts}
    if len(kinds) != 1:
        raise ValueError(f"fused matrices need one block type, got {sorted(kinds)}")
    return Blocks(parts[0].kind, torch.cat([p.rows for p in parts]), parts[0].in_features)


def read_matrices(path: Path, cfg) -> dict[str, Blocks]:
    """Every matrix ``LlamaDecoder.matrices()`` multiplies by, as the file's blocks:
    ``layers.{i}.{qkv,o,gate_up,down}`` and ``head`` (the LM head, or the tied embedding).
    Raises ValueError naming a tensor whose type the kernels do not take."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}

    def get(name: str, permute_heads: int | None = None) -> Blocks:
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"{path}: no tensor {name!r}")
        kind = t.tensor_type.name
        if kind not in BLOCK_BYTES:
            raise ValueError(f"{path}: {name} is {kind}; native weights take "
                             f"{', '.join(BLOCK_BYTES)} (use weights='dequantized')")
        rows = torch.from_numpy(np.array(t.data))  # a copy: the reader maps the file read-only
        if permute_heads is not None:
            rows = rows[_unpermute(permute_heads, rows.shape[0])]
        return Blocks(kind, rows, int(t.shape[0]))

    out = {}
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        out[f"layers.{i}.qkv"] = _cat([get(p + "attn_q.weight", cfg.num_heads),
                                       get(p + "attn_k.weight", cfg.num_kv_heads),
                                       get(p + "attn_v.weight")])
        out[f"layers.{i}.o"] = get(p + "attn_output.weight")
        out[f"layers.{i}.gate_up"] = _cat([get(p + "ffn_gate.weight"), get(p + "ffn_up.weight")])
        out[f"layers.{i}.down"] = get(p + "ffn_down.weight")
    out["head"] = get("token_embd.weight" if cfg.tie_word_embeddings else "output.weight")
    return out


def native_panels(model, gguf: Path, mode: str, dtype: torch.dtype, device: torch.device,
                  linear_kernels: str, activations: str = "float", strict: bool = True
                  ) -> list[tuple[torch.Tensor, Panels]]:
    """What ``weights=mode`` ("auto" | "native" | "dequantized") gives ``model`` (loaded from
    the folder holding ``gguf``): [] for its dequantized weights, else (weight, panels) for
    every matrix it multiplies by, each checked bitwise against the weight at load, laid out
    for ``activations`` ("float" | "q8": specdec.models.q8_activations). "native", and "q8"
    (which exists only over the blocks) unless not ``strict`` (a draft model: it may compute
    otherwise), raise ValueError saying why they cannot run; "auto" logs why and returns []."""
    if mode == "dequantized":
        return []
    reason = None
    if not gguf.exists():
        reason = "the model does not come from a GGUF file"
    elif dtype != torch.float32:
        reason = f"they compute in float32, not {str(dtype).removeprefix('torch.')}"
    elif device.type != "cpu" or linear_kernels != "invariant" or native.load() is None:
        reason = "they need the compiled CPU kernels (linear_kernels='invariant' on a CPU)"
    out = []
    if reason is None:
        try:
            out = _cached_panels(model, gguf, activations)
        except ValueError as e:
            reason = str(e)
        except Exception as e:  # a file gguf-py cannot read
            reason = f"{gguf} cannot be read as GGUF ({type(e).__name__}: {e})"
    if reason is not None:
        if mode == "native" or (activations == "q8" and strict):
            asked = "weights='native'" if mode == "native" else "activations='q8'"
            raise ValueError(f"{asked} cannot run here: {reason}")
        logger.info("weights: dequantized (native GGUF weights: %s)", reason)
    return out


# beside model.gguf, per activations mode: the checked, prepared panels
CACHE_NAMES = {"float": "native_panels.safetensors", "q8": "native_panels_q8.safetensors"}
LAYOUT = 1  # of the prepare functions' output: a cache of another layout is made again


def _cached_panels(model, gguf: Path, activations: str = "float"
                   ) -> list[tuple[torch.Tensor, Panels]]:
    """The checked panels of every matrix, from the cache beside the file when it was made from
    this very file (size, mtime) and layout, else read (gguf-py parses the whole file: ~6 s for
    SmolLM2's tokenizer fields), checked bitwise, prepared and cached (atomically; a folder
    that cannot be written is only logged)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    params = model.named_matrices()
    stat = gguf.stat()
    key = f"{LAYOUT}:{stat.st_size}:{stat.st_mtime_ns}"
    cache = gguf.parent / CACHE_NAMES[activations]
    if cache.exists():
        with safe_open(str(cache), "pt") as f:
            meta = f.metadata() or {}
        if meta.get("key") == key and set(params) <= set(meta):
            tensors = load_file(cache)
            return [(params[n], Panels(tensors[n], *map(int, meta[n].split(":"))))
                    for n in params]
    out = _checked_panels(params, read_matrices(gguf, model.cfg), activations)
    meta = {"key": key, **{n: f"{p.out_features}:{p.in_features}:{p.fmt}:{p.panels}"
                           for n, (_, p) in zip(params, out)}}
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
    try:
        save_file({n: p.data for n, (_, p) in zip(params, out)}, tmp, metadata=meta)
        os.replace(tmp, cache)
    except OSError as e:
        logger.info("weights: native panels not cached in %s (%s)", cache.parent, e)
        tmp.unlink(missing_ok=True)
    return out


def _checked_panels(params: dict[str, torch.Tensor], blocks: dict[str, Blocks],
                    activations: str = "float") -> list[tuple[torch.Tensor, Panels]]:
    """(weight, panels for ``activations``) in ``params``' order (``LlamaDecoder.
    named_matrices``); ValueError unless every matrix's blocks dequantize bitwise to its
    weight."""
    make = q8_activations.preparer(activations)
    out = []
    for name, weight in params.items():
        b = blocks[name]
        if not torch.equal(dequantize(b), weight):
            raise ValueError(f"the file's {name} blocks do not dequantize to the model's weights "
                             "bitwise (a layout this loader does not know)")
        out.append((weight, make(b)))
    return out
