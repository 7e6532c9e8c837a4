"""Row-invariant linear layer: ``y = x @ weight.T + bias`` with a reduction order that does not
depend on how many rows the call has.

cuBLAS picks a kernel (GEMV for one row, a GEMM tile, split-K) by the shape of the whole call, so
a decode step's row and the same row inside a verification step of 5 rows can differ in the last
bf16 bit; under greedy speculation that flips an argmax now and then. Here every output element
(i, j) is computed the same way for any M:

- BLOCK_M is 16 for every call (a single decode row is the first row of a zero-padded 16-row
  tile); BLOCK_N and BLOCK_K are functions of (N, K, dtype) only (``tile_config``).
- K is cut into ``split_k`` equal ranges fixed per weight (``tile_config``: never from M). A
  program walks its range from its start in BLOCK_K steps, in order, ``acc += tl.dot(a, b)`` in
  fp32 (masked lanes load 0 and add exactly 0). With one range it stores the result; with more,
  each range's fp32 partial goes to a workspace and a second kernel adds the partials of
  element (i, j) in range order (0, 1, ...), then the bias: the same operands in the same order
  for any M. The split is what brings a decode step's GEMV to the memory bound on a narrow
  weight: SmolLM2's o_proj (576 x 576) has 36 column tiles, 3 ranges make 108 programs for a
  132-SM GPU, and its down_proj walks 6 K-steps a program instead of 24.
- fp32 inputs use ``input_precision="ieee"`` (not TF32).

What this leans on, and cannot be tested off a GPU: the tensor-core instruction computes
element (i, j) the same way whatever tile row i sits in (Triton's batch-invariant matmuls rely
on the same property).

Example::

    x = torch.randn(5, 64, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(48, 64, dtype=torch.bfloat16, device="cuda")
    y = invariant_linear(x, w)                    # [5, 48] bf16
    assert torch.equal(y[2:3], invariant_linear(x[2:3], w))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK_M = 16  # fixed for every call: the per-element instruction sequence must not depend on M
# Programs a decode step (M <= 16) should have at least, so that a memory-bound GEMV keeps the
# GPU's ~132 SMs (H100 / H200) busy: BLOCK_N shrinks until cdiv(N, BLOCK_N) reaches it
TARGET_PROGRAMS = 128


MIN_STEPS_PER_SPLIT = 2  # BLOCK_K steps a K range has at least: fewer and the workspace dominates


@dataclass(frozen=True)
class TileConfig:
    block_n: int
    block_k: int
    num_warps: int
    split_k: int = 1  # K ranges, each summed by its own programs, added in range order
    k_per_split: int = 0  # elements of K a range covers (whole block_k steps)


def tile_config(n: int, k: int, dtype: torch.dtype) -> TileConfig:
    """The tile for a weight [n, k] of ``dtype``: never a function of M (the row count).

    BLOCK_N is 64 when the weight has enough columns for TARGET_PROGRAMS programs, else 32, else
    16 (tl.dot's smallest N): at decode, M is one tile, so the grid is cdiv(N, BLOCK_N) programs
    and a narrow N with 64-wide tiles would leave most SMs idle. Where even 16-wide tiles give
    fewer than TARGET_PROGRAMS, K is split into equal ranges (whole BLOCK_K steps, at least
    MIN_STEPS_PER_SPLIT each) until the programs reach it. BLOCK_K is 64 (128 bytes of a bf16
    row: one full cache line per row per step); ``dtype`` does not change it today but may,
    since it is fixed per weight. 4 warps (Triton's default).

    Example: SmolLM2-135M's o_proj [576, 576] -> 16-wide tiles, 36 of them; 9 K-steps in 3
    ranges of 3, 108 programs; its down_proj [576, 1536]: 24 K-steps in 4 ranges of 6, 144
    programs; a vocab-sized head [49152, 576]: 768 tiles of 64, one range.
    """
    for block_n in (64, 32):
        if triton.cdiv(n, block_n) >= TARGET_PROGRAMS:
            break
    else:
        block_n = 16
    block_k = 64
    tiles, steps = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    split = max(1, min(triton.cdiv(TARGET_PROGRAMS, tiles), steps // MIN_STEPS_PER_SPLIT))
    per_split = triton.cdiv(steps, split)
    split = triton.cdiv(steps, per_split)  # equal ranges: none left empty
    return TileConfig(block_n=block_n, block_k=block_k, num_warps=4, split_k=split,
                      k_per_split=per_split * block_k)


# M is not specialized (Triton would compile a separate variant for M == 1 and for M % 16 == 0):
# one compiled kernel for every row count, so "the same instructions" is literal
@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn,
                   stride_ym, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                   UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """One (M tile, N tile, K range of K_SPLIT) of x @ w.T: with one range the result (+ bias)
    into y [M, N]; with several, range pid_s's fp32 partial into y [splits, M, N]
    (``_add_ranges`` adds them)."""
    # M tiles on axis 0: consecutive programs share one weight tile (L2 reuse at prefill)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_start = pid_s * K_SPLIT
    k_end = tl.minimum(K, k_start + K_SPLIT)
    # 64-bit row offsets: a vocab-sized weight has more than 2**31 elements in some models
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
    m_ok = (rm < M)[:, None]
    n_ok = (rn < N)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + rk
        a = tl.load(x_rows + kk[None, :], mask=m_ok & (kk < k_end)[None, :], other=0.0)
        b = tl.load(w_cols + kk[:, None], mask=(kk < k_end)[:, None] & n_ok, other=0.0)
        if UPCAST:  # only under TRITON_INTERPRET: its tl.dot multiplies bf16 bit patterns
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + pid_s.to(tl.int64) * M * N + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok & n_ok)


@triton.jit(do_not_specialize=["M"])
def _add_ranges(part_ptr, b_ptr, y_ptr, M, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                BLOCK: tl.constexpr):
    """y[i, j] = ((part[0, i, j] + part[1, i, j]) + ...) + bias[j]: the K ranges' fp32 partials
    added in range order, one element per lane (no lane sees another row)."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < M * N
    acc = tl.load(part_ptr + idx, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(part_ptr + s * M * N + idx, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + idx % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + idx, acc.to(y_ptr.dtype.element_ty), mask=ok)


ADD_BLOCK = 1024  # elements a program of _add_ranges adds (a function of nothing but this)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T + bias [N] -> y [M, N] in x's dtype, fp32 accumulation.

    x, weight (and bias) share one dtype of DTYPES and one device; x and weight are contiguous.
    Row i of the result is bitwise the same for any M and any other rows beside it.
    """
    _check(x, weight, bias)
    m, k = x.shape
    n = weight.shape[0]
    if m == 0 or n == 0 or k == 0:  # k == 0: an empty sum, what the kernel would give too
        y = x.new_zeros(m, n)
        return y if bias is None or m == 0 else y.copy_(bias.expand(m, n))
    emulate = x.dtype == torch.bfloat16 and interpreted(_linear_kernel)
    # under the interpreter bf16 results come back in fp32 and torch rounds them (RTNE, as the
    # GPU's cast does; the interpreter's own fp32 -> bf16 cast truncates)
    y = torch.empty(m, n, dtype=torch.float32 if emulate else x.dtype, device=x.device)
    cfg = tile_config(n, k, weight.dtype)
    split = cfg.split_k > 1
    # with K ranges, the kernel writes each range's fp32 partial, and the bias comes after
    out = torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device) if split else y
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, cfg.block_n), cfg.split_k)
    _linear_kernel[grid](
        x, weight, bias if bias is not None else weight, out, m, n, k, cfg.k_per_split,
        x.stride(0), weight.stride(0), n,
        HAS_BIAS=bias is not None and not split,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # tf32: ignored for 16-bit
        UPCAST=emulate,
        BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps)
    if split:
        _add_ranges[(triton.cdiv(m * n, ADD_BLOCK),)](
            out, bias if bias is not None else weight, y, m, n, SPLITS=cfg.split_k,
            HAS_BIAS=bias is not None, BLOCK=ADD_BLOCK)
    return y.to(x.dtype) if emulate else y


def interpreted(kernel) -> bool:
    """Whether ``kernel`` runs under Triton's CPU interpreter (``TRITON_INTERPRET=1`` when the
    module was imported). The interpreter keeps bf16 as uint16 bit patterns and its ``tl.dot``
    multiplies those (triton-lang/triton#11584, "not supported yet"), so the kernels upcast bf16
    dot operands there (products of bf16 values are exact in fp32, so the sums are what the
    GPU's fp32-accumulating tensor cores add, in numpy's order); and its fp32 -> bf16 cast
    truncates, so bf16 results are stored in fp32 there and rounded by torch."""
    return type(kernel).__name__ == "InterpretedFunction"


def invariant_linear_reference(x: torch.Tensor, weight: torch.Tensor,
                               bias: torch.Tensor | None = None) -> torch.Tensor:
    """What invariant_linear computes, in plain torch: fp32 (fp64 on the CPU would hide fp32's
    own rounding) accumulation of x @ weight.T + bias, then cast to x's dtype."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"invariant_linear needs x [M, K] and weight [N, K], got x "
                         f"{tuple(x.shape)} and weight {tuple(weight.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x has K={x.shape[1]} columns but weight [N, K] has K="
                         f"{weight.shape[1]}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x dtype must be one of {DTYPES}, got {x.dtype}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} must equal x's {x.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x on {x.device}")
    if not (x.is_contiguous() and weight.is_contiguous()):
        raise ValueError("x and weight must be contiguous (call .contiguous())")
    if bias is not None:
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must be [N={weight.shape[0]}], got {tuple(bias.shape)}")
        if bias.dtype != x.dtype or bias.device != x.device:
            raise ValueError(f"bias must be {x.dtype} on {x.device}, got {bias.dtype} on "
                             f"{bias.device}")
        if not bias.is_contiguous():
            raise ValueError("bias must be contiguous")


class InvariantLinear:
    """The engine's matmul hook on a GPU with ``linear_kernels="invariant"``: F.linear's
    signature, ``invariant_linear`` underneath (F.linear where gradients are wanted: training
    never goes through the engine's hook, but a trainable head's layer may)."""

    key = f"triton-invariant (BLOCK_M {BLOCK_M}, split-K fixed per weight)"
    weight_bytes = None  # the models' own weights: nothing prepared apart
    # a mixture of experts' experts run as gathered launches over stacked weights
    # (specdec.kernels.invariant_moe: the same numbers, no host read): install_kernels stacks them
    gathers_experts = True

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return torch.nn.functional.linear(x, weight, bias)
        return invariant_linear(x if x.is_contiguous() else x.contiguous(), weight, bias)

    def describe(self) -> dict:
        return {"key": self.key, "block_m": BLOCK_M, "target_programs": TARGET_PROGRAMS,
                "min_steps_per_split": MIN_STEPS_PER_SPLIT}
