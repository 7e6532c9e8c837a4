"""The tensor-parallel plan of a model: which sizes N work, and which rows / columns of each
matrix rank r holds -- checked from the ModelConfig alone, before any process starts.

Megatron-style split of a Llama-family layer over N ranks:

- column-parallel (each rank some output rows, no communication): q (its query heads), k and v
  (its KV heads), gate and up (its share of the MLP width);
- row-parallel (each rank some input columns, then an all-reduce of the partial sums): o (the
  columns of its query heads), down (the columns of its MLP share).

Mixture-of-experts layers (qwen3_moe, mixtral, qwen2_moe) split every expert by its width, as
the dense MLP: each rank holds every expert's gate and up rows of its share of the expert width
(``expert_rows``; ``moe_intermediate_size``, mixtral's ``intermediate_size``) and down's matching
columns; qwen2_moe's shared expert is split the same way over its own width (``shared_rows``);
the router and the shared expert's gate are replicated (every rank routes every row the same
way). The layer's output (routed experts plus shared expert) is one partial sum a rank, reduced
once before the residual add.

Rules (``plan_tensor_parallel``; every violation a ValueError naming ``tensor_parallel_size``,
the value, the model's numbers and the sizes that work):

- N divides ``num_heads`` and ``intermediate_size`` (an MoE: the experts' width and the shared
  expert's; qwen MoE families' dense ``intermediate_size`` is used by no layer and not split);
- KV heads: split when N divides ``num_kv_heads`` (rank r: heads [r kv/N, (r+1) kv/N));
  replicated when N is a multiple of them (each rank holds one, ``max(1, kv // N)``: rank r
  uses KV head ``r // (N // kv)``, the one its query heads read); any other N is refused;
- a quantized (GGUF-block) row-parallel matrix is cut along K (its input) at block boundaries:
  each rank's K share a multiple of the block size, 32 for Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0,
  256 for the K-quants (``check_row_parallel_split``; ``block_size`` maps a type name).

Index ranges are half-open ``(start, stop)`` pairs of plain ints, in the unfused HF matrices'
coordinates (q_proj's rows, o_proj's columns, ...); ``RankShard.qkv_rows`` and
``RankShard.gate_up_rows`` give them in the decoder's fused q|k|v and gate|up matrices.

Example, SmolLM2-135M (9 heads over 3 KV heads, head_dim 64, intermediate 1536) at N = 3::

    plan = plan_tensor_parallel(cfg, 3)
    r1 = plan.ranks[1]
    r1.q_heads, r1.kv_heads        # (3, 6), (1, 2): query heads 3..5 read KV head 1
    r1.q_rows, r1.k_rows           # (192, 384), (64, 128)   (v_rows = k_rows)
    r1.gate_rows, r1.up_rows       # (512, 1024), (512, 1024)
    r1.o_cols, r1.down_cols        # (192, 384), (512, 1024)
    r1.qkv_rows                    # ((192, 384), (640, 704), (832, 896)) in the fused
                                   #   [q | k | v] weight (576 + 192 + 192 rows)
    plan_tensor_parallel(cfg, 2)   # ValueError: tensor_parallel_size=2 does not divide
                                   #   num_heads=9 of this model; sizes that work: 1, 3 (...)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from specdec.models.decoder.config import ModelConfig

FIELD = "tensor_parallel_size"
# the matrices cut along K (their input); an MoE: each expert's down, the shared expert's down
ROW_PARALLEL = ("o_proj", "down_proj", "experts.down_proj", "shared_expert.down_proj")
# weights per block along K, by GGUF type (specdec.models.gguf.types: BLOCK, QK_K)
GGUF_BLOCK_SIZES = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32,
                    "Q2_K": 256, "Q3_K": 256, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256,
                    "Q8_K": 256}
UNBLOCKED = ("F32", "F16", "BF16", "F64")  # float matrices: any cut works (block size 1)

Span = tuple[int, int]  # half-open (start, stop)


def block_size(gguf_type: str) -> int:
    """Weights per block along K of a GGUF type: 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), 256 (the
    K-quants), 1 for float types (no block)."""
    name = gguf_type.upper()
    if name in UNBLOCKED:
        return 1
    if name not in GGUF_BLOCK_SIZES:
        raise ValueError(f"unknown GGUF type {gguf_type!r}; known: "
                         f"{', '.join([*GGUF_BLOCK_SIZES, *UNBLOCKED])}")
    return GGUF_BLOCK_SIZES[name]


def _check_size(tp_size) -> None:
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"{FIELD} must be an integer >= 1, got {tp_size!r}")


def _sizes(ok, upto: int) -> str:
    return ", ".join(str(n) for n in range(1, max(1, upto) + 1) if ok(n))


def row_parallel_sizes(k: int, block: int) -> list[int]:
    """The N that cut a matrix of K inputs into equal shares of whole blocks (1 always: no
    cut)."""
    return [n for n in range(1, max(1, k) + 1)
            if n == 1 or (k % n == 0 and (k // n) % block == 0)]


def check_row_parallel_split(matrix: str, k: int, tp_size: int, block: int) -> None:
    """ValueError unless ``tp_size`` ranks can each take an equal K share of ``matrix`` made of
    whole blocks of ``block`` weights (32 for Q4_0 / Q4_1 / Q5_* / Q8_0, 256 for K-quants, 1
    for float matrices). The error names the matrix, its K, the block and the sizes that
    work."""
    _check_size(tp_size)
    if block < 1:
        raise ValueError(f"block size must be >= 1, got {block}")
    if tp_size == 1:
        return
    if k % tp_size == 0 and (k // tp_size) % block == 0:
        return
    why = (f"does not divide K={k} of {matrix}" if k % tp_size else
           f"cuts K={k} of {matrix} into shares of {k // tp_size}, not a multiple of its "
           f"block size {block}")
    raise ValueError(f"{FIELD}={tp_size} {why} (a row-parallel matrix is split at block "
                     f"boundaries); sizes that work for {matrix}: "
                     f"{', '.join(map(str, row_parallel_sizes(k, block)))}")


@dataclass(frozen=True)
class RankShard:
    """What rank ``rank`` holds, as half-open (start, stop) index ranges.

    Heads: ``q_heads`` its query heads, ``kv_heads`` the KV heads it stores and reads (one,
    shared with other ranks, when the KV heads are replicated). Rows of the column-parallel
    matrices (HF layout): ``q_rows`` of q_proj, ``k_rows`` of k_proj, ``v_rows`` of v_proj,
    ``gate_rows`` of gate_proj, ``up_rows`` of up_proj. Columns of the row-parallel ones:
    ``o_cols`` of o_proj (= ``q_rows``), ``down_cols`` of down_proj (= ``gate_rows``).

    Mixture of experts: ``expert_rows`` the rank's rows of every expert's gate_proj and up_proj
    (and columns of its down_proj) out of ``expert_width``; ``shared_rows`` the same of the
    shared expert (qwen2_moe; (0, 0) without one) out of ``shared_width``. A dense model:
    (0, 0) and 0.
    """
    rank: int
    q_heads: Span
    kv_heads: Span
    q_rows: Span
    k_rows: Span
    v_rows: Span
    gate_rows: Span
    up_rows: Span
    o_cols: Span
    down_cols: Span
    q_size: int  # the full model's num_heads * head_dim (the fused matrices' offsets)
    kv_size: int  # the full model's num_kv_heads * head_dim
    intermediate_size: int
    expert_rows: Span = (0, 0)
    shared_rows: Span = (0, 0)
    expert_width: int = 0  # the full model's moe_intermediate_size (0: dense)
    shared_width: int = 0  # the full model's shared_expert_intermediate_size (0: none)

    @property
    def qkv_rows(self) -> tuple[Span, Span, Span]:
        """q, k and v row ranges inside the decoder's fused [q | k | v] weight (its rows
        q_size + 2 kv_size); concatenated, they are this rank's fused qkv shard."""
        q, kv = self.q_size, self.kv_size
        return (self.q_rows, _shift(self.k_rows, q), _shift(self.v_rows, q + kv))

    @property
    def gate_up_rows(self) -> tuple[Span, Span]:
        """gate and up row ranges inside the decoder's fused [gate | up] weight."""
        return (self.gate_rows, _shift(self.up_rows, self.intermediate_size))

    @property
    def expert_gate_up_rows(self) -> tuple[Span, Span]:
        """gate and up row ranges inside each expert's fused [gate | up] weight."""
        return (self.expert_rows, _shift(self.expert_rows, self.expert_width))

    @property
    def shared_gate_up_rows(self) -> tuple[Span, Span]:
        """gate and up row ranges inside the shared expert's fused [gate | up] weight."""
        return (self.shared_rows, _shift(self.shared_rows, self.shared_width))


