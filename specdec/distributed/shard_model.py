"""A ``LlamaDecoder`` cut down to one tensor-parallel rank's share, in place (issue #54).

``shard_decoder(model, plan, rank, reduce)`` keeps, in every layer, what rank ``rank`` of
``plan`` (``specdec.distributed.sharding.plan_tensor_parallel``) computes:

- column-parallel: its rows of the fused q|k|v weight and q|k|v bias (its query heads' q rows,
  its KV heads' k and v rows: ``RankShard.qkv_rows``) and of the fused gate|up weight (its MLP
  share: ``RankShard.gate_up_rows``);
- row-parallel: its columns of o (its query heads' inputs: ``o_cols``) and of down (its MLP
  share: ``down_cols``), whose outputs are partial sums: ``reduce`` (the group's exact
  all-reduce, ``TPGroup.all_reduce``) is installed on every layer (``DecoderLayer.reduce``)
  and sums them over the ranks before the residual add;
- a mixture of experts (``layer.moe``): every expert's fused gate|up rows of the rank's share of
  the expert width (``RankShard.expert_gate_up_rows``) and down's matching columns
  (``expert_rows``), qwen2_moe's shared expert the same over its own width (``shared_rows``);
  the router and the shared expert's gate replicated, so every rank routes every row alike
  and wakes the same experts. The layer's output (the routed experts' weighted sum plus the
  gated shared expert, linear in each expert's down output) is the rank's partial sum: the
  same ``reduce``, once, before the residual add;
- the rank's ``ModelConfig`` (``rank_config``: its heads, KV heads and MLP width), on every
  layer and as the decoder's ``cfg`` (the runner sizes attention and the KV cache from it: a
  rank's KV cache holds its KV heads only); the model's own is kept as ``model.full_cfg``,
  with ``model.tp_size`` / ``model.tp_rank``;
- unchanged: the norms (qwen3's q_norm / k_norm act per head_dim, the same on every head),
  RoPE, the embedding and the LM head. The embedding and the head are replicated: every rank
  holds them whole and computes the full logits itself. The vocab-parallel variant (each rank
  a 1/N slice of the vocab rows, the embedding's rows summed and the logits gathered across
  the ranks) saves 2 x (N-1)/N x vocab x hidden weights a rank (SmolLM2-135M: 28 of its 135 M
  parameters are the tied embedding) at the cost of two more collectives a step (an
  all-reduce of the embedded rows, an all-gather of the logits rows); it is for later.

Memory: the rank's slices are copied (contiguous, only the rank's part) and the full matrices
dropped, so a rank holds ~1/N of the layer matrices plus the replicated embedding / head.

Weights as GGUF blocks (``BlockWeight``: a GGUF file's matrices, or a checkpoint quantized or
kept in bf16 / fp16 bytes): a ``Blocks`` stores each output row's blocks along K, so a row
slice is whole rows of blocks and a column slice at a block-aligned K span
(``sharding.check_row_parallel_split``: each rank's K share a multiple of the block width, 32
for Q4_0..Q8_0, 256 for the K-quants, 1 for float rows) is each row's blocks
[k0 / width, k1 / width): both are the file's bytes, copied, so the compiled kernels run the
rank's blocks as they run a whole file's (``BlockWeight.dequantize`` of the slice is bitwise
the slice of the matrix's). A split that is not block-aligned is a ValueError naming the
sizes that work, or ``weights="dequantized"`` (float weights cut anywhere the heads allow).

Shard before any kernel is installed (``install_kernels`` prepares the weights the model holds
then): a model whose ``matmul`` is not ``F.linear`` or that has a compiled layer call is
refused. A sharded model never runs the compiled layer call (``LlamaDecoder.compiled_refusal``;
its matmuls still go through the installed kernels).

Example (each rank, in its own process, on the same folder)::

    group = TPGroup.init(rank, world_size, init_method=address, backend="gloo")
    model, cfg, _ = load_model(folder, torch.float64, "cpu", 512)
    plan = plan_tensor_parallel(cfg, world_size)
    shard_decoder(model, plan, group.rank, group.all_reduce)
    model.cfg.num_heads                   # cfg.num_heads // world_size
    out = model.forward_dense(ids)        # every rank: the same hidden states, bit for bit
    logits = model.compute_logits(out.hidden[:, -1])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specdec.distributed.sharding import (
    FIELD,
    RankShard,
    Span,
    TPPlan,
    check_row_parallel_split,
    plan_tensor_parallel,
)
from specdec.models.decoder.config import ModelConfig
from specdec.models.gguf.block_weight import BlockWeight, Part
from specdec.models.gguf.blocks import Blocks

Reduce = Callable[[torch.Tensor], torch.Tensor]
FLOAT_KINDS = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}  # bytes of one weight, width 1


def rank_config(cfg: ModelConfig, plan: TPPlan) -> ModelConfig:
    """The ModelConfig one rank of ``plan`` computes with: its query heads, its KV heads
    (one when replicated), its share of the MLP width (an MoE: of each expert's and the shared
    expert's width); everything else the model's."""
    return dataclasses.replace(cfg, num_heads=plan.heads_per_rank,
                               num_kv_heads=plan.kv_heads_per_rank,
                               intermediate_size=plan.intermediate_per_rank,
                               moe_intermediate_size=plan.expert_intermediate_per_rank,
                               shared_expert_intermediate_size=plan.shared_intermediate_per_rank)


def shard_decoder(model, plan: TPPlan, rank: int, reduce: Reduce) -> None:
    """Cut ``model`` (a ``LlamaDecoder`` as loaded, no kernels installed) down to rank
    ``rank``'s share of ``plan``, in place; install ``reduce`` (the sum over the ranks of a
    [T, hidden] partial sum, e.g. ``TPGroup.all_reduce``) on every layer. ValueError when
    the plan is not this model's, the model is sharded already or has kernels installed, or a
    GGUF-block matrix cannot be cut at the plan's K spans (see the module docstring)."""
    cfg = model.cfg
    _check(model, plan, rank)
    shard = plan.ranks[rank]
    if plan.tp_size > 1:
        _check_blocks(model, plan)
    local = rank_config(cfg, plan)
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            _shard_layer(layer, shard, local, f"layers.{i}")
            layer.reduce = reduce if plan.tp_size > 1 else None
    model.full_cfg, model.cfg = cfg, local
    model.tp_size, model.tp_rank = plan.tp_size, rank
    model.fused = None


