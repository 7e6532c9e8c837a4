"""A GGUF file's own quantized weights, prepared for the compiled kernels.

A model loaded from a GGUF (specdec.models.gguf_model) keeps its matrices as the file's blocks
(``BlockWeight``: dequantized on demand, bitwise gguf-py's, so bitwise the fp32 weights
transformers makes of the file). Here they are laid out matrix by matrix for ``sd_linear``
(panel pairs of 16 output rows, block by block; specdec/native/linear.c, which dequantizes in
registers exactly as gguf-py does), for float or int8 activations: ``weights="native"`` and
``"dequantized"`` give the same tokens in float, the native ones streaming the file's bytes
(SmolLM2-135M: ~96 MB against 540 MB of fp32).

A model with fp32 weights of its own beside a GGUF (an HF folder that also holds
``model.gguf``) gets the file's blocks only where they dequantize bitwise to its weights.

    panels = native_panels(model, folder / "model.gguf", "auto", torch.float32, cpu,
                           "invariant", "float")     # [(weight, Panels)], [] to fall back
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch

from specdec.models import native, q8_activations
from specdec.models.block_weight import BlockWeight
from specdec.models.gguf_blocks import BLOCK_BYTES, Blocks, dequantize
from specdec.models.native import Panels

logger = logging.getLogger("specdec")


def read_matrices(path: Path, cfg) -> dict[str, Blocks]:
    """Every matrix ``LlamaDecoder.named_matrices()`` multiplies by, as the file's blocks:
    ``layers.{i}.{qkv,o,gate_up,down}`` and ``head`` (the LM head, or the tied embedding), in
    the decoder's row order. Raises ValueError naming the file and a tensor whose type the
    kernels do not take."""
    from specdec.models.gguf_file import open_gguf
    from specdec.models.gguf_model import check_architecture, gguf_matrices

    f = open_gguf(path)
    check_architecture(f)
    mats = gguf_matrices(f, cfg)
    mats.pop("embed")
    return {name: _native_blocks(BlockWeight(parts, name, f)) for name, parts in mats.items()}


def _native_blocks(w: BlockWeight) -> Blocks:
    """``w``'s blocks as one matrix; ValueError naming it unless the kernels take their type."""
    for kind in w.kinds:
        if kind not in BLOCK_BYTES:
            raise ValueError(f"{w.file.path if w.file else 'the file'}: {w.tensor_name} is "
                             f"{kind}; native weights take {', '.join(BLOCK_BYTES)} (use "
                             "weights='dequantized')")
    return w.blocks()


def native_panels(model, gguf: Path, mode: str, dtype: torch.dtype, device: torch.device,
                  linear_kernels: str, activations: str = "float", strict: bool = True
                  ) -> list[tuple[torch.Tensor, Panels]]:
    """What ``weights=mode`` ("auto" | "native" | "dequantized") gives ``model`` (loaded from
    the folder holding ``gguf``): [] for its dequantized weights, else (weight, panels) for
    every matrix it multiplies by (its ``BlockWeight``s' blocks, or the file's checked
    bitwise against its fp32 weights), laid out for ``activations`` ("float" | "q8": specdec.models.q8_activations). "native", and "q8"
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


# per activations mode: the prepared panels, beside model.gguf in specdec's cache (or, for a
# folder elsewhere, in specdec's cache under panels/: never written beside a user's file).
# Preparing costs more than reading them back (SmolLM2 on a loaded 2-core Xeon: 26 s in
# float, 1.9 s in q8, against 0.01 s to map the cached file).
CACHE_NAMES = {"float": "native_panels.safetensors", "q8": "native_panels_q8.safetensors"}
LAYOUT = 2  # of the prepare functions' output: a cache of another layout is made again
# (2: Q4_K, Q6_K in their super-block formats)


def panel_cache(gguf: Path, activations: str) -> Path:
    """Where the panels of ``gguf`` for ``activations`` are cached."""
    from specdec.models.aliases import cache_dir

    root = cache_dir().resolve()
    folder = gguf.parent.resolve()
    if not folder.is_relative_to(root):
        digest = hashlib.blake2b(str(gguf.resolve()).encode(), digest_size=8).hexdigest()
        folder = root / "panels" / digest
    return folder / CACHE_NAMES[activations]


def _cached_panels(model, gguf: Path, activations: str = "float"
                   ) -> list[tuple[torch.Tensor, Panels]]:
    """The panels of every matrix, from the cache (``panel_cache``) when it was made from this
    very file (size, mtime) and layout, else prepared (from the model's ``BlockWeight``s, or
    from the file's blocks checked bitwise against its fp32 weights) and cached (atomically;
    a folder that cannot be written is only logged). The file's pages the preparation read
    are then dropped from memory (the panels hold the values)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    params = model.named_matrices()
    stat = gguf.stat()
    key = f"{LAYOUT}:{stat.st_size}:{stat.st_mtime_ns}"
    cache = panel_cache(gguf, activations)
    if cache.exists():
        with safe_open(str(cache), "pt") as f:
            meta = f.metadata() or {}
        if meta.get("key") == key and set(params) <= set(meta):
            tensors = load_file(cache)
            return [(params[n], Panels(tensors[n], *map(int, meta[n].split(":"))))
                    for n in params]
    if all(isinstance(w, BlockWeight) for w in params.values()):
        make = q8_activations.preparer(activations)
        out = [(w, make(_native_blocks(w))) for w in params.values()]
        for f in {id(w.file): w.file for w in params.values() if w.file is not None}.values():
            f.release_pages()
    else:
        out = _checked_panels(params, read_matrices(gguf, model.cfg), activations)
    meta = {"key": key, **{n: f"{p.out_features}:{p.in_features}:{p.fmt}:{p.panels}"
                           for n, (_, p) in zip(params, out)}}
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
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