def _shift(span: Span, by: int) -> Span:
    return (span[0] + by, span[1] + by)


@dataclass(frozen=True)
class TPPlan:
    """The split of one model over ``tp_size`` ranks: per-rank counts and ``ranks[r]``."""
    tp_size: int
    heads_per_rank: int
    kv_heads_per_rank: int
    kv_replicated: bool  # tp_size > num_kv_heads: ranks share KV heads (each stores one)
    intermediate_per_rank: int
    ranks: tuple[RankShard, ...]
    expert_intermediate_per_rank: int = 0  # an MoE: each expert's width a rank (0: dense)
    shared_intermediate_per_rank: int = 0  # qwen2_moe: the shared expert's width a rank

    def kv_head_of_rank(self, rank: int) -> int:
        """The first (with replication: the only) KV head rank ``rank`` uses."""
        return self.ranks[rank].kv_heads[0]


def tp_sizes_that_work(cfg: ModelConfig,
                       row_parallel_blocks: Mapping[str, int] | None = None) -> list[int]:
    """Every N for which ``plan_tensor_parallel(cfg, N, row_parallel_blocks)`` succeeds."""
    return [n for n in range(1, cfg.num_heads + 1) if not _problem(cfg, n, row_parallel_blocks)]


def _problem(cfg: ModelConfig, n: int, blocks: Mapping[str, int] | None) -> str | None:
    """Why N does not work for this model (None when it does)."""
    heads, kv, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    if heads % n:
        return f"does not divide num_heads={heads} of this model"
    if not cfg.is_moe and inter % n:
        return f"does not divide intermediate_size={inter} of this model"
    if cfg.is_moe:
        width = cfg.moe_intermediate_size
        field = "intermediate_size" if cfg.model_type == "mixtral" else "moe_intermediate_size"
        if width % n:
            return (f"does not divide {field}={width} of this model (each of its "
                    f"{cfg.num_experts} experts' width, split inside every expert)")
        shared = cfg.shared_expert_intermediate_size
        if shared % n:
            return (f"does not divide shared_expert_intermediate_size={shared} of this model "
                    f"(its shared expert's width)")
    if kv % n and n % kv:
        return (f"neither divides num_kv_heads={kv} of this model (to split them) nor is a "
                f"multiple of it (to replicate them)")
    for matrix, k in _row_parallel_k(cfg).items():
        block = (blocks or {}).get(matrix, 1)
        if n > 1 and (k % n or (k // n) % block):
            return (f"cuts K={k} of {matrix} into shares of {k / n:g}, not a multiple of its "
                    f"block size {block}")
    return None


def _row_parallel_k(cfg: ModelConfig) -> dict[str, int]:
    if not cfg.is_moe:
        return {"o_proj": cfg.num_heads * cfg.head_dim, "down_proj": cfg.intermediate_size}
    out = {"o_proj": cfg.num_heads * cfg.head_dim,
           "experts.down_proj": cfg.moe_intermediate_size}
    if cfg.shared_expert_intermediate_size:
        out["shared_expert.down_proj"] = cfg.shared_expert_intermediate_size
    return out


def _split_dense_mlp(cfg: ModelConfig) -> bool:
    """Whether ``intermediate_size`` is split: a dense model's MLP width, mixtral's experts'
    width; the qwen MoE families' is used by no layer (kept whole)."""
    return not cfg.is_moe or cfg.model_type == "mixtral"


def _widths(cfg: ModelConfig) -> str:
    if not cfg.is_moe:
        return f"intermediate_size={cfg.intermediate_size}"
    out = (f"intermediate_size={cfg.intermediate_size}" if cfg.model_type == "mixtral" else
           f"moe_intermediate_size={cfg.moe_intermediate_size}")
    if cfg.shared_expert_intermediate_size:
        out += f", shared_expert_intermediate_size={cfg.shared_expert_intermediate_size}"
    return out


def plan_tensor_parallel(cfg: ModelConfig, tp_size: int,
                         row_parallel_blocks: Mapping[str, int] | None = None) -> TPPlan:
    """The plan of ``cfg`` over ``tp_size`` ranks, or a ValueError naming the field, the value,
    the model's numbers and the sizes that work.

    ``row_parallel_blocks``: the block size of each quantized row-parallel matrix, by name
    ("o_proj", "down_proj"; an MoE's "experts.down_proj", "shared_expert.down_proj"; e.g.
    ``{"o_proj": block_size("Q4_K")}``); a matrix left out is float (any cut).
    """
    _check_size(tp_size)
    unknown = set(row_parallel_blocks or {}) - set(ROW_PARALLEL)
    if unknown:
        raise ValueError(f"row_parallel_blocks names {sorted(unknown)}; the row-parallel "
                         f"matrices are {', '.join(ROW_PARALLEL)}")
    n = tp_size
    why = _problem(cfg, n, row_parallel_blocks)
    if why is not None:
        heads, kv = cfg.num_heads, cfg.num_kv_heads
        works = ", ".join(map(str, tp_sizes_that_work(cfg, row_parallel_blocks)))
        raise ValueError(f"{FIELD}={n} {why}; sizes that work: {works} (num_heads={heads}, "
                         f"num_kv_heads={kv}, {_widths(cfg)})")
    hd, inter = cfg.head_dim, cfg.intermediate_size
    heads_per = cfg.num_heads // n
    inter_per = inter // n if _split_dense_mlp(cfg) else inter
    ew, sw = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    ew_per, sw_per = ew // n, sw // n
    replicated = n > cfg.num_kv_heads
    kv_per = max(1, cfg.num_kv_heads // n)
    ranks = []
    for r in range(n):
        kv0 = r // (n // cfg.num_kv_heads) if replicated else r * kv_per
        q_heads = (r * heads_per, (r + 1) * heads_per)
        kv_heads = (kv0, kv0 + kv_per)
        q_rows = (q_heads[0] * hd, q_heads[1] * hd)
        kv_rows = (kv_heads[0] * hd, kv_heads[1] * hd)
        mlp = ((r * inter_per, (r + 1) * inter_per) if _split_dense_mlp(cfg) else (0, inter))
        ranks.append(RankShard(rank=r, q_heads=q_heads, kv_heads=kv_heads, q_rows=q_rows,
                               k_rows=kv_rows, v_rows=kv_rows, gate_rows=mlp, up_rows=mlp,
                               o_cols=q_rows, down_cols=mlp, q_size=cfg.q_size,
                               kv_size=cfg.kv_size, intermediate_size=inter,
                               expert_rows=(r * ew_per, (r + 1) * ew_per),
                               shared_rows=(r * sw_per, (r + 1) * sw_per),
                               expert_width=ew, shared_width=sw))
    return TPPlan(tp_size=n, heads_per_rank=heads_per, kv_heads_per_rank=kv_per,
                  kv_replicated=replicated, intermediate_per_rank=inter_per,
                  ranks=tuple(ranks), expert_intermediate_per_rank=ew_per,
                  shared_intermediate_per_rank=sw_per)