def _check(model, plan: TPPlan, rank: int) -> None:
    if getattr(model, "tp_size", 1) != 1:
        raise ValueError(f"the model is sharded already (rank {model.tp_rank} of "
                         f"{model.tp_size}); load it again to shard it otherwise")
    if model.matmul is not F.linear or getattr(model, "fused", None) is not None:
        raise ValueError("shard the model before installing kernels on it (install_kernels "
                         "prepares the weights the model holds: the full matrices)")
    if not isinstance(plan, TPPlan):
        raise ValueError(f"plan must be a TPPlan (plan_tensor_parallel), got "
                         f"{type(plan).__name__}")
    if not 0 <= rank < plan.tp_size:
        raise ValueError(f"rank={rank} is outside 0..{plan.tp_size - 1} ({FIELD}="
                         f"{plan.tp_size})")
    cfg = model.cfg
    try:
        want = plan_tensor_parallel(cfg, plan.tp_size)
    except ValueError as e:
        raise ValueError(f"the plan is not for this model: {e}") from e
    if plan != want:
        raise ValueError(
            f"the plan ({FIELD}={plan.tp_size}, {plan.heads_per_rank} heads / "
            f"{plan.kv_heads_per_rank} KV heads / {plan.intermediate_per_rank} MLP a rank) is "
            f"not this model's (num_heads={cfg.num_heads}, num_kv_heads={cfg.num_kv_heads}, "
            f"head_dim={cfg.head_dim}, intermediate_size={cfg.intermediate_size}, "
            f"moe_intermediate_size={cfg.moe_intermediate_size}): make it "
            f"with plan_tensor_parallel(model.cfg, {plan.tp_size})")


def _check_blocks(model, plan: TPPlan) -> None:
    """ValueError unless every GGUF-block row-parallel matrix splits at whole blocks."""
    for i, layer in enumerate(model.layers):
        for name, w, k in _row_parallel(model.cfg, layer):
            if not isinstance(w, BlockWeight):
                continue
            for kind in w.kinds:
                try:
                    check_row_parallel_split(f"layers.{i}.{name} ({kind} blocks)", k,
                                             plan.tp_size, block_geometry(kind)[0])
                except ValueError as e:
                    raise ValueError(f"{e}; or load the model with weights=\"dequantized\" "
                                     f"(float weights split wherever the heads do)") from e


def _row_parallel(cfg: ModelConfig, layer) -> list[tuple[str, torch.Tensor, int]]:
    """(name, matrix, K) of a layer's row-parallel matrices: o and down, or o and every
    expert's down (and the shared expert's)."""
    out = [("o_proj", layer.o_weight, cfg.q_size)]
    if layer.moe is None:
        return out + [("down_proj", layer.down_weight, cfg.intermediate_size)]
    out += [(f"experts.{j}.down_proj", e.down_weight, cfg.moe_intermediate_size)
            for j, e in enumerate(layer.moe.experts)]
    if layer.moe.shared is not None:
        out.append(("shared_expert.down_proj", layer.moe.shared.down_weight,
                    cfg.shared_expert_intermediate_size))
    return out


