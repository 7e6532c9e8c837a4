"""ms per 8-bit-activation linear call by GGUF type, matrix shape and rows, with the weights
streamed from memory as in a model's forward: ``COPIES`` copies of each matrix called in turn
(one matrix would stay in the caches).

    .venv/bin/python docs/bench/q8_rows_streamed.py [--kinds Q4_K,Q5_K,Q6_K] [--rows 8,16,32]
        [--shapes 2048x8192,8192x2048] [--copies 12] [--threads 2] [--repeats 5]

Prints ``kind outxin rN fastest median`` per case. To compare two builds of the kernels (e.g.
AMX against the AVX-512 kernels below a format's AMX threshold: linear_q8.c's Q8_FORMATS
``amx_rows`` set to 1 in one build, to 1000 in the other), run it once per build, interleaved,
and compare the fastest times; ``SPECDEC_NATIVE_ISA=avx512-vnni`` alone caps every format.

Quick form (the test suite's, tests/bench/test_bench_scripts.py): ``--kinds Q4_K --rows 8 --shapes
256x256 --copies 2 --repeats 1``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from specdec import native
from specdec.bench.random_blocks import random_blocks
from specdec.models.gguf import blocks as gb
from specdec.models.gguf import q8_activations as qa


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", default="Q4_K,Q5_K,Q6_K")
    ap.add_argument("--rows", default="8,9,10,11,12,16,24,32,64")
    ap.add_argument("--shapes", default="2048x8192,8192x2048")
    ap.add_argument("--copies", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    from gguf import GGMLQuantizationType

    torch.set_num_threads(a.threads)
    k = native.load()
    print("q8_isa", k.q8_isa, flush=True)
    for kind in a.kinds.split(","):
        for shape in a.shapes.split(","):
            out, inp = (int(v) for v in shape.split("x"))
            rows = random_blocks(np.random.default_rng(0), GGMLQuantizationType[kind], out, inp,
                                 0.02)
            b = gb.Blocks(kind, torch.from_numpy(rows), inp)
            panels = [qa.prepare(b) for _ in range(a.copies)]
            for t in (int(r) for r in a.rows.split(",")):
                x, times = torch.randn(t, inp), []
                for p in panels:
                    k.linear(x, p)  # warm-up
                for _ in range(a.repeats):
                    t0 = time.perf_counter()
                    for p in panels:
                        k.linear(x, p)
                    times.append((time.perf_counter() - t0) / a.copies)
                print(f"{kind} {shape} r{t} {1e3 * min(times):.3f} "
                      f"{1e3 * statistics.median(times):.3f}", flush=True)


if __name__ == "__main__":
    main()
