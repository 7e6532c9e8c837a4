"""T(rows): the target forward's seconds by rows, per weights, matmul policy and dtype, beside
the limits.

    .venv/bin/python docs/bench/forward_rows.py [--configs float32:invariant:native,...] [--json OUT]
        [--model smollm2-135m-instruct] [--rows 1,2,4,8,16,32,64] [--repeats 3]

SmolLM2-135M-Instruct (or ``--model``: an alias, HF folder or .gguf file, e.g. a folder of
docs/bench/shape_gguf.py, a real model's shape with random weights), the engine's own step
profile (``specdec.controllers.costs.profile_forward``: one request feeding n rows over 64 cached tokens, logits for every row, fastest of several runs),
for each configuration ``dtype:linear_kernels:weights[:activations]`` in fresh engines built one after another
in this process
(``--rounds`` times, interleaved, so that the spread of T(1) across engines shows). Beside them:
the memory-bound time (weight bytes streamed / the stream bandwidth measured here with a large
``sum``, all threads) and the compute-bound time (multiply-adds / the FMA rate measured here with
a large fp32 matmul). Ratios only mean something within one run: say which CPU.

Quick form (the test suite's, tests/bench/test_bench_scripts.py): ``--model`` a tiny GGUF, ``--rows
1,2 --repeats 1 --rounds 1`` and the two native configs.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform

import torch

from specdec import LLM, native
from specdec.bench.physics import bandwidth_gbs, fma_rate
from specdec.controllers.costs import StepCosts, profile_forward

ROWS = (1, 2, 4, 8, 16, 32, 64)


CONFIGS = ("float32:invariant:native:q8,float32:invariant:native,float32:invariant:dequantized,"
           "bfloat16:invariant:dequantized,float32:plain:dequantized")


def profile(model: str, rows: tuple[int, ...], repeats: int, dtype: str, policy: str,
            weights: str, activations: str = "float") -> dict:
    """"ms": the engine's step-cost curve (its profile made non-decreasing: a row count
    measured slower than a larger one is averaged with it), "raw_ms": each row count's own
    fastest run."""
    llm = LLM(model=model, dtype=dtype, linear_kernels=policy,
              weights=weights, activations=activations, max_model_len=256,
              max_num_batched_tokens=256)
    eng = llm.engine
    raw = [profile_forward(eng.parts.runner, (n,), repeats=repeats).times[0] for n in rows]
    costs = StepCosts(list(rows), raw)
    macs = sum(w.numel() for w in eng.parts.runner.model.matrices())  # per row: layers + LM head
    return {"rows": list(rows), "ms": [1e3 * s for s in costs.times],
            "raw_ms": [1e3 * s for s in raw],
            "weight_bytes": eng.parts.weight_bytes_per_forward, "macs_per_row": macs,
            "weights": eng.parts.weights, "activations": eng.parts.activations}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default=CONFIGS,
                   help="dtype:linear_kernels:weights[:activations],...")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="an alias, HF folder or .gguf file")
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts, e.g. 1,2,4")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per row count (at least)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = tuple(sorted({int(n) for n in args.rows.split(",")}))
    bw, fma = bandwidth_gbs(), fma_rate(native.load())
    out = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
           "model": args.model, "bandwidth_gbs": bw, "fma_per_s": fma, "runs": []}
    print(f"stream bandwidth {bw:.1f} GB/s, fp32 matmul {fma / 1e9:.1f} G multiply-adds/s")
    for r in range(args.rounds):
        for config in args.configs.split(","):
            dtype, policy, *rest = config.split(":")
            run = {"dtype": dtype, "policy": policy, "round": r,
                   **profile(args.model, rows, args.repeats, dtype, policy, *rest)}
            gc.collect()  # the engine before the next one is built (a large model twice)
            out["runs"].append(run)
            mem = run["weight_bytes"] / (bw * 1e9) * 1e3
            t1 = run["ms"][0]
            ratios = " ".join(f"{n}:{t / t1:.2f}" for n, t in zip(rows, run["ms"]))
            print(f"{dtype:9s} {policy:9s} {run['weights']:11s} {run['activations']:5s} T(1) {t1:6.1f} ms "
                  f"({run['weight_bytes'] / 1e6:.0f} MB, memory-bound {mem:.1f} ms, "
                  f"{t1 / mem:.2f}x)  T(n)/T(1) {ratios}", flush=True)
            print("  T(n) ms " + " ".join(f"{n}:{t:.1f}" for n, t in zip(rows, run["ms"]))
                  + "  raw " + " ".join(f"{n}:{t:.1f}" for n, t in zip(rows, run["raw_ms"])),
                  flush=True)
    macs = out["runs"][0]["macs_per_row"]  # SmolLM2-135M: 134.5e6 (layers + LM head)
    out["compute_bound_ms_per_row"] = macs / fma * 1e3
    print(f"compute-bound: {out['compute_bound_ms_per_row']:.1f} ms per row at the matmul rate")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