def _shard_layer(layer, shard: RankShard, local: ModelConfig, name: str) -> None:
    _put(layer, "qkv_weight", take_rows(layer.qkv_weight, shard.qkv_rows, f"{name}.qkv"))
    if layer.qkv_bias is not None:
        _put(layer, "qkv_bias", take_rows(layer.qkv_bias, shard.qkv_rows, f"{name}.qkv_bias"))
    _put(layer, "o_weight", take_columns(layer.o_weight, shard.o_cols, f"{name}.o"))
    if layer.moe is None:
        _put(layer, "gate_up_weight",
             take_rows(layer.gate_up_weight, shard.gate_up_rows, f"{name}.gate_up"))
        _put(layer, "down_weight",
             take_columns(layer.down_weight, shard.down_cols, f"{name}.down"))
    else:
        moe = layer.moe
        for j, e in enumerate(moe.experts):
            _shard_expert(e, shard.expert_gate_up_rows, shard.expert_rows,
                          f"{name}.experts.{j}")
        if moe.shared is not None:
            _shard_expert(moe.shared, shard.shared_gate_up_rows, shard.shared_rows,
                          f"{name}.shared_expert")
        moe.cfg = local  # (the router and the shared expert's gate: whole on every rank)
    layer.cfg = local


def _shard_expert(e, gate_up_rows: Sequence[Span], cols: Span, name: str) -> None:
    _put(e, "gate_up_weight", take_rows(e.gate_up_weight, gate_up_rows, f"{name}.gate_up"))
    _put(e, "down_weight", take_columns(e.down_weight, cols, f"{name}.down"))


def _put(module: nn.Module, attr: str, value: torch.Tensor) -> None:
    old = getattr(module, attr)
    setattr(module, attr, nn.Parameter(value, requires_grad=old.requires_grad))


# ---------------------------------------------------------------- slices of one matrix

def take_rows(w: torch.Tensor, spans: Sequence[Span], name: str = "") -> torch.Tensor:
    """The rows ``spans`` (half-open, in order) of ``w`` [out, ...] concatenated, as a new
    tensor holding only them: a float tensor's values, a ``BlockWeight``'s blocks (its parts'
    rows, in the matrix's row order)."""
    if isinstance(w, BlockWeight):
        return _block_rows(w, spans, name)
    if len(spans) == 1:
        (a, b), = spans
        return w[a:b].clone(memory_format=torch.contiguous_format)
    return torch.cat([w[a:b] for a, b in spans])


def take_columns(w: torch.Tensor, span: Span, name: str = "") -> torch.Tensor:
    """Columns [k0, k1) of ``w`` [out, in] as a new contiguous tensor; a ``BlockWeight``'s as
    each row's blocks [k0 / width, k1 / width) (ValueError unless k0 and k1 are multiples of
    each part's block width)."""
    k0, k1 = span
    if isinstance(w, BlockWeight):
        return _block_columns(w, k0, k1, name)
    return w[:, k0:k1].clone(memory_format=torch.contiguous_format)


def block_geometry(kind: str) -> tuple[int, int]:
    """(weights per block along K, bytes per block) of a GGUF type (float types: (1, bytes
    of a weight))."""
    if kind in FLOAT_KINDS:
        return 1, FLOAT_KINDS[kind]
    from specdec.models.gguf.types import TYPES

    if kind in TYPES:
        return TYPES[kind].width, TYPES[kind].nbytes
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        return tuple(GGML_QUANT_SIZES[GGMLQuantizationType[kind]])
    except KeyError as e:
        raise ValueError(f"unknown GGUF type {kind!r}: its blocks cannot be cut") from e


def _block_rows(w: BlockWeight, spans: Sequence[Span], name: str) -> BlockWeight:
    bounds, start = [], 0  # each part's (first row, row count) in the matrix
    for p in w.parts:
        n = p.blocks.out_features if p.order is None else p.order.numel()
        bounds.append((start, n))
        start += n
    parts = []
    for a, b in spans:  # in the spans' order: the shard's row order
        for p, (first, n) in zip(w.parts, bounds):
            lo, hi = max(a, first), min(b, first + n)
            if lo >= hi:
                continue
            index = torch.arange(lo - first, hi - first)
            stored = index if p.order is None else p.order[index]
            rows = p.blocks.rows[stored]  # advanced indexing: a copy of these rows only
            parts.append(Part(Blocks(p.blocks.kind, rows, p.blocks.in_features), None, p.name))
    return BlockWeight(parts, _label(w, name), w.file)


def _block_columns(w: BlockWeight, k0: int, k1: int, name: str) -> BlockWeight:
    parts = []
    for p in w.parts:
        width, nbytes = block_geometry(p.blocks.kind)
        if k0 % width or k1 % width:
            raise ValueError(f"{name or w.tensor_name}: columns [{k0}, {k1}) are not whole "
                             f"{p.blocks.kind} blocks of {width} weights (split at block "
                             f"boundaries, or load with weights=\"dequantized\")")
        rows = p.ordered_rows()[:, k0 // width * nbytes:k1 // width * nbytes]
        parts.append(Part(Blocks(p.blocks.kind, rows.clone(memory_format=torch.contiguous_format),
                                 k1 - k0), None, p.name))
    return BlockWeight(parts, _label(w, name), w.file)


def _label(w: BlockWeight, name: str) -> str:
    return f"{w.tensor_name} [tensor-parallel shard{' ' + name if name else ''}]"
