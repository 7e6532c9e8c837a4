"""Row-invariant linear of a mixture-of-experts step's (row, expert) pairs, in one launch with no
host read: ``y[p] = x[rows[p]] @ weights[experts[p]].T`` for every pair p.

A step's T rows route to k experts each: P = T * k pairs (pair p = t * k + s, s the row's s-th
expert). ``moe_layout`` sorts the pairs by expert (a stable sort: rows in increasing order within
an expert) and cuts each expert's run into tiles of BLOCK_M (16) pairs, all on the device; a
program of ``_moe_linear_kernel`` computes one tile (pairs of one expert) x one BLOCK_N column
tile x one K range exactly as ``invariant_linear``'s ``_linear_kernel`` computes a tile of rows
(the same ``tile_config(N, K, dtype)``: the same BLOCK_K steps in the same order, split-K ranges
added in range order by the same ``_add_ranges``). So a pair's result is bitwise
``invariant_linear(x[rows of its expert], weights[e])``'s row for it, whatever other pairs share
the step or its tile, and only the experts some row routed to are read.

Shapes depend on P and E only: the grid has cdiv(P, 16) + E programs along M (the most tiles
P pairs over E experts can need: each expert's last tile may be partial); those past the step's
tiles exit at once. Nothing is read to the host, so a forward that uses it keeps fixed shapes
for a given T (what a CUDA graph needs); the count of experts woken stays on the device
(``MoELayout.woken``) until someone asks for it.

What this leans on, as invariant_linear does (and cannot be tested off a GPU): the tensor-core
instruction computes element (i, j) the same way whatever tile row i sits in.

Example::

    experts = torch.tensor([[1, 3], [0, 1]], device="cuda").reshape(-1)   # T = 2, k = 2
    layout = moe_layout(experts, num_experts=4)
    rows = torch.arange(4, device="cuda") // 2                           # pair p -> row p // k
    y = invariant_moe_linear(h, gate_up, rows, layout)                   # [4, 2 * width]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specdec.kernels.invariant_matmul import (
    ADD_BLOCK,
    BLOCK_M,
    DTYPES,
    _add_ranges,
    interpreted,
    tile_config,
)


@dataclass(frozen=True)
class MoELayout:
    """The pairs of one step sorted by expert, in tiles (all device tensors, int64).

    order [P]: sorted position -> pair; tile_expert / tile_first / tile_count [cdiv(P, 16) + E]:
    each tile's expert, its first sorted position and its pairs (0: past the step's tiles);
    woken: a 0-d count of the experts some pair routed to."""

    order: torch.Tensor
    tile_expert: torch.Tensor
    tile_first: torch.Tensor
    tile_count: torch.Tensor
    woken: torch.Tensor

    @property
    def num_pairs(self) -> int:
        return self.order.numel()


def moe_layout(experts: torch.Tensor, num_experts: int) -> MoELayout:
    """The layout of pairs routed to ``experts`` [P] (int64 in 0 .. num_experts - 1): device
    ops of fixed shapes only (no host read, no size that depends on the values)."""
    if experts.dim() != 1 or experts.dtype != torch.int64:
        raise ValueError(f"moe_layout needs experts [P] int64, got {tuple(experts.shape)} "
                         f"{experts.dtype}")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"moe_layout needs num_experts >= 1, got {num_experts!r}")
    dev, e = experts.device, num_experts
    order = torch.sort(experts, stable=True).indices
    counts = torch.zeros(e, dtype=torch.int64, device=dev).scatter_add_(
        0, experts, torch.ones_like(experts))
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_end = torch.cumsum(tiles, 0)
    pair_start = torch.cumsum(counts, 0) - counts
    j = torch.arange(triton.cdiv(experts.numel(), BLOCK_M) + e, device=dev)
    owner = torch.searchsorted(tile_end, j, right=True)  # e: past the step's tiles
    valid = owner < e
    owner = owner.clamp(max=e - 1)
    local = j - (tile_end - tiles)[owner]
    count = torch.where(valid, (counts[owner] - local * BLOCK_M).clamp(0, BLOCK_M), 0)
    return MoELayout(order, owner, pair_start[owner] + local * BLOCK_M, count,
                     (counts > 0).sum())


@triton.jit(do_not_specialize=["P"])
def _moe_linear_kernel(x_ptr, w_ptr, y_ptr, rows_ptr, order_ptr, tile_expert_ptr,
                       tile_first_ptr, tile_count_ptr, P, N, K, K_SPLIT, stride_xm, stride_we,
                       stride_wn, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One tile of one expert's pairs x one N tile x one K range of K_SPLIT (``_linear_kernel``
    of invariant_matmul, its rows gathered): with one range the result into y [P, N], with
    several range pid_s's fp32 partial into y [splits, P, N]."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    count = tl.load(tile_count_ptr + pid_m)
    if count == 0:  # past the step's tiles: nothing to read
        return
    e = tl.load(tile_expert_ptr + pid_m)
    first = tl.load(tile_first_ptr + pid_m)
    i = tl.arange(0, BLOCK_M)
    m_ok = i < count
    pair = tl.load(order_ptr + first + i, mask=m_ok, other=0)
    row = tl.load(rows_ptr + pair, mask=m_ok, other=0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_start = pid_s * K_SPLIT
    k_end = tl.minimum(K, k_start + K_SPLIT)
    x_rows = x_ptr + row.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + e.to(tl.int64) * stride_we + rn.to(tl.int64)[None, :] * stride_wn
    n_ok = (rn < N)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + rk
        a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & (kk < k_end)[None, :], other=0.0)
        b = tl.load(w_cols + kk[:, None], mask=(kk < k_end)[:, None] & n_ok, other=0.0)
        if UPCAST:  # only under TRITON_INTERPRET (invariant_matmul.interpreted)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    y = (y_ptr + pid_s.to(tl.int64) * P * N + pair.to(tl.int64)[:, None] * N + rn[None, :])
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok)


def invariant_moe_linear(x: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor,
                         layout: MoELayout) -> torch.Tensor:
    """x [M, K], weights [E, N, K] (contiguous, x's dtype and device), rows [P] int64 (pair ->
    row of x), ``layout`` of the pairs' experts -> y [P, N] in x's dtype, fp32 accumulation:
    y[p] = x[rows[p]] @ weights[expert of p].T, each pair's row bitwise the same whatever the
    other pairs (see the module docstring)."""
    _check(x, weights, rows, layout)
    p, (_, n, k) = layout.num_pairs, weights.shape
    if p == 0 or n == 0 or k == 0:
        return x.new_zeros(p, n)
    emulate = x.dtype == torch.bfloat16 and interpreted(_moe_linear_kernel)
    y = torch.empty(p, n, dtype=torch.float32 if emulate else x.dtype, device=x.device)
    cfg = tile_config(n, k, weights.dtype)
    split = cfg.split_k > 1
    out = torch.empty(cfg.split_k, p, n, dtype=torch.float32, device=x.device) if split else y
    grid = (layout.tile_count.numel(), triton.cdiv(n, cfg.block_n), cfg.split_k)
    _moe_linear_kernel[grid](
        x, weights, out, rows, layout.order, layout.tile_expert, layout.tile_first,
        layout.tile_count, p, n, k, cfg.k_per_split, x.stride(0), weights.stride(0),
        weights.stride(1),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        UPCAST=emulate,
        BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps)
    if split:
        _add_ranges[(triton.cdiv(p * n, ADD_BLOCK),)](
            out, weights, y, p, n, SPLITS=cfg.split_k, HAS_BIAS=False, BLOCK=ADD_BLOCK)
    return y.to(x.dtype) if emulate else y


def invariant_moe_linear_reference(x: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor,
                                   experts: torch.Tensor) -> torch.Tensor:
    """What invariant_moe_linear computes, in plain torch (fp32 accumulation, then x's dtype)."""
    w = weights.float()[experts]  # [P, N, K]
    return torch.einsum("pk,pnk->pn", x.float()[rows], w).to(x.dtype)


def _check(x, weights, rows, layout: MoELayout) -> None:
    if x.dim() != 2 or weights.dim() != 3 or x.shape[1] != weights.shape[2]:
        raise ValueError(f"invariant_moe_linear needs x [M, K] and weights [E, N, K], got x "
                         f"{tuple(x.shape)} and weights {tuple(weights.shape)}")
    if x.dtype not in DTYPES or weights.dtype != x.dtype:
        raise ValueError(f"x and weights must share one dtype of {DTYPES}, got {x.dtype} and "
                         f"{weights.dtype}")
    if weights.device != x.device or rows.device != x.device:
        raise ValueError(f"x, weights and rows must be on one device, got {x.device}, "
                         f"{weights.device}, {rows.device}")
    if not (x.is_contiguous() and weights.is_contiguous()):
        raise ValueError("x and weights must be contiguous (call .contiguous())")
    if rows.dtype != torch.int64 or tuple(rows.shape) != (layout.num_pairs,):
        raise ValueError(f"rows must be [P={layout.num_pairs}] int64, got "
                         f"{tuple(rows.shape)} {rows.dtype}")
    if layout.tile_count.numel() != triton.cdiv(layout.num_pairs, BLOCK_M) + weights.shape[0]:
        raise ValueError(f"the layout is for {layout.tile_count.numel()} tiles, not "
                         f"{weights.shape[0]} experts' (made with another num_experts)")
