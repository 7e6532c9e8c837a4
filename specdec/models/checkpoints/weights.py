"""A safetensors checkpoint's matrices on their own bytes, or quantized into GGUF blocks at load.

Without this a checkpoint's matrices are copied into the decoder's parameters in its dtype
(float32 on a CPU): a bf16 checkpoint held and streamed at twice its bytes. Here, for a model
computing in float32 on the CPU, each matrix the decoder multiplies by becomes a
``BlockWeight`` over the checkpoint's memory-mapped bytes (specdec.models.checkpoints.safetensors_file):

* bf16 / fp16 matrices stay as they are stored (parts "BF16" / "F16"); the kernels get panels
  in that dtype (``Kernels.prepare``: 2 bytes a weight) and compute in float32, so the model
  is exactly the float32 model made from the same weights (the upcast is exact). The token
  embedding stays in the file too: a lookup upcasts only the rows it reads.
* with ``quantize`` ("q8_0" | "q4_k", specdec.models.checkpoints.quantize) every matrix is quantized as
  it is read into the blocks a GGUF would hold, and runs as a GGUF's does (float or q8
  activations). A tied embedding is quantized with the LM head it is (one matrix, one set of
  numbers); an untied one stays in the file's dtype. The blocks are cached and mapped back
  from the cache (specdec.models.checkpoints.quantized_cache), so a start keeps only their panels.
* anything else (an fp32 checkpoint, a fused matrix whose parts differ in dtype) is copied
  into the parameters in float32, as before.

Norms and biases are small: float32 copies.

    files = open_checkpoint(paths)
    put_checkpoint_weights(model, files, quantize=None)      # BlockWeights, logged
    adopted = checkpoint_panels(model, "auto", "float")     # [(weight, Panels)] for the kernels
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from specdec import native
from specdec.models.checkpoints import quantized_cache
from specdec.models.checkpoints.quantize import kind_for, quantize_matrix
from specdec.models.checkpoints.safetensors_file import CheckpointFiles
from specdec.models.gguf import repack
from specdec.models.gguf.block_weight import BlockWeight, Part
from specdec.models.gguf.blocks import Blocks
from specdec.models.gguf.types import TYPES
from specdec.native import Panels

logger = logging.getLogger("specdec")
HALF = {"BF16": torch.bfloat16, "F16": torch.float16}  # stored dtypes kept as they are


def matrix_names(cfg) -> dict[str, list[tuple[str, tuple[int, int]]]]:
    """The decoder's matrices (``embed``, ``head`` unless tied, ``layers.{i}.{qkv,o,gate_up,
    down}``, or for a mixture of experts ``layers.{i}.{qkv,o}`` and ``expert_matrix_names``)
    as their HF tensors' (name, shape), in the fused row order."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    out = {"embed": [("model.embed_tokens.weight", (cfg.vocab_size, h))]}
    if not cfg.tie_word_embeddings:
        out["head"] = [("lm_head.weight", (cfg.vocab_size, h))]
    for i in range(cfg.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out[f"layers.{i}.qkv"] = [(a + "q_proj.weight", (q, h)), (a + "k_proj.weight", (kv, h)),
                                  (a + "v_proj.weight", (kv, h))]
        out[f"layers.{i}.o"] = [(a + "o_proj.weight", (h, q))]
        if cfg.is_moe:
            out.update({f"layers.{i}.{n}": parts
                        for n, parts in expert_matrix_names(cfg, i).items()})
            continue
        out[f"layers.{i}.gate_up"] = [(m + "gate_proj.weight", (inter, h)),
                                      (m + "up_proj.weight", (inter, h))]
        out[f"layers.{i}.down"] = [(m + "down_proj.weight", (h, inter))]
    return out


# the HF names of an expert's gate / up / down projections, by family
EXPERT_PROJECTIONS = {"mixtral": ("w1", "w3", "w2")}
QWEN_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def expert_matrix_names(cfg, i: int) -> dict[str, list[tuple[str, tuple[int, int]]]]:
    """Layer ``i``'s mixture-of-experts matrices (``MoEMLP.named_matrices``: ``router``,
    ``experts.{j}.{gate_up,down}``, ``shared.{gate_up,down}``, ``shared_gate``) as their HF
    tensors' (name, shape), gate rows before up rows. transformers' names: qwen3_moe /
    qwen2_moe ``mlp.gate`` (the router), ``mlp.experts.{j}.{gate,up,down}_proj``, qwen2_moe's
    ``mlp.shared_expert.{gate,up,down}_proj`` and ``mlp.shared_expert_gate``; mixtral
    ``block_sparse_moe.gate``, ``block_sparse_moe.experts.{j}.w1`` (gate) / ``w3`` (up) /
    ``w2`` (down)."""
    h, width = cfg.hidden_size, cfg.moe_intermediate_size
    m = f"model.layers.{i}." + ("block_sparse_moe." if cfg.model_type == "mixtral" else "mlp.")
    gate, up, down = EXPERT_PROJECTIONS.get(cfg.model_type, QWEN_PROJECTIONS)
    out = {"router": [(m + "gate.weight", (cfg.num_experts, h))]}
    for j in range(cfg.num_experts):
        e = f"{m}experts.{j}."
        out[f"experts.{j}.gate_up"] = [(e + gate + ".weight", (width, h)),
                                       (e + up + ".weight", (width, h))]
        out[f"experts.{j}.down"] = [(e + down + ".weight", (h, width))]
    shared = cfg.shared_expert_intermediate_size
    if shared:
        e = m + "shared_expert."
        out["shared.gate_up"] = [(e + "gate_proj.weight", (shared, h)),
                                 (e + "up_proj.weight", (shared, h))]
        out["shared.down"] = [(e + "down_proj.weight", (h, shared))]
        out["shared_gate"] = [(m + "shared_expert_gate.weight", (1, h))]
    return out


def kept_in_float(name: str, cfg) -> bool:
    """Whether ``quantize`` leaves the matrix ``name`` in the file's dtype: an untied
    embedding, and the routers (a router's logits pick the experts: llama-quantize keeps
    ``ffn_gate_inp`` in float too) and qwen2_moe's shared-expert gate."""
    if name == "embed":
        return not cfg.tie_word_embeddings
    return name.endswith((".router", ".shared_gate"))


def _tensor(files: CheckpointFiles, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    if name not in files:
        raise ValueError(f"weights are missing tensor {name!r}")
    t = files[name]
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"tensor {name}: shape {tuple(t.shape)}, expected {tuple(shape)}")
    if not t.dtype.is_floating_point:
        raise ValueError(f"tensor {name} in {files.path_of(name)} is {files.kind(name)}; "
                         "weights must be floating point")
    return t


def _matrix(files: CheckpointFiles, name: str, parts: list, quantized: Quantized | None):
    """One decoder matrix: a BlockWeight (of ``quantized`` blocks, or the stored bf16 / fp16
    bytes), else a float32 tensor."""
    tensors = [_tensor(files, n, shape) for n, shape in parts]
    label = f"{name} ({'|'.join(n for n, _ in parts)})"
    width = parts[0][1][1]
    if quantized is not None:
        kind = kind_for(quantized.mode, width)
        return BlockWeight([Part(Blocks(kind, quantized.rows[n], width), None, n)
                            for n, _ in parts], label, quantized.owner(files))
    kinds = {files.kind(n) for n, _ in parts}
    if len(kinds) == 1 and kinds <= set(HALF):
        kind = kinds.pop()
        return BlockWeight([Part(Blocks(kind, t.view(torch.uint8), width), None, n)
                            for (n, _), t in zip(parts, tensors)], label, files)
    return torch.cat([t.float() for t in tensors])


@dataclass
class Quantized:
    """Every quantized part's blocks: ``rows`` HF name -> [out, row bytes] uint8, mapped from
    specdec's cache (specdec.models.checkpoints.quantized_cache) or, where it could not be written, in
    memory."""
    mode: str  # "q8_0" | "q4_k"
    rows: Mapping[str, torch.Tensor]
    from_cache: bool
    seconds: float  # spent quantizing now (0 from the cache)

    def owner(self, files: CheckpointFiles) -> CheckpointFiles:
        """Whose pages to drop once the panels are made: the cache file's, else the
        checkpoint's."""
        return self.rows if isinstance(self.rows, CheckpointFiles) else files


def _quantized(files: CheckpointFiles, cfg, quantize: str) -> Quantized:
    """The blocks of every part that ``quantize`` covers (not an untied embedding): from the
    cache when it holds them all, of the shapes they must have, else quantized now (matrix by
    matrix from the mapped checkpoint) and cached."""
    parts = {n: (shape, kind_for(quantize, shape[1])) for name, ps in matrix_names(cfg).items()
             if not kept_in_float(name, cfg) for n, shape in ps}

    def row_shape(shape, kind) -> tuple[int, int]:
        t = TYPES[kind]
        return shape[0], shape[1] // t.width * t.nbytes

    cached = quantized_cache.read(files, quantize)
    if cached is not None and all(n in cached and cached.kind(n) == "U8"
                                  and tuple(cached[n].shape) == row_shape(*v)
                                  for n, v in parts.items()):
        return Quantized(quantize, cached, True, 0.0)
    start, rows = time.perf_counter(), {}
    for n, (shape, kind) in parts.items():
        try:
            rows[n] = quantize_matrix(_tensor(files, n, shape), kind).rows
        except ValueError as e:
            raise ValueError(f"tensor {n} in {files.path_of(n)}: {e}") from e
        files.release_pages()
    seconds = time.perf_counter() - start
    written = quantized_cache.write(files, quantize, rows)
    return Quantized(quantize, rows if written is None else written, False, seconds)


def put_checkpoint_weights(model, files: CheckpointFiles, quantize: str | None = None) -> None:
    """Give ``model`` (a float32 LlamaDecoder on the CPU) the checkpoint's weights: matrices as
    the module docstring says, norms and biases as float32 copies. ValueError names a missing
    tensor, a wrong shape, a non-float one, or a matrix that cannot be quantized."""
    cfg = model.cfg
    assert model.final_norm.dtype == torch.float32 and model.final_norm.device.type == "cpu"
    kept = {}
    blocks = None if quantize is None else _quantized(files, cfg, quantize)
    for name, parts in matrix_names(cfg).items():
        quantized = None if kept_in_float(name, cfg) else blocks
        kept[name] = w = _matrix(files, name, parts, quantized)
        _set(*model.owner(name), w)
    _put_vectors(model, files)
    files.release_pages()  # what the checks and the quantizer read
    trim_heap()  # the quantizer's float32 chunks
    _log(kept, files, blocks)


def _set(module, attr: str, value: torch.Tensor) -> None:
    if isinstance(value, BlockWeight):
        setattr(module, attr, nn.Parameter(value, requires_grad=False))
    else:
        with torch.no_grad():
            getattr(module, attr).copy_(value)


def _put_vectors(model, files: CheckpointFiles) -> None:
    cfg = model.cfg

    def put(param, name: str, shape: tuple[int, ...]) -> None:
        with torch.no_grad():
            param.copy_(_tensor(files, name, shape).float())

    h, d = cfg.hidden_size, cfg.head_dim
    put(model.final_norm, "model.norm.weight", (h,))
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        put(layer.input_norm, p + "input_layernorm.weight", (h,))
        put(layer.post_attn_norm, p + "post_attention_layernorm.weight", (h,))
        if cfg.attention_bias:
            bias = [_tensor(files, p + f"self_attn.{x}_proj.bias", (n,)).float()
                    for x, n in (("q", cfg.q_size), ("k", cfg.kv_size), ("v", cfg.kv_size))]
            with torch.no_grad():
                layer.qkv_bias.copy_(torch.cat(bias))
        if cfg.qk_norm:
            put(layer.q_norm, p + "self_attn.q_norm.weight", (d,))
            put(layer.k_norm, p + "self_attn.k_norm.weight", (d,))


def _log(kept: dict, files: CheckpointFiles, source: Quantized | None) -> None:
    blocks = {n: w for n, w in kept.items() if isinstance(w, BlockWeight)}
    if not blocks:
        return
    quantized = {n: w for n, w in blocks.items() if not set(w.kinds) <= set(HALF)}
    own = {n: w for n, w in blocks.items() if n not in quantized}
    copied = [n for n in kept if n not in blocks]
    said = []
    if quantized:
        kinds = "/".join(sorted({k for w in quantized.values() for k in w.kinds}))
        how = ("read from the cache" if source.from_cache else
               f"quantized at load in {source.seconds:.1f} s")
        said.append(f"{len(quantized)} {how} (quantize={source.mode!r}) into {kinds}, "
                    f"{sum(w.stored_bytes for w in quantized.values()) / 1e6:.0f} MB")
    if own:
        kinds = "/".join(sorted({k for w in own.values() for k in w.kinds}))
        said.append(f"{len(own)} kept as the file's {kinds} (no float32 copy; computed in "
                    f"float32), {sum(w.stored_bytes for w in own.values()) / 1e6:.0f} MB")
    if copied:
        said.append(f"{len(copied)} copied into float32")
    logger.info("weights: matrices of %s: %s", files.files[0].path.parent, "; ".join(said))
    mixed = [w.tensor_name for w in quantized.values()
             if source.mode == "q4_k" and "Q8_0" in w.kinds]
    if mixed:
        logger.info("weights: %d matrices are Q8_0, not Q4_K (inputs not a multiple of 256), "
                    "e.g. %s", len(mixed), mixed[0])


def from_checkpoint(model) -> bool:
    """Whether ``model``'s matrices are a checkpoint's own bytes or blocks quantized from it
    (put_checkpoint_weights), rather than a GGUF's blocks or plain tensors."""
    return any(isinstance(w, BlockWeight) and isinstance(w.file, CheckpointFiles)
               for w in model.matrices())


def checkpoint_panels(model, mode: str, activations: str, reason: str | None = None
                      ) -> list[tuple[torch.Tensor, Panels]]:
    """(weight, panels) for every BlockWeight matrix of ``model`` (from_checkpoint), laid out
    for ``activations`` ("float" | "q8"): bf16 / fp16 bytes as float panels of their dtype,
    quantized blocks as a GGUF's. ``reason``: why the compiled kernels cannot run here (None:
    they can). Where they cannot, or "q8" meets float bytes: ValueError for ``mode`` "native",
    "q8" or quantized blocks; else [] and a log line (the caller dequantizes them)."""
    weights = list({w.key: w for w in model.matrices() if isinstance(w, BlockWeight)}.values())
    quantized = any(k not in HALF for w in weights for k in w.kinds)
    if reason is None and activations == "q8" and not quantized:
        reason = ("a bf16 / fp16 checkpoint's matrices are floats; activations='q8' needs "
                  "blocks (quantize='q8_0' or 'q4_k')")
    if reason is not None:
        if mode == "native" or activations == "q8" or quantized:
            asked = ("activations='q8'" if activations == "q8" else "quantize" if quantized
                     else "weights='native'")
            raise ValueError(f"{asked} cannot run here: {reason}")
        logger.info("weights: float32 copies (the checkpoint's own bytes: %s)", reason)
        return []
    make = repack.preparer(activations)
    out = []
    for w in weights:
        kinds = w.kinds
        out.append((w, half_panels(w) if kinds[0] in HALF else make(w.blocks())))
        w.file.release_pages()  # the panels hold the values now: one matrix's pages at a time
    trim_heap()
    return out


def half_panels(w: BlockWeight) -> Panels:
    """``native.Kernels.prepare`` of a bf16 / fp16 BlockWeight, its parts copied straight from
    the file into the padded rows (no fused copy of the matrix first)."""
    out, inp = w.shape
    p = 2 * -(-out // (2 * native.PANEL))
    padded = torch.zeros(p * native.PANEL, inp, dtype=HALF[w.kinds[0]])
    row = 0
    for part in w.parts:
        rows = part.ordered_rows()
        padded[row:row + rows.shape[0]] = rows.view(padded.dtype)
        row += rows.shape[0]
    panels = padded.view(p, native.PANEL, inp).transpose(1, 2).contiguous()
    return Panels(panels, out, inp, native.FORMATS[padded.dtype], p)


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; a no-op where
    there is none): preparing leaves freed copies of matrix size in the heap, ~half the
    panels' bytes of resident memory that nothing uses."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)
