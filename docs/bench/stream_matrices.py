"""How fast the native kernels stream a model's weights: every layer matrix of ``--model``
(prepared as the engine prepares them) run once in turn by ``sd_linear`` for a few row counts,
the fastest of ``--repeats`` passes, as GB/s of weight bytes beside the stream bandwidth
measured here. Isolates the kernels from the rest of a step (attention, norms, the LM head,
Python): a kernel at the bandwidth streams as fast as the memory allows.

    .venv/bin/python docs/bench/stream_matrices.py --model runs/shapes/smollm2-1.7b_q4_k_m.gguf \\
        [--activations q8] [--rows 1,2,4] [--repeats 6]

Use a model whose weights do not fit in the last-level cache (e.g. a SmolLM2-1.7B shape from
docs/bench/shape_gguf.py), or the figure is the cache's, not the memory's. Ratios only mean
something within one run: say which CPU.

Quick form (the test suite's, tests/bench/test_bench_scripts.py): ``--model`` a tiny GGUF, ``--rows
1 --repeats 1``.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from specdec import LLM, native
from specdec.bench.physics import bandwidth_gbs
from specdec.models.matmul.fused import FusedLayers
from specdec.native.panels import PanelParts


def parts(p):
    return p.parts if isinstance(p, PanelParts) else (p,)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="an alias, HF folder or .gguf file")
    ap.add_argument("--activations", default="q8", help="q8 or float")
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args()
    llm = LLM(model=args.model, activations=args.activations)
    (layers,) = [o for o in gc.get_objects() if isinstance(o, FusedLayers)]
    matrices = list(layers._panels)  # qkv, o, gate_up, down of every layer, in order
    kernels = native.load()
    total = sum(q.data.numel() * q.data.element_size() for p in matrices for q in parts(p))
    bw = bandwidth_gbs()
    print(f"{args.model} ({llm.engine.parts.activations}): {len(matrices)} matrices, "
          f"{total / 1e9:.3f} GB; stream bandwidth {bw:.1f} GB/s")
    for rows in (int(n) for n in args.rows.split(",")):
        x_of = {k: torch.randn(rows, k) for k in {parts(p)[0].in_features for p in matrices}}
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for p in matrices:
                kernels.linear(x_of[parts(p)[0].in_features], p)
            best = min(best, time.perf_counter() - t0)
        print(f"{rows} rows: {best * 1e3:.1f} ms, {total / best / 1e9:.1f} GB/s "
              f"({total / best / 1e9 / bw:.2f} of the bandwidth)")


if __name__ == "__main__":
    main()
