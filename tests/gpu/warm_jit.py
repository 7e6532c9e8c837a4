"""Compile flashinfer's kernels for the GPU check before it starts, all at once (run by run.sh).

flashinfer 0.6 compiles each kernel module with nvcc on its first use, one after another; the
GPU check needs about five (decode and FA2 batch prefill in bf16 and fp16 for head_dim 64, and
the mask-packing module). Built here in parallel threads (each a ninja run) their wall time is
about the slowest one's, not the sum; each module's seconds are printed for the report. Uses
flashinfer 0.6.0's JIT module generators (internal API: a failure here is reported and the
check goes on, compiling lazily).
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch


def specs():
    from flashinfer.jit.attention.modules import gen_batch_decode_module, gen_batch_prefill_module
    from flashinfer.jit.quantization import gen_quantization_module

    i32, d = torch.int32, 64
    out = {"quantization": gen_quantization_module()}
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
        for name, seconds, error in pool.map(build, todo.items()):
            print(f"warm_jit: {name}: {seconds:.1f} s" + (f" FAILED {error}" if error else ""))
    print(f"warm_jit: all in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
