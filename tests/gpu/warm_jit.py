"""Compile the GPU check's kernels before it starts, all at once (run by run.sh).

flashinfer 0.6 compiles each kernel module with nvcc on its first use, one after another; the
GPU check needs about eight (decode and FA2 batch prefill in bf16 and fp16 for head_dim 64, the
mask-packing module, and the fused layer ops: norm, RoPE, SiLU * mul). Built here in parallel
threads (each a ninja run) their wall time is about the slowest one's, not the sum; each
module's seconds are printed for the report. Uses flashinfer 0.6.0's JIT module generators
(internal API: a failure here is reported and the check goes on, compiling lazily). Meanwhile
the row-invariant Triton kernels are compiled for the bench's shapes (Triton caches them on the
machine, for the processes that follow).
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch


def specs():
    from flashinfer.jit.activation import gen_act_and_mul_module
    from flashinfer.jit.attention.modules import gen_batch_decode_module, gen_batch_prefill_module
    from flashinfer.jit.norm import gen_norm_module
    from flashinfer.jit.quantization import gen_quantization_module
    from flashinfer.jit.rope import gen_rope_module

    i32, d = torch.int32, 64
    out = {"quantization": gen_quantization_module(), "norm": gen_norm_module(),
           "rope": gen_rope_module(), "silu_and_mul": gen_act_and_mul_module("silu")}
    for dt in (torch.bfloat16, torch.float16):
        name = str(dt).split(".")[-1]
        out[f"decode-{name}"] = gen_batch_decode_module(dt, dt, dt, i32, d, d, 0, False, False)
        out[f"prefill-fa2-{name}"] = gen_batch_prefill_module("fa2", dt, dt, dt, i32, d, d, 0,
                                                              False, False, False)
    return out


def build(item):
    name, spec = item
    t0 = time.perf_counter()
    try:
        spec.build(verbose=False)
        return name, time.perf_counter() - t0, None
    except Exception as e:  # reported; the tests then compile (and fail) on first use
        return name, time.perf_counter() - t0, f"{type(e).__name__}: {e}"[:500]


def main() -> int:
    t0 = time.perf_counter()
    try:
        todo = specs()
    except Exception as e:
        print(f"warm_jit: flashinfer's JIT specs unavailable: {e!r}")
        return 1
    with ThreadPoolExecutor(len(todo)) as pool:
        builds = pool.map(build, todo.items())
        triton = warm_triton()
        for name, seconds, error in builds:
            print(f"warm_jit: {name}: {seconds:.1f} s" + (f" FAILED {error}" if error else ""))
    print(triton)
    print(f"warm_jit: all in {time.perf_counter() - t0:.1f} s")
    return 0


def warm_triton() -> str:
    """The invariant matmul for every matrix of the bench's shapes and the invariant attention
    for their heads, once each in bf16 (a compile per specialization, cached by Triton)."""
    t0 = time.perf_counter()
    try:
        from gpu_helpers import SHAPES

        from specdec.kernels.invariant_attention import (
            RowMetadata,
            invariant_attention,
            row_metadata,
        )
        from specdec.kernels.invariant_matmul import invariant_linear

        dev, bf16 = "cuda", torch.bfloat16
        for s in SHAPES.values():
            h, i, v = s["hidden_size"], s["intermediate_size"], s["vocab_size"]
            heads, kv = s["num_attention_heads"], s["num_key_value_heads"]
            d = h // heads
            for n, k in ((heads * d + 2 * kv * d, h), (h, heads * d), (2 * i, h), (h, i), (v, h)):
                invariant_linear(torch.randn(3, k, dtype=bf16, device=dev),
                                 torch.randn(n, k, dtype=bf16, device=dev))
            qkv = torch.randn(3, (heads + 2 * kv) * d, dtype=bf16, device=dev)
            q = qkv[:, :heads * d].view(3, heads, d)
            cache = torch.randn(4, 2, 16, kv, d, dtype=bf16, device=dev)
            rows = row_metadata([3], [20])  # staged as int64, as the engine stages them
            rows = RowMetadata(*(t.long().to(dev) for t in (rows.row_request, rows.row_limit,
                                                             rows.row_tree)))
            indptr = torch.tensor([0, 2], dtype=torch.int64, device=dev)
            invariant_attention(q, cache, rows, indptr, torch.tensor([1, 3], device=dev),
                                d**-0.5)
        torch.cuda.synchronize()
        return f"warm_jit: triton kernels: {time.perf_counter() - t0:.1f} s"
    except Exception as e:  # reported; the kernels then compile on first use
        return f"warm_jit: triton kernels FAILED after {time.perf_counter() - t0:.1f} s: {e!r}"


if __name__ == "__main__":
    sys.exit(main())
