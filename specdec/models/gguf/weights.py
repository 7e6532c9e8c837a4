"""A GGUF file's own quantized weights, prepared for the compiled kernels.

A model loaded from a GGUF (specdec.models.gguf.model) keeps its matrices as the file's blocks
(``BlockWeight``: dequantized on demand, bitwise gguf-py's, so bitwise the fp32 weights
transformers makes of the file). Here they are laid out matrix by matrix for ``sd_linear``
(panel pairs of 16 output rows, block by block; specdec/native/linear.c, which dequantizes in
registers exactly as gguf-py does), for float or int8 activations: ``weights="native"`` and
``"dequantized"`` give the same tokens in float, the native ones streaming the file's bytes
(SmolLM2-135M: ~96 MB against 540 MB of fp32). The panels are made at every load by the
compiled repacker (specdec.models.gguf.repack: one pass over the mapped file, ~2 GB/s on one core)
and never written to disk.

A fused matrix (q|k|v, gate|up) whose file tensors differ in type, as a Q4_K_M file's Q4_K q|k
beside its Q6_K v in some layers, is prepared in parts, one per run of a type
(``native.PanelParts``: the kernels compute each into its own output columns); every part but
the last must be a multiple of 16 rows, else "native" refuses and "auto" dequantizes.

A model with fp32 weights of its own beside a GGUF (an HF folder that also holds
``model.gguf``) gets the file's blocks only where they dequantize bitwise to its weights.

    panels = native_panels(model, folder / "model.gguf", "auto", torch.float32, cpu,
                           "invariant", "float")     # [(weight, Panels | PanelParts)], [] to fall back
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

from specdec import native
from specdec.models.gguf import repack
from specdec.models.gguf.block_weight import BlockWeight
from specdec.models.gguf.blocks import BLOCK_BYTES, Blocks, dequantize
from specdec.native import PanelParts, Panels

logger = logging.getLogger("specdec")


# the float types of a GGUF's matrices (the kernels run them as float panels, not blocks)
FLOAT_KINDS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# matrices llama.cpp keeps in float in every file (llama-quantize never quantizes an MoE
# router, nor qwen2moe's one-row shared-expert gate): float panels of the file's values
FLOAT_KEPT = (".router", ".shared_gate")


def float_kept(name: str, w: BlockWeight) -> bool:
    """Whether the matrix ``name`` runs as float panels: a router (or shared-expert gate) the
    file stores in a float type."""
    return name.endswith(FLOAT_KEPT) and set(w.kinds) <= set(FLOAT_KINDS)


def float_panels(w: BlockWeight) -> Panels:
    """The float kernels' panels of a float BlockWeight: an F16 / BF16 one in its own dtype
    (2 bytes a weight, computed in float32: exact), others in float32; bitwise its values."""
    kinds = w.kinds
    if len(kinds) == 1 and kinds[0] in ("F16", "BF16"):
        rows = [p.ordered_rows() for p in w.parts]
        values = (rows[0] if len(rows) == 1 else torch.cat(rows)).contiguous()
        return native.load().prepare(values.view(FLOAT_KINDS[kinds[0]]).reshape(w.shape))
    return native.load().prepare(w.dequantize())


def read_matrices(path: Path, cfg) -> dict[str, list[Blocks]]:
    """Every matrix ``LlamaDecoder.named_matrices()`` multiplies by, as the file's blocks
    (``native_runs``: one ``Blocks`` per run of parts of one type): ``layers.{i}.{qkv,o,
    gate_up,down}`` (a mixture of experts: its experts' gate_up and down) and ``head`` (the LM
    head, or the tied embedding), in the decoder's row order; not a float router
    (``float_kept``: the model's own float32 weights run). Raises ValueError naming the file
    and a tensor the kernels cannot run."""
    from specdec.models.gguf.file import open_gguf
    from specdec.models.gguf.model import check_architecture, gguf_matrices

    f = open_gguf(path)
    check_architecture(f)
    mats = gguf_matrices(f, cfg)
    mats.pop("embed")
    weights = {name: BlockWeight(parts, f"{name} ({'|'.join(p.name for p in parts)})", f)
               for name, parts in mats.items()}
    return {name: native_runs(w) for name, w in weights.items() if not float_kept(name, w)}


def native_runs(w: BlockWeight) -> list[Blocks]:
    """``w``'s blocks as the kernels take them: one ``Blocks`` per run of its parts of one type
    (``BlockWeight.runs``; one for a matrix of one type). ValueError naming it unless the
    kernels take every type and every run but the last is whole pairs of 8-row panels (a
    multiple of 16 rows: each part's output columns start where its rows do)."""
    where = w.file.path if w.file else "the file"
    for kind in w.kinds:
        if kind not in BLOCK_BYTES:
            raise ValueError(f"{where}: {w.tensor_name} is {kind}; native weights take "
                             f"{', '.join(BLOCK_BYTES)} (use weights='dequantized')")
    runs = w.runs()
    for b in runs[:-1]:
        if b.out_features % (2 * native.PANEL):
            raise ValueError(
                f"{where}: {w.tensor_name} fuses tensors of types {'+'.join(r.kind for r in runs)}"
                f"; the kernels run such a matrix in parts, one per type, each but the last a "
                f"multiple of {2 * native.PANEL} rows, but its {b.kind} part has "
                f"{b.out_features} rows (use weights='dequantized')")
    return runs


def prepare_runs(runs: list[Blocks], activations: str = "float") -> Panels | PanelParts:
    """The panels of a matrix given as ``native_runs``, laid out for ``activations`` ("float" |
    "q8"; by the compiled repacker, specdec.models.gguf.repack): one run's ``Panels``, or a
    ``PanelParts`` of one per run."""
    make = repack.preparer(activations)
    panels = [make(b) for b in runs]
    return panels[0] if len(panels) == 1 else PanelParts(tuple(panels))


def native_panels(model, gguf: Path, mode: str, dtype: torch.dtype, device: torch.device,
                  linear_kernels: str, activations: str = "float", strict: bool = True
                  ) -> list[tuple[torch.Tensor, Panels | PanelParts]]:
    """What ``weights=mode`` ("auto" | "native" | "dequantized") gives ``model`` (loaded from
    the folder holding ``gguf``): [] for its dequantized weights, else (weight, panels) for
    every matrix it multiplies by (its ``BlockWeight``s' blocks, or the file's checked
    bitwise against its fp32 weights), laid out for ``activations`` ("float" | "q8": specdec.models.gguf.q8_activations). "native", and "q8"
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
            out = _made_panels(model, gguf, activations)
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


# what earlier versions cached per activations mode, beside model.gguf in specdec's cache or
# under its panels/ folder: a copy of the panels, the size of the file, per mode. Panels are
# made at load now (specdec.models.gguf.repack); a load removes what an earlier version left for its
# file (``remove_legacy_panels``).
LEGACY_CACHE_NAMES = {"float": "native_panels.safetensors", "q8": "native_panels_q8.safetensors"}


def remove_legacy_panels(gguf: Path) -> None:
    """Delete the panel caches older versions wrote for ``gguf`` (only ever under specdec's
    cache: never a file beside a user's own)."""
    from specdec.models.aliases import cache_dir

    root = cache_dir().resolve()
    digest = hashlib.blake2b(str(gguf.resolve()).encode(), digest_size=8).hexdigest()
    folders = [root / "panels" / digest]
    if gguf.parent.resolve().is_relative_to(root):
        folders.append(gguf.parent.resolve())
    for folder in folders:
        for name in LEGACY_CACHE_NAMES.values():
            try:
                (folder / name).unlink(missing_ok=True)
            except OSError as e:  # a read-only cache: nothing to reclaim, nothing read
                logger.info("weights: could not remove %s (%s)", folder / name, e)
    try:
        folders[0].rmdir()
    except OSError:  # absent, or not empty
        pass


def _made_panels(model, gguf: Path, activations: str = "float"
                 ) -> list[tuple[torch.Tensor, Panels | PanelParts]]:
    """The panels of every matrix, made now (from the model's ``BlockWeight``s, or from the
    file's blocks checked bitwise against its fp32 weights); nothing is written. The file's
    pages the preparation read are dropped from memory matrix by matrix (the panels hold the
    values)."""
    remove_legacy_panels(gguf)
    params = model.named_matrices()
    if not all(isinstance(w, BlockWeight) for w in params.values()):
        return _checked_panels(params, read_matrices(gguf, model.cfg), activations)
    out = []
    for name, w in params.items():  # matrix by matrix, the file's pages dropped after each:
        panels = (float_panels(w) if float_kept(name, w)  # peak = panels + one matrix's pages,
                  else prepare_runs(native_runs(w), activations))  # not panels + the file
        out.append((w, panels))
        if w.file is not None:
            w.file.release_pages()
    return out


def _checked_panels(params: dict[str, torch.Tensor], blocks: dict[str, list[Blocks]],
                    activations: str = "float") -> list[tuple[torch.Tensor, Panels | PanelParts]]:
    """(weight, panels for ``activations``) in ``params``' order (``LlamaDecoder.
    named_matrices``); ``blocks``: each matrix's ``native_runs``. ValueError unless every
    matrix's blocks dequantize bitwise to its weight."""
    out = []
    for name, weight in params.items():
        if name.endswith(FLOAT_KEPT) and name not in blocks:  # a float router: its own weight
            continue
        runs = blocks[name]
        values = [dequantize(b) for b in runs]
        if not torch.equal(values[0] if len(values) == 1 else torch.cat(values), weight):
            raise ValueError(f"the file's {name} blocks do not dequantize to the model's weights "
                             "bitwise (a layout this loader does not know)")
        out.append((weight, prepare_runs(runs, activations)))
    return out
